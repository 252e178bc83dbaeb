// SPDX-License-Identifier: MIT
//! `DataParallel<Module, Group>`: persistent replicas on persistent threads, scatter/gather,
//! bucketed gradient all-reduce overlapped with backward, gradient accumulation and clipping,
//! checkpoints of model and optimizer, and one parallel region per training step.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <shared_mutex>
#include <span>
#include <string>
#include <type_traits>
#include <unordered_map>
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
#include "lockstep/nn/checkpoint.hpp"
#include "lockstep/nn/context.hpp"
#include "lockstep/nn/loss.hpp"
#include "lockstep/nn/module.hpp"
#include "lockstep/nn/sgd.hpp"
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
    //! No collective waits longer than this for a peer, and no call waits longer than this for
    //! a replica once another has failed or finished (then it throws `ReplicaStuck`).
    std::chrono::milliseconds timeout = AbortableBarrier::default_timeout;
    //! Where the replica threads run (see Note [replica CPU binding]).
    CpuBinding cpu_binding = CpuBinding::automatic;
    //! Clip the all-reduced gradients to this global L2 norm before the optimizer step, as
    //! torch.nn.utils.clip_grad_norm_ (must be positive; unset: no clipping).
    std::optional<double> clip_grad_norm = std::nullopt;
    //! Check the loss and the all-reduced gradients before the commit point: a step with NaN or
    //! infinity throws `NonFinite` and no replica applies it (costs a pass over the gradients).
    bool check_finite = false;
    //! The processes this DataParallel spans (Note [hierarchical groups] in comm/process_group.hpp;
    //! `comm::MpiProcessGroup` from `<lockstep/mpi.hpp>`); empty: this process alone. Then the
    //! devices are this process's replicas, every process runs as many, global rank = process rank
    //! x replicas + local rank, and train_step and forward take this process's rows of the global
    //! batch: those of its global ranks' shards, contiguous, in global-rank order. Host replicas
    //! meet as in Note [hierarchical groups]; CUDA replicas through NCCL across processes (Note
    //! [stream groups across processes] in comm/stream_group.hpp).
    std::shared_ptr<comm::ProcessGroup> process_group = nullptr;
};

//! What one training step reports, computed identically for any split of the batch. It covers
//! every sample since the previous step: the step's own batch and those of `accumulate` calls.
struct StepResult {
    double loss = 0;           //!< mean loss over those samples
    std::int64_t count = 0;    //!< samples
    std::int64_t correct = 0;  //!< samples classified correctly (classification losses only; 0 otherwise)
};

// Note [step order]
// After backward, in this order on every replica: gradient all-reduce (the buckets) -> finite
// check (optional) -> clip by the global norm (optional) -> commit barrier -> optimizer step ->
// second barrier. Every replica holds the same all-reduced gradients, so the check and the
// clipping decide and compute the same bits everywhere.
//
// Note [commit point]
// A step that fails on any replica must not leave replicas different. Every replica passes one
// barrier after its gradients are all-reduced and clipped, and before its optimizer step; a
// replica that fails earlier aborts the barrier, so either every replica steps or none does.
// A step (or an accumulate) that fails before the commit barrier leaves nothing behind: each
// replica restores its buffers (SyncBatchNorm's running statistics, which its forward updated)
// from the copy it took when the step began; the gradients are dropped (the next call starts
// afresh). A failure after the commit barrier (an optimizer that throws on one replica) can leave
// replicas apart: every replica passes a second barrier after its optimizer step, so the step
// fails on all of them, and the object is marked diverged: every later call throws `Diverged`
// until `resync(optimizer)` copies parameters, buffers and optimizer state from a replica that
// completed the step.
//
// Note [gradient buckets]
// Parameters are grouped, in reverse visit order (the order backward finishes them), into flat
// buckets of about `bucket_bytes`. A layer reports each parameter whose gradient is final
// through Context::mark_grad_ready; when the last parameter of a bucket is in, the bucket (whose
// flat buffer the gradients are views of: Note [gradients in their buckets]) is handed to the
// replica's communication thread, which all-reduces it in place on a second replica group (so
// it never interleaves with the SyncBatchNorm collectives of the compute threads). Where
// collectives are enqueued on streams (CUDA: Note [stream-ordered collectives]), no second
// thread calls the communicator: the replica thread itself starts the bucket's all-reduce there
// and then, on the group's communication stream, and joins the group once backward has ended,
// before anything reads the sums. Every replica runs the same layers in the same order, so every
// replica launches the same buckets in the same order. Buckets never reported (a layer that does
// not call mark_grad_ready) are launched after backward, in bucket order. Summation is per
// element in rank order, so bucketing changes no bit of the result.
//
// Note [gradients in their buckets]
// A replica's gradients are views (Tensor::view) of its buckets' flat buffers, so backward
// writes straight into what is all-reduced: no copy in before the all-reduce, none out after
// it (PyTorch DDP's gradient_as_bucket_view). The parameters' values are views too, of a second
// flat buffer per bucket laid out alike, so an optimizer can update a bucket in one loop over
// flat arrays (Note [momentum beside its bucket] in nn/sgd.hpp). Within a bucket the parameters
// lie in visit order, each on a 64-byte boundary (zero padding between them), as tensors of
// their own would. A tensor replaced from outside (a layer that assigns a new gradient, a
// parallel_apply that assigns a value or swaps two parameters) is copied back into its place
// and made a view again: at the start of every step for both, and at the bucket's launch for a
// gradient. A gradient replaced after its bucket was launched missed the all-reduce: the step
// fails with UsageError, as does a parameter whose size changed.
//
// Note [gradient accumulation]
// `accumulate(x, ...)` runs forward and backward and keeps the gradients without any gradient
// collective (layer collectives such as SyncBatchNorm's still run). Each micro-batch is weighted
// by its share of the samples: before the backward of a micro-batch of N samples, with M samples
// accumulated so far, the kept gradients are scaled by M/(M+N) and the loss gradient by
// N/(M+N), so the gradients are always those of the mean loss over all M+N samples. The next
// train_step all-reduces once and steps: accumulate(b1) then train_step(b2) equals
// train_step(b1 + b2) for a model without batch norm, whatever the sizes.

// Note [jobs own their state]
// A call may give up on a stuck replica and return while that replica's thread still runs the
// call's job (Note [stuck replicas] in runtime/replica_pool.hpp). So no job references the
// caller's stack or the DataParallel object: the replicas, groups and options live in a `Core`
// that the object and every job own jointly, and a call's own state (shards, per-replica results,
// a copy of the loss) in a `std::shared_ptr` the job holds. The caller's input batch, targets and
// prototype are read only at the start of a replica's part, through `CallerRefs`, and a call that
// returns first marks them gone, so a late replica can never read them. What a stuck replica is
// inside of stays in use: the user's layer, loss copy or optimizer it is stuck in.

