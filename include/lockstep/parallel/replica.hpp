// SPDX-License-Identifier: MIT
//! A DataParallel replica: its module and execution context, its gradient buckets (flat buffers
//! its parameters and gradients are views of, all-reduced as backward finishes them) and the
//! copies that let a failed step leave nothing behind.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "lockstep/comm/collective_tag.hpp"
#include "lockstep/comm/collectives.hpp"
#include "lockstep/core/device_span.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/tensor.hpp"
#include "lockstep/kernels/ops.hpp"
#include "lockstep/nn/bucket_layout.hpp"
#include "lockstep/nn/context.hpp"
#include "lockstep/nn/module.hpp"
#include "lockstep/runtime/serial_worker.hpp"

namespace lockstep::parallel::detail {

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

//! One gradient bucket of a replica (Note [gradients in their buckets]).
template <class B>
struct Bucket {
    std::vector<nn::Parameter<B>*> params;
    std::vector<std::int64_t> offsets;     // into flat and values, 64-byte aligned
    std::vector<std::int64_t> counts;      // elements of each parameter
    std::vector<std::size_t> visit_index;  // each parameter's place in visit order (its name)
    Tensor<float, B> flat;                 // the gradients, all-reduced as one (Note [gradients in their buckets])
    Tensor<float, B> values;               // the parameters' values, laid out as `flat`
    // `flat` rounded to bfloat16 (their bits), what is all-reduced when gradients are reduced
    // in bf16 (DataParallelOptions::gradient_precision); empty otherwise.
    Tensor<std::uint16_t, B> narrow;
    int pending = 0;
    bool launched = false;
};

//! A replica's captured steps (Note [captured steps] in parallel/step.hpp): graphs (a) of
//! forward, loss, backward and the collectives, and (b) of clipping and the update, each keyed by
//! what it holds; the tensors (a) reads its input from; the keys that ran eagerly once.
template <class B>
struct StepGraphs {
    using Cache = typename kernels::Ops<B>::GraphCache;
    using Key = typename Cache::Key;

    explicit StepGraphs(std::size_t capacity) : forward(capacity), update(capacity), capacity_(capacity) {}

    //! The input of a graph (a): its shard of x and its targets, copied in before each launch.
    struct Inputs {
        Tensor<float, B> x;
        Tensor<std::int64_t, B> labels;
        Tensor<float, B> targets;
        Shape output;  // the module's output at capture (what the loss checks replayed targets against)
    };

    Cache forward;                   // (a)
    Cache update;                    // (b)
    std::map<Key, Inputs> inputs;    // of (a)'s keys: dropped with their graphs
    std::uint64_t epoch = 0;         // Core::graph_epoch when these were made
    bool layers_hold_state = false;  // a forward() since the last step: a capture could free its tensors
    std::uint64_t captures = 0, launches = 0;

    //! The keys that an eager step left ready for capture since the last clear: the key as it
    //! reads after that step, which grew what it needed (Note [captured steps]).
    std::set<Key> seen_forward, seen_update;
    void remember(std::set<Key>& keys, Key key) {
        if (keys.size() >= 4 * capacity_) {  // shapes that come and go: bounded
            keys.clear();
            prune();
        }
        keys.insert(std::move(key));
    }

    //! Keeps the inputs of (a)'s graphs only.
    void prune() {
        for (auto it = inputs.begin(); it != inputs.end();) it = forward_contains(it->first) ? std::next(it) : inputs.erase(it);
    }
    void clear() noexcept {
        forward.clear();
        update.clear();
        inputs.clear();
        seen_forward.clear();
        seen_update.clear();
    }

private:
    bool forward_contains(const Key& key) const {
        if constexpr (kernels::Ops<B>::graphs)
            return forward.contains(key);
        else
            return false;
    }
    std::size_t capacity_;
};

//! One replica: its module and execution context, its gradient buckets, its communication
//! thread, and copies of its buffers taken when a step begins (Note [commit point] in
//! parallel/step.hpp).
template <class Module>
struct Replica {
    using backend = typename Module::backend;
    using K = kernels::Ops<backend>;

    Replica(Module&& replica, const typename K::ReplicaResources& resources, comm::Collectives& layer, comm::Collectives& grad)
        : module(std::move(replica)), layer_comm(&layer), grad_comm(&grad), worker([&resources] { resources.bind_thread(); }) {}

