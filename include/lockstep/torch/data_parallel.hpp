// SPDX-License-Identifier: MIT
//! `lockstep::torch::DataParallel`: lockstep's persistent replicas, bucketed gradient all-reduce
//! and commit point for any libtorch module (Note [libtorch replicas]).
#pragma once

#include <torch/torch.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <iostream>
#include <mutex>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <type_traits>
#include <cmath>
#include <cstring>
#include <span>
#include <utility>
#include <vector>

#include "lockstep/comm/collective_tag.hpp"
#include "lockstep/comm/collectives.hpp"
#include "lockstep/comm/host_communicator.hpp"
#include "lockstep/comm/process_group.hpp"
#include "lockstep/core/device_span.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/parallel/checkpoint_coordination.hpp"
#include "lockstep/parallel/process_coordination.hpp"
#include "lockstep/runtime/abortable_barrier.hpp"
#include "lockstep/runtime/replica_pool.hpp"
#include "lockstep/runtime/serial_worker.hpp"
#include "lockstep/torch/checkpoint.hpp"
#include "lockstep/torch/gradient_exchange.hpp"
#include "lockstep/torch/sync_batch_norm.hpp"

namespace lockstep::torch {

// Note [libtorch replicas]
// A DataParallel clones the user's module once per replica (Cloneable::clone) on that replica's
// persistent thread (a ReplicaPool), checks that every replica, in every process, holds the same
// parameters and buffers (names, shapes, dtypes), and broadcasts global replica 0's values. A
// training step is one job of the pool, on every replica:
//   1. its rows of the batch (dim 0; shards differ in size by one at most) through forward and
//      the user's loss, which returns the shard's mean; the loss is weighted by the shard's share
//      of the global batch, so the summed gradients are those of the global mean exactly;
//   2. backward through autograd. A post-hook on each parameter's gradient accumulator (PyTorch
//      DDP's place for it) counts the bucket's final gradients; a bucket whose gradients are all
//      in, and every bucket before it, is copied into its flat buffer and handed to the replica's
//      communication thread, which all-reduces it on the gradient group while backward goes on.
//      Buckets hold parameters in reverse registration order (the order backward finishes them),
//      about bucket_bytes each, and are launched in index order on every replica;
//   3. after backward: the buckets left (a parameter the hooks did not report) are launched, the
//      sums copied back into the gradients, the step's totals all-reduced; then the finite check
//      and clipping, which read only all-reduced values and so decide alike everywhere;
//   4. the commit barrier; then the replica's own optimizer steps; then a second barrier, which a
//      replica whose optimizer threw aborts, marking the object diverged (Note [commit point]).
// A failure before the commit barrier aborts both groups: every replica's call fails, each replica
// restores the buffers it had when the step began (running statistics), the gradients are
// dropped, and the next call runs on reset groups. Replicas of one process sum on the host in rank
// order, so they stay bit-identical.
//
// Note [libtorch CUDA replicas]
// One replica per CUDA device (two on one device would deadlock: libtorch runs every backward of
// a device on that device's one autograd thread, and SyncBatchNorm's backward waits there for its
// peers). Jobs run under a StreamGuard of the device's default stream (which also makes the
// device current). On CUDA, autograd calls the gradient hooks, and SyncBatchNorm's backward, on
// its device thread, not the replica's. The hooks count the replica's buckets and launch the full
// ones (copies into the flat buffer, a job for the communication thread, or with overlap off the
// all-reduce itself), which no other thread touches during backward (backward() orders them with
// the replica thread); the rendezvous works from any thread, and an exception there reaches
// backward()'s caller. Buckets are all-reduced by NCCL where the component was built with it
// (Note [libtorch NCCL buckets] in torch/nccl_group.hpp). Otherwise, or with Options::nccl off,
// through the host: each bucket is copied into a page-locked host buffer (which waits for the
// device), summed in rank order as on CPUs (bit-identical replicas), and copied back.
// SyncBatchNorm's sums are host tensors already; broadcasts and the optimizer state go through
// (pageable) host tensors. Every job makes the device's default stream the replica thread's
// current one, and the communication thread's copies use it too, so they are ordered with the
// replica's kernels (a model that moves its work to a stream of its own must join it back before
// returning).

//! How a lockstep::torch::DataParallel runs.
struct Options {
    //! Gradients are all-reduced in flat buckets of about this many bytes, last layers first.
    std::size_t bucket_bytes = std::size_t{25} << 20;
    //! All-reduce each bucket on the replica's communication thread while backward goes on
    //! (false: after backward, in line).
    bool overlap = true;
    //! CUDA replicas all-reduce their buckets with NCCL where the component was built with it
    //! (nccl_available(); Note [libtorch NCCL buckets]); false, or without NCCL: through
    //! page-locked host memory (Note [libtorch CUDA replicas]).
    bool nccl = true;
    //! No collective waits longer than this for a peer, and no call longer than this for a replica
    //! once another has failed or finished (then it throws ReplicaStuck).
    std::chrono::milliseconds timeout = AbortableBarrier::default_timeout;
    //! Where the replica threads run. libtorch's own intra-op threads start from them and inherit
    //! a binding, so the default leaves them unbound.
    CpuBinding cpu_binding = CpuBinding::none;
    //! libtorch's intra-op threads per replica, set on each replica thread at a call when it
    //! changed (Note [intra-op threads]; at::set_num_threads, which also sets the process's
    //! default): a positive value is that count; 0 the machine's CPUs divided by the replicas (at
    //! least 1) when that is fewer than the calling thread's at::get_num_threads(); a negative
    //! value the calling thread's at::get_num_threads().
    int intra_op_threads = 0;
    //! Clip the all-reduced gradients to this global L2 norm before the optimizer steps.
    std::optional<double> clip_grad_norm = std::nullopt;
    //! Check the loss and the all-reduced gradients before the commit point: NaN or infinity throws
    //! NonFinite and no replica steps.
    bool check_finite = false;
    //! The processes this DataParallel spans (comm::MpiProcessGroup from <lockstep/mpi.hpp>);
    //! empty: this process alone. Each process passes its own rows of the global batch.
    std::shared_ptr<comm::ProcessGroup> process_group = nullptr;
};

//! What a training step reports, over every sample since the previous step.
struct StepResult {
    double loss = 0;           //!< mean loss over the samples
    std::int64_t count = 0;    //!< samples
    std::int64_t correct = 0;  //!< samples whose argmax over dim 1 is their class (int64 class targets only)
};

//! Makes a replica's optimizer from that replica's module (its parameters, its parameter groups).
template <class Impl>
using OptimizerFactory = std::function<std::unique_ptr<::torch::optim::Optimizer>(Impl& replica)>;

//! Data parallelism over persistent replicas of a libtorch module `Impl` (a
//! torch::nn::Cloneable<Impl>), on CPU replicas or one per CUDA device (Note [libtorch replicas]).
template <class Impl>
class DataParallel {
public:
    using module_type = Impl;
    //! The user's loss: (output of a shard, its targets) -> the shard's mean loss, a scalar.
    using Loss = std::function<at::Tensor(const at::Tensor& output, const at::Tensor& targets)>;