namespace detail {

//! "No optimizer": what accumulate(), load(checkpoint) and resync() pass where the others pass
//! the user's optimizer.
struct NoOptimizer {};
inline NoOptimizer no_optimizer;
template <class Optimizer>
inline constexpr bool has_optimizer = !std::is_same_v<Optimizer, NoOptimizer>;

//! The caller's objects a job may read (the input batch, the targets, the prototype): readable
//! until the call releases them, which waits for the reads in progress (library copies only,
//! never user code) and makes later reads fail.
class CallerRefs {
public:
    //! Runs `f` if the caller's objects are still there; false when the call has returned. A
    //! read may only enqueue its copies (on a device stream): `settle` then waits until they have
    //! run, and the call runs it before it returns (Note [jobs own their state]).
    template <class F>
    bool read(F&& f, std::function<void()> settle = {}) {
        std::shared_lock lock(mutex_);
        if (gone_) return false;
        f();
        if (settle) {
            std::lock_guard settle_lock(settle_mutex_);
            settles_.push_back(std::move(settle));
        }
        return true;
    }
    //! Waits for the reads made so far to settle; throws the first failure (a settle that timed
    //! out has aborted the groups: the call fails, and the caller must not reuse its input).
    void settle() {
        std::lock_guard settle_lock(settle_mutex_);
        std::exception_ptr first;
        for (auto& s : settles_) {
            try {
                s();
            } catch (...) {
                if (!first) first = std::current_exception();
            }
        }
        settles_.clear();
        if (first) std::rethrow_exception(first);
    }
    //! Later reads fail; reads not settled yet are settled (bounded waits; on a call that is
    //! failing already, its own failure is what the caller sees).
    void release() noexcept {
        std::unique_lock lock(mutex_);
        gone_ = true;
        try {
            settle();
        } catch (...) {
        }
    }

private:
    std::shared_mutex mutex_;
    bool gone_ = false;
    std::mutex settle_mutex_;
    std::vector<std::function<void()>> settles_;
};

//! A copy of a caller's object when it can be copied, else a pointer to it.
template <class T>
class Held {
public:
    explicit Held(const T& value) : value_(hold(value)) {}
    const T& get() const noexcept {
        if constexpr (std::is_copy_constructible_v<T>) return value_;
        else return *value_;
    }

private:
    static auto hold(const T& value) {
        if constexpr (std::is_copy_constructible_v<T>) return value;
        else return &value;
    }
    std::conditional_t<std::is_copy_constructible_v<T>, T, const T*> value_;
};

//! One replica's targets as the replica keeps them: class labels copied out of the caller's
//! container, a tensor shard as it is (already a copy).
template <class Shard>
struct OwnedShard {
    using type = Shard;
    static Shard own(Shard s) { return s; }
    static const Shard& view(const Shard& s) noexcept { return s; }
};
template <>
struct OwnedShard<std::span<const std::int64_t>> {
    using type = std::vector<std::int64_t>;
    static type own(std::span<const std::int64_t> s) { return type(s.begin(), s.end()); }
    static std::span<const std::int64_t> view(const type& v) noexcept { return std::span<const std::int64_t>(v); }
};

inline CollectiveAborted caller_gone() {
    return CollectiveAborted("this replica started after its call had given up on a stuck peer and returned");
}

}  // namespace detail

