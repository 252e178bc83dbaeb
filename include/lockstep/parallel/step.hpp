// SPDX-License-Identifier: MIT
//! The step runner of DataParallel: what every replica runs for a training step and for an
//! accumulated micro-batch, two paths over shared pieces, and what a failed step leaves behind.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <memory>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <vector>

#include "lockstep/comm/collective_tag.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/tensor.hpp"
#include "lockstep/kernels/ops.hpp"
#include "lockstep/nn/context.hpp"
#include "lockstep/nn/loss.hpp"
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
// second barrier. (With graphs the clipping is part of the update, after the commit barrier:
// Note [captured steps].) Every replica holds the same all-reduced gradients, so the check and the
// clipping decide and compute the same bits everywhere.
//
// Note [commit point]
// A step that fails on any replica must not leave replicas different. Every replica passes one
// barrier after its gradients are all-reduced (and clipped, without graphs), and before its
// optimizer step; a replica that fails earlier aborts the barrier, so either every replica steps
// or none does.
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

// Note [captured steps]
// With DataParallelOptions::graphs (CUDA) a replica's training step is two CUDA graphs (Note
// [graphs] in core/cuda_graph.cuh) launched on its stream, with the commit point between them:
//   (a) forward, loss, backward, SyncBatchNorm's collectives and the buckets' all-reduces, ending
//       with the all-reduced gradients and the step's scalars copied into the replica's pinned
//       memory (cuda::PinnedScalars): with check_finite the gradients' squared norms and the
//       totals, else the totals. The host reads them there after a polled wait, with no launch of
//       its own: before the commit barrier with check_finite, else after (b)'s launch;
//   (b) clipping and the optimizer's update.
// The host code between the kernels (the rendezvous before each collective, the bucket
// bookkeeping, the layers' checks) runs once, at capture, on every replica alike, so a launch is
// one call and the collectives meet on the devices, with no host rendezvous.
// - A graph holds what it was captured with, and its key says what that is: for (a) the global
//   batch (the loss's 1/N), the shard's and the targets' shapes, the loss's type (and its
//   graph_key() where it has state: a loss with state and none is refused), the module's
//   nn::structure_signature, the replica's device, workspace and pinned step scalars; for (b)
//   the clipping norm, the optimizer's graph_key (its hyper-parameters and where its state lies:
//   a new learning rate is a new key), the module's signature and the device. A key's first step runs eagerly (it grows the
//   workspaces, lets cuDNN choose, makes the optimizer's state: allocations a capture may not
//   make) and leaves the key as it then reads ready; the next step captures; later ones launch.
//   Each replica keeps at most graph_capacity graphs of each kind, the least recently launched
//   dropped first.
// - The replicas decide (a) together: each votes (eagerly, capture, launch) and all do the least
//   (agree_on_graph, one host barrier a step; across processes also an exchange of the processes'
//   votes and, with several replicas a process, a second barrier). A replica that launched while a peer captured
//   would skip the rendezvous the peer waits in: keys differ by replica (a workspace grown on one
//   only) and so may their graphs. A replica whose graph's collectives were launched while a
//   peer never launches its own would leave them to run on communicators the abort then destroys
//   (a fault, or a hang, on a GPU; the host CUDA device faults), so what can fail comes before
//   the vote: (b)'s capture, the input's copy and the labels' check; and captures of (a) end with
//   a second barrier before anyone launches. What is left between the vote and the launch is
//   cudaGraphLaunch itself, which fails only on a device that has failed already. (b) holds no
//   collective: each replica decides for itself, and captures it before (a)'s vote (capturing
//   runs nothing), so a capture CUDA refuses fails the step before anything runs. Each graph is
//   uploaded when captured and the upload waited for (Note [graph memory] in
//   core/cuda_graph.cuh): a graph whose memory does not fit fails there, before the barrier
//   that lets the replicas launch, and no launch needs memory after it.
// - Before each launch of (a), eagerly: the buffers saved (a failure before the launch restores
//   them), and the step's input copied into the tensors the graph reads (one set per key, dropped
//   with its graph): the shard of x, and the targets: class labels through pinned staging after
//   the loss's `check_targets` (if it has one) has checked them against the output shape of the
//   capture (in a capture, once forward has given it), or a tensor's rows. In the graph: the
//   gradients and totals zeroed, then the loss called with its targets on the device.
// - A call that fails, parallel_apply(), load() and resync() move Core::graph_epoch on: every
//   replica drops its graphs before its next step (they may hold aborted communicators or state
//   replaced since), and each key runs eagerly once more before it is captured again. A failure
//   during a launch is a failed step as any other (Note [commit point]). After a forward() the
//   layers may hold tensors (in training mode they do) that a capture would have to free, which
//   CUDA refuses: the next step runs eagerly.
// - What a graph cannot hold runs eagerly: the update of an optimizer without graph_key, the
//   step after accumulate() (its weights are host numbers of the call), the finite check's
//   judgement (on the host, between the graphs, of the values (a) staged).
// - A capture CUDA refuses (a layer that waits for the device in its forward or backward) fails
//   the step with UsageError, naming the rule.
// - One replica per GPU (Core refuses the rest): replicas that share a GPU sum through the host's
//   rendezvous, which a graph cannot replay. Across processes (Note [stream groups across
//   processes]) the processes vote together as well (agree_on_graph): a capture checks each
//   collective's tag with the other processes, which a process launching its graph would never
//   answer. A launch then meets the other processes' launches in NCCL alone.

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

