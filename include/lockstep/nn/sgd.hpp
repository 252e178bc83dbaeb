// SPDX-License-Identifier: MIT
//! `nn::Sgd`: stochastic gradient descent with momentum, PyTorch semantics, one state per replica;
//! and the `OptimizerLike` concept DataParallel checks an optimizer against.
#pragma once

#include <algorithm>
#include <bit>
#include <concepts>
#include <cstdint>
#include <cstddef>
#include <string>
#include <vector>

#include "lockstep/core/error.hpp"
#include "lockstep/core/tensor.hpp"
#include "lockstep/kernels/ops.hpp"
#include "lockstep/nn/bucket_layout.hpp"
#include "lockstep/nn/context.hpp"
#include "lockstep/nn/module.hpp"

namespace lockstep::nn {

// Note [optimizer protocol]
// An optimizer keeps one state per replica, so replicas never share a buffer:
//   prepare(replicas, layout)          makes room for that many states (before a parallel region)
//                                      and takes the parameters' BucketLayout (the same for every
//                                      replica; empty outside DataParallel) to lay state out alike;
//   step(ctx, module)                  updates `module` with replica ctx.local_rank's state;
//   visit_state(rank, module, f)       calls f(name, Tensor<float, B>& state, const Parameter<B>& p)
//                                      for every state tensor of replica `rank`, named as in
//                                      PyTorch's optimizer state ("<parameter>.momentum_buffer");
//                                      an empty tensor is a state not created yet (PyTorch's None).
//   visit_counters(rank, module, f)    (optional) calls f(name, std::int64_t& count) for every
//                                      per-parameter counter ("<parameter>.step" of nn::Adam),
//                                      saved as PyTorch's float32 scalar.
// DataParallel saves, loads and resyncs optimizer state through visit_state and visit_counters,
// so a resume is exact.

namespace detail {
template <class B>
struct ArchetypeStateVisitor {
    void operator()(const std::string&, Tensor<float, B>&, const Parameter<B>&) const {}
};
}  // namespace detail

//! What DataParallel needs of an optimizer for module `M` (see Note [optimizer protocol]).
template <class O, class M>
concept OptimizerLike = requires(O& o, M& module, int rank, const Context<typename M::backend>& ctx, const BucketLayout& layout,
                                 detail::ArchetypeStateVisitor<typename M::backend> v) {
    o.prepare(rank, layout);
    o.step(ctx, module);
    o.visit_state(rank, module, v);
};

struct SgdOptions {
    double lr = 0.01;
    double momentum = 0.0;
    double dampening = 0.0;
    double weight_decay = 0.0;
    bool nesterov = false;
};

// Note [momentum beside its bucket]
// Under DataParallel a replica's parameters and gradients are views of flat bucket buffers (Note
// [gradients in their buckets] in parallel/replica.hpp), whose layout DataParallel hands to
// `prepare`. Sgd lays the momentum buffers out to match: one block per bucket, holding the
// bucket's buffers at the bucket's offsets, as views of the block. The update of a bucket then
// runs over three flat arrays laid out alike: one loop for every stretch of parameters that lie
// back to back (Ops<Host>::sgd_step_many merges those), one launch per 32 parameters on CUDA. A
// buffer replaced from outside (a checkpoint loaded through visit_state) is copied into a new
// block for its bucket at the next step. Without a layout every parameter is a bucket of its own.
// The arithmetic per element is the same either way, so the layout changes no bit.

//! SGD as torch.optim.SGD: g = grad + wd * p; v = mu * v + (1 - dampening) * g (v = g on the
//! first step); g = nesterov ? g + mu * v : v; p -= lr * g. Every replica keeps its own momentum
//! buffers and, fed identical gradients, computes identical bits.
template <BackendTag B = Host>
class Sgd {
    using K = kernels::Ops<B>;

public:
    using backend = B;

    explicit Sgd(SgdOptions options = {}) : options_(options) {
        LOCKSTEP_CHECK(options.lr >= 0, "Sgd: learning rate must be >= 0, got ", options.lr);
        LOCKSTEP_CHECK(options.momentum >= 0, "Sgd: momentum must be >= 0, got ", options.momentum);
        LOCKSTEP_CHECK(options.weight_decay >= 0, "Sgd: weight decay must be >= 0, got ", options.weight_decay);
        LOCKSTEP_CHECK(!options.nesterov || (options.momentum > 0 && options.dampening == 0),
                       "Sgd: Nesterov momentum requires a momentum and zero dampening");
    }

    const SgdOptions& options() const noexcept { return options_; }
    void set_lr(double lr) { options_.lr = lr; }

