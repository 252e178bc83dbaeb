// SPDX-License-Identifier: MIT
//! `DataParallel<Module>`: persistent replicas on persistent threads, scatter/gather, bucketed
//! gradient all-reduce overlapped with backward, and one parallel region per training step.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "lockstep/comm/collectives.hpp"
#include "lockstep/comm/host_communicator.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/tensor.hpp"
#include "lockstep/nn/context.hpp"
#include "lockstep/nn/module.hpp"
#include "lockstep/parallel/scatter.hpp"
#include "lockstep/runtime/replica_pool.hpp"
#include "lockstep/runtime/serial_worker.hpp"

namespace lockstep {

struct DataParallelOptions {
    //! Gradients are all-reduced in flat buckets of about this many bytes, last layers first.
    std::size_t bucket_bytes = std::size_t{25} << 20;
    //! Run each bucket's all-reduce on the replica's communication thread as soon as the bucket's
    //! gradients are final, overlapping the rest of backward (false: after backward, in line).
    bool overlap = true;
    //! No collective waits longer than this for a peer.
    std::chrono::milliseconds timeout = AbortableBarrier::default_timeout;
    //! Where the replica threads run (see Note [replica CPU binding]).
    CpuBinding cpu_binding = CpuBinding::automatic;
};

//! What one training step reports (computed identically for any split of the batch).
struct StepResult {
    double loss = 0;             // mean loss over the global batch
    std::int64_t correct = 0;    // samples classified correctly
    std::int64_t count = 0;      // samples in the global batch
};

// Note [commit point]
// A step that fails on any replica must not leave replicas different. Every replica passes one
// barrier after its gradients are all-reduced and before its optimizer step; a replica that
// fails earlier aborts the barrier, so either every replica steps or none does. What a failed
// step may leave behind is the same on every replica: SyncBatchNorm running statistics are
// updated by a completed forward collective, which completes on all replicas or on none.

// Note [gradient buckets]
// Parameters are grouped, in reverse visit order (the order backward finishes them), into flat
// buckets of about `bucket_bytes`. A layer reports each parameter whose gradient is final
// through Context::mark_grad_ready; when the last parameter of a bucket is in, the bucket is
// packed and handed to the replica's communication thread, which all-reduces it on a second
// replica group (so it never interleaves with the SyncBatchNorm collectives of the compute
// threads) and unpacks the sums. Every replica runs the same layers in the same order, so every
// replica launches the same buckets in the same order. Buckets never reported (a layer that does
// not call mark_grad_ready) are launched after backward, in bucket order. Summation is per
// element in rank order, so bucketing changes no bit of the result.

//! Data parallelism over persistent replicas of `Module` (see DESIGN.md, "Replicas and threads").
template <class Module>
class DataParallel {
    static_assert(nn::check_module<Module>());

public:
    using backend = typename Module::backend;
    static_assert(std::same_as<backend, Host>, "DataParallel<Cuda modules> lives in <lockstep/cuda.cuh>");
    using Comm = comm::HostCommunicator;

    //! Clones `prototype` once per device and makes every replica hold replica 0's values.
    DataParallel(const Module& prototype, std::vector<Device> devices, DataParallelOptions options = {})
        : options_(options), devices_(check_devices(devices)), world_(static_cast<int>(devices_.size())),
          comms_(Comm::create_group(world_, options.timeout)), grad_comms_(Comm::create_group(world_, options.timeout)),
          pool_(world_, {}, options.cpu_binding) {
        LOCKSTEP_CHECK(options.bucket_bytes > 0, "DataParallelOptions::bucket_bytes must be positive");
        pool_.attach(comms_[0].group_ptr());
        pool_.attach(grad_comms_[0].group_ptr());
        for (int r = 0; r < world_; ++r) {
            replicas_.push_back(std::make_unique<Replica>(nn::clone(prototype, devices_[static_cast<std::size_t>(r)]),
                                                          comms_[static_cast<std::size_t>(r)],
                                                          grad_comms_[static_cast<std::size_t>(r)]));
            auto& rep = *replicas_.back();
            rep.ctx.rank = r;
            rep.ctx.world = world_;
            rep.ctx.device = devices_[static_cast<std::size_t>(r)];
            rep.ctx.comm = &rep.collectives;
            build_buckets(rep);
        }
        broadcast_from_first();
    }

