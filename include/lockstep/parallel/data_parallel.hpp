// SPDX-License-Identifier: MIT
//! `DataParallel<Module, Group>`: persistent replicas on persistent threads, scatter/gather,
//! bucketed gradient all-reduce overlapped with backward, gradient accumulation and clipping,
//! checkpoints of model and optimizer, and one parallel region per training step. Its parts:
//! the replicas and their buckets (parallel/replica.hpp), the step runner (parallel/step.hpp),
//! what processes agree on (parallel/process_coordination.hpp, checkpoint_coordination.hpp).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <concepts>
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "lockstep/comm/collective_tag.hpp"
#include "lockstep/comm/collectives.hpp"
#include "lockstep/comm/group.hpp"
#include "lockstep/comm/process_group.hpp"
#include "lockstep/core/device_span.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/tensor.hpp"
#include "lockstep/kernels/ops.hpp"
#include "lockstep/nn/bucket_layout.hpp"
#include "lockstep/nn/checkpoint.hpp"
#include "lockstep/nn/context.hpp"
#include "lockstep/nn/loss.hpp"
#include "lockstep/nn/module.hpp"
#include "lockstep/nn/sgd.hpp"
#include "lockstep/parallel/call_state.hpp"
#include "lockstep/parallel/checkpoint_coordination.hpp"
#include "lockstep/parallel/core.hpp"
#include "lockstep/parallel/options.hpp"
#include "lockstep/parallel/process_coordination.hpp"
#include "lockstep/parallel/replica.hpp"
#include "lockstep/parallel/scatter.hpp"
#include "lockstep/parallel/step.hpp"
#include "lockstep/runtime/replica_pool.hpp"

namespace lockstep {

//! Data parallelism over persistent replicas of `Module` (docs/design.md; Notes [step order] and
//! [commit point] in parallel/step.hpp).
//! No call waits for a replica without bound: one that has not finished `options().timeout` after
//! a peer failed or finished makes the call throw `ReplicaStuck` naming it, and the object then
//! refuses every later call; its destructor waits the timeout again, then leaves the stuck thread
//! behind (reported on stderr), with the replica state it still uses (Note [stuck replicas] in
//! runtime/replica_pool.hpp, Note [jobs own their state] in parallel/call_state.hpp).
template <class Module, class Group = comm::default_group_t<typename Module::backend>>
class DataParallel {
    static_assert(nn::check_module<Module>());

public:
    using backend = typename Module::backend;
    using module_type = Module;
    using group_type = Group;

private:
    static_assert(comm::GroupLike<Group>,
                  "lockstep: DataParallel's Group needs `using backend`, constructors from (std::vector<Device>, "
                  "std::chrono::milliseconds) and from those and (std::shared_ptr<comm::ProcessGroup>, "
                  "comm::ProcessGroup::Channel), size(), communicator(rank) returning comm::Collectives&, abortable() "
                  "and bind(rank, execution)");
    static_assert(std::same_as<typename Group::backend, backend>,
                  "lockstep: DataParallel's Group must be of the module's backend (comm::default_group_t<backend>)");
    using K = kernels::Ops<backend>;
    using Core = parallel::detail::Core<Module, Group>;
    using Replica = parallel::detail::Replica<Module>;

public:
    //! Clones `prototype` once per device and makes every replica hold replica 0's values.
    DataParallel(const Module& prototype, std::vector<Device> devices, DataParallelOptions options = {})
        : core_(Core::make(options, devices)),
          world_(core_->world),
          // Each replica's backend resources are made on its own thread, which then works on its device.
          pool_(
              world_,
              [core = core_](int r) {
                  const auto ur = static_cast<std::size_t>(r);
                  core->resources[ur] = std::make_unique<typename K::ReplicaResources>(core->devices[ur]);
                  core->resources[ur]->bind_thread();
              },
              options.cpu_binding, options.timeout) {
        pool_.attach(core_->abortable(0));
        pool_.attach(core_->abortable(1));
        core_->replicas.resize(static_cast<std::size_t>(world_));
        // Each replica is cloned on its own thread, so its tensors are made on its device.
        auto caller = std::make_shared<parallel::detail::CallerRefs>();  // Note [jobs own their state]
        run_job(*caller, [core = core_, caller, proto = &prototype](int r) { make_replica(*core, r, *caller, *proto); });
        core_->layout = core_->replica(0).layout();
        pool_.run([core = core_](int r) { core->replica(r).broadcast_from(0); });
    }

