// SPDX-License-Identifier: MIT
//! `nn::Sgd`: stochastic gradient descent with momentum, PyTorch semantics, one state per replica;
//! and the `OptimizerLike` concept DataParallel checks an optimizer against.
#pragma once

#include <algorithm>
#include <concepts>
#include <cstdint>
#include <string>
#include <vector>

#include "lockstep/core/error.hpp"
#include "lockstep/core/tensor.hpp"
#include "lockstep/kernels/ops.hpp"
#include "lockstep/nn/context.hpp"
#include "lockstep/nn/module.hpp"

namespace lockstep::nn {

// Note [optimizer protocol]
// An optimizer keeps one state per replica, so replicas never share a buffer:
//   prepare(replicas)                  makes room for that many states (before a parallel region);
//   step(ctx, module)                  updates `module` with replica ctx.local_rank's state;
//   visit_state(rank, module, f)       calls f(name, Tensor<float, B>& state, const Parameter<B>& p)
//                                      for every state tensor of replica `rank`, named as in
//                                      PyTorch's optimizer state ("<parameter>.momentum_buffer");
//                                      an empty tensor is a state not created yet (PyTorch's None).
// DataParallel saves and loads optimizer state through visit_state, so a resume is exact.

namespace detail {
template <class B>
struct ArchetypeStateVisitor {
    void operator()(const std::string&, Tensor<float, B>&, const Parameter<B>&) const {}
};
}  // namespace detail

//! What DataParallel needs of an optimizer for module `M` (see Note [optimizer protocol]).
template <class O, class M>
concept OptimizerLike = requires(O& o, M& module, int rank, const Context<typename M::backend>& ctx,
                                 detail::ArchetypeStateVisitor<typename M::backend> v) {
    o.prepare(rank);
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
// [gradients in their buckets] in parallel/data_parallel.hpp). Sgd lays the momentum buffers out
// to match: for every run of parameters laid out alike in value and gradient, in visit order, it
// keeps one block holding the run's buffers at the same distances, as views of the block. The
// update of a bucket then runs over three flat arrays laid out alike: one loop for every stretch
// of parameters that lie back to back (Ops<Host>::sgd_step_many merges those), one launch per 32
// parameters on CUDA. A buffer replaced from outside (a checkpoint loaded through visit_state) is
// copied into a new block at the next step; blocks no buffer uses any more are freed. Outside
// DataParallel every parameter is a run of its own. The arithmetic per element is the same
// either way, so the layout changes no bit.

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
    void prepare(int replicas) {
        if (static_cast<int>(states_.size()) < replicas) states_.resize(static_cast<std::size_t>(replicas));
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
        K::sgd_step_many(ctx.exec, state.items, u);
    }

    //! Calls `f(name, state, parameter)` for replica `rank`'s momentum buffer of every parameter
    //! of `module`, named "<parameter>.momentum_buffer" (see Note [optimizer protocol]).
    template <class M, class F>
    void visit_state(int rank, M& module, F&& f) {
        prepare(rank + 1);
        auto& buffers = states_[static_cast<std::size_t>(rank)].buffers;
        std::size_t i = 0;
        for_each_parameter(module, [&](const std::string& name, const Parameter<B>& p) {
            if (buffers.size() <= i) buffers.emplace_back();
            f(name + ".momentum_buffer", buffers[i++], p);
        });
    }

private:
    struct State {
        std::vector<Tensor<float, B>> buffers;  // parameter order; empty before the first step
        std::vector<Tensor<float, B>> blocks;   // what the buffers view (Note [momentum beside its bucket])
        // The last step's parameters and entries, kept for their capacity.
        std::vector<Parameter<B>*> params;
        std::vector<kernels::SgdTensors<B>> items;
    };

    // Note [momentum beside its bucket]: gives every run of parameters laid out alike in value
    // and gradient (each next one at the same distance from the one before in both, past its end
    // by at most 64 bytes of padding) a momentum block laid out alike, unless its buffers
    // already are.
    void place_buffers(const Context<B>& ctx, State& state) {
        auto& items = state.items;
        bool changed = false;
        for (std::size_t lo = 0; lo < items.size();) {
            std::size_t hi = lo + 1;
            while (hi < items.size()) {
                const auto d = items[hi].value->offset_from(*items[hi - 1].value);
                const std::int64_t end = items[hi - 1].value->numel();
                if (!d || *d < end || *d > end + 16 || items[hi].grad->offset_from(*items[hi - 1].grad) != d) break;
                ++hi;
            }
            bool placed = true;
            for (std::size_t k = lo; placed && k < hi; ++k)
                placed = !items[k].first && items[k].momentum->is_view() &&
                         (k == lo || items[k].momentum->offset_from(*items[k - 1].momentum) ==
                                         items[k].value->offset_from(*items[k - 1].value));
            if (!placed) {
                const auto& first = *items[lo].value;
                const auto& last = *items[hi - 1].value;
                // Zero-filled: the padding between buffers stays zero.
                const std::int64_t size = (hi - 1 == lo ? 0 : *last.offset_from(first)) + last.numel();
                Tensor<float, B> block(Shape{size}, MemoryFormat::nchw, first.device());
                for (std::size_t k = lo; k < hi; ++k) {
                    auto& buf = *items[k].momentum;
                    const auto& value = *items[k].value;
                    const std::int64_t offset = lo == k ? 0 : *value.offset_from(first);
                    if (!items[k].first) K::copy(ctx.exec, block, offset, buf, 0, value.numel());  // a buffer it had
                    buf = Tensor<float, B>::view(block, offset, value.shape(), value.format());
                }
                state.blocks.push_back(std::move(block));
                changed = true;
            }
            lo = hi;
        }
        if (!changed) return;
        std::erase_if(state.blocks, [&](const Tensor<float, B>& block) {
            return std::none_of(state.buffers.begin(), state.buffers.end(), [&](const Tensor<float, B>& buf) {
                return buf.views(block);
            });
        });
    }
    SgdOptions options_;
    std::vector<State> states_;
};

Sgd(SgdOptions) -> Sgd<Host>;

}  // namespace lockstep::nn