//! Data parallelism over persistent replicas of `Module` (docs/design.md; Notes [step order] and
//! [commit point] below).
//! No call waits for a replica without bound: one that has not finished `options().timeout` after
//! a peer failed or finished makes the call throw `ReplicaStuck` naming it, and the object then
//! refuses every later call; its destructor waits the timeout again, then leaves the stuck thread
//! behind (reported on stderr), with the replica state it still uses (Notes [stuck replicas] and
//! [jobs own their state]).
template <class Module, class Group = comm::default_group_t<typename Module::backend>>
class DataParallel {
    static_assert(nn::check_module<Module>());

public:
    using backend = typename Module::backend;
    using module_type = Module;
    using group_type = Group;

private:
    static_assert(comm::GroupLike<Group>,
                  "lockstep: DataParallel's Group needs `using backend`, a constructor from (std::vector<Device>, "
                  "std::chrono::milliseconds), size(), communicator(rank) returning comm::Collectives& and abortable()");
    static_assert(std::same_as<typename Group::backend, backend>,
                  "lockstep: DataParallel's Group must be of the module's backend (comm::default_group_t<backend>)");
    using K = kernels::Ops<backend>;
    using Ctx = nn::Context<backend>;

public:
    //! Clones `prototype` once per device and makes every replica hold replica 0's values.
    DataParallel(const Module& prototype, std::vector<Device> devices, DataParallelOptions options = {})
        : core_(make_core(options, devices)), world_(core_->world),
          // Each replica's backend resources are made on its own thread, which then works on its device.
          pool_(world_,
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
        auto caller = std::make_shared<detail::CallerRefs>();  // Note [jobs own their state]
        run_job(*caller, [core = core_, caller, proto = &prototype](int r) {
            const auto ur = static_cast<std::size_t>(r);
            std::optional<Module> clone;
            const auto ex = core->resources[ur]->execution();
            if (!caller->read(
                    [&] {
                        clone.emplace(nn::clone(*proto, core->devices[ur]));
                        K::mark_inputs_read(ex);  // the caller may change its prototype once constructed
                    },
                    [ex] { K::wait_inputs_read(ex); }))
                throw detail::caller_gone();
            core->replicas[ur] = std::make_unique<Replica>(std::move(*clone), *core->resources[ur], core->layer(r),
                                                           core->grad(r));
            auto& rep = *core->replicas[ur];
            rep.ctx.rank = core->first_rank + r;
            rep.ctx.local_rank = r;
            rep.ctx.world = core->global_world;
            rep.ctx.comm = rep.layer_comm;
            rep.ctx.exec = core->resources[ur]->execution();
            core->bind(r, rep.ctx.exec);
            rep.totals = Tensor<double, backend>(Shape{2}, MemoryFormat::nchw, core->devices[ur]);
            rep.norm_sq = Tensor<double, backend>(Shape{1}, MemoryFormat::nchw, core->devices[ur]);
            nn::for_each_parameter(rep.module, [&](const std::string& name, const auto&) { rep.param_names.push_back(name); });
            rep.finite_check = Tensor<double, backend>(Shape{static_cast<std::int64_t>(rep.param_names.size()) + 2},
                                                       MemoryFormat::nchw, core->devices[ur]);
            build_buckets(rep, core->devices[ur], core->options.bucket_bytes);
            rep.make_buffer_copies();
        });
        broadcast_from_first();
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
    std::size_t bucket_count() const noexcept { return core_->replicas[0]->buckets.size(); }
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
        pool_.run([core = core_, owned, f, training = training_](int r) {
            auto& rep = *core->replicas[static_cast<std::size_t>(r)];
            rep.ctx.training = training;
            rep.ctx.global_batch = -1;
            rep.ctx.grad_ready = nullptr;
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
            detail::CallerRefs caller;  // x
        };
        auto call = std::make_shared<Call>();
        const std::int64_t batch = global_rows(x.dim(0), "forward", call->shards);
        call->outs.resize(static_cast<std::size_t>(world_));
        run_job(call->caller, [core = core_, call, xp = &x, training = training_, batch](int r) {
            const auto ur = static_cast<std::size_t>(r);
            auto& rep = *core->replicas[ur];
            rep.ctx.training = training;
            rep.ctx.global_batch = batch;
            rep.ctx.grad_ready = nullptr;
            Tensor<float, backend> in;
            if (!call->caller.read(
                    [&] {
                        in = parallel::take_rows(rep.ctx.exec, *xp, call->shards[ur], core->devices[ur]);
                        K::mark_inputs_read(rep.ctx.exec);
                    },
                    [ex = rep.ctx.exec] { K::wait_inputs_read(ex); }))
                throw detail::caller_gone();
            call->outs[ur] = rep.module.forward(rep.ctx, std::move(in));
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
                      "lockstep: the optimizer needs prepare(int replicas), step(const nn::Context<backend>&, Module&) "
                      "and visit_state(int rank, Module&, f): see Note [optimizer protocol] in nn/sgd.hpp");
        LOCKSTEP_CHECK_AS(UsageError, training_, "DataParallel::train_step in eval mode; call train() first");
        check_in_step("train_step");
        return run_step<true>(x, parallel::targets_view(targets), loss, &optimizer, "train_step");
    }

    //! Forward and backward of a micro-batch whose gradients are kept for the next train_step,
    //! with no gradient collective (DDP's no_sync; layer collectives still run). Micro-batches are
    //! weighted by their sample counts (see Note [gradient accumulation]).
    template <class Targets, class Loss>
    void accumulate(const Tensor<float, backend>& x, const Targets& targets, const Loss& loss) {
        LOCKSTEP_CHECK_AS(UsageError, training_,
                          "DataParallel::accumulate in eval mode keeps no gradients; call train() first");
        check_in_step("accumulate");
        run_step<false>(x, parallel::targets_view(targets), loss, &detail::no_optimizer, "accumulate");
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
        optimizer.prepare(world_);
        nn::put_optimizer(ck, optimizer, module(), 0);
        return ck;
    }

    //! Writes the model (and the optimizer's state) to `path` atomically.
    //! Across processes (`process_group`), global rank 0's process alone writes, and every
    //! process returns when it has, or throws the same `IoError` when it failed.
    nn::Checkpoint::SaveReport save(const std::string& path) const {
        return save_once([&] { return checkpoint().save(path); });
    }
    template <class Optimizer>
    nn::Checkpoint::SaveReport save(const std::string& path, Optimizer& optimizer) const {
        return save_once([&] { return checkpoint(optimizer).save(path); });
    }
    //! Writes `ck` (say `checkpoint(optimizer)` with metadata added) as `save` does: once, by
    //! process 0, when the object spans processes.
    nn::Checkpoint::SaveReport save(const nn::Checkpoint& ck, const std::string& path) const {
        return save_once([&] { return ck.save(path); });
    }
    //! The processes this object spans (null: this process alone).
    const std::shared_ptr<comm::ProcessGroup>& process_group() const noexcept { return core_->procs; }
    //! Replicas over all processes (`size()` on one process).
    int global_size() const noexcept { return core_->global_world; }

    //! Loads a checkpoint into every replica (and the optimizer's state of every replica). Every
    //! tensor is checked against the model first: a checkpoint of another model throws `IoError`
    //! naming the checkpoint, the tensor and both shapes, and changes nothing.
    //! (The replicas read a copy of `ck`, owned by the call's job: Note [jobs own their state].)
    void load(const nn::Checkpoint& ck) { load_impl(std::make_shared<const nn::Checkpoint>(ck), &detail::no_optimizer); }
    template <class Optimizer>
    void load(const nn::Checkpoint& ck, Optimizer& optimizer) {
        load_impl(std::make_shared<const nn::Checkpoint>(ck), &optimizer);
    }
    void load(const std::string& path) {
        load_impl(std::make_shared<const nn::Checkpoint>(nn::Checkpoint::load(path)), &detail::no_optimizer);
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
    void resync() { resync_impl(&detail::no_optimizer); }
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

    //! Collectives made so far by replica `rank` on the layer group and the gradient group.
    std::uint64_t layer_collectives(int rank) const {
        return core_->replicas.at(static_cast<std::size_t>(rank))->layer_comm->collective_count();
    }
    std::uint64_t gradient_collectives(int rank) const {
        return core_->replicas.at(static_cast<std::size_t>(rank))->grad_comm->collective_count();
    }

private:
    struct Bucket {
        std::vector<nn::Parameter<backend>*> params;
        std::vector<std::int64_t> offsets;      // into flat and values, 64-byte aligned
        std::vector<std::int64_t> counts;       // elements of each parameter
        std::vector<std::size_t> visit_index;   // each parameter's place in visit order (its name)
        Tensor<float, backend> flat;    // the gradients, all-reduced as one (Note [gradients in their buckets])
        Tensor<float, backend> values;  // the parameters' values, laid out as `flat`
        int pending = 0;
        bool launched = false;
    };

    struct Replica {
        Replica(Module&& replica, const typename K::ReplicaResources& resources, comm::Collectives& layer,
                comm::Collectives& grad)
            : module(std::move(replica)), layer_comm(&layer), grad_comm(&grad),
              worker([&resources] { resources.bind_thread(); }) {}

        Module module;
        comm::Collectives* layer_comm;  // layer collectives (SyncBatchNorm), on the replica thread
        comm::Collectives* grad_comm;   // gradient buckets and commit barriers
        Ctx ctx;
        Tensor<double, backend> totals;   // (2): loss sum and correct count since the last step
        Tensor<double, backend> norm_sq;       // (1): squared global gradient norm, when clipping
        Tensor<double, backend> finite_check;  // (parameters + 2): squared gradient norms, then the step's totals
        std::vector<std::string> param_names;  // visit order
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

        void begin_buckets(bool overlap_now) {
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

        // Queues what makes parameter i of bucket b hold `t` (its value or gradient) as a view of
        // `flat` at its offset: a copy of what `t` holds when it is elsewhere (Note [gradients in
        // their buckets]). `place_queued` then copies (one call: on CUDA one launch), zeroes
        // gradients not made yet, and swaps the views in. A source that is a view of another
        // place (two parameters swapped) is copied out first, so no copy reads a place another
        // one writes.
        void queue_place(Bucket& b, std::size_t i, Tensor<float, backend>& t, Tensor<float, backend>& flat) {
            const auto& p = *b.params[i];
            const std::int64_t n = b.counts[i];
            if (t.views(flat, b.offsets[i]) && t.numel() == n) return;
            const std::string& name = param_names[b.visit_index[i]];
            LOCKSTEP_CHECK_AS(UsageError, p.value.numel() == n, "parameter '", name, "' holds ", p.value.numel(),
                              " elements, but DataParallel was made with ", n,
                              "; a model's parameters keep their sizes (assign values of the same shape)");
            LOCKSTEP_CHECK_AS(ShapeError, t.shape() == p.shape() || t.empty(), "the gradient of parameter '", name,
                              "' has shape ", t.shape(), " beside its value of shape ", p.shape(),
                              "; a layer must keep a parameter's gradient in the parameter's shape");
            if (t.is_view()) t = Tensor<float, backend>(t);  // an owning copy
            auto view = Tensor<float, backend>::view(flat, b.offsets[i], p.shape(), p.value.format());
            if (t.empty()) zeroing.push_back(&t);  // a gradient not made yet: zero, as Parameter makes it
            else placing.push_back({&flat, b.offsets[i], &t, 0, n});
            swaps.emplace_back(&t, std::move(view));
        }
        void place_queued() {
            K::copy_many(ctx.exec, placing);
            for (auto& [t, view] : swaps) *t = std::move(view);
            for (auto* t : zeroing) t->zero();
            clear_queue();
        }
        void clear_queue() noexcept {
            placing.clear();
            swaps.clear();
            zeroing.clear();
        }
        std::vector<kernels::CopyPiece<backend>> placing;
        std::vector<std::pair<Tensor<float, backend>*, Tensor<float, backend>>> swaps;
        std::vector<Tensor<float, backend>*> zeroing;

        void place_all() {
            clear_queue();  // nothing left over from a place that threw
            for (auto& b : buckets)
                for (std::size_t i = 0; i < b.params.size(); ++i) {
                    queue_place(b, i, b.params[i]->value, b.values);
                    queue_place(b, i, b.params[i]->grad, b.flat);
                }
            place_queued();
        }

        void launch(std::size_t index) {
            auto& b = buckets[index];
            b.launched = true;
            clear_queue();
            for (std::size_t i = 0; i < b.params.size(); ++i) queue_place(b, i, b.params[i]->grad, b.flat);
            place_queued();
            const typename K::Range range("lockstep gradient bucket");
            if (grad_comm->stream_ordered()) {
                // Enqueued by this thread, here, on every rank: one order everywhere; read after
                // join() in finish_buckets (Note [gradient buckets]).
                grad_comm->start_all_reduce_sum(DeviceSpan(b.flat), comm::CollectiveSite::bucket(index));
                reduced.fetch_add(1, std::memory_order_release);
                return;
            }
            auto job = [this, index] {
                auto& bb = buckets[index];
                grad_comm->all_reduce_sum(DeviceSpan(bb.flat), comm::CollectiveSite::bucket(index));
                reduced.fetch_add(1, std::memory_order_release);
            };
            if (overlap) worker.submit(job);
            else job();
        }

        void finish_buckets() {
            reduced_during_backward = reduced.load(std::memory_order_acquire);  // backward has just ended
            for (std::size_t i = 0; i < buckets.size(); ++i)
                if (!buckets[i].launched) launch(i);
            if (grad_comm->stream_ordered()) grad_comm->join();
            worker.wait();
            // A gradient replaced after its bucket was launched missed the all-reduce: this
            // replica would step with its own gradient alone.
            for (auto& b : buckets)
                for (std::size_t i = 0; i < b.params.size(); ++i)
                    LOCKSTEP_CHECK_AS(UsageError, b.params[i]->grad.views(b.flat, b.offsets[i]), "the gradient of parameter '",
                                      param_names[b.visit_index[i]],
                                      "' was replaced after its layer marked it ready (Context::mark_grad_ready), so it "
                                      "missed the all-reduce; write into the gradient, or assign it before marking it ready");
            ctx.grad_ready = nullptr;
        }

        // Buffers as they were when the step began (running statistics are the step's only
        // change before the commit point besides gradients).
        std::vector<Tensor<float, backend>> saved_float;
        std::vector<Tensor<std::int64_t, backend>> saved_int;

        template <class F>
        void each_buffer(F&& f) {
            std::size_t fi = 0, ii = 0;
            nn::for_each_buffer(module, [&](const std::string&, auto& t) {
                using T = typename std::remove_reference_t<decltype(t)>::value_type;
                if constexpr (std::is_same_v<T, float>) f(t, saved_float[fi++]);
                else f(t, saved_int[ii++]);
            });
        }
        void make_buffer_copies() {
            nn::for_each_buffer(module, [&](const std::string&, auto& t) {
                using T = typename std::remove_reference_t<decltype(t)>::value_type;
                if constexpr (std::is_same_v<T, float>) saved_float.push_back(Tensor<float, backend>::empty_like(t));
                else saved_int.push_back(Tensor<std::int64_t, backend>::empty_like(t));
            });
        }
        void save_buffers() {
            each_buffer([&](auto& live, auto& copy) { K::copy(ctx.exec, copy, 0, live, 0, live.numel()); });
        }
        void restore_buffers() noexcept {
            try {
                each_buffer([&](auto& live, auto& copy) { K::copy(ctx.exec, live, 0, copy, 0, live.numel()); });
            } catch (...) {  // a device that failed: the step's own error is what the caller sees
            }
        }

        // After a failure on this replica (the groups are aborted already): make sure this
        // replica's communication thread is idle before the job returns, so the pool never
        // resets a group with a thread still inside it.
        void unwind() noexcept {
            worker.wait_quietly();
            try {  // stream-ordered groups: later work on this replica waits for what was started
                grad_comm->join();
            } catch (...) {
            }
            ctx.grad_ready = nullptr;
        }
    };

    // What the replica threads touch, owned by the object and by every job it gives the pool
    // (Note [jobs own their state]): a thread the pool gave up on keeps it alive, and destroys it
    // when it comes back after the object is gone.
    struct Core {
        DataParallelOptions options;
        std::vector<Device> devices;
        int world = 0;
        // Destroyed in reverse: the replicas, then the groups (a CUDA group finalizes its
        // communicators and destroys its streams), then the replicas' resources (their streams).
        std::vector<std::unique_ptr<typename K::ReplicaResources>> resources;  // made on the replica threads
        std::unique_ptr<Group> layer_group;  // layer collectives (SyncBatchNorm), on the replica threads
        std::unique_ptr<Group> grad_group;   // gradient buckets (see Note [gradient buckets])
        // Across processes (options.process_group): these instead of the two groups above.
        std::shared_ptr<comm::ProcessGroup> procs;
        std::unique_ptr<comm::HierarchicalGroup> layer_hier, grad_hier;
        int first_rank = 0;    // global rank of this process's replica 0
        int global_world = 0;  // replicas over all processes
        std::vector<std::unique_ptr<Replica>> replicas;  // destroyed first: they use the groups and resources

        comm::Collectives& layer(int r) {
            if (layer_hier) return layer_hier->communicator(r);
            return layer_group->communicator(r);
        }
        comm::Collectives& grad(int r) {
            if (grad_hier) return grad_hier->communicator(r);
            return grad_group->communicator(r);
        }
        std::shared_ptr<Abortable> abortable(int which) const {
            if (layer_hier) return which == 0 ? layer_hier->abortable() : grad_hier->abortable();
            return which == 0 ? layer_group->abortable() : grad_group->abortable();
        }
        void bind(int r, Execution<backend>& ex) {
            if (!layer_group) return;
            layer_group->bind(r, ex);
            grad_group->bind(r, ex);
        }
    };

    // One step or micro-batch on every replica (see Notes [step order] and [gradient accumulation]).
    template <bool Step, class View, class Loss, class Optimizer>
    StepResult run_step(const Tensor<float, backend>& x, const View& targets, const Loss& loss, Optimizer* optimizer,
                        const char* what) {
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
        std::vector<parallel::ShardRange> shards;
        const std::int64_t batch = global_rows(x.dim(0), what, shards);  // the global batch
        const std::int64_t before = pending_, after = pending_ + batch;
        if constexpr (Step) optimizer->prepare(world_);
        // The call's state, owned by this call and by the job (Note [jobs own their state]).
        struct Call {
            Call(int world, const Loss& l)
                : sums(static_cast<std::size_t>(world)), corrects(static_cast<std::size_t>(world)),
                  applied(static_cast<std::size_t>(world)), loss(l) {}
            std::vector<parallel::ShardRange> shards;
            std::vector<double> sums, corrects;
            std::atomic<int> committed{0};                // replicas past the commit barrier
            std::atomic<bool> device_failed{false};       // the device failed the step after it
            std::vector<std::atomic<bool>> applied;       // replicas whose optimizer step completed
            detail::Held<Loss> loss;
            detail::CallerRefs caller;                    // x and targets
        };
        using Owned = detail::OwnedShard<Shard>;
        auto call = std::make_shared<Call>(world_, loss);
        call->shards = std::move(shards);
        const std::int64_t step_number = steps_ + 1;
        try {
            run_job(call->caller, [core = core_, call, xp = &x, tp = &targets, optimizer, before, after, batch,
                                   step_number](int r) {
                const auto ur = static_cast<std::size_t>(r);
                const auto& options = core->options;
                auto& rep = *core->replicas[ur];
                rep.ctx.training = true;
                rep.ctx.global_batch = batch;
                rep.place_all();  // Note [gradients in their buckets]
                if (before == 0) {
                    nn::zero_grad(rep.module);
                    rep.totals.zero();
                }
                if constexpr (Step) rep.begin_buckets(options.overlap);
                else rep.ctx.grad_ready = nullptr;
                rep.save_buffers();
                try {
                    // This replica's rows of the caller's batch and targets, copied while the call waits.
                    Tensor<float, backend> in;
                    typename Owned::type shard_targets;
                    const auto& shard = call->shards[ur];
                    const auto& device = core->devices[ur];
                    if (!call->caller.read(
                            [&] {
                                in = parallel::take_rows(rep.ctx.exec, *xp, shard, device);
                                shard_targets = Owned::own(parallel::shard_targets(rep.ctx.exec, *tp, shard, device));
                                K::mark_inputs_read(rep.ctx.exec);
                            },
                            [ex = rep.ctx.exec] { K::wait_inputs_read(ex); }))
                        throw detail::caller_gone();
                    Tensor<float, backend> out;
                    {
                        const typename K::Range range("lockstep forward");
                        out = rep.module.forward(rep.ctx, std::move(in));
                    }
                    auto lo = call->loss.get()(rep.ctx, out, Owned::view(shard_targets));
                    out = Tensor<float, backend>();
                    if (before > 0) {  // Note [gradient accumulation]
                        const double kept = static_cast<double>(before) / static_cast<double>(after);
                        nn::for_each_parameter(rep.module, [&](const std::string&, nn::Parameter<backend>& p) {
                            K::scale(rep.ctx.exec, p.grad, kept);
                        });
                        K::scale(rep.ctx.exec, lo.grad, static_cast<double>(batch) / static_cast<double>(after));
                    }
                    {
                        const typename K::Range range("lockstep backward");
                        rep.module.backward(rep.ctx, lo.grad);
                    }
                    K::add(rep.ctx.exec, rep.totals, lo.totals);
                    if constexpr (Step) {
                        rep.finish_buckets();
                        if (options.check_finite) check_finite(rep, r, step_number, call->sums[ur], call->corrects[ur]);
                        if (options.clip_grad_norm) clip(rep, *options.clip_grad_norm);
                        // Note [commit point]: no replica updates its parameters unless every
                        // replica got here; a failure anywhere before aborts this barrier on all.
                        rep.grad_comm->barrier(comm::CollectiveSite::commit(0));
                    }
                } catch (...) {
                    // Abort both groups first (peers and this replica's communication thread wake
                    // up), then wait for the communication thread, then leave.
                    ReplicaPool::report_failure(r, std::current_exception());
                    rep.unwind();
                    rep.restore_buffers();  // Note [commit point]: the failed step leaves nothing behind
                    throw;
                }
                if constexpr (Step) {
                    call->committed.fetch_add(1, std::memory_order_relaxed);
                    {
                        const typename K::Range range("lockstep optimizer step");
                        optimizer->step(rep.ctx, rep.module);
                    }
                    call->applied[ur].store(true, std::memory_order_relaxed);
                    // Note [commit point]: a replica whose optimizer threw fails the step everywhere.
                    rep.grad_comm->barrier(comm::CollectiveSite::commit(1));
                    // The step's scalars: the one read from the device in a step (with check_finite
                    // they came back with the finite check, before the commit barrier, and so had
                    // every collective of the step). Without it, a collective that fails on the
                    // device is seen here, after every replica enqueued its optimizer step on
                    // gradients that may be partly reduced (Note [device failure after the commit]).
                    if (!options.check_finite) {
                        try {
                            const auto t = K::to_vector(rep.ctx.exec, rep.totals);
                            call->sums[ur] = t[0];
                            call->corrects[ur] = t[1];
                        } catch (...) {
                            call->device_failed.store(true, std::memory_order_relaxed);
                            throw;
                        }
                    }
                }
            });
        } catch (const ReplicaStuck&) {
            pending_ = 0;  // the object is unusable now (Note [stuck replicas]); nothing more to record
            throw;
        } catch (const std::exception& e) {
            pending_ = 0;  // the kept gradients are incomplete: the next call starts afresh
            if constexpr (Step) mark_if_diverged(call->committed.load(), call->applied, call->device_failed.load(), e.what());
            throw;
        } catch (...) {
            pending_ = 0;
            if constexpr (Step)
                mark_if_diverged(call->committed.load(), call->applied, call->device_failed.load(),
                                 "an exception that is not a std::exception");
            throw;
        }
        if constexpr (!Step) {
            pending_ = after;
            return {};
        } else {
            pending_ = 0;
            ++steps_;
            StepResult result;
            result.count = after;
            double total = 0, correct = 0;
            for (int r = 0; r < world_; ++r) {  // rank order: the same bits for any run
                total += call->sums[static_cast<std::size_t>(r)];
                correct += call->corrects[static_cast<std::size_t>(r)];
            }
            if (core_->procs) {  // then over the processes, in process order
                std::vector<double> totals{total, correct};
                core_->procs->channel(comm::ProcessGroup::control)
                    .all_reduce_sum(DeviceSpan<double>::host(totals), comm::CollectiveSite::control(comm::Exchange::step_totals));
                total = totals[0];
                correct = totals[1];
            }
            result.loss = total / static_cast<double>(after);
            result.correct = static_cast<std::int64_t>(correct);
            return result;
        }
    }

    // Scales every gradient by min(1, max_norm / (global norm + 1e-6)) (Note [step order]).
    static void clip(Replica& rep, double max_norm) {
        rep.norm_sq.zero();
        nn::for_each_parameter(rep.module, [&](const std::string&, const nn::Parameter<backend>& p) {
            K::add_sum_squares(rep.ctx.exec, p.grad, rep.norm_sq);
        });
        nn::for_each_parameter(rep.module, [&](const std::string&, nn::Parameter<backend>& p) {
            K::clip_to_norm(rep.ctx.exec, p.grad, rep.norm_sq, max_norm);
        });
    }

    // Throws NonFinite, on the replica that finds it, when the loss or an all-reduced gradient holds
    // NaN or infinity: before the commit barrier, so no replica applies the step. One read of the
    // per-parameter squared norms and the step's totals (the gradients are the same on every
    // replica), which also returns the totals: the step reads nothing else from the device.
    static void check_finite(Replica& rep, int rank, std::int64_t step_number, double& loss_sum, double& correct) {
        const auto& ex = rep.ctx.exec;
        rep.finite_check.zero();
        std::int64_t i = 0;
        nn::for_each_parameter(rep.module, [&](const std::string&, const nn::Parameter<backend>& p) {
            K::add_sum_squares(ex, p.grad, rep.finite_check, i++);
        });
        K::copy(ex, rep.finite_check, i, rep.totals, 0, 2);  // the loss summed over this replica's samples, the correct count
        const auto v = K::to_vector(ex, rep.finite_check);
        loss_sum = v[static_cast<std::size_t>(i)];
        correct = v[static_cast<std::size_t>(i) + 1];
        const std::string step = "step " + std::to_string(step_number);
        if (!std::isfinite(v[static_cast<std::size_t>(i)]))
            throw NonFinite(step + ": the loss over replica " + std::to_string(rank) + "'s samples is " +
                            std::to_string(v[static_cast<std::size_t>(i)]) +
                            "; no replica applied the step. Lower the learning rate, or look for NaN or infinity in the input");
        for (std::size_t k = 0; k < rep.param_names.size(); ++k)
            if (!std::isfinite(v[k]))
                throw NonFinite(step + ": the all-reduced gradient of '" + rep.param_names[k] +
                                "' holds NaN or infinity; no replica applied the step. Lower the learning rate (or clip: "
                                "DataParallelOptions::clip_grad_norm), or look for NaN or infinity in the input");
    }

    // Note [device failure after the commit]
    // Without check_finite nothing reads the device between the gradient all-reduce and the
    // commit barrier (that read would cost the overlap of the step's tail), so a collective that
    // fails on the device (an NCCL error, a peer gone) is seen only when the step's scalars are
    // read, after every replica has enqueued its optimizer step: the replicas may then hold
    // updates from partly reduced gradients. The step fails everywhere and the object is marked
    // diverged with no replica known to be right: `load()` a checkpoint, or `resync()` to make
    // the replicas equal again (replica 0's state). With check_finite the failure is seen before
    // the commit barrier and no replica applies the step.

    // After a failed step (Note [commit point]): replicas differ when some passed the commit
    // barrier but not all of them applied the step, or when the device failed the step after its
    // commit (Note [device failure after the commit]).
    void mark_if_diverged(int committed, const std::vector<std::atomic<bool>>& applied, bool device_failed,
                          const std::string& what) {
        const auto done = [](const std::atomic<bool>& a) { return a.load(std::memory_order_relaxed); };
        const bool all = std::all_of(applied.begin(), applied.end(), done);
        if (committed == 0 || (all && !device_failed)) return;
        const auto first = std::find_if(applied.begin(), applied.end(), done);
        if (device_failed)
            diverged_ = Divergence{steps_ + 1, 0, "the device failed it after every replica had enqueued the update (" + what +
                                                      "); no replica is known to hold the right parameters", true};
        else
            diverged_ = Divergence{steps_ + 1, first == applied.end() ? 0 : static_cast<int>(first - applied.begin()), what, false};
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
        if constexpr (detail::has_optimizer<Optimizer>) {
            optimizer->prepare(world_);
            optimizer->visit_state(root, core_->replicas[static_cast<std::size_t>(root)]->module,
                                   [&](const std::string&, const auto& state, const auto&) { root_has.push_back(state.numel() > 0); });
        }
        // Note [jobs own their state]: the job holds its own copy of `root_has`.
        pool_.run([core = core_, root, root_has = std::move(root_has), optimizer](int r) {
            auto& rep = *core->replicas[static_cast<std::size_t>(r)];
            const std::uint64_t next = broadcast_module(rep, root);
            if constexpr (detail::has_optimizer<Optimizer>) {
                std::size_t i = 0;
                optimizer->visit_state(r, rep.module, [&](const std::string&, auto& state, const auto& p) {
                    using S = std::remove_reference_t<decltype(state)>;
                    if (root_has[i] == 0) state = S();
                    else {
                        if (state.numel() != p.numel()) state = S::empty_like(p.value);
                        rep.layer_comm->broadcast(DeviceSpan(state), root, comm::CollectiveSite::broadcast(next + i));
                    }
                    ++i;
                });
            }
        });
        diverged_.reset();
        pending_ = 0;
    }

    template <class Optimizer>
    void load_impl(std::shared_ptr<const nn::Checkpoint> held, Optimizer* optimizer) {
        pool_.check_usable("DataParallel::load");
        const nn::Checkpoint& ck = *held;
        // Check everything against replica 0 before any replica changes.
        nn::check_module_fits(ck, module(), {}, true, "optimizer.");
        if constexpr (detail::has_optimizer<Optimizer>) {
            optimizer->prepare(world_);
            std::set<std::string> states;
            optimizer->visit_state(0, core_->replicas[0]->module, [&](const std::string& name, const auto&, const auto& p) {
                const std::string key = "optimizer." + name;
                states.insert(key);
                if (ck.contains(key)) ck.check_fits(key, p.value);
            });
            for (const auto& name : ck.names())
                if (name.rfind("optimizer.", 0) == 0 && states.count(name) == 0)
                    throw IoError(ck.label() + " has optimizer state '" + name + "' that this model's optimizer does not have");
        }
        pool_.run([core = core_, held, optimizer](int r) {  // Note [jobs own their state]: the job owns the checkpoint
            auto& rep = *core->replicas[static_cast<std::size_t>(r)];
            nn::assign_module(*held, rep.module);  // checked above, against replica 0
            if constexpr (detail::has_optimizer<Optimizer>) nn::get_optimizer(*held, *optimizer, rep.module, r);
        });
        pending_ = 0;
        diverged_.reset();  // every replica holds the checkpoint now
    }

    // The global batch size for `rows` rows in this process, and the shards of this process's
    // replicas as ranges of its own rows. Across processes: one exchange of every process's row
    // count, so every process checks every process's count and all throw the same error.
    std::int64_t global_rows(std::int64_t rows, const char* what, std::vector<parallel::ShardRange>& mine) const {
        if (!core_->procs) {
            mine = parallel::shard_ranges(rows, world_);
            return rows;
        }
        auto& procs = *core_->procs;
        const int P = procs.size();
        std::vector<double> counts(static_cast<std::size_t>(P), 0.0);
        counts[static_cast<std::size_t>(procs.rank())] = static_cast<double>(rows);
        procs.channel(comm::ProcessGroup::control).all_reduce_sum(DeviceSpan<double>::host(counts), comm::CollectiveSite::control(comm::Exchange::batch_rows));
        std::int64_t batch = 0;
        for (const double c : counts) batch += static_cast<std::int64_t>(c);
        const auto all = parallel::shard_ranges(batch, core_->global_world);
        for (int q = 0; q < P; ++q) {
            std::int64_t want = 0;
            for (int l = 0; l < world_; ++l) want += all[static_cast<std::size_t>(q * world_ + l)].count;
            LOCKSTEP_CHECK_AS(ShapeError, static_cast<std::int64_t>(counts[static_cast<std::size_t>(q)]) == want, "DataParallel::",
                              what, ": process ", q, " passed ", static_cast<std::int64_t>(counts[static_cast<std::size_t>(q)]),
                              " rows, but its ", world_, " replicas' shards of the global batch of ", batch, " hold ", want,
                              "; pass each process the rows of its global ranks (contiguous, in global-rank order: "
                              "parallel::shard_ranges(batch, replicas x processes))");
        }
        const std::int64_t offset = all[static_cast<std::size_t>(core_->first_rank)].begin;
        mine.assign(all.begin() + core_->first_rank, all.begin() + core_->first_rank + world_);
        for (auto& s : mine) s.begin -= offset;
        return batch;
    }

    // `write` on global rank 0's process only, then its outcome to every process (Note
    // [hierarchical groups]): every process returns, or all throw the same IoError.
    template <class Write>
    nn::Checkpoint::SaveReport save_once(Write&& write) const {
        if (!core_->procs) return write();
        auto& procs = *core_->procs;
        nn::Checkpoint::SaveReport report;
        std::string failure;
        if (procs.rank() == 0) {
            try {
                report = write();
            } catch (const std::exception& e) {
                failure = e.what();
                if (failure.empty()) failure = "the checkpoint could not be written";
            }
        }
        std::vector<std::int64_t> status(1 + 1024, 0);  // length, then the message's bytes
        if (procs.rank() == 0) {
            status[0] = static_cast<std::int64_t>(std::min<std::size_t>(failure.size(), 1024));
            for (std::size_t i = 0; i < static_cast<std::size_t>(status[0]); ++i)
                status[1 + i] = static_cast<unsigned char>(failure[i]);
        }
        procs.channel(comm::ProcessGroup::control).broadcast(DeviceSpan<std::int64_t>::host(status), 0, comm::CollectiveSite::control(comm::Exchange::checkpoint_status));
        if (status[0] > 0) {
            std::string message;
            for (std::int64_t i = 0; i < status[0]; ++i) message += static_cast<char>(status[static_cast<std::size_t>(1 + i)]);
            throw IoError(procs.rank() == 0 ? message : "process 0 failed to write the checkpoint: " + message);
        }
        return report;
    }

    static DataParallelOptions check_options(const DataParallelOptions& o) {
        LOCKSTEP_CHECK(o.bucket_bytes > 0, "DataParallelOptions::bucket_bytes must be positive");
        LOCKSTEP_CHECK(!o.clip_grad_norm || *o.clip_grad_norm > 0, "DataParallelOptions::clip_grad_norm must be positive, got ",
                       o.clip_grad_norm.value_or(0), "; leave it unset to not clip");
        return o;
    }

    static std::vector<Device> check_devices(const std::vector<Device>& devices) {
        LOCKSTEP_CHECK(!devices.empty(), "DataParallel needs at least one device, got none; pass e.g. "
                                         "lockstep::DataParallel(model, 2) for two host replicas");
        for (const auto& d : devices)
            LOCKSTEP_CHECK_AS(DeviceMismatch, d.kind == device_kind_of<backend>(), "DataParallel of a ", backend::name,
                              " module cannot use device ", d);
        return devices;
    }

    // Note [gradient buckets] and [gradients in their buckets]: buckets in reverse visit order,
    // parameters inside a bucket in visit order.
    static void build_buckets(Replica& rep, const Device& device, std::size_t bucket_bytes) {
        std::vector<nn::Parameter<backend>*> params;
        nn::for_each_parameter(rep.module, [&](const std::string&, nn::Parameter<backend>& p) { params.push_back(&p); });
        Bucket current;
        std::int64_t elems = 0;
        const auto close = [&] {
            if (current.params.empty()) return;
            // Slots in visit order (the bucket's parameters are in reverse), each starting on a
            // 64-byte boundary, as a tensor of its own would: vector loads stay aligned.
            const std::size_t k = current.params.size();
            current.offsets.assign(k, 0);
            std::int64_t end = 0;
            for (std::size_t j = k; j-- > 0;) {
                current.offsets[j] = (end + 15) / 16 * 16;
                end = current.offsets[j] + current.counts[j];
            }
            current.flat = Tensor<float, backend>(Shape{end}, MemoryFormat::nchw, device);
            current.values = Tensor<float, backend>(Shape{end}, MemoryFormat::nchw, device);  // padding zero
            for (auto* p : current.params) rep.slots[p] = {rep.buckets.size(), false};
            rep.buckets.push_back(std::move(current));
            current = Bucket{};
            elems = 0;
        };
        for (std::size_t v = params.size(); v-- > 0;) {
            auto* p = params[v];
            if (!current.params.empty() &&
                static_cast<std::size_t>(elems + p->numel()) * sizeof(float) > bucket_bytes)
                close();
            current.params.push_back(p);
            current.counts.push_back(p->numel());
            current.visit_index.push_back(v);
            elems += p->numel();
        }
        close();
        rep.place_all();
    }

    void broadcast_from_first() {
        pool_.run([core = core_](int r) { broadcast_module(*core->replicas[static_cast<std::size_t>(r)], 0); });
    }

    // Copies `root`'s parameters and buffers into replica `rep` (on its thread, with all the others);
    // returns the number of broadcasts made, the next free site index.
    static std::uint64_t broadcast_module(Replica& rep, int root) {
        std::uint64_t index = 0;
        const auto bcast = [&](auto& t) { rep.layer_comm->broadcast(DeviceSpan(t), root, comm::CollectiveSite::broadcast(index++)); };
        nn::walk(
            rep.module, [&](const std::string&, auto& p) { bcast(p.value); }, [&](const std::string&, auto& t) { bcast(t); });
        return index;
    }

    // Runs `job` on every replica; when the call returns (or gives up on a stuck replica and
    // throws), the caller's objects that `caller` guards are gone for any replica still to read them.
    void run_job(detail::CallerRefs& caller, ReplicaPool::Job job) {
        struct Release {
            detail::CallerRefs& refs;
            ~Release() { refs.release(); }
        } release{caller};
        pool_.run(std::move(job));
        caller.settle();  // the call succeeds only once its copies of the caller's objects have run
    }

    static std::shared_ptr<Core> make_core(const DataParallelOptions& options, const std::vector<Device>& devices) {
        auto core = std::make_shared<Core>();
        std::exception_ptr failure;
        try {
            core->options = check_options(options);
            core->devices = check_devices(devices);
        } catch (...) {
            if (!options.process_group) throw;
            failure = std::current_exception();
        }
        if (options.process_group) {  // every process refuses alike (comm::agreed_failure), none waits for one that left
            const std::string agreed = comm::agreed_failure(*options.process_group, comm::ProcessGroup::control, failure);
            if (!agreed.empty()) throw UsageError("DataParallel across processes: " + agreed);
        }
        core->world = static_cast<int>(core->devices.size());
        core->global_world = core->world;
        core->resources.resize(core->devices.size());
        if (!options.process_group) {
            core->layer_group = std::make_unique<Group>(core->devices, options.timeout);
            core->grad_group = std::make_unique<Group>(core->devices, options.timeout);
            return core;
        }
        auto& procs = *options.process_group;
        core->procs = options.process_group;
        // Every process must run as many replicas: all see every count, so all agree or all throw
        // the same error.
        std::vector<double> counts(static_cast<std::size_t>(procs.size()), 0.0);
        counts[static_cast<std::size_t>(procs.rank())] = core->world;
        procs.channel(comm::ProcessGroup::control).all_reduce_sum(DeviceSpan<double>::host(counts), comm::CollectiveSite::control(comm::Exchange::replica_counts));
        if (std::adjacent_find(counts.begin(), counts.end(), std::not_equal_to<>()) != counts.end()) {
            std::string list;
            for (std::size_t p = 0; p < counts.size(); ++p)
                list += (p ? ", " : "") + std::to_string(static_cast<long long>(counts[p]));
            throw UsageError("DataParallel across " + std::to_string(procs.size()) +
                             " processes: they run different replica counts (" + list +
                             ", by process); every process must run the same number (the same --replicas or --devices "
                             "on every rank)");
        }
        core->first_rank = procs.rank() * core->world;
        core->global_world = procs.size() * core->world;
        if constexpr (std::constructible_from<Group, const std::vector<Device>&, std::chrono::milliseconds,
                                              std::shared_ptr<comm::ProcessGroup>, comm::ProcessGroup::Channel>) {
            // A group that spans processes itself (a CUDA group: NCCL across processes, Note
            // [stream groups across processes]).
            core->layer_group = std::make_unique<Group>(core->devices, options.timeout, core->procs, comm::ProcessGroup::layer);
            core->grad_group = std::make_unique<Group>(core->devices, options.timeout, core->procs, comm::ProcessGroup::gradients);
        } else if constexpr (std::same_as<backend, Host>) {
            core->layer_hier = std::make_unique<comm::HierarchicalGroup>(core->world, core->procs, comm::ProcessGroup::layer, options.timeout);
            core->grad_hier = std::make_unique<comm::HierarchicalGroup>(core->world, core->procs, comm::ProcessGroup::gradients, options.timeout);
        } else {
            throw NotImplemented("DataParallel across processes needs a replica group that spans processes; this group "
                                 "type has no constructor taking a ProcessGroup");
        }
        return core;
    }

    typename K::Runtime runtime_;  // the backend's process-wide settings while replicas exist
    std::shared_ptr<Core> core_;   // Note [jobs own their state]
    int world_;
    ReplicaPool pool_;  // after core_: its threads are joined (or left behind) before core_ is released
    bool training_ = true;
    std::int64_t pending_ = 0;  // samples accumulated since the last step
    std::int64_t steps_ = 0;    // steps applied
    struct Divergence {
        std::int64_t step;
        int root;  // a replica that completed the step
        std::string reason;
        bool unknown = false;  // no replica is known to be right (Note [device failure after the commit])
    };
    std::optional<Divergence> diverged_;
};

//! `DataParallel dp(net, 3);` deduces the module type.
template <class Module>
DataParallel(const Module&, int, DataParallelOptions = {}) -> DataParallel<Module>;
template <class Module>
DataParallel(const Module&, std::vector<Device>, DataParallelOptions = {}) -> DataParallel<Module>;

}  // namespace lockstep