    //! `replicas` CPU replicas of `module`, each with an optimizer made by `optimizer`.
    DataParallel(std::shared_ptr<Impl> module, int replicas, OptimizerFactory<Impl> optimizer, Options options = {})
        : DataParallel(std::move(module), std::vector<::torch::Device>(static_cast<std::size_t>(std::max(replicas, 0)), ::torch::kCPU),
                       std::move(optimizer), std::move(options)) {
        LOCKSTEP_CHECK(replicas > 0, "lockstep::torch::DataParallel needs at least one replica, got ", replicas);
    }
    DataParallel(::torch::nn::ModuleHolder<Impl> module, int replicas, OptimizerFactory<Impl> optimizer, Options options = {})
        : DataParallel(module.ptr(), replicas, std::move(optimizer), std::move(options)) {}

    //! One replica per entry of `devices`: CPU devices, or distinct CUDA devices (Note [libtorch
    //! CUDA replicas]). A CUDA module's parameters must be on a CUDA device, a CPU module's on the CPU.
    DataParallel(std::shared_ptr<Impl> module, std::vector<::torch::Device> devices, OptimizerFactory<Impl> optimizer,
                 Options options = {})
        : DataParallel(std::move(module), std::move(devices), std::move(optimizer), std::move(options), detail::ExchangeMaker{}) {
    }
    //! As above, all-reducing gradients through the exchange `make_exchange` makes (tests run
    //! stream-ordered buckets on CPU replicas with it).
    DataParallel(std::shared_ptr<Impl> module, std::vector<::torch::Device> devices, OptimizerFactory<Impl> optimizer,
                 Options options, const detail::ExchangeMaker& make_exchange)
        : core_(make_core(module, devices, std::move(optimizer), options, make_exchange)),
          pool_(core_->world, {}, options.cpu_binding, options.timeout) {
        pool_.attach(core_->layer_group->abortable());
        pool_.attach(core_->grads->abortable());
        run_job([core = core_, proto = module](int r) { core->make_replica(r, *proto); });
        check_same_structure();
        run_job([core = core_](int r) { core->replica(r).broadcast_from(0, 0); });
    }
    DataParallel(::torch::nn::ModuleHolder<Impl> module, std::vector<::torch::Device> devices,
                 OptimizerFactory<Impl> optimizer, Options options = {})
        : DataParallel(module.ptr(), std::move(devices), std::move(optimizer), std::move(options)) {}

    DataParallel(const DataParallel&) = delete;
    DataParallel& operator=(const DataParallel&) = delete;

    int size() const noexcept { return core_->world; }
    int global_size() const noexcept { return core_->global_world; }
    const Options& options() const noexcept { return core_->options; }
    //! Replica `i`'s module, for reading: replicas change only through DataParallel.
    std::shared_ptr<const Impl> replica(int i) const { return core_->replicas.at(static_cast<std::size_t>(i))->module; }
    //! Replica 0's module. Every replica holds the same values.
    std::shared_ptr<const Impl> module() const { return replica(0); }
    //! Replica `i`'s optimizer.
    const ::torch::optim::Optimizer& optimizer(int i) const { return *core_->replicas.at(static_cast<std::size_t>(i))->optimizer; }
    std::size_t bucket_count() const noexcept { return core_->replicas.front()->buckets.size(); }
    //! Buckets whose all-reduce replica `rank` started before its last backward ended.
    std::size_t overlapped_buckets(int rank) const {
        return core_->replicas.at(static_cast<std::size_t>(rank))->launched_in_backward;
    }
    //! Collectives replica `rank` has made on its layer group (SyncBatchNorm) and gradient group.
    std::uint64_t layer_collectives(int rank) const { return core_->layer_group->communicator(rank).collective_count(); }
    //! How buckets are all-reduced: "host" (CPU replicas; CUDA replicas staged through page-locked
    //! memory) or "nccl" (Note [libtorch NCCL buckets]).
    const char* gradient_transport() const noexcept { return core_->grads->transport(); }
    std::uint64_t gradient_collectives(int rank) const { return core_->grads->communicator(rank).collective_count(); }
    //! The intra-op threads each replica runs a call from this thread with (Options::intra_op_threads).
    int intra_op_threads() const { return call_threads(); }
    std::int64_t steps() const noexcept { return steps_; }
    std::int64_t accumulated_samples() const noexcept { return pending_.count; }
    bool diverged() const noexcept { return diverged_.has_value(); }

    void train() noexcept { training_ = true; }
    void eval() noexcept { training_ = false; }
    bool training() const noexcept { return training_; }