    //! `replicas` replicas on the backend's default devices (host replicas 0, 1, ...).
    DataParallel(const Module& prototype, int replicas, DataParallelOptions options = {})
        : DataParallel(prototype, K::default_devices(replicas), options) {}

    DataParallel(const DataParallel&) = delete;
    DataParallel& operator=(const DataParallel&) = delete;

    int size() const noexcept { return world_; }
    const std::vector<Device>& devices() const noexcept { return core_->devices; }
    const DataParallelOptions& options() const noexcept { return core_->options; }
    //! The CPU each replica thread is bound to, by rank; empty when unbound (see `cpu_binding`).
    const std::vector<int>& bound_cpus() const noexcept { return pool_.bound_cpus(); }
    //! Replica `i`, for reading. Replicas change only through DataParallel, so they cannot drift apart.
    const Module& replica(int i) const { return core_->replicas.at(static_cast<std::size_t>(i))->module; }
    //! The primary replica (rank 0). All replicas hold the same values.
    const Module& module() const { return replica(0); }
    std::size_t bucket_count() const noexcept { return core_->layout.buckets.size(); }
    //! The gradient buckets' layout, the same for every replica, as the optimizer gets it.
    const nn::BucketLayout& bucket_layout() const noexcept { return core_->layout; }
    //! Samples accumulated by `accumulate` since the last training step.
    std::int64_t accumulated_samples() const noexcept { return pending_; }

    void train() noexcept { training_ = true; }
    void eval() noexcept { training_ = false; }
    bool training() const noexcept { return training_; }

    //! Runs `fn(Module& replica, nn::Context<backend>& ctx)` on every replica's thread (the seed's
    //! `_parallel_apply`); rethrows the first failure after every replica has stopped. Whatever
    //! `fn` changes, it must change alike on every replica. A temporary `fn` is kept alive by the
    //! job (Note [jobs own their state]); one passed by reference, and whatever `fn` captures by
    //! reference, must outlive a replica the call gives up on.
    template <class F>
    void parallel_apply(F&& fn) {
        pool_.check_usable("DataParallel::parallel_apply");
        using Fn = std::remove_cvref_t<F>;
        std::shared_ptr<Fn> owned;
        std::remove_reference_t<F>* f = nullptr;
        if constexpr (!std::is_lvalue_reference_v<F> && std::is_move_constructible_v<Fn>) {
            owned = std::make_shared<Fn>(std::move(fn));
            f = owned.get();
        } else {
            f = std::addressof(fn);
        }
        // Whatever fn changes (a host setting of a layer, a tensor left in one), a graph captured
        // before would not see it: every replica captures again (Note [captured steps]).
        drop_graphs();
        pool_.run([core = core_, owned, f, training = training_](int r) {
            auto& rep = *core->replicas[static_cast<std::size_t>(r)];
            rep.ctx.training = training;
            rep.ctx.global_batch = -1;
            rep.ctx.grad_ready = nullptr;
            // fn drives the module itself, perhaps through several forwards: it numbers its passes
            // if it wants the check (Note [one instance, one use]).
            rep.ctx.pass = 0;
            (*f)(rep.module, rep.ctx);
        });
    }