// The finite check's values on the device: rep.finite_check = the all-reduced gradients' squared
// norms (one per parameter, in visit order), then the step's totals (the loss summed over this
// replica's samples, the correct count). A captured step does this in its graph (a).
template <class Module>
void stage_finite_check(Replica<Module>& rep) {
    using backend = typename Module::backend;
    using K = kernels::Ops<backend>;
    const auto& ex = rep.ctx.exec;
    rep.finite_check.zero();
    std::int64_t i = 0;
    nn::for_each_parameter(rep.module, [&](const std::string&, const nn::Parameter<backend>& p) {
        K::add_sum_squares(ex, p.grad, rep.finite_check, i++);
    });
    K::copy(ex, rep.finite_check, i, rep.totals, 0, 2);
}

// Throws NonFinite, on the replica that finds it, when the loss or an all-reduced gradient holds
// NaN or infinity (`v`: stage_finite_check's values, read to the host): before the commit
// barrier, so no replica applies the step. Gives the step's totals.
template <class Module>
void judge_finite(const Replica<Module>& rep, const std::vector<double>& v, int rank, std::int64_t step_number, double& loss_sum,
                  double& correct) {
    const std::size_t i = rep.param_names.size();
    LOCKSTEP_CHECK(v.size() == i + 2, "the finite check read ", v.size(), " values for ", i, " parameters");
    loss_sum = v[i];
    correct = v[i + 1];
    const std::string step = "step " + std::to_string(step_number);
    if (!std::isfinite(v[i]))
        throw NonFinite(step + ": the loss over replica " + std::to_string(rank) + "'s samples is " + std::to_string(v[i]) +
                        "; no replica applied the step. Lower the learning rate, or look for NaN or infinity in the input");
    for (std::size_t k = 0; k < i; ++k)
        if (!std::isfinite(v[k]))
            throw NonFinite(step + ": the all-reduced gradient of '" + rep.param_names[k] +
                            "' holds NaN or infinity; no replica applied the step. Lower the learning rate (or clip: "
                            "DataParallelOptions::clip_grad_norm), or look for NaN or infinity in the input");
}

// The finite check of an eager step: one read of the per-parameter squared norms and the step's
// totals (the gradients are the same on every replica), which also returns the totals: the step
// reads nothing else from the device.
template <class Module>
void check_finite(Replica<Module>& rep, int rank, std::int64_t step_number, double& loss_sum, double& correct) {
    using K = kernels::Ops<typename Module::backend>;
    stage_finite_check(rep);
    judge_finite(rep, K::to_vector(rep.ctx.exec, rep.finite_check), rank, step_number, loss_sum, correct);
}