    //! One training step: scatter, forward, loss, backward with the bucketed all-reduce, clipping,
    //! the commit point and every replica's optimizer step. `targets` has one row per sample.
    StepResult train_step(const at::Tensor& inputs, const at::Tensor& targets, const Loss& loss) {
        check_usable("train_step");
        LOCKSTEP_CHECK_AS(UsageError, training_, "DataParallel::train_step in eval mode; call train() first");
        auto call = begin_call(inputs, targets, loss, "train_step", true);
        try {
            run_job([core = core_, call](int r) { core->train_part(r, *call); });
        } catch (const ReplicaStuck&) {
            pending_ = {};
            throw;
        } catch (const std::exception& e) {
            pending_ = {};
            if (call->committed.load() > 0) diverged_ = std::string(e.what());
            throw;
        }
        StepResult result{(pending_.loss_sum + call->totals[0]) / static_cast<double>(pending_.count + call->batch),
                          pending_.count + call->batch, pending_.correct + static_cast<std::int64_t>(call->totals[1])};
        pending_ = {};
        ++steps_;
        return result;
    }

    //! Forward and backward of a micro-batch whose gradients are kept for the next train_step,
    //! with no gradient all-reduce (SyncBatchNorm's collectives still run). Micro-batches are
    //! weighted by their samples, so accumulate(b1) then train_step(b2) equals train_step(b1+b2)
    //! for a model without batch norm.
    void accumulate(const at::Tensor& inputs, const at::Tensor& targets, const Loss& loss) {
        check_usable("accumulate");
        LOCKSTEP_CHECK_AS(UsageError, training_, "DataParallel::accumulate in eval mode keeps no gradients; call train() first");
        auto call = begin_call(inputs, targets, loss, "accumulate", false);
        try {
            run_job([core = core_, call](int r) { core->train_part(r, *call); });
        } catch (...) {
            pending_ = {};
            throw;
        }
        pending_.count += call->batch;
        pending_.loss_sum += call->totals[0];
        pending_.correct += static_cast<std::int64_t>(call->totals[1]);
    }

    //! Runs every replica on its rows of `inputs` without autograd and concatenates the outputs in
    //! order (this process's rows, across processes). Uses the replicas' current mode
    //! (eval(): running statistics).
    at::Tensor forward(const at::Tensor& inputs) {
        check_usable("forward");
        LOCKSTEP_CHECK_AS(ShapeError, inputs.dim() >= 1, "DataParallel::forward needs a batched input, got a scalar");
        auto split = std::make_shared<parallel::BatchSplit>(split_batch(inputs.size(0), "forward"));
        auto outs = std::make_shared<std::vector<at::Tensor>>(static_cast<std::size_t>(size()));
        run_job([core = core_, split, outs, inputs, training = training_](int r) {
            auto& rep = core->replica(r);
            rep.link.held.clear();
            detail::LinkScope scope(&rep.link);
            ::torch::NoGradGuard no_grad;
            rep.module->train(training);
            const auto& s = split->shards[static_cast<std::size_t>(r)];
            (*outs)[static_cast<std::size_t>(r)] = rep.module->forward(inputs.narrow(0, s.begin, s.count).to(rep.device));
        });
        for (auto& o : *outs) o = o.to(inputs.device());
        return ::torch::cat(*outs, 0);
    }

    //! Runs `fn(Impl& replica, int rank)` on every replica's thread; whatever it changes it must
    //! change alike everywhere.
    void parallel_apply(std::function<void(Impl&, int)> fn) {
        check_usable("parallel_apply");
        run_job([core = core_, fn = std::move(fn)](int r) {
            auto& rep = core->replica(r);
            detail::LinkScope scope(&rep.link);
            fn(*rep.module, r);
        });
    }

    //! Replica 0's parameters and buffers by their state_dict names, atomically written as
    //! safetensors (Note [libtorch checkpoints]); across processes, process 0 writes and every
    //! process returns when it has.
    nn::Checkpoint::SaveReport save(const std::string& path) const {
        check_usable("save");
        return parallel::save_once(core_->procs, [&] { return torch::checkpoint(*module()).save(path); });
    }
    //! Loads a checkpoint of this model into every replica (checked whole first: a checkpoint of
    //! another model throws IoError and changes nothing).
    //! The replicas' optimizers are made equal to replica 0's (a diverged object is usable again).
    void load(const std::string& path) {
        pool_.check_usable("DataParallel::load");
        auto ck = std::make_shared<const nn::Checkpoint>(nn::Checkpoint::load(path));
        torch::check_fits(*ck, *core_->replicas.front()->module);
        run_job([core = core_, ck](int r) {
            auto& rep = core->replica(r);
            rep.link.held.clear();
            torch::assign(*ck, *rep.module);
            rep.broadcast_optimizer_from(0);
        });
        diverged_.reset();
        pending_ = {};
    }

    //! After a step failed past its commit point: copies global replica 0's parameters, buffers
    //! and optimizer state to every replica.
    void resync() {
        pool_.check_usable("DataParallel::resync");
        run_job([core = core_](int r) {
            auto& rep = core->replica(r);
            rep.link.held.clear();
            rep.broadcast_from(0, 0);
            rep.broadcast_optimizer_from(0);
        });
        diverged_.reset();
        pending_ = {};
    }

private:
    struct Call {
        // Owned by the call (Note [jobs own their state] in parallel/call_state.hpp): a replica the
        // pool gave up on may still read them after the call has thrown.
        at::Tensor inputs, targets;
        Loss loss;
        parallel::BatchSplit split;
        std::int64_t batch = 0;    // global samples of this call
        std::int64_t pending = 0;  // global samples accumulated before it
        bool step = true;          // train_step (false: accumulate)
        std::vector<double> totals = {0.0, 0.0};  // loss x samples, correct, summed over every replica
        std::atomic<int> committed{0};            // replicas past the commit barrier
    };
    struct Pending {
        std::int64_t count = 0;
        double loss_sum = 0;
        std::int64_t correct = 0;
    };

    struct Bucket {
        std::vector<std::size_t> params;  // indices into Replica::params
        std::vector<std::int64_t> offsets;
        at::Tensor flat;
        at::Tensor host;  // CUDA replicas: the page-locked host copy the all-reduce sums
        std::size_t ready = 0;
        bool launched = false;
    };

    struct Core;