    //! `replicas` host replicas.
    DataParallel(const Module& prototype, int replicas, DataParallelOptions options = {})
        : DataParallel(prototype, host_devices(replicas), options) {}

    DataParallel(const DataParallel&) = delete;
    DataParallel& operator=(const DataParallel&) = delete;

    int size() const noexcept { return world_; }
    const std::vector<Device>& devices() const noexcept { return devices_; }
    //! The CPU each replica thread is bound to, by rank; empty when unbound (see `cpu_binding`).
    const std::vector<int>& bound_cpus() const noexcept { return pool_.bound_cpus(); }
    Module& replica(int i) { return replicas_.at(static_cast<std::size_t>(i))->module; }
    //! The primary replica (rank 0): the one to save. All replicas hold the same values.
    Module& module() { return replica(0); }
    std::size_t bucket_count() const noexcept { return replicas_[0]->buckets.size(); }

    void train() noexcept { training_ = true; }
    void eval() noexcept { training_ = false; }
    bool training() const noexcept { return training_; }

    //! Runs `fn(Module& replica, nn::Context& ctx)` on every replica's thread (the seed's
    //! `_parallel_apply`); rethrows the first failure after every replica has stopped.
    template <class F>
    void parallel_apply(F&& fn) {
        pool_.run([&](int r) {
            auto& rep = *replicas_[static_cast<std::size_t>(r)];
            rep.ctx.training = training_;
            rep.ctx.global_batch = -1;
            rep.ctx.grad_ready = nullptr;
            fn(rep.module, rep.ctx);
        });
    }

    //! Scatters `x` over the replicas, runs forward on each and concatenates the outputs.
    Tensor<float, backend> forward(const Tensor<float, backend>& x) {
        LOCKSTEP_CHECK_AS(ShapeError, x.rank() >= 1, "DataParallel::forward needs a batched input, got a scalar");
        const auto shards = parallel::shard_ranges(x.dim(0), world_);
        std::vector<Tensor<float, backend>> outs(static_cast<std::size_t>(world_));
        pool_.run([&](int r) {
            const auto ur = static_cast<std::size_t>(r);
            auto& rep = *replicas_[ur];
            rep.ctx.training = training_;
            rep.ctx.global_batch = x.dim(0);
            rep.ctx.grad_ready = nullptr;
            outs[ur] = rep.module.forward(rep.ctx, parallel::take_rows(x, shards[ur]));
        });
        return parallel::concat_rows(outs);
    }