    Module module;
    comm::Collectives* layer_comm;  // layer collectives (SyncBatchNorm), on the replica thread
    comm::Collectives* grad_comm;   // gradient buckets and commit barriers
    nn::Context<backend> ctx;
    Tensor<double, backend> totals;        // (2): loss sum and correct count since the last step
    Tensor<double, backend> norm_sq;       // (1): squared global gradient norm, when clipping
    Tensor<double, backend> finite_check;  // (parameters + 2): squared gradient norms, then the step's totals
    std::vector<std::string> param_names;  // visit order
    std::vector<Bucket<backend>> buckets;
    struct Slot {
        std::size_t bucket = 0;
        bool ready = false;  // reported in this step
    };
    std::unordered_map<const void*, Slot> slots;  // every parameter of the replica
    SerialWorker worker;
    std::optional<StepGraphs<backend>> graphs;  // with DataParallelOptions::graphs
    bool overlap = true;

    //! Destroys the replica's captured steps, on its thread: after a failed call their
    //! communicators are being aborted, which waits for them (Note [aborting communicators]).
    void drop_graphs() noexcept {
        if (graphs) graphs->clear();
    }
    // Buckets all-reduced in bf16 (DataParallelOptions::gradient_precision).
    bool bf16_gradients = false;
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
        // A parameter that a layer computes but visit() never listed (Note [parameters without a
        // gradient]): it would train frozen on each replica alone and be missing from checkpoints.
        LOCKSTEP_CHECK_AS(UsageError, it != slots.end(),
                          "a layer marked the gradient of a parameter ready (Context::mark_grad_ready) that DataParallel does "
                          "not know: a module's visit() leaves out the child or parameter that holds it, so it would be "
                          "neither all-reduced, stepped nor saved; list it in that module's visit() (v.module(name, child) "
                          "or v.parameter(name, p))");
        if (it->second.ready) return;  // counted
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
    void queue_place(Bucket<backend>& b, std::size_t i, Tensor<float, backend>& t, Tensor<float, backend>& flat) {
        const auto& p = *b.params[i];
        const std::int64_t n = b.counts[i];
        if (t.views(flat, b.offsets[i]) && t.numel() == n) return;
        const std::string& name = param_names[b.visit_index[i]];
        LOCKSTEP_CHECK_AS(UsageError, p.value.numel() == n, "parameter '", name, "' holds ", p.value.numel(),
                          " elements, but DataParallel was made with ", n,
                          "; a model's parameters keep their sizes (assign values of the same shape)");
        LOCKSTEP_CHECK_AS(ShapeError, t.shape() == p.shape() || t.empty(), "the gradient of parameter '", name, "' has shape ",
                          t.shape(), " beside its value of shape ", p.shape(),
                          "; a layer must keep a parameter's gradient in the parameter's shape");
        if (t.is_view()) t = Tensor<float, backend>(t);  // an owning copy
        auto view = Tensor<float, backend>::view(flat, b.offsets[i], p.shape(), p.value.format());
        if (t.empty())
            zeroing.push_back(&t);  // a gradient not made yet: zero, as Parameter makes it
        else
            placing.push_back({&flat, b.offsets[i], &t, 0, n});
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

    //! The gradients (every one a view of its bucket after place_all: one zeroing per bucket)
    //! and the step's totals, zeroed for a new step.
    void clear_step() {
        for (auto& b : buckets) b.flat.zero();
        totals.zero();
    }

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
            if (bf16_gradients) {  // rounded on the compute stream, before the collective's event
                if constexpr (K::bf16_products) {
                    K::to_bf16(ctx.exec, b.flat, b.narrow);
                    grad_comm->start_all_reduce_sum_bf16(DeviceSpan(b.narrow), comm::CollectiveSite::bucket(index));
                } else {
                    throw NotImplemented("gradients all-reduced in bf16 on the " + std::string(backend::name) + " backend");
                }
            } else {
                grad_comm->start_all_reduce_sum(DeviceSpan(b.flat), comm::CollectiveSite::bucket(index));
            }
            reduced.fetch_add(1, std::memory_order_release);
            return;
        }
        auto job = [this, index] {  // fp32 buckets only: build_buckets refuses bf16 ones here
            auto& bb = buckets[index];
            grad_comm->all_reduce_sum(DeviceSpan(bb.flat), comm::CollectiveSite::bucket(index));
            reduced.fetch_add(1, std::memory_order_release);
        };
        if (overlap)
            worker.submit(job);
        else
            job();
    }