    //! Scatters `x` over the replicas, runs forward on each and concatenates the outputs (on `x`'s device).
    Tensor<float, backend> forward(const Tensor<float, backend>& x) {
        check_in_step("forward");
        LOCKSTEP_CHECK_AS(ShapeError, x.rank() >= 1, "DataParallel::forward needs a batched input, got a scalar");
        struct Call {  // Note [jobs own their state]
            std::vector<parallel::ShardRange> shards;
            std::vector<Tensor<float, backend>> outs;
            parallel::detail::CallerRefs caller;  // x
        };
        auto call = std::make_shared<Call>();
        auto split = split_batch(x.dim(0), "forward");
        call->shards = std::move(split.shards);
        const std::int64_t batch = split.batch;
        call->outs.resize(static_cast<std::size_t>(world_));
        run_job(call->caller, [core = core_, call, xp = &x, training = training_, batch](int r) {
            const auto ur = static_cast<std::size_t>(r);
            auto& rep = *core->replicas[ur];
            rep.ctx.training = training;
            rep.ctx.global_batch = batch;
            rep.ctx.grad_ready = nullptr;
            rep.ctx.pass = nn::next_pass();  // Note [one instance, one use]
            Tensor<float, backend> in;
            if (!call->caller.read(
                    [&] {
                        in = parallel::take_rows(rep.ctx.exec, *xp, call->shards[ur], core->devices[ur]);
                        K::mark_inputs_read(rep.ctx.exec);
                    },
                    [ex = rep.ctx.exec] { K::wait_inputs_read(ex); }))
                throw parallel::detail::caller_gone();
            call->outs[ur] = rep.module.forward(rep.ctx, std::move(in));
            // The layers may keep what backward would read (in training mode they do): a capture
            // must not free it (Note [captured steps]), so the next step runs eagerly.
            if (rep.graphs) rep.graphs->layers_hold_state = true;
        });
        std::vector<Execution<backend>> producers;
        for (const auto& rep : core_->replicas) producers.push_back(rep->ctx.exec);
        return parallel::gather_rows(K::caller_execution(x.device()), call->outs, producers, x.device());
    }

    //! One training step as ONE parallel region: scatter, forward, loss, backward with the
    //! bucketed gradient all-reduce, clipping, optimizer step (see Note [step order]). `targets`
    //! are whatever `loss` takes for a shard: class labels (any contiguous container of
    //! std::int64_t) for nn::SoftmaxCrossEntropy, a float tensor of the output's shape for
    //! nn::MseLoss. Gradients of earlier `accumulate` calls join this step's.
    template <class Targets, class Loss, class Optimizer>
    StepResult train_step(const Tensor<float, backend>& x, const Targets& targets, const Loss& loss, Optimizer& optimizer) {
        static_assert(nn::OptimizerLike<Optimizer, Module>,
                      "lockstep: the optimizer needs prepare(int replicas, const nn::BucketLayout&), step(const "
                      "nn::Context<backend>&, Module&) and visit_state(int rank, Module&, f): see Note [optimizer "
                      "protocol] in nn/sgd.hpp");
        LOCKSTEP_CHECK_AS(UsageError, training_, "DataParallel::train_step in eval mode; call train() first");
        check_in_step("train_step");
        const auto view = parallel::targets_view(targets);
        auto call = begin_call(x, view, loss, "train_step");
        optimizer.prepare(world_, core_->layout);
        try {
            run_job(call->caller, [core = core_, call, xp = &x, tp = &view, op = &optimizer](int r) {
                parallel::detail::train_part(*core, r, *call, *xp, *tp, *op);
            });
        } catch (const ReplicaStuck&) {
            pending_ = 0;  // the object is unusable now (Note [stuck replicas]); nothing more to record
            throw;
        } catch (const std::exception& e) {
            pending_ = 0;  // the kept gradients are incomplete: the next call starts afresh
            if (auto d = parallel::detail::divergence_after(*call, e.what())) diverged_ = std::move(d);
            throw;
        } catch (...) {
            pending_ = 0;
            if (auto d = parallel::detail::divergence_after(*call, "an exception that is not a std::exception"))
                diverged_ = std::move(d);
            throw;
        }
        pending_ = 0;
        ++steps_;
        return parallel::detail::step_result(*call, core_->procs);
    }

    //! Forward and backward of a micro-batch whose gradients are kept for the next train_step,
    //! with no gradient collective (DDP's no_sync; layer collectives still run). Micro-batches are
    //! weighted by their sample counts (see Note [gradient accumulation]).
    template <class Targets, class Loss>
    void accumulate(const Tensor<float, backend>& x, const Targets& targets, const Loss& loss) {
        LOCKSTEP_CHECK_AS(UsageError, training_, "DataParallel::accumulate in eval mode keeps no gradients; call train() first");
        check_in_step("accumulate");
        const auto view = parallel::targets_view(targets);
        auto call = begin_call(x, view, loss, "accumulate");
        try {
            run_job(call->caller, [core = core_, call, xp = &x, tp = &view](int r) {
                parallel::detail::accumulate_part(*core, r, *call, *xp, *tp);
            });
        } catch (...) {
            pending_ = 0;  // the kept gradients are incomplete: the next call starts afresh
            throw;
        }
        pending_ = call->after;
    }