    struct Replica {
        Core* core = nullptr;
        int rank = 0;
        ::torch::Device device = ::torch::kCPU;
        std::shared_ptr<Impl> module;
        std::unique_ptr<::torch::optim::Optimizer> optimizer;
        std::vector<at::Tensor> params;  // those that take gradients, in registration order
        std::vector<std::string> names;
        std::vector<std::size_t> bucket_of;
        std::vector<Bucket> buckets;
        std::size_t next_launch = 0;
        bool collecting = false;
        std::size_t launched_in_backward = 0;
        std::vector<at::Tensor> saved_buffers;
        std::vector<c10::intrusive_ptr<::torch::autograd::Node>> accumulators;  // kept: they hold the hooks
        std::vector<std::uintptr_t> hook_keys;
        std::vector<double> totals = {0.0, 0.0};
        std::vector<std::int64_t> words;  // broadcast_optimizer_from's bytes
        detail::ReplicaLink link;
        comm::Collectives* grad = nullptr;
        Device span_device;  // its buffers' device as the gradient group names it
        std::unique_ptr<SerialWorker> worker;

        void build_buckets(std::size_t bucket_bytes) {
            for (const auto& item : module->named_parameters(true))
                if (item.value().requires_grad() &&
                    std::none_of(params.begin(), params.end(), [&](const at::Tensor& p) { return p.is_same(item.value()); })) {
                    LOCKSTEP_CHECK_AS(NotImplemented, item.value().scalar_type() == at::kFloat, "parameter '", item.key(),
                                      "' is of dtype ", item.value().scalar_type(),
                                      "; lockstep::torch::DataParallel all-reduces float32 gradients");
                    params.push_back(item.value());
                    names.push_back(item.key());
                }
            bucket_of.assign(params.size(), 0);
            Bucket current;
            std::int64_t used = 0;
            const auto close = [&] {
                if (current.params.empty()) return;
                current.flat = at::zeros({used}, params.front().options().dtype(at::kFloat).requires_grad(false));
                if (!current.flat.device().is_cpu() && !core->grads->on_device())
                    current.host = at::empty({used}, at::TensorOptions().dtype(at::kFloat).pinned_memory(true));
                buckets.push_back(std::move(current));
                current = Bucket{};
                used = 0;
            };
            for (std::size_t k = params.size(); k-- > 0;) {
                const std::int64_t n = params[k].numel();
                if (!current.params.empty() && static_cast<std::size_t>((used + n) * 4) > bucket_bytes) close();
                bucket_of[k] = buckets.size();
                current.params.push_back(k);
                current.offsets.push_back(used);
                used += n;
            }
            close();
            for (std::size_t k = 0; k < params.size(); ++k) {
                auto acc = ::torch::autograd::impl::grad_accumulator(params[k]);
                LOCKSTEP_CHECK(acc != nullptr, "parameter '", names[k], "' has no gradient accumulator");
                hook_keys.push_back(acc->add_post_hook(std::make_unique<::torch::autograd::utils::LambdaPostHook>(
                    [this, k](const ::torch::autograd::variable_list& outputs, const ::torch::autograd::variable_list&) {
                        on_grad_ready(k);
                        return outputs;
                    })));
                accumulators.push_back(std::move(acc));
            }
        }

        // A graph the user keeps may outlive the replica: its accumulators must not call back here.
        Replica() = default;
        Replica(const Replica&) = delete;
        Replica& operator=(const Replica&) = delete;
        ~Replica() {
            for (std::size_t k = 0; k < hook_keys.size(); ++k) accumulators[k]->del_post_hook(hook_keys[k]);
        }

        void on_grad_ready(std::size_t k) {
            if (!collecting) return;
            auto& b = buckets[bucket_of[k]];
            if (++b.ready < b.params.size()) return;
            while (next_launch < buckets.size() && buckets[next_launch].ready == buckets[next_launch].params.size()) {
                launch(next_launch);
                ++launched_in_backward;
            }
        }

        void launch(std::size_t index) {
            auto& b = buckets[index];
            b.launched = true;
            next_launch = std::max(next_launch, index + 1);
            for (std::size_t i = 0; i < b.params.size(); ++i) {
                const auto& p = params[b.params[i]];
                auto slot = b.flat.narrow(0, b.offsets[i], p.numel()).view(p.sizes());
                const auto& g = p.grad();
                LOCKSTEP_CHECK_AS(UsageError, g.defined(), "parameter '", names[b.params[i]],
                                  "' received no gradient in this step; set requires_grad(false) on a parameter the "
                                  "model does not use (it would otherwise differ from a single-process run's)");
                slot.copy_(g);
            }
            auto job = [this, index] {
                auto& bb = buckets[index];
                if (core->grads->on_device()) {  // Note [libtorch NCCL buckets]
                    const c10::DeviceGuard on_device(device);
                    grad->start_all_reduce_sum(DeviceSpan<float>(static_cast<float*>(bb.flat.data_ptr()),
                                                                 static_cast<std::size_t>(bb.flat.numel()), span_device),
                                               comm::CollectiveSite::bucket(index));
                    return;
                }
                const bool staged = bb.host.defined();  // Note [libtorch CUDA replicas]
                if (staged) bb.host.copy_(bb.flat);
                auto& summed = staged ? bb.host : bb.flat;
                grad->all_reduce_sum(DeviceSpan<float>(static_cast<float*>(summed.data_ptr()),
                                                       static_cast<std::size_t>(summed.numel()), Device::host()),
                                     comm::CollectiveSite::bucket(index));
                if (staged) bb.flat.copy_(bb.host);
            };
            if (core->options.overlap)
                worker->submit(job);
            else
                job();
        }

        void finish_buckets() {
            collecting = false;
            for (std::size_t i = 0; i < buckets.size(); ++i)
                if (!buckets[i].launched) launch(i);
            worker->wait();
            join_buckets();
            for (auto& b : buckets)
                for (std::size_t i = 0; i < b.params.size(); ++i) {
                    auto& p = params[b.params[i]];
                    p.mutable_grad().copy_(b.flat.narrow(0, b.offsets[i], p.numel()).view(p.sizes()));
                }
            core->grads->wait_for_work(rank);  // Note [libtorch NCCL buckets]
        }

