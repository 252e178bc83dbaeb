// SPDX-License-Identifier: MIT
//! The step runner of DataParallel: what every replica runs for a training step and for an
//! accumulated micro-batch, two paths over shared pieces, and what a failed step leaves behind.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "lockstep/comm/collective_tag.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/tensor.hpp"
#include "lockstep/kernels/ops.hpp"
#include "lockstep/nn/context.hpp"
#include "lockstep/nn/module.hpp"
#include "lockstep/parallel/call_state.hpp"
#include "lockstep/parallel/core.hpp"
#include "lockstep/parallel/options.hpp"
#include "lockstep/parallel/process_coordination.hpp"
#include "lockstep/parallel/replica.hpp"
#include "lockstep/parallel/scatter.hpp"
#include "lockstep/runtime/replica_pool.hpp"

namespace lockstep::parallel::detail {

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
// Note [gradient accumulation]
// `accumulate(x, ...)` runs forward and backward and keeps the gradients without any gradient
// collective (layer collectives such as SyncBatchNorm's still run). Each micro-batch is weighted
// by its share of the samples: before the backward of a micro-batch of N samples, with M samples
// accumulated so far, the kept gradients are scaled by M/(M+N) and the loss gradient by
// N/(M+N), so the gradients are always those of the mean loss over all M+N samples. The next
// train_step all-reduces once and steps: accumulate(b1) then train_step(b2) equals
// train_step(b1 + b2) for a model without batch norm, whatever the sizes.

// Note [device failure after the commit]
// Without check_finite nothing reads the device between the gradient all-reduce and the
// commit barrier (that read would cost the overlap of the step's tail), so a collective that
// fails on the device (an NCCL error, a peer gone) is seen only when the step's scalars are
// read, after every replica has enqueued its optimizer step: the replicas may then hold
// updates from partly reduced gradients. The step fails everywhere and the object is marked
// diverged with no replica known to be right: `load()` a checkpoint, or `resync()` to make
// the replicas equal again (replica 0's state). With check_finite the failure is seen before
// the commit barrier and no replica applies the step.

// Scales every gradient by min(1, max_norm / (global norm + 1e-6)) (Note [step order]).
template <class Module>
void clip(Replica<Module>& rep, double max_norm) {
    using backend = typename Module::backend;
    using K = kernels::Ops<backend>;
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
template <class Module>
void check_finite(Replica<Module>& rep, int rank, std::int64_t step_number, double& loss_sum, double& correct) {
    using backend = typename Module::backend;
    using K = kernels::Ops<backend>;
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

//! A step's or a micro-batch's state, owned by the call and by its job (Note [jobs own their state]).
template <class Loss>
struct StepCall {
    StepCall(int world, const Loss& l, BatchSplit split, std::int64_t before_, std::int64_t step)
        : shards(std::move(split.shards)),
          batch(split.batch),
          before(before_),
          after(before_ + split.batch),
          step_number(step),
          sums(static_cast<std::size_t>(world)),
          corrects(static_cast<std::size_t>(world)),
          applied(static_cast<std::size_t>(world)),
          loss(l) {}
    std::vector<ShardRange> shards;          // this process's replicas' rows of the caller's batch
    std::int64_t batch;                      // the global batch
    std::int64_t before, after;              // samples accumulated before and after this call (Note [gradient accumulation])
    std::int64_t step_number;                // the step this call applies, for messages
    std::vector<double> sums, corrects;      // each replica's loss sum and correct count
    std::atomic<int> committed{0};           // replicas past the commit barrier
    std::atomic<bool> device_failed{false};  // the device failed the step after it
    std::vector<std::atomic<bool>> applied;  // replicas whose optimizer step completed
    Held<Loss> loss;
    CallerRefs caller;  // x and targets
};

//! What a replica does first, step or micro-batch: its tensors back in their buckets (Note
//! [gradients in their buckets]), gradients zeroed at the first micro-batch, no bucket armed yet,
//! its buffers saved (Note [commit point]).
template <class Module, class Loss>
void begin_part(Replica<Module>& rep, const StepCall<Loss>& call) {
    rep.ctx.training = true;
    rep.ctx.global_batch = call.batch;
    rep.ctx.grad_ready = nullptr;
    rep.place_all();
    if (call.before == 0) {
        nn::zero_grad(rep.module);
        rep.totals.zero();
    }
    rep.save_buffers();
}

//! Forward, loss and backward of replica `r` on its shard of the caller's batch, copied while the
//! call waits; the loss gradient weighted as Note [gradient accumulation] says.
template <class Module, class Group, class Loss, class View>
void forward_backward(Core<Module, Group>& core, int r, StepCall<Loss>& call, const Tensor<float, typename Module::backend>& x,
                      const View& targets) {
    using backend = typename Module::backend;
    using K = kernels::Ops<backend>;
    using Owned = OwnedShard<typename shard_of<View, backend>::type>;
    const auto ur = static_cast<std::size_t>(r);
    auto& rep = core.replica(r);
    Tensor<float, backend> in;
    typename Owned::type own_targets;
    const auto& shard = call.shards[ur];
    const auto& device = core.devices[ur];
    if (!call.caller.read(
            [&] {
                in = take_rows(rep.ctx.exec, x, shard, device);
                own_targets = Owned::own(shard_targets(rep.ctx.exec, targets, shard, device));
                K::mark_inputs_read(rep.ctx.exec);
            },
            [ex = rep.ctx.exec] { K::wait_inputs_read(ex); }))
        throw caller_gone();
    Tensor<float, backend> out;
    {
        const typename K::Range range("lockstep forward");
        out = rep.module.forward(rep.ctx, std::move(in));
    }
    auto lo = call.loss.get()(rep.ctx, out, Owned::view(own_targets));
    out = Tensor<float, backend>();
    if (call.before > 0) {  // Note [gradient accumulation]
        const double kept = static_cast<double>(call.before) / static_cast<double>(call.after);
        nn::for_each_parameter(rep.module,
                               [&](const std::string&, nn::Parameter<backend>& p) { K::scale(rep.ctx.exec, p.grad, kept); });
        K::scale(rep.ctx.exec, lo.grad, static_cast<double>(call.batch) / static_cast<double>(call.after));
    }
    {
        const typename K::Range range("lockstep backward");
        rep.module.backward(rep.ctx, lo.grad);
    }
    K::add(rep.ctx.exec, rep.totals, lo.totals);
}

//! After backward, in a step: the gradient all-reduce, the finite check and the clipping, then
//! the commit barrier (Notes [step order] and [commit point]).
template <class Module, class Loss>
void reduce_and_commit(Replica<Module>& rep, const DataParallelOptions& options, int r, StepCall<Loss>& call) {
    const auto ur = static_cast<std::size_t>(r);
    rep.finish_buckets();
    if (options.check_finite) check_finite(rep, r, call.step_number, call.sums[ur], call.corrects[ur]);
    if (options.clip_grad_norm) clip(rep, *options.clip_grad_norm);
    // No replica updates its parameters unless every replica got here; a failure anywhere before
    // aborts this barrier on all.
    rep.grad_comm->barrier(comm::CollectiveSite::commit(0));
}

//! After the commit barrier: the optimizer step, the barrier after it (a replica whose optimizer
//! threw fails the step everywhere), then the step's scalars.
template <class Module, class Loss, class Optimizer>
void apply_update(Replica<Module>& rep, Optimizer& optimizer, const DataParallelOptions& options, int r, StepCall<Loss>& call) {
    using K = kernels::Ops<typename Module::backend>;
    const auto ur = static_cast<std::size_t>(r);
    call.committed.fetch_add(1, std::memory_order_relaxed);
    {
        const typename K::Range range("lockstep optimizer step");
        optimizer.step(rep.ctx, rep.module);
    }
    call.applied[ur].store(true, std::memory_order_relaxed);
    rep.grad_comm->barrier(comm::CollectiveSite::commit(1));
    // The step's scalars: the one read from the device in a step (with check_finite they came back
    // with the finite check, before the commit barrier, and so had every collective of the step).
    // Without it, a collective that fails on the device is seen here, after every replica enqueued
    // its optimizer step on gradients that may be partly reduced (Note [device failure after the
    // commit]).
    if (options.check_finite) return;
    try {
        const auto t = K::to_vector(rep.ctx.exec, rep.totals);
        call.sums[ur] = t[0];
        call.corrects[ur] = t[1];
    } catch (...) {
        call.device_failed.store(true, std::memory_order_relaxed);
        throw;
    }
}

//! A replica whose part failed before the commit point: both groups aborted first (peers and
//! this replica's communication thread wake up), then its communication thread idle, then its
//! buffers as the step found them (Note [commit point]: the failed step leaves nothing behind).
template <class Module>
void abandon_part(Replica<Module>& rep, int r) noexcept {
    ReplicaPool::report_failure(r, std::current_exception());
    rep.unwind();
    rep.restore_buffers();
}

//! Replica `r`'s part of a training step (Note [step order]).
template <class Module, class Group, class Loss, class View, class Optimizer>
void train_part(Core<Module, Group>& core, int r, StepCall<Loss>& call, const Tensor<float, typename Module::backend>& x,
                const View& targets, Optimizer& optimizer) {
    auto& rep = core.replica(r);
    begin_part(rep, call);
    rep.begin_buckets(core.options.overlap);  // Note [gradient buckets]: all-reduced as backward finishes them
    try {
        forward_backward(core, r, call, x, targets);
        reduce_and_commit(rep, core.options, r, call);
    } catch (...) {
        abandon_part(rep, r);
        throw;
    }
    apply_update(rep, optimizer, core.options, r, call);
}

//! Replica `r`'s part of an accumulated micro-batch (Note [gradient accumulation]).
template <class Module, class Group, class Loss, class View>
void accumulate_part(Core<Module, Group>& core, int r, StepCall<Loss>& call, const Tensor<float, typename Module::backend>& x,
                     const View& targets) {
    auto& rep = core.replica(r);
    begin_part(rep, call);  // no bucket armed: the gradients are kept
    try {
        forward_backward(core, r, call, x, targets);
    } catch (...) {
        abandon_part(rep, r);
        throw;
    }
}

//! What a completed step reports: the replicas' sums in rank order, then over the processes in
//! process order, so every run gives the same bits.
template <class Loss>
StepResult step_result(const StepCall<Loss>& call, comm::ProcessGroup* procs) {
    double total = 0, correct = 0;
    for (std::size_t r = 0; r < call.sums.size(); ++r) {
        total += call.sums[r];
        correct += call.corrects[r];
    }
    sum_step_totals(procs, total, correct);
    StepResult result;
    result.count = call.after;
    result.loss = total / static_cast<double>(call.after);
    result.correct = static_cast<std::int64_t>(correct);
    return result;
}

//! How a step failed after its commit point left the replicas (Note [commit point]).
struct Divergence {
    std::int64_t step;
    int root;  // a replica that completed the step
    std::string reason;
    bool unknown = false;  // no replica is known to be right (Note [device failure after the commit])
};

//! After a failed step: replicas differ when some passed the commit barrier but not all of them
//! applied the step, or when the device failed the step after its commit.
template <class Loss>
std::optional<Divergence> divergence_after(const StepCall<Loss>& call, const std::string& what) {
    const auto done = [](const std::atomic<bool>& a) { return a.load(std::memory_order_relaxed); };
    const auto& applied = call.applied;
    const bool all = std::all_of(applied.begin(), applied.end(), done);
    const bool device_failed = call.device_failed.load();
    if (call.committed.load() == 0 || (all && !device_failed)) return std::nullopt;
    if (device_failed)
        return Divergence{call.step_number, 0,
                          "the device failed it after every replica had enqueued the update (" + what +
                              "); no replica is known to hold the right parameters",
                          true};
    const auto first = std::find_if(applied.begin(), applied.end(), done);
    return Divergence{call.step_number, first == applied.end() ? 0 : static_cast<int>(first - applied.begin()), what, false};
}

}  // namespace lockstep::parallel::detail