    //! The model (replica 0) as a checkpoint, with `optimizer`'s state of replica 0 under
    //! "optimizer." when one is given.
    nn::Checkpoint checkpoint() const {
        check_in_step("checkpoint");
        nn::Checkpoint ck;
        nn::put_module(ck, module());
        return ck;
    }
    template <class Optimizer>
    nn::Checkpoint checkpoint(Optimizer& optimizer) const {
        auto ck = checkpoint();
        optimizer.prepare(world_, core_->layout);
        nn::put_optimizer(ck, optimizer, module(), 0);
        return ck;
    }

    //! Writes the model (and the optimizer's state) to `path` atomically.
    //! Across processes (`process_group`), global rank 0's process alone writes, and every
    //! process returns when it has, or throws the same `IoError` when it failed.
    nn::Checkpoint::SaveReport save(const std::string& path) const {
        return parallel::save_once(core_->procs, [&] { return checkpoint().save(path); });
    }
    template <class Optimizer>
    nn::Checkpoint::SaveReport save(const std::string& path, Optimizer& optimizer) const {
        return parallel::save_once(core_->procs, [&] { return checkpoint(optimizer).save(path); });
    }
    //! Writes `ck` (say `checkpoint(optimizer)` with metadata added) as `save` does: once, by
    //! process 0, when the object spans processes.
    nn::Checkpoint::SaveReport save(const nn::Checkpoint& ck, const std::string& path) const {
        return parallel::save_once(core_->procs, [&] { return ck.save(path); });
    }
    //! The processes this object spans (null: this process alone).
    const std::shared_ptr<comm::ProcessGroup>& process_group() const noexcept { return core_->options.process_group; }
    //! Replicas over all processes (`size()` on one process).
    int global_size() const noexcept { return core_->global_world; }

    //! Loads a checkpoint into every replica (and the optimizer's state of every replica). Every
    //! tensor is checked against the model first: a checkpoint of another model throws `IoError`
    //! naming the checkpoint, the tensor and both shapes, and changes nothing.
    //! (The replicas read a copy of `ck`, owned by the call's job: Note [jobs own their state].)
    void load(const nn::Checkpoint& ck) {
        load_impl(std::make_shared<const nn::Checkpoint>(ck), &parallel::detail::no_optimizer);
    }
    template <class Optimizer>
    void load(const nn::Checkpoint& ck, Optimizer& optimizer) {
        load_impl(std::make_shared<const nn::Checkpoint>(ck), &optimizer);
    }
    void load(const std::string& path) {
        load_impl(std::make_shared<const nn::Checkpoint>(nn::Checkpoint::load(path)), &parallel::detail::no_optimizer);
    }
    template <class Optimizer>
    void load(const std::string& path, Optimizer& optimizer) {
        load_impl(std::make_shared<const nn::Checkpoint>(nn::Checkpoint::load(path)), &optimizer);
    }

    //! Training steps applied so far.
    std::int64_t steps() const noexcept { return steps_; }
    //! Whether a step failed after some replica applied it (see Note [commit point]).
    bool diverged() const noexcept { return diverged_.has_value(); }

    //! Makes every replica equal again after a step that failed past its commit point: copies the
    //! parameters, buffers and `optimizer`'s state of a replica that completed the step (the
    //! lowest such rank) to all. Without the optimizer only the model is copied.
    void resync() { resync_impl(&parallel::detail::no_optimizer); }
    template <class Optimizer>
    void resync(Optimizer& optimizer) {
        resync_impl(&optimizer);
    }

    //! Gradient buckets of the last training step whose all-reduce replica `rank` had finished
    //! (host groups) or enqueued on the device (stream-ordered groups, CUDA) before its backward
    //! pass ended: the all-reduce work that overlapped backward.
    std::size_t overlapped_buckets(int rank) const {
        return core_->replicas.at(static_cast<std::size_t>(rank))->reduced_during_backward;
    }