        // The compute stream waits for the all-reduces a stream group started (a null handle, the
        // current device's stream: so on the replica's device, whatever the model left current).
        void join_buckets() {
            const c10::DeviceGuard on_device(device);
            grad->join();
        }

        void start_backward() {
            for (auto& b : buckets) {
                b.ready = 0;
                b.launched = false;
            }
            next_launch = 0;
            launched_in_backward = 0;
        }

        // Every tensor of the module: parameters (all of them) then buffers, in registration order.
        std::vector<at::Tensor> state() const {
            std::vector<at::Tensor> all;
            for (const auto& p : module->parameters(true)) all.push_back(p);
            for (const auto& b : module->buffers(true))
                if (b.defined()) all.push_back(b);
            return all;
        }

        void save_buffers() {
            saved_buffers.clear();
            for (const auto& b : module->buffers(true))
                if (b.defined()) saved_buffers.push_back(b.clone());
        }
        void restore_buffers() noexcept {
            try {
                ::torch::NoGradGuard no_grad;
                std::size_t i = 0;
                for (auto& b : module->buffers(true))
                    if (b.defined() && i < saved_buffers.size()) b.copy_(saved_buffers[i++]);
            } catch (...) {
            }
        }

        // Copies global replica `root`'s parameters and buffers into this replica (site ids from `first`).
        void broadcast_from(int root, std::uint64_t first) {
            ::torch::NoGradGuard no_grad;
            std::uint64_t i = first;
            for (auto& t : state()) {
                const auto site = comm::CollectiveSite::broadcast(i++);
                auto c = t.device().is_cpu() ? t.contiguous() : t.to(at::kCPU).contiguous();
                const auto n = static_cast<std::size_t>(c.numel());
                switch (c.scalar_type()) {
                    case at::kFloat: link.layer->broadcast(DeviceSpan<float>(static_cast<float*>(c.data_ptr()), n, Device::host()), root, site); break;
                    case at::kDouble: link.layer->broadcast(DeviceSpan<double>(static_cast<double*>(c.data_ptr()), n, Device::host()), root, site); break;
                    case at::kLong:
                        link.layer->broadcast(DeviceSpan<std::int64_t>(static_cast<std::int64_t*>(c.data_ptr()), n, Device::host()), root, site);
                        break;
                    default:
                        throw NotImplemented("lockstep::torch::DataParallel broadcasts float32, float64 and int64 tensors; the "
                                             "module holds one of dtype " + std::string(c10::toString(c.scalar_type())));
                }
                if (!c.is_same(t)) t.copy_(c);
            }
        }

        // Copies global replica `root`'s optimizer state (torch::optim's own serialization) to this one.
        void broadcast_optimizer_from(int root) {
            std::string bytes;
            if (link.layer->rank() == root) {
                ::torch::serialize::OutputArchive archive;
                optimizer->save(archive);
                std::ostringstream out;
                archive.save_to(out);
                bytes = out.str();
            }
            std::int64_t size = static_cast<std::int64_t>(bytes.size());
            link.layer->broadcast(DeviceSpan<std::int64_t>(&size, 1, Device::host()), root,
                                  comm::CollectiveSite::broadcast(std::uint64_t{1} << 32));
            words.assign(static_cast<std::size_t>((size + 7) / 8), 0);
            std::memcpy(words.data(), bytes.data(), bytes.size());
            link.layer->broadcast(DeviceSpan<std::int64_t>(words.data(), words.size(), Device::host()), root,
                                  comm::CollectiveSite::broadcast((std::uint64_t{1} << 32) + 1));
            if (link.layer->rank() == root) return;
            optimizer->state().clear();  // load() keeps states the root lacks: none may remain
            std::istringstream in(std::string(reinterpret_cast<const char*>(words.data()), static_cast<std::size_t>(size)));
            ::torch::serialize::InputArchive archive;
            archive.load_from(in, device);
            optimizer->load(archive);
        }
    };

    struct Core {
        Options options;
        std::vector<::torch::Device> devices;
        int world = 0;
        int first_rank = 0;
        int global_world = 0;
        comm::ProcessGroup* procs = nullptr;
        OptimizerFactory<Impl> make_optimizer;
        std::unique_ptr<comm::HostGroup> layer_group;
        std::unique_ptr<detail::GradientExchange> grads;
        std::vector<std::unique_ptr<Replica>> replicas;  // destroyed first: they use the groups

        Replica& replica(int r) { return *replicas[static_cast<std::size_t>(r)]; }

        void make_replica(int r, const Impl& proto) {
            auto rep = std::make_unique<Replica>();
            rep->core = this;
            rep->rank = r;
            rep->device = devices[static_cast<std::size_t>(r)];
            std::shared_ptr<::torch::nn::Module> copy;
            try {
                copy = proto.clone(rep->device);
            } catch (const c10::Error& e) {
                throw UsageError(std::string("lockstep::torch::DataParallel clones the module once per replica, and "
                                             "cloning it failed (derive the module from torch::nn::Cloneable<Impl>, and "
                                             "register every submodule, parameter and buffer in reset()): ") +
                                 e.what_without_backtrace());
            }
            rep->module = std::dynamic_pointer_cast<Impl>(copy);
            LOCKSTEP_CHECK_AS(UsageError, rep->module != nullptr, "the module's clone() returned another type");
            std::uint64_t layer = 0;
            for (const auto& m : rep->module->modules(/*include_self=*/true))
                if (auto* bn = dynamic_cast<SyncBatchNormImpl*>(m.get())) bn->layer_id = comm::CollectiveSite::placed_layers + layer++;
            rep->link.layer = &layer_group->communicator(r);
            grads->bind(r, rep->device);
            rep->grad = &grads->communicator(r);
            rep->span_device = grads->device(r);
            rep->worker = std::make_unique<SerialWorker>();
            rep->build_buckets(options.bucket_bytes);
            rep->optimizer = make_optimizer(*rep->module);
            LOCKSTEP_CHECK_AS(UsageError, rep->optimizer != nullptr, "the optimizer factory returned no optimizer");
            // An optimizer over another module's parameters (the prototype's, say) would step
            // tensors that no replica trains.
            std::vector<const void*> own;
            for (const auto& p : rep->module->parameters(true)) own.push_back(p.unsafeGetTensorImpl());
            for (const auto& group : rep->optimizer->param_groups())
                for (const auto& p : group.params())
                    LOCKSTEP_CHECK_AS(UsageError, std::find(own.begin(), own.end(), p.unsafeGetTensorImpl()) != own.end(),
                                      "the optimizer factory returned an optimizer over a tensor of shape ", p.sizes(),
                                      " that is not a parameter of the replica it was given; build the optimizer from "
                                      "that replica's parameters (replica.parameters()), not from the prototype's");
            replicas[static_cast<std::size_t>(r)] = std::move(rep);
        }