    //! One training step as ONE parallel region: scatter, forward, loss, backward with the
    //! bucketed gradient all-reduce, optimizer step. `loss(ctx, logits, labels)` returns an
    //! `nn::LossOutput`; `optimizer` has `prepare(replicas)` and `step(rank, module)`.
    template <class Loss, class Optimizer>
    StepResult train_step(const Tensor<float, backend>& x, std::span<const std::int64_t> labels, const Loss& loss,
                          Optimizer& optimizer) {
        LOCKSTEP_CHECK_AS(ShapeError, x.rank() >= 1, "DataParallel::train_step needs a batched input, got a scalar");
        LOCKSTEP_CHECK_AS(ShapeError, static_cast<std::int64_t>(labels.size()) == x.dim(0), "train_step: ", labels.size(),
                          " labels for a batch of ", x.dim(0), "; pass one label per sample");
        const auto shards = parallel::shard_ranges(x.dim(0), world_);
        optimizer.prepare(world_);
        std::vector<double> sums(static_cast<std::size_t>(world_));
        std::vector<std::int64_t> correct(static_cast<std::size_t>(world_));
        pool_.run([&](int r) {
            const auto ur = static_cast<std::size_t>(r);
            auto& rep = *replicas_[ur];
            rep.ctx.training = true;
            rep.ctx.global_batch = x.dim(0);
            nn::zero_grad(rep.module);
            rep.begin_step(options_.overlap);
            try {
                auto out = rep.module.forward(rep.ctx, parallel::take_rows(x, shards[ur]));
                auto lo = loss(rep.ctx, out, labels.subspan(static_cast<std::size_t>(shards[ur].begin),
                                                            static_cast<std::size_t>(shards[ur].count)));
                out = Tensor<float, backend>();
                rep.module.backward(rep.ctx, lo.grad);
                rep.finish_backward();
                // Note [commit point]: no replica updates its parameters unless every replica
                // got here; a failure anywhere before aborts this barrier on all of them.
                rep.grad_comm->barrier(0x636f6d6dull);  // "comm(it)"
                sums[ur] = lo.sum;
                correct[ur] = lo.correct;
            } catch (...) {
                // Abort both groups first (peers and this replica's communication thread wake
                // up), then wait for the communication thread, then leave.
                pool_.report_failure(r, std::current_exception());
                rep.unwind();
                throw;
            }
            optimizer.step(r, rep.module);
        });
        StepResult result;
        result.count = x.dim(0);
        double total = 0;
        for (int r = 0; r < world_; ++r) {  // rank order: the same bits for any run
            total += sums[static_cast<std::size_t>(r)];
            result.correct += correct[static_cast<std::size_t>(r)];
        }
        result.loss = total / static_cast<double>(result.count);
        return result;
    }

    //! Gradient buckets of the last training step that replica `rank` had finished all-reducing
    //! before its backward pass ended: the all-reduce work that overlapped backward.
    std::size_t overlapped_buckets(int rank) const {
        return replicas_.at(static_cast<std::size_t>(rank))->reduced_during_backward;
    }

    //! Collectives made so far by replica `rank` on the layer group and the gradient group.
    std::uint64_t layer_collectives(int rank) const { return comms_.at(static_cast<std::size_t>(rank)).collective_count(); }
    std::uint64_t gradient_collectives(int rank) const {
        return grad_comms_.at(static_cast<std::size_t>(rank)).collective_count();
    }

private:
    struct Bucket {
        std::vector<nn::Parameter<backend>*> params;
        std::vector<std::int64_t> offsets;
        Tensor<float, backend> flat;
        int pending = 0;
        bool launched = false;
    };

    struct Replica {
        Replica(Module&& replica, Comm& layer_comm, Comm& grad_comm)
            : module(std::move(replica)), collectives(layer_comm), grad_comm(&grad_comm) {}

        Module module;
        comm::CollectivesOf<Comm> collectives;
        Comm* grad_comm;
        nn::Context ctx;
        std::vector<Bucket> buckets;
        struct Slot {
            std::size_t bucket = 0;
            bool ready = false;  // reported in this step
        };
        std::unordered_map<const void*, Slot> slots;  // every parameter of the replica
        SerialWorker worker;
        bool overlap = true;
        std::atomic<std::size_t> reduced{0};  // buckets all-reduced in this step so far
        std::size_t reduced_during_backward = 0;

        void begin_step(bool overlap_now) {
            overlap = overlap_now;
            for (auto& b : buckets) {
                b.pending = static_cast<int>(b.params.size());
                b.launched = false;
            }
            for (auto& [p, slot] : slots) slot.ready = false;
            reduced.store(0, std::memory_order_relaxed);
            ctx.grad_ready = [this](const void* p) { on_ready(p); };
        }

        void on_ready(const void* p) {
            auto it = slots.find(p);
            if (it == slots.end() || it->second.ready) return;  // not a parameter of this model, or counted
            it->second.ready = true;
            auto& b = buckets[it->second.bucket];
            if (--b.pending == 0 && overlap) launch(it->second.bucket);
        }