    //! With DataParallelOptions::graphs: the CUDA graphs replica `rank` has captured so far, and
    //! the launches of graphs it made (Note [captured steps]; both 0 without graphs).
    std::uint64_t captured_graphs(int rank) const {
        const auto& g = core_->replicas.at(static_cast<std::size_t>(rank))->graphs;
        return g ? g->captures : 0;
    }
    std::uint64_t graph_launches(int rank) const {
        const auto& g = core_->replicas.at(static_cast<std::size_t>(rank))->graphs;
        return g ? g->launches : 0;
    }

    //! Collectives made so far by replica `rank` on the layer group and the gradient group.
    std::uint64_t layer_collectives(int rank) const {
        return core_->replicas.at(static_cast<std::size_t>(rank))->layer_comm->collective_count();
    }
    std::uint64_t gradient_collectives(int rank) const {
        return core_->replicas.at(static_cast<std::size_t>(rank))->grad_comm->collective_count();
    }

private:
    // Replica `r` as a clone of the caller's prototype, made on its own thread (so its tensors are
    // made on its device), bound to both groups, its buckets built and its buffers' copies made.
    static void make_replica(Core& core, int r, parallel::detail::CallerRefs& caller, const Module& prototype) {
        const auto ur = static_cast<std::size_t>(r);
        std::optional<Module> clone;
        const auto ex = core.resources[ur]->execution();
        if (!caller.read(
                [&] {
                    clone.emplace(nn::clone(prototype, core.devices[ur]));
                    nn::number_layers(*clone);  // ids alike in every process (Note [layer ids])
                    K::mark_inputs_read(ex);    // the caller may change its prototype once constructed
                },
                [ex] { K::wait_inputs_read(ex); }))
            throw parallel::detail::caller_gone();
        core.replicas[ur] = std::make_unique<Replica>(std::move(*clone), *core.resources[ur], core.layer(r), core.grad(r));
        auto& rep = *core.replicas[ur];
        rep.ctx.rank = core.first_rank + r;
        rep.ctx.local_rank = r;
        rep.ctx.world = core.global_world;
        rep.ctx.comm = rep.layer_comm;
        rep.ctx.exec = core.resources[ur]->execution();
        rep.ctx.exec.math = core.options.math;
        if constexpr (K::bf16_products) rep.ctx.exec.precision = core.options.precision;
        core.bind(r, rep.ctx.exec);
        rep.totals = Tensor<double, backend>(Shape{2}, MemoryFormat::nchw, core.devices[ur]);
        rep.norm_sq = Tensor<double, backend>(Shape{1}, MemoryFormat::nchw, core.devices[ur]);
        nn::for_each_parameter(rep.module, [&](const std::string& name, const auto&) { rep.param_names.push_back(name); });
        rep.finite_check = Tensor<double, backend>(Shape{static_cast<std::int64_t>(rep.param_names.size()) + 2},
                                                   MemoryFormat::nchw, core.devices[ur]);
        rep.build_buckets(core.devices[ur], core.options.bucket_bytes, core.options.gradient_precision == Precision::bf16);
        if (core.options.graphs) rep.graphs.emplace(core.options.graph_capacity);
        rep.make_buffer_copies();
    }

    // The checks every step and micro-batch makes of its arguments, and its call state (Note
    // [jobs own their state]): the split of the batch and the samples accumulated so far.
    template <class View, class Loss>
    std::shared_ptr<parallel::detail::StepCall<Loss>> begin_call(const Tensor<float, backend>& x, const View& targets,
                                                                 const Loss& loss, const char* what) {
        static_assert(parallel::ShardableTargets<View, backend>,
                      "lockstep: DataParallel cannot split these targets over its replicas: pass class labels as a "
                      "std::vector or span of std::int64_t, or a Tensor<float, backend> with one row per sample");
        using Shard = typename parallel::shard_of<View, backend>::type;
        static_assert(std::is_void_v<Shard> || nn::LossLike<Loss, backend, Shard>,
                      "lockstep: this loss does not take these targets. A loss is called as loss(ctx, output, "
                      "targets_of_the_shard) and returns nn::LossOutput<backend>: class labels (a std::vector or span "
                      "of std::int64_t) go with nn::SoftmaxCrossEntropy, a float tensor of the output's shape with "
                      "nn::MseLoss");
        LOCKSTEP_CHECK_AS(ShapeError, x.rank() >= 1, "DataParallel::", what, " needs a batched input, got a scalar");
        const std::int64_t rows = parallel::target_rows(targets);
        LOCKSTEP_CHECK_AS(ShapeError, rows == x.dim(0), what, ": ", rows,
                          std::is_same_v<View, std::span<const std::int64_t>> ? " labels" : " target rows", " for a batch of ",
                          x.dim(0), "; pass one per sample");
        return std::make_shared<parallel::detail::StepCall<Loss>>(world_, loss, split_batch(x.dim(0), what), pending_,
                                                                  steps_ + 1);
    }