    //! Makes room for `replicas` states; called before a parallel region, never inside one.
    void prepare(int replicas) { make_room(replicas); }
    //! Makes room for `replicas` states and lays the momentum buffers out as `layout` from the
    //! next step (Note [momentum beside its bucket]).
    void prepare(int replicas, const BucketLayout& layout) {
        make_room(replicas);
        if (layout != layout_) layout_ = layout;
    }

    //! One update of `module`'s parameters with the state of replica `ctx.local_rank`.
    template <class M>
    void step(const Context<B>& ctx, M& module) {
        const int rank = ctx.local_rank;
        LOCKSTEP_CHECK_AS(UsageError, rank >= 0 && rank < static_cast<int>(states_.size()), "Sgd::step for replica ", rank,
                          " without prepare(", rank + 1, ")");
        auto& state = states_[static_cast<std::size_t>(rank)];
        auto& buffers = state.buffers;
        const kernels::SgdUpdate u{options_.lr, options_.momentum, options_.dampening, options_.weight_decay, options_.nesterov};
        // Every parameter's update in one call: on CUDA one launch for many tensors, on the host
        // one loop per bucket (Note [momentum beside its bucket]).
        state.params.clear();
        for_each_parameter(module, [&](const std::string&, Parameter<B>& p) { state.params.push_back(&p); });
        const std::size_t count = state.params.size();
        if (buffers.size() < count) buffers.resize(count);  // no reallocation while `items` points into it
        state.items.clear();
        for (std::size_t i = 0; i < count; ++i) {
            auto& p = *state.params[i];
            const bool first = options_.momentum != 0 && buffers[i].numel() != p.numel();
            state.items.push_back({&p.value, &p.grad, &buffers[i], first});
        }
        if (options_.momentum != 0) place_buffers(ctx, state);
        // Frozen parameters keep their values and momentum (PyTorch skips a parameter without a
        // gradient); the rest is one call still.
        if (std::any_of(state.params.begin(), state.params.end(), [](const Parameter<B>* p) { return p->frozen; })) {
            std::size_t kept = 0;
            for (std::size_t i = 0; i < count; ++i)
                if (!state.params[i]->frozen) state.items[kept++] = state.items[i];
            state.items.resize(kept);
        }
        K::sgd_step_many(ctx.exec, state.items, u);
    }

    //! What a captured update of replica `rank` holds (Note [captured steps] in
    //! parallel/step.hpp): the hyper-parameters' bits, whether each momentum buffer exists (a
    //! first step differs) and where it lies. Equal keys: a graph captured at an earlier step does
    //! this step's update. (Called before step(), on the replica's thread.)
    template <class M>
    std::vector<std::int64_t> graph_key(int rank, const M& module) const {
        const auto bits = [](double v) { return std::bit_cast<std::int64_t>(v); };
        std::vector<std::int64_t> key{bits(options_.lr), bits(options_.momentum), bits(options_.dampening),
                                      bits(options_.weight_decay), options_.nesterov ? 1 : 0};
        for_each_parameter(module, [&](const std::string&, const Parameter<B>& p) { key.push_back(p.frozen ? 1 : 0); });
        if (options_.momentum == 0) return key;
        const auto* state =
            rank >= 0 && rank < static_cast<int>(states_.size()) ? &states_[static_cast<std::size_t>(rank)] : nullptr;
        std::size_t i = 0;
        for_each_parameter(module, [&](const std::string&, const Parameter<B>& p) {
            const bool has = state != nullptr && i < state->buffers.size() && state->buffers[i].numel() == p.numel();
            const void* where = has ? state->buffers[i].data() : nullptr;  // seam: the address as an identity, never read through
            key.push_back(static_cast<std::int64_t>(reinterpret_cast<std::uintptr_t>(where)));
            ++i;
        });
        return key;
    }

    //! Calls `f(name, state, parameter)` for replica `rank`'s momentum buffer of every parameter
    //! of `module`, named "<parameter>.momentum_buffer" (see Note [optimizer protocol]).
    template <class M, class F>
    void visit_state(int rank, M& module, F&& f) {
        make_room(rank + 1);
        auto& buffers = states_[static_cast<std::size_t>(rank)].buffers;
        std::size_t i = 0;
        for_each_parameter(module, [&](const std::string& name, const Parameter<B>& p) {
            if (buffers.size() <= i) buffers.emplace_back();
            f(name + ".momentum_buffer", buffers[i++], p);
        });
    }

private:
    void make_room(int replicas) {
        if (static_cast<int>(states_.size()) < replicas) states_.resize(static_cast<std::size_t>(replicas));
    }