        void train_part(int r, Call& call) {
            auto& rep = replica(r);
            rep.link.held.clear();  // the last call's collective buffers: its groups are reset since
            detail::LinkScope scope(&rep.link);
            const auto& shard = call.split.shards[static_cast<std::size_t>(r)];
            const double total = static_cast<double>(call.pending + call.batch);
            rep.module->train(true);
            rep.save_buffers();
            try {
                if (call.pending == 0) {
                    rep.optimizer->zero_grad(true);
                    for (auto& p : rep.params) p.mutable_grad() = at::Tensor();
                } else {  // Note [gradient accumulation]: the kept gradients weigh pending/total
                    ::torch::NoGradGuard no_grad;
                    for (auto& p : rep.params)
                        if (p.grad().defined()) p.mutable_grad().mul_(static_cast<double>(call.pending) / total);
                }
                const at::Tensor x = call.inputs.narrow(0, shard.begin, shard.count).to(rep.device);
                const at::Tensor t = call.targets.narrow(0, shard.begin, shard.count).to(rep.device);
                const at::Tensor out = rep.module->forward(x);
                // Shards are never empty: parallel::shard_ranges refuses a batch smaller than the replicas.
                const at::Tensor l = call.loss(out, t);
                LOCKSTEP_CHECK_AS(ShapeError, l.numel() == 1, "the loss returned a tensor of shape ", l.sizes(),
                                  "; it must return the shard's mean loss, a scalar");
                const double loss_sum = l.item<double>() * static_cast<double>(shard.count);
                double correct = 0;
                if (t.scalar_type() == at::kLong && t.dim() == 1 && out.dim() == 2)
                    correct = static_cast<double>(out.argmax(1).eq(t).sum().item<std::int64_t>());
                const at::Tensor objective = l.reshape({}) * (static_cast<double>(shard.count) / total);
                rep.start_backward();
                rep.collecting = call.step;
                objective.backward();
                if (call.step) {
                    rep.finish_buckets();
                } else {
                    rep.collecting = false;
                }
                auto& totals = rep.totals;  // a member: a peer may read it after an abort (Note [libtorch replicas])
                totals = {loss_sum, correct};
                rep.link.layer->all_reduce_sum(DeviceSpan<double>::host(std::span<double>(totals)),
                                               comm::CollectiveSite::user(0));
                if (r == 0) call.totals = totals;
                if (!call.step) return;
                if (options.check_finite) {
                    LOCKSTEP_CHECK_AS(NonFinite, std::isfinite(totals[0]), "the step's loss is not finite (", totals[0],
                                      "); no replica applied the step");
                    for (std::size_t k = 0; k < rep.params.size(); ++k) {
                        const at::Tensor g = rep.params[k].grad();
                        LOCKSTEP_CHECK_AS(NonFinite, g.isfinite().all().item<bool>(),
                                          "the all-reduced gradient of parameter '", rep.names[k],
                                          "' is not finite; no replica applied the step");
                    }
                }
                if (options.clip_grad_norm) ::torch::nn::utils::clip_grad_norm_(rep.params, *options.clip_grad_norm);
                rep.grad->barrier(comm::CollectiveSite::commit(0));
            } catch (...) {
                // Abort the groups now, so that no peer (nor this replica's communication thread)
                // waits on a collective this replica will never reach.
                ReplicaPool::report_failure(r, std::current_exception());
                rep.collecting = false;
                rep.worker->wait_quietly();
                try {  // the next step's copies into the buckets come after what was started
                    rep.join_buckets();
                } catch (...) {
                }
                rep.restore_buffers();
                throw;
            }
            call.committed.fetch_add(1);
            rep.optimizer->step();
            rep.grad->barrier(comm::CollectiveSite::commit(1));
        }
    };

    static std::shared_ptr<Core> make_core(const std::shared_ptr<Impl>& module, const std::vector<::torch::Device>& devices,
                                           OptimizerFactory<Impl> optimizer, const Options& options,
                                           const detail::ExchangeMaker& make_exchange) {
        LOCKSTEP_CHECK(module != nullptr, "lockstep::torch::DataParallel got a null module");
        LOCKSTEP_CHECK(!devices.empty(), "lockstep::torch::DataParallel needs at least one device");
        LOCKSTEP_CHECK(static_cast<bool>(optimizer), "lockstep::torch::DataParallel needs an optimizer factory");
        LOCKSTEP_CHECK(options.bucket_bytes > 0, "Options::bucket_bytes must be positive");
        LOCKSTEP_CHECK(!options.clip_grad_norm || *options.clip_grad_norm > 0, "Options::clip_grad_norm must be positive");
        LOCKSTEP_CHECK_AS(UsageError, !module->parameters(true).empty(), "lockstep::torch::DataParallel: the module (",
                          module->name(), ") has no parameters, so there is nothing to train; run it as it is");
        check_devices(devices);
        for (const auto& t : module->parameters(true))
            LOCKSTEP_CHECK_AS(DeviceMismatch, t.device().type() == devices.front().type(),
                              "lockstep::torch::DataParallel: the module's parameters are on ", t.device().str(),
                              " but its replicas are to run on ", devices.front().str(),
                              "; pass devices of the module's kind (or move the module first with module->to(device))");
        warn_unconverted(*module);
        auto core = std::make_shared<Core>();
        core->options = options;
        core->devices = devices;
        core->world = static_cast<int>(devices.size());
        core->procs = options.process_group.get();
        core->make_optimizer = std::move(optimizer);
        core->layer_group = std::make_unique<comm::HostGroup>(detail::host_devices(core->world), options.timeout,
                                                              options.process_group, comm::ProcessGroup::layer);
        core->grads =
            make_exchange ? make_exchange(devices, options.timeout, options.process_group) : default_exchange(devices, options);
        core->first_rank = core->layer_group->communicator(0).rank();
        core->global_world = core->layer_group->communicator(0).size();
        core->replicas.resize(devices.size());
        return core;
    }