    parallel::BatchSplit split_batch(std::int64_t rows, const char* what) const {
        return parallel::split_batch(core_->procs, rows, world_, core_->first_rank, core_->global_world, what);
    }

    void check_in_step(const char* what) const {
        pool_.check_usable(std::string("DataParallel::") + what);  // Note [stuck replicas] first: resync cannot mend that
        if (!diverged_) return;
        if (diverged_->unknown)
            throw Diverged(std::string("DataParallel::") + what + ": the replicas may hold wrong parameters since step " +
                           std::to_string(diverged_->step) + " failed after its commit point: " + diverged_->reason +
                           "; load() a checkpoint, or call resync(optimizer) to make every replica equal to replica 0");
        throw Diverged(std::string("DataParallel::") + what + ": the replicas may differ since step " +
                       std::to_string(diverged_->step) + " failed after its commit point (" + diverged_->reason +
                       "); call resync(optimizer) to copy replica " + std::to_string(diverged_->root) +
                       "'s parameters and optimizer state to all, or load() a checkpoint");
    }

    template <class Optimizer>
    void resync_impl(Optimizer* optimizer) {
        pool_.check_usable("DataParallel::resync");
        const int root = diverged_ ? diverged_->root : 0;
        std::vector<char> root_has;  // which of the root's optimizer states exist (PyTorch's None otherwise)
        if constexpr (parallel::detail::has_optimizer<Optimizer>) {
            optimizer->prepare(world_, core_->layout);
            optimizer->visit_state(
                root, core_->replicas[static_cast<std::size_t>(root)]->module,
                [&](const std::string&, const auto& state, const auto&) { root_has.push_back(state.numel() > 0); });
        }
        std::vector<double> root_counts;  // step counts (nn::Adam's), exact in fp64
        if constexpr (nn::detail::has_counters<Optimizer, Module>)
            optimizer->visit_counters(
                root, core_->replicas[static_cast<std::size_t>(root)]->module,
                [&](const std::string&, const std::int64_t& c) { root_counts.push_back(static_cast<double>(c)); });
        drop_graphs();  // the optimizer's state may be made anew (Note [captured steps])
        // Note [jobs own their state]: the job holds its own copy of `root_has`.
        pool_.run([core = core_, root, root_has = std::move(root_has), root_counts = std::move(root_counts), optimizer](int r) {
            auto& rep = core->replica(r);
            const std::uint64_t next = rep.broadcast_from(root);
            if constexpr (parallel::detail::has_optimizer<Optimizer>) {
                std::size_t i = 0;
                optimizer->visit_state(r, rep.module, [&](const std::string&, auto& state, const auto& p) {
                    using S = std::remove_reference_t<decltype(state)>;
                    if (root_has[i] == 0)
                        state = S();
                    else {
                        if (state.numel() != p.numel()) state = S::empty_like(p.value);
                        rep.layer_comm->broadcast(DeviceSpan(state), root, comm::CollectiveSite::broadcast(next + i));
                    }
                    ++i;
                });
                if constexpr (nn::detail::has_counters<Optimizer, Module>) {
                    Tensor<double, Host> counts(Shape{static_cast<std::int64_t>(root_counts.size())});
                    for (std::size_t k = 0; k < root_counts.size(); ++k) counts[static_cast<std::int64_t>(k)] = root_counts[k];
                    auto on_device = counts.template to<backend>(core->devices[static_cast<std::size_t>(r)]);
                    rep.layer_comm->broadcast(DeviceSpan(on_device), root, comm::CollectiveSite::broadcast(next + i));
                    const auto got = kernels::Ops<backend>::to_vector(rep.ctx.exec, on_device);
                    std::size_t k = 0;
                    optimizer->visit_counters(
                        r, rep.module, [&](const std::string&, std::int64_t& c) { c = static_cast<std::int64_t>(got[k++]); });
                }
            }
        });
        diverged_.reset();
        pending_ = 0;
    }