// The first `n` scalars a captured step's graph (a) left in the replica's pinned memory, once its
// stream has done its work (a polled wait against the deadline).
template <class Module>
std::vector<double> captured_scalars(Replica<Module>& rep, std::size_t n) {
    using K = kernels::Ops<typename Module::backend>;
    if constexpr (K::graphs)
        return K::read_step_scalars(rep.ctx.exec, n);
    else
        return {};  // no step is captured on a backend without graphs
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
//! [gradients in their buckets]), gradients and totals zeroed at the first micro-batch (unless
//! `clear` is false: a step that may be captured zeroes them in its graph), no bucket armed yet,
//! its buffers saved (Note [commit point]).
template <class Module, class Loss>
void begin_part(Replica<Module>& rep, const StepCall<Loss>& call, bool clear = true) {
    rep.ctx.training = true;
    rep.ctx.global_batch = call.batch;
    rep.ctx.grad_ready = nullptr;
    rep.ctx.pass = nn::next_pass();  // Note [one instance, one use]
    rep.place_all();
    if (call.before == 0 && clear) rep.clear_step();
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
    if (rep.graphs) rep.graphs->layers_hold_state = false;  // backward released what forward kept
}

//! How a step's targets reach a graph (a) (Note [captured steps]): class labels given on the host
//! go to a tensor of labels on the device; a tensor of targets (float rows, or labels) is copied.
template <class View, class B>
struct GraphTargets {
    static constexpr bool supported = false;
    using device_type = void;
};
template <class B>
struct GraphTargets<std::span<const std::int64_t>, B> {
    static constexpr bool supported = true, host_labels = true;
    using device_type = Tensor<std::int64_t, B>;
};
template <class T, class B>
struct GraphTargets<Tensor<T, B>, B> {
    static constexpr bool supported = std::is_same_v<T, float> || std::is_same_v<T, std::int64_t>, host_labels = false;
    using device_type = Tensor<T, B>;
};

//! Appends what a loss's result depends on besides the output and targets: its type, and its
//! graph_key() where it has state; a loss with state and no graph_key cannot be captured.
template <class Loss>
void add_loss_key(const Loss& loss, std::vector<std::int64_t>& key) {
    key.push_back(static_cast<std::int64_t>(typeid(Loss).hash_code()));
    if constexpr (requires { loss.graph_key(); }) {
        const auto k = loss.graph_key();
        key.push_back(static_cast<std::int64_t>(k.size()));
        key.insert(key.end(), k.begin(), k.end());
    } else {
        LOCKSTEP_CHECK_AS(UsageError, std::is_empty_v<Loss>, "DataParallelOptions::graphs: the loss (", typeid(Loss).name(),
                          ") holds state that a captured step would keep as it was at its capture; give it a graph_key() "
                          "returning a std::vector<std::int64_t> of everything its result depends on besides the output "
                          "and the targets, or leave graphs off");
    }
}

//! The key of a graph (a) (Note [captured steps]).
template <class Module, class Loss, class View>
std::vector<std::int64_t> forward_key(Replica<Module>& rep, const StepCall<Loss>& call, const ShardRange& shard,
                                      const Tensor<float, typename Module::backend>& x, const View& targets) {
    using K = kernels::Ops<typename Module::backend>;
    std::vector<std::int64_t> key{call.batch, shard.count, static_cast<std::int64_t>(x.format()), x.rank(), rep.overlap ? 1 : 0};
    for (int d = 1; d < x.rank(); ++d) key.push_back(x.dim(d));
    if constexpr (std::is_same_v<View, std::span<const std::int64_t>>) {
        key.push_back(-1);
    } else {
        key.push_back(static_cast<std::int64_t>(sizeof(typename View::value_type)));
        key.push_back(static_cast<std::int64_t>(targets.format()));
        key.push_back(targets.rank());
        for (int d = 1; d < targets.rank(); ++d) key.push_back(targets.dim(d));
    }
    add_loss_key(call.loss.get(), key);
    const auto sig = nn::structure_signature(rep.module);
    key.insert(key.end(), sig.begin(), sig.end());
    if constexpr (K::graphs) K::add_graph_key(rep.ctx.exec, key);
    return key;
}

//! The replicas' one decision on graph (a) for this step (Note [captured steps]): the least of
//! their votes, 0 eagerly, 1 capture, 2 launch. Every replica votes at the same point of every
//! step with graphs; a barrier of the gradient group orders the votes before the reads, and a
//! replica votes again only after the commit barriers of this step, which every replica reaches
//! after its read. Across processes, replica 0 of each process gives its process's least to the
//! others (one exchange on the gradient channel, which its thread alone uses) and writes the
//! least of all, which the process's replicas read after a second barrier. (Those replicas wait
//! there with the group's timeout while replica 0 may wait for another process with the process
//! group's: a process that fails between the first barrier and the exchange may be reported as
//! replica 0's lateness.)
template <class Module, class Group>
int agree_on_graph(Core<Module, Group>& core, int r, int vote) {
    core.graph_votes[static_cast<std::size_t>(r)].store(vote, std::memory_order_release);
    auto& grads = *core.replica(r).grad_comm;
    grads.barrier(comm::CollectiveSite::commit(2));
    int least = 2;
    for (int i = 0; i < core.world; ++i)
        least = std::min(least, core.graph_votes[static_cast<std::size_t>(i)].load(std::memory_order_acquire));
    if (core.procs == nullptr) return least;
    if (r == 0) {
        std::array<double, 3> processes{};  // how many processes' least is 0, 1, 2
        processes[static_cast<std::size_t>(least)] = 1;
        core.procs->channel(comm::ProcessGroup::gradients)
            .all_reduce_sum(DeviceSpan<double>::host(processes), comm::CollectiveSite::control(comm::Exchange::graph_votes));
        least = processes[0] > 0 ? 0 : processes[1] > 0 ? 1 : 2;
        core.graph_decision.store(least, std::memory_order_release);
    }
    if (core.world == 1) return least;
    grads.barrier(comm::CollectiveSite::commit(4));
    return core.graph_decision.load(std::memory_order_acquire);
}

//! A capture CUDA refused, as the step's error: what the user can change.
[[noreturn]] inline void capture_refused(int r, const char* what, const CaptureRefused& e) {
    throw UsageError(std::string("DataParallelOptions::graphs: replica ") + std::to_string(r) + "'s " + what +
                     " could not be captured as a CUDA graph (" + e.what() +
                     "); a layer or optimizer that waits for the device, reads a tensor to the host, or frees in the step "
                     "a tensor it made before it cannot run in a graph: leave graphs off for this model");
}

//! Forward, loss and backward of replica `r` as graph (a), with its buckets' all-reduces
//! (Note [captured steps]); false, having done nothing, when the replicas run this step eagerly.
template <class Module, class Group, class Loss, class View>
bool forward_backward_graphed(Core<Module, Group>& core, int r, StepCall<Loss>& call,
                              const Tensor<float, typename Module::backend>& x, const View& targets) {
    using backend = typename Module::backend;
    using K = kernels::Ops<backend>;
    using GT = GraphTargets<View, backend>;
    if constexpr (!K::graphs || !GT::supported) {
        throw UsageError(
            "DataParallelOptions::graphs takes class labels (a std::vector or span of std::int64_t) or a tensor of float or "
            "std::int64_t targets, which it copies to the device before each launch; pass those, or leave graphs off");
    } else if constexpr (!nn::LossLike<Loss, backend, typename GT::device_type>) {
        throw UsageError(
            "DataParallelOptions::graphs calls the loss with its targets on the device (class labels as a "
            "Tensor<std::int64_t, backend>); this loss takes them only on the host. Use nn::SoftmaxCrossEntropy or "
            "nn::MseLoss, give the loss that overload, or leave graphs off");
    } else {
        const auto ur = static_cast<std::size_t>(r);
        auto& rep = core.replica(r);
        auto& g = *rep.graphs;
        const auto& ex = rep.ctx.exec;
        const auto& shard = call.shards[ur];
        const Device device = core.devices[ur];
        const auto& loss = call.loss.get();
        K::reserve_step_scalars(ex, rep.param_names.size() + 2);  // before the key, which holds their address
        const auto key = forward_key(rep, call, shard, x, targets);
        const bool kept = g.forward.contains(key);
        // A forward() may have left tensors in the layers that a capture would free; a key's
        // first step runs eagerly.
        const int vote = g.layers_hold_state || g.seen_forward.count(key) == 0 ? 0 : kept ? 2 : 1;
        // The step's input in the graph's tensors, before the vote: whatever can fail here (a
        // label out of range, a caller gone) fails before any replica launches. A replica that
        // launched its collectives while a peer never will leaves them to run on communicators
        // the abort destroys: a fault on a GPU (Note [captured steps]).
        typename StepGraphs<backend>::Inputs* in = nullptr;
        std::vector<std::int64_t> labels;  // this shard's, checked in a capture once the output's shape is known
        constexpr bool checks = GT::host_labels && requires { loss.check_targets(std::span<const std::int64_t>(), Shape{}); };
        const auto on_device = [&]() -> typename GT::device_type& {
            if constexpr (std::is_same_v<typename GT::device_type, Tensor<float, backend>>)
                return in->targets;
            else
                return in->labels;
        };
        if (vote > 0) {
            auto [it, made] = g.inputs.try_emplace(key);
            in = &it->second;
            if (made) {
                in->x = Tensor<float, backend>(x.shape().with(0, shard.count), x.format(), device, uninitialized);
                if constexpr (GT::host_labels)
                    on_device() = Tensor<std::int64_t, backend>(Shape{shard.count}, MemoryFormat::nchw, device, uninitialized);
                else
                    on_device() =
                        typename GT::device_type(targets.shape().with(0, shard.count), targets.format(), device, uninitialized);
            }
            if (!call.caller.read(
                    [&] {
                        copy_rows(ex, in->x, x, shard);
                        if constexpr (GT::host_labels) {
                            const auto mine = shard_targets(ex, targets, shard, device);
                            if constexpr (checks) {
                                if (kept) loss.check_targets(mine, in->output);
                                labels.assign(mine.begin(), mine.end());
                            }
                            K::upload_labels(ex, mine, on_device());
                        } else {
                            copy_rows(ex, on_device(), targets, shard);
                        }
                        K::mark_inputs_read(ex);
                    },
                    [ex] { K::wait_inputs_read(ex); }))
                throw caller_gone();
        }
        const int decision = agree_on_graph(core, r, vote);
        if (decision == 0) return false;  // eagerly: forward_backward reads the caller's objects again
        const auto record = [&] {
            rep.clear_step();  // in the graph: a launch less on the host
            Tensor<float, backend> out;
            {
                const typename K::Range range("lockstep forward");
                out = rep.module.forward(rep.ctx, Tensor<float, backend>::view(in->x, 0, in->x.shape(), in->x.format()));
            }
            in->output = out.shape();
            if constexpr (checks) loss.check_targets(std::span<const std::int64_t>(labels), in->output);
            auto lo = loss(rep.ctx, out, on_device());
            out = Tensor<float, backend>();
            {
                const typename K::Range range("lockstep backward");
                rep.module.backward(rep.ctx, lo.grad);
            }
            K::add(ex, rep.totals, lo.totals);
            rep.finish_buckets();
            // The step's scalars into pinned memory, read after the launch without a launch of
            // their own: with check_finite the finite check's values, else the totals.
            if (core.options.check_finite) {
                stage_finite_check(rep);
                K::stage_step_scalars(ex, rep.finite_check);
            } else {
                K::stage_step_scalars(ex, rep.totals);
            }
        };
        if (decision == 1) {  // every replica captures, this one too if it kept a graph
            if (kept) g.forward.erase(key);
            try {
                g.forward.prepare(key, ex.stream, record);
            } catch (const CaptureRefused& e) {
                capture_refused(r, "forward and backward", e);
            }
            // Its upload has run: a graph whose memory does not fit failed above, before any
            // replica launches (Note [graph memory] in core/cuda_graph.cuh).
            K::wait(ex, "uploading a captured step's graph");
            ++g.captures;
            g.prune();  // the inputs of a graph the capture pushed out
            // No replica launches before every replica has its graph (a capture that fails at its
            // end, after its last collective, fails here on all).
            rep.grad_comm->barrier(comm::CollectiveSite::commit(3));
        }
        K::launch_graph(ex, g.forward, key, record);
        ++g.launches;
        return true;
    }
}

//! Clipping and the optimizer's step: what graph (b) holds.
template <class Module, class Optimizer>
void run_update(Replica<Module>& rep, Optimizer& optimizer, const DataParallelOptions& options) {
    if (options.clip_grad_norm) clip(rep, *options.clip_grad_norm);
    optimizer.step(rep.ctx, rep.module);
}

//! The key of a graph (b); none where the optimizer does not say what its update holds
//! (graph_key), whose update then runs eagerly (Note [captured steps]).
template <class Module, class Optimizer>
std::optional<std::vector<std::int64_t>> update_key(Replica<Module>& rep, Optimizer& optimizer,
                                                    const DataParallelOptions& options) {
    using K = kernels::Ops<typename Module::backend>;
    if constexpr (K::graphs && requires { optimizer.graph_key(rep.ctx.local_rank, rep.module); }) {
        auto key = optimizer.graph_key(rep.ctx.local_rank, rep.module);
        key.push_back(options.clip_grad_norm ? std::bit_cast<std::int64_t>(*options.clip_grad_norm) : -1);
        const auto sig = nn::structure_signature(rep.module);
        key.insert(key.end(), sig.begin(), sig.end());
        key.push_back(rep.ctx.exec.device);  // no convolution: the workspace is not (b)'s
        return key;
    } else {
        return std::nullopt;
    }
}

//! At the start of a step, before (a)'s vote: graph (b) captured where its key ran eagerly before
//! and no graph is kept for it. A capture records and runs nothing, so one that CUDA refuses (or
//! an optimizer that throws in it) fails the step before any replica launches (a) or applies
//! anything. (b) holds no collective: each replica decides for itself. Returns the key, which
//! nothing in the step changes before the update.
template <class Module, class Optimizer>
std::optional<std::vector<std::int64_t>> prepare_update(Replica<Module>& rep, Optimizer& optimizer,
                                                        const DataParallelOptions& options, int r) {
    using K = kernels::Ops<typename Module::backend>;
    auto key = update_key(rep, optimizer, options);
    if constexpr (K::graphs) {
        auto& g = *rep.graphs;
        if (!key || g.seen_update.count(*key) == 0) return key;
        try {
            if (g.update.prepare(*key, rep.ctx.exec.stream, [&] { run_update(rep, optimizer, options); })) {
                K::wait(rep.ctx.exec, "uploading a captured update's graph");  // Note [graph memory]
                ++g.captures;
            }
        } catch (const CaptureRefused& e) {
            capture_refused(r, "update", e);
        }
    }
    return key;
}

//! After the commit barrier, with graphs: graph (b) launched where one is kept for `key` (the one
//! prepare_update gave at the step's start), else the update eagerly, after which its key (as it
//! then reads: the optimizer's state made) is ready for capture.
template <class Module, class Optimizer>
void update_graphed(Replica<Module>& rep, Optimizer& optimizer, const DataParallelOptions& options,
                    const std::optional<std::vector<std::int64_t>>& key) {
    using K = kernels::Ops<typename Module::backend>;
    if constexpr (K::graphs) {
        auto& g = *rep.graphs;
        if (key && g.update.contains(*key)) {
            K::launch_graph(rep.ctx.exec, g.update, *key, [&] { run_update(rep, optimizer, options); });
            ++g.launches;
            return;
        }
        run_update(rep, optimizer, options);
        if (key) g.remember(g.seen_update, *update_key(rep, optimizer, options));
    } else {
        run_update(rep, optimizer, options);
    }
}

//! At a replica's first step, after the all-reduce: a warning on std::cerr from the first
//! replica naming each parameter that received no gradient (Note [parameters without a gradient]
//! in parallel/replica.hpp).
template <class Module>
void warn_parameters_without_gradient(Replica<Module>& rep, int r) {
    const auto names = rep.parameters_without_gradient();
    if (r != 0 || names.empty()) return;
    std::ostringstream s;
    s << "lockstep: DataParallel: " << names.size() << (names.size() == 1 ? " parameter" : " parameters")
      << " received no gradient in the first step:";
    for (const auto& n : names) s << " '" << n << "'";
    s << ". Nothing in forward uses it, or its layer's backward never writes its gradient (a custom module's "
         "backward, or a child that visit() lists but forward skips), so it trains frozen; set Parameter::frozen "
         "where that is meant.\n";
    std::cerr << s.str() << std::flush;
}

//! After backward, in a step: the gradient all-reduce, the finite check and the clipping, then
//! the commit barrier (Notes [step order] and [commit point]). With graphs the clipping is part of
//! the update, after the barrier (the same bits: it reads only the all-reduced gradients).
template <class Module, class Loss>
void reduce_and_commit(Replica<Module>& rep, const DataParallelOptions& options, int r, StepCall<Loss>& call, bool captured) {
    const auto ur = static_cast<std::size_t>(r);
    if (!captured) {
        rep.finish_buckets();  // a captured step's graph joins its buckets itself
        warn_parameters_without_gradient(rep, r);
    }
    if (options.check_finite) {
        if (captured)  // its graph (a) left the values in pinned memory
            judge_finite(rep, captured_scalars(rep, rep.param_names.size() + 2), r, call.step_number, call.sums[ur],
                         call.corrects[ur]);
        else
            check_finite(rep, r, call.step_number, call.sums[ur], call.corrects[ur]);
    }
    if (options.clip_grad_norm && !options.graphs) clip(rep, *options.clip_grad_norm);
    // No replica updates its parameters unless every replica got here; a failure anywhere before
    // aborts this barrier on all.
    rep.grad_comm->barrier(comm::CollectiveSite::commit(0));
}

//! After the commit barrier: the optimizer step, the barrier after it (a replica whose optimizer
//! threw fails the step everywhere), then the step's scalars.
template <class Module, class Loss, class Optimizer>
void apply_update(Replica<Module>& rep, Optimizer& optimizer, const DataParallelOptions& options, int r, StepCall<Loss>& call,
                  const std::optional<std::vector<std::int64_t>>& update_key_now, bool captured) {
    using K = kernels::Ops<typename Module::backend>;
    const auto ur = static_cast<std::size_t>(r);
    call.committed.fetch_add(1, std::memory_order_relaxed);
    {
        const typename K::Range range("lockstep optimizer step");
        if (options.graphs)
            update_graphed(rep, optimizer, options, update_key_now);
        else
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
        const auto t = captured ? captured_scalars(rep, 2) : K::to_vector(rep.ctx.exec, rep.totals);
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
    if (rep.graphs) {  // Note [captured steps]: graphs of an older epoch may hold aborted communicators
        const std::uint64_t epoch = core.graph_epoch.load(std::memory_order_acquire);
        if (rep.graphs->epoch != epoch) {
            rep.graphs->clear();
            rep.graphs->epoch = epoch;
        }
    }
    const bool may_capture = rep.graphs && call.before == 0;  // alike on every replica
    begin_part(rep, call, !may_capture);
    rep.begin_buckets(core.options.overlap);          // Note [gradient buckets]: all-reduced as backward finishes them
    std::optional<std::vector<std::int64_t>> update;  // graph (b)'s key (Note [captured steps])
    bool captured = false;
    try {
        // (b) is captured before (a)'s vote: a capture that fails on one replica must fail before
        // any replica launches (a) (Note [captured steps]).
        if (core.options.graphs) update = prepare_update(rep, optimizer, core.options, r);
        captured = may_capture && forward_backward_graphed(core, r, call, x, targets);
        if (!captured) {
            if (may_capture) rep.clear_step();
            forward_backward(core, r, call, x, targets);
            // The key as it reads after an eager step, which grew what it needed: the next step
            // with it captures (Note [captured steps]).
            if (may_capture)
                rep.graphs->remember(rep.graphs->seen_forward,
                                     forward_key(rep, call, call.shards[static_cast<std::size_t>(r)], x, targets));
        }
        reduce_and_commit(rep, core.options, r, call, captured);
    } catch (...) {
        abandon_part(rep, r);
        throw;
    }
    apply_update(rep, optimizer, core.options, r, call, update, captured);
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