    // The host group, or NCCL for CUDA replicas where the component has it (Note [libtorch NCCL buckets]).
    static std::unique_ptr<detail::GradientExchange> default_exchange(const std::vector<::torch::Device>& devices,
                                                                      const Options& options) {
#if LOCKSTEP_TORCH_NCCL
        if (devices.front().is_cuda() && options.nccl) {
            std::vector<Device> gpus;
            for (const auto& d : devices) gpus.push_back(Device::cuda(d.index()));
            return std::make_unique<detail::StreamExchange<detail::TorchNcclApi>>(gpus, options.timeout, options.process_group);
        }
#endif
        return std::make_unique<detail::HostExchange>(static_cast<int>(devices.size()), options.timeout, options.process_group);
    }

    // CPU replicas, or CUDA replicas one per device (Note [libtorch CUDA replicas]).
    static void check_devices(const std::vector<::torch::Device>& devices) {
        for (const auto& d : devices) {
            LOCKSTEP_CHECK_AS(UsageError, d.is_cpu() || d.is_cuda(),
                              "lockstep::torch::DataParallel runs replicas on CPU or CUDA "
                              "devices; got ",
                              d.str());
            LOCKSTEP_CHECK_AS(UsageError, d.type() == devices.front().type(), "lockstep::torch::DataParallel: replicas on ",
                              devices.front().str(), " and on ", d.str(), "; put every replica on a CPU or every one on a GPU");
        }
        if (!devices.front().is_cuda()) return;
        std::vector<std::int64_t> used;
        for (const auto& d : devices) {
            LOCKSTEP_CHECK_AS(UsageError, d.has_index(),
                              "lockstep::torch::DataParallel: give each CUDA replica its device "
                              "index (torch::Device(torch::kCUDA, i)), got ",
                              d.str());
            LOCKSTEP_CHECK_AS(UsageError, std::find(used.begin(), used.end(), d.index()) == used.end(),
                              "lockstep::torch::DataParallel: two replicas on ", d.str(),
                              "; one replica per GPU (libtorch runs "
                              "a device's backward on one thread, where SyncBatchNorm's would wait for each other)");
            used.push_back(d.index());
        }
        const auto gpus = static_cast<std::int64_t>(::torch::cuda::device_count());
        LOCKSTEP_CHECK_AS(DeviceError, gpus > 0, "lockstep::torch::DataParallel: replicas on ", devices.front().str(),
                          ", but libtorch sees no CUDA device (no GPU, no driver, or a CPU-only libtorch); pass CPU devices");
        for (const auto& d : devices)
            LOCKSTEP_CHECK_AS(DeviceError, d.index() < gpus, "lockstep::torch::DataParallel: ", d.str(),
                              " does not exist; libtorch sees ", gpus, " CUDA device(s)");
    }

    // A torch::nn::BatchNorm normalizes each replica's shard alone: its running statistics drift
    // apart across replicas and training differs from one process on the whole batch. Warned once
    // per process, naming the first such layer.
    static void warn_unconverted(const ::torch::nn::Module& module) {
        for (const auto& item : module.named_modules("", /*include_self=*/true)) {
            const auto& m = item.value();
            if (!m->as<::torch::nn::BatchNorm1d>() && !m->as<::torch::nn::BatchNorm2d>() && !m->as<::torch::nn::BatchNorm3d>())
                continue;
            std::call_once(detail::unconverted_warning(), [&] {
                std::cerr << "lockstep::torch::DataParallel: warning: '" << (item.key().empty() ? "the module" : item.key())
                          << "' is a " << m->name()
                          << ", whose statistics cover each replica's shard alone (its running statistics drift apart "
                             "across replicas); call lockstep::torch::convert_sync_batchnorm(module) first, or declare "
                             "it as lockstep::torch::SyncBatchNorm\n";
            });
            return;
        }
    }

    // Note [intra-op threads]
    // libtorch keeps its intra-op thread count per thread: a thread takes the process's setting
    // (at::set_num_threads) at its first parallel operation and keeps it. A replica thread would
    // keep whatever the setting was when it first ran one, deaf to every later at::set_num_threads
    // of the user's; 2 replicas that took all the machine's CPUs each oversubscribe it (seen: 25 %
    // of a step at batch 64 on 2 CPUs). So every job starts by setting the replica thread's count
    // to the one its call resolves, on the calling thread, from Options::intra_op_threads. The set
    // happens only on a change, since libtorch's set_num_threads is not only the thread's: it also
    // stores the process's setting (which threads that have not yet run a parallel operation will
    // take, the user's too), resizes its shared pthreadpool and drops oneDNN's primitive cache.
    // Threads that already ran one, the caller among them, keep their count. All this is libtorch's
    // OpenMP build (PyPI's, Debian's); its native thread pool takes one count per process, fixed by
    // the first parallel operation, and ignores a later set with a warning.
    int call_threads() const {
        const int caller = at::get_num_threads();
        const int requested = core_->options.intra_op_threads;
        if (requested > 0) return requested;
        if (requested < 0) return caller;
        return std::min(caller, std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / core_->world));
    }