    template <class Optimizer>
    void load_impl(std::shared_ptr<const nn::Checkpoint> held, Optimizer* optimizer) {
        pool_.check_usable("DataParallel::load");
        // Everything checked against replica 0 before any replica changes.
        parallel::check_loadable(*held, core_->replica(0).module, optimizer, world_, core_->layout);
        drop_graphs();                                      // the optimizer's state may be made anew (Note [captured steps])
        pool_.run([core = core_, held, optimizer](int r) {  // Note [jobs own their state]: the job owns the checkpoint
            auto& rep = core->replica(r);
            nn::assign_module(*held, rep.module);  // checked above, against replica 0
            if constexpr (parallel::detail::has_optimizer<Optimizer>) nn::get_optimizer(*held, *optimizer, rep.module, r);
        });
        pending_ = 0;
        diverged_.reset();  // every replica holds the checkpoint now
    }

    // Runs `job` on every replica; when the call returns (or gives up on a stuck replica and
    // throws), the caller's objects that `caller` guards are gone for any replica still to read them.
    void run_job(parallel::detail::CallerRefs& caller, ReplicaPool::Job job) {
        struct Release {
            parallel::detail::CallerRefs& refs;
            ~Release() { refs.release(); }
        } release{caller};
        try {
            pool_.run(std::move(job));
            caller.settle();  // the call succeeds only once its copies of the caller's objects have run
        } catch (...) {
            after_failure();
            throw;
        }
    }

    // After a failed call the groups are aborted, and graphs hold their communicators, whose abort
    // waits for them (Note [aborting communicators] in comm/stream_group.hpp): every replica drops
    // its graphs now, on its own thread, then the aborts are waited for, at most the groups'
    // timeout (a kernel that never ends keeps NCCL's abort waiting for its launch), so the call
    // normally returns with the communicators gone. A pool that gave up on a replica runs no job:
    // that replica's graphs go with the object, and its helpers end when they do.
    void after_failure() noexcept {
        drop_graphs();
        if (!pool_.usable()) return;
        try {
            pool_.run([core = core_](int r) {
                const auto ur = static_cast<std::size_t>(r);
                if (ur < core->replicas.size() && core->replicas[ur] != nullptr) core->replicas[ur]->drop_graphs();
            });
        } catch (...) {  // the call's own failure is what the caller sees
        }
        // A timeout of years (ReplicaPool saturates those too) waits a day at most here.
        const auto deadline = std::chrono::steady_clock::now() + std::min<std::chrono::milliseconds>(
                                                                      core_->options.timeout, std::chrono::hours(24));
        for (int g = 0; g < 2; ++g) (void)core_->abortable(g)->settle(deadline);
    }

    // Every replica drops its captured steps before its next one (Note [captured steps]).
    void drop_graphs() noexcept { core_->graph_epoch.fetch_add(1, std::memory_order_release); }

    typename K::Runtime runtime_;  // the backend's process-wide settings while replicas exist
    std::shared_ptr<Core> core_;   // Note [jobs own their state]
    int world_;
    ReplicaPool pool_;  // after core_: its threads are joined (or left behind) before core_ is released
    bool training_ = true;
    std::int64_t pending_ = 0;  // samples accumulated since the last step
    std::int64_t steps_ = 0;    // steps applied
    std::optional<parallel::detail::Divergence> diverged_;
};

//! `DataParallel dp(net, 3);` deduces the module type.
template <class Module>
DataParallel(const Module&, int, DataParallelOptions = {}) -> DataParallel<Module>;
template <class Module>
DataParallel(const Module&, std::vector<Device>, DataParallelOptions = {}) -> DataParallel<Module>;

}  // namespace lockstep