    struct State {
        std::vector<Tensor<float, B>> buffers;  // parameter order; empty before the first step
        std::vector<Tensor<float, B>> blocks;   // what the buffers view, by bucket (Note [momentum beside its bucket])
        BucketLayout own_layout;                // every parameter a bucket of its own, without a layout
        // The last step's parameters and entries, kept for their capacity.
        std::vector<Parameter<B>*> params;
        std::vector<kernels::SgdTensors<B>> items;
    };

    // Note [momentum beside its bucket]: gives every bucket a momentum block laid out as the
    // bucket, unless its buffers already are views of it at the bucket's offsets. Buffers are
    // views: a block some buffer may still view (a bucket not placed yet, a layout that changed)
    // is kept until every bucket is placed.
    void place_buffers(const Context<B>& ctx, State& state) {
        const BucketLayout& layout = layout_for(state);
        auto& items = state.items;
        std::vector<Tensor<float, B>> retired;
        for (std::size_t b = layout.buckets.size(); b < state.blocks.size(); ++b) retired.push_back(std::move(state.blocks[b]));
        state.blocks.resize(layout.buckets.size());
        for (std::size_t b = 0; b < layout.buckets.size(); ++b) {
            const auto& bucket = layout.buckets[b];
            auto& block = state.blocks[b];
            bool placed = block.numel() == bucket.size;
            for (std::size_t k = 0; placed && k < bucket.params.size(); ++k) {
                const auto& item = items[bucket.params[k]];
                placed = !item.first && item.momentum->views(block, bucket.offsets[k]);
            }
            if (placed) continue;
            // Zero-filled: the padding between buffers stays zero.
            Tensor<float, B> fresh(Shape{bucket.size}, MemoryFormat::nchw, items[bucket.params[0]].value->device());
            for (std::size_t k = 0; k < bucket.params.size(); ++k) {
                auto& item = items[bucket.params[k]];
                const auto& value = *item.value;
                if (!item.first)
                    K::copy(ctx.exec, fresh, bucket.offsets[k], *item.momentum, 0, value.numel());  // a buffer it had
                *item.momentum = Tensor<float, B>::view(fresh, bucket.offsets[k], value.shape(), value.format());
            }
            retired.push_back(std::move(block));
            block = std::move(fresh);
        }
    }

    // The layout handed to prepare(), checked against this step's parameters before any buffer
    // moves, or, without one, every parameter a bucket of its own.
    const BucketLayout& layout_for(State& state) {
        const auto& items = state.items;
        const std::size_t count = items.size();
        if (!layout_.empty()) {
            LOCKSTEP_CHECK_AS(UsageError, layout_.parameters() == count, "Sgd: the bucket layout handed to prepare() places ",
                              layout_.parameters(), " parameters, but the model has ", count,
                              "; prepare with the layout of the model being stepped (or none)");
            std::vector<char> seen(count, 0);
            for (const auto& bucket : layout_.buckets) {
                LOCKSTEP_CHECK_AS(UsageError, !bucket.params.empty() && bucket.offsets.size() == bucket.params.size(),
                                  "Sgd: a bucket of the layout handed to prepare() has no parameters or not one offset per "
                                  "parameter; prepare with DataParallel's layout (bucket_layout())");
                for (std::size_t k = 0; k < bucket.params.size(); ++k) {
                    const std::size_t i = bucket.params[k];
                    LOCKSTEP_CHECK_AS(UsageError, i < count && seen[i] == 0,
                                      "Sgd: the bucket layout handed to prepare() "
                                      "names parameter ",
                                      i, (i < count ? " twice" : ", which the model does not have"),
                                      "; prepare with the layout of the model being stepped");
                    seen[i] = 1;
                    LOCKSTEP_CHECK_AS(UsageError,
                                      bucket.offsets[k] >= 0 && bucket.offsets[k] + items[i].value->numel() <= bucket.size,
                                      "Sgd: parameter ", i,
                                      " does not fit its place in the bucket layout handed to prepare(); "
                                      "prepare with the layout of the model being stepped");
                }
            }
            return layout_;
        }
        auto& own = state.own_layout;
        if (own.parameters() != count) {
            own.buckets.clear();
            for (std::size_t i = 0; i < count; ++i) own.buckets.push_back({{i}, {0}, 0});
        }
        for (std::size_t i = 0; i < count; ++i) own.buckets[i].size = items[i].value->numel();
        return own;
    }

    SgdOptions options_;
    BucketLayout layout_;  // DataParallel's (Note [momentum beside its bucket]); empty outside it
    std::vector<State> states_;
};

Sgd(SgdOptions)->Sgd<Host>;

}  // namespace lockstep::nn