    // Every replica, in every process, must hold the same tensors: a hash of their names, shapes
    // and dtypes and their count, compared through one all-reduce.
    void check_same_structure() {
        auto fingerprints = std::make_shared<std::vector<double>>(2 * static_cast<std::size_t>(core_->global_world), 0.0);
        run_job([core = core_, fingerprints](int r) {
            auto& rep = core->replica(r);
            std::uint64_t h = 1469598103934665603ull;
            std::int64_t count = 0;
            const auto mix = [&](const std::string& s) {
                for (const unsigned char c : s) h = (h ^ c) * 1099511628211ull;
            };
            detail::each_state(*rep.module, [&](const std::string& name, const at::Tensor& t) {
                mix(name + ":" + c10::toString(t.scalar_type()) + ":" + c10::str(t.sizes()) + ";");
                ++count;
            });
            std::vector<double> mine(fingerprints->size(), 0.0);
            const auto g = static_cast<std::size_t>(rep.link.layer->rank());
            mine[2 * g] = static_cast<double>(h >> 12);  // exact in a double
            mine[2 * g + 1] = static_cast<double>(count);
            rep.link.layer->all_reduce_sum(DeviceSpan<double>::host(std::span<double>(mine)),
                                           comm::CollectiveSite::control(comm::Exchange::math_modes));
            if (r == 0) *fingerprints = mine;
        });
        const auto& f = *fingerprints;
        for (int g = 1; g < core_->global_world; ++g) {
            const auto ug = static_cast<std::size_t>(g);
            if (f[2 * ug] != f[0] || f[2 * ug + 1] != f[1])
                throw UsageError("lockstep::torch::DataParallel: replica " + std::to_string(g) + "'s module holds other "
                                 "parameters or buffers than replica 0's (" + std::to_string(static_cast<std::int64_t>(f[2 * ug + 1])) +
                                 " tensors against " + std::to_string(static_cast<std::int64_t>(f[1])) +
                                 ", or other names, shapes or dtypes); every process must build the same model");
        }
    }

    std::shared_ptr<Call> begin_call(const at::Tensor& inputs, const at::Tensor& targets, const Loss& loss, const char* what,
                                     bool step) {
        LOCKSTEP_CHECK_AS(ShapeError, inputs.dim() >= 1, "DataParallel::", what, " needs a batched input, got a scalar");
        LOCKSTEP_CHECK_AS(ShapeError, targets.dim() >= 1 && targets.size(0) == inputs.size(0), what, ": targets of shape ",
                          targets.sizes(), " for a batch of ", inputs.size(0), "; pass one per sample");
        LOCKSTEP_CHECK(static_cast<bool>(loss), "DataParallel::", what, " needs a loss");
        auto call = std::make_shared<Call>();
        call->inputs = inputs;
        call->targets = targets;
        call->loss = loss;
        call->split = split_batch(inputs.size(0), what);
        call->batch = call->split.batch;
        call->pending = pending_.count;
        call->step = step;
        return call;
    }

    parallel::BatchSplit split_batch(std::int64_t rows, const char* what) const {
        return parallel::split_batch(core_->procs, rows, core_->world, core_->first_rank, core_->global_world, what);
    }

    void check_usable(const char* what) const {
        pool_.check_usable(std::string("DataParallel::") + what);
        if (diverged_)
            throw Diverged(std::string("DataParallel::") + what + ": the replicas may differ since a step failed after its "
                           "commit point (" + *diverged_ + "); call resync() to copy replica 0's parameters, buffers and "
                           "optimizer state to all, or load() a checkpoint");
    }

    // A failed job aborted the groups; a stream group's communicators are aborted by helper
    // threads (Note [aborting communicators] in comm/stream_group.hpp), waited for here, at most
    // the groups' timeout (a day at most), so that the call returns with them gone.
    void run_job(ReplicaPool::Job job) {
        try {
            run_job_once(std::move(job));
        } catch (...) {
            const auto deadline = std::chrono::steady_clock::now() +
                                  std::min<std::chrono::milliseconds>(core_->options.timeout, std::chrono::hours(24));
            (void)core_->grads->abortable()->settle(deadline);
            (void)core_->layer_group->abortable()->settle(deadline);
            throw;
        }
    }
    void run_job_once(ReplicaPool::Job job) {
        pool_.run([threads = call_threads(), core = core_, job = std::move(job)](int r) {
#if AT_PARALLEL_OPENMP  // (libtorch's native pool ignores, with a warning, a set after its first use)
            if (at::get_num_threads() != threads) at::set_num_threads(threads);
#else
            (void)threads;
#endif
            std::optional<c10::StreamGuard> on_device;  // Note [libtorch CUDA replicas]
            if (const auto& d = core->devices[static_cast<std::size_t>(r)]; d.is_cuda())
                on_device.emplace(c10::impl::VirtualGuardImpl(d.type()).getDefaultStream(d));
            job(r);
        });
    }

    std::shared_ptr<Core> core_;
    ReplicaPool pool_;
    bool training_ = true;
    Pending pending_;
    std::int64_t steps_ = 0;
    std::optional<std::string> diverged_;
};

template <class Impl>
DataParallel(::torch::nn::ModuleHolder<Impl>, int, std::type_identity_t<OptimizerFactory<Impl>>, Options = {}) -> DataParallel<Impl>;
template <class Impl>
DataParallel(std::shared_ptr<Impl>, int, std::type_identity_t<OptimizerFactory<Impl>>, Options = {}) -> DataParallel<Impl>;
template <class Impl>
DataParallel(::torch::nn::ModuleHolder<Impl>, std::vector<::torch::Device>, std::type_identity_t<OptimizerFactory<Impl>>,
             Options = {}) -> DataParallel<Impl>;
template <class Impl>
DataParallel(std::shared_ptr<Impl>, std::vector<::torch::Device>, std::type_identity_t<OptimizerFactory<Impl>>, Options = {})
    -> DataParallel<Impl>;

}  // namespace lockstep::torch