        void launch(std::size_t index) {
            auto& b = buckets[index];
            b.launched = true;
            for (std::size_t i = 0; i < b.params.size(); ++i)
                std::memcpy(b.flat.data() + b.offsets[i], b.params[i]->grad.data(), b.params[i]->grad.bytes());
            auto job = [this, index] {
                auto& bb = buckets[index];
                grad_comm->all_reduce_sum(bb.flat.span(), 0x6772ull << 32 | index);  // "gr" + bucket index
                for (std::size_t i = 0; i < bb.params.size(); ++i)
                    std::memcpy(bb.params[i]->grad.data(), bb.flat.data() + bb.offsets[i], bb.params[i]->grad.bytes());
                reduced.fetch_add(1, std::memory_order_release);
            };
            if (overlap) worker.submit(job);
            else job();
        }

        void finish_backward() {
            reduced_during_backward = reduced.load(std::memory_order_acquire);  // backward has just ended
            for (std::size_t i = 0; i < buckets.size(); ++i)
                if (!buckets[i].launched) launch(i);
            worker.wait();
            ctx.grad_ready = nullptr;
        }

        // After a failure on this replica (the groups are aborted already): make sure this
        // replica's communication thread is idle before the job returns, so the pool never
        // resets a group with a thread still inside it.
        void unwind() noexcept {
            worker.wait_quietly();
            ctx.grad_ready = nullptr;
        }
    };

    static std::vector<Device> check_devices(const std::vector<Device>& devices) {
        LOCKSTEP_CHECK(!devices.empty(), "DataParallel needs at least one device, got none; pass e.g. "
                                         "lockstep::DataParallel(model, 2) for two host replicas");
        for (const auto& d : devices)
            LOCKSTEP_CHECK(d.kind == device_kind_of<backend>(), "DataParallel of a ", backend::name,
                           " module cannot use device ", d);
        return devices;
    }

    static std::vector<Device> host_devices(int replicas) {
        LOCKSTEP_CHECK(replicas > 0, "DataParallel needs at least one replica, got ", replicas);
        std::vector<Device> d;
        for (int r = 0; r < replicas; ++r) d.push_back(Device::host(r));
        return d;
    }

    void build_buckets(Replica& rep) {
        std::vector<nn::Parameter<backend>*> params;
        nn::for_each_parameter(rep.module, [&](const std::string&, nn::Parameter<backend>& p) { params.push_back(&p); });
        Bucket current;
        std::int64_t elems = 0;
        const auto close = [&] {
            if (current.params.empty()) return;
            current.flat = Tensor<float, backend>(Shape{elems});
            for (auto* p : current.params) rep.slots[p] = {rep.buckets.size(), false};
            rep.buckets.push_back(std::move(current));
            current = Bucket{};
            elems = 0;
        };
        for (auto it = params.rbegin(); it != params.rend(); ++it) {
            auto* p = *it;
            if (!current.params.empty() &&
                static_cast<std::size_t>(elems + p->numel()) * sizeof(float) > options_.bucket_bytes)
                close();
            current.params.push_back(p);
            current.offsets.push_back(elems);
            elems += p->numel();
        }
        close();
    }

    void broadcast_from_first() {
        pool_.run([&](int r) {
            auto& rep = *replicas_[static_cast<std::size_t>(r)];
            auto& c = comms_[static_cast<std::size_t>(r)];
            std::uint64_t site = 0x6263ull << 32;  // "bc"
            nn::walk(
                rep.module, [&](const std::string&, auto& p) { c.broadcast(p.value.span(), 0, site++); },
                [&](const std::string&, auto& t) { c.broadcast(t.span(), 0, site++); });
        });
    }

    DataParallelOptions options_;
    std::vector<Device> devices_;
    int world_;
    std::vector<Comm> comms_;       // layer collectives (SyncBatchNorm), on the replica threads
    std::vector<Comm> grad_comms_;  // gradient buckets, on the communication threads
    ReplicaPool pool_;
    std::vector<std::unique_ptr<Replica>> replicas_;
    bool training_ = true;
};

}  // namespace lockstep