    void finish_buckets() {
        reduced_during_backward = reduced.load(std::memory_order_acquire);  // backward has just ended
        for (std::size_t i = 0; i < buckets.size(); ++i)
            if (!buckets[i].launched) launch(i);
        if (grad_comm->stream_ordered()) grad_comm->join();
        worker.wait();
        if constexpr (K::bf16_products)
            if (bf16_gradients)
                for (auto& b : buckets) K::from_bf16(ctx.exec, b.narrow, b.flat);  // after join(): the sums
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

    // Note [parameters without a gradient]
    // A parameter listed by visit() whose gradient is all zero after the all-reduce of a replica's
    // first step, and which no layer marked ready, is used by nothing in forward (a child that
    // visit() lists but forward skips) or has a backward that never writes it: it would train
    // frozen without a word. The first step (not a captured one) warns once, on the first
    // replica, naming each such parameter, unless it is marked frozen (Parameter::frozen). The
    // opposite mistake, a child that forward uses but visit() leaves out, is caught as its layer
    // marks a gradient ready that DataParallel does not know (on_ready throws UsageError).
    bool gradients_checked = false;

    //! The names of the parameters without a gradient in this step (Note [parameters without a
    //! gradient]); empty after the replica's first step.
    std::vector<std::string> parameters_without_gradient() {
        std::vector<std::string> out;
        if (gradients_checked) return out;
        gradients_checked = true;
        std::vector<std::size_t> found;  // visit indices
        Tensor<double, backend> sum;
        for (auto& b : buckets)
            for (std::size_t i = 0; i < b.params.size(); ++i) {
                const auto* p = b.params[i];
                if (p->frozen || slots.at(p).ready) continue;
                if (sum.empty()) sum = Tensor<double, backend>(Shape{1}, MemoryFormat::nchw, b.flat.device());
                K::fill(ctx.exec, sum, 0.0);
                K::add_sum_squares(ctx.exec, p->grad, sum, 0);
                if (K::read(ctx.exec, sum, 0) == 0.0) found.push_back(b.visit_index[i]);
            }
        std::sort(found.begin(), found.end());
        for (const std::size_t v : found) out.push_back(param_names[v]);
        return out;
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
            if constexpr (std::is_same_v<T, float>)
                f(t, saved_float[fi++]);
            else
                f(t, saved_int[ii++]);
        });
    }
    void make_buffer_copies() {
        nn::for_each_buffer(module, [&](const std::string&, auto& t) {
            using T = typename std::remove_reference_t<decltype(t)>::value_type;
            if constexpr (std::is_same_v<T, float>)
                saved_float.push_back(Tensor<float, backend>::empty_like(t));
            else
                saved_int.push_back(Tensor<std::int64_t, backend>::empty_like(t));
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

    // Note [gradient buckets] and [gradients in their buckets]: buckets in reverse visit order,
    // parameters inside a bucket in visit order.
    void build_buckets(const Device& device, std::size_t bucket_bytes, bool bf16 = false) {
        LOCKSTEP_CHECK_AS(NotImplemented, !bf16 || grad_comm->stream_ordered(),
                          "gradients all-reduced in bf16 need a stream-ordered (CUDA) replica group; leave "
                          "DataParallelOptions::gradient_precision at Precision::fp32");
        bf16_gradients = bf16;
        std::vector<nn::Parameter<backend>*> params;
        nn::for_each_parameter(module, [&](const std::string&, nn::Parameter<backend>& p) { params.push_back(&p); });
        Bucket<backend> current;
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
            if (bf16_gradients) current.narrow = Tensor<std::uint16_t, backend>(Shape{end}, MemoryFormat::nchw, device);
            for (auto* p : current.params) slots[p] = {buckets.size(), false};
            buckets.push_back(std::move(current));
            current = Bucket<backend>{};
            elems = 0;
        };
        for (std::size_t v = params.size(); v-- > 0;) {
            auto* p = params[v];
            if (!current.params.empty() && static_cast<std::size_t>(elems + p->numel()) * sizeof(float) > bucket_bytes) close();
            current.params.push_back(p);
            current.counts.push_back(p->numel());
            current.visit_index.push_back(v);
            elems += p->numel();
        }
        close();
        place_all();
    }

    //! The buckets as the optimizer sees them (nn::BucketLayout): parameters in visit order.
    nn::BucketLayout layout() const {
        nn::BucketLayout out;
        for (const auto& b : buckets) {
            nn::BucketLayout::Bucket lb;
            for (std::size_t i = b.params.size(); i-- > 0;) {  // a bucket holds its parameters in reverse
                lb.params.push_back(b.visit_index[i]);
                lb.offsets.push_back(b.offsets[i]);
            }
            lb.size = b.flat.numel();
            out.buckets.push_back(std::move(lb));
        }
        return out;
    }

    // Copies `root`'s parameters and buffers into this replica (on its thread, with all the
    // others); returns the number of broadcasts made, the next free site index.
    std::uint64_t broadcast_from(int root) {
        std::uint64_t index = 0;
        const auto bcast = [&](auto& t) { layer_comm->broadcast(DeviceSpan(t), root, comm::CollectiveSite::broadcast(index++)); };
        nn::walk(
            this->module, [&](const std::string&, auto& p) { bcast(p.value); }, [&](const std::string&, auto& t) { bcast(t); });
        return index;
    }
};

}  // namespace lockstep::parallel::detail
