// SPDX-License-Identifier: MIT
//! `nn::Sgd`: stochastic gradient descent with momentum, PyTorch semantics, one state per replica;
//! and the `OptimizerLike` concept DataParallel checks an optimizer against.
#pragma once

#include <concepts>
#include <cstdint>
#include <string>
#include <vector>

#include "lockstep/core/error.hpp"
#include "lockstep/core/tensor.hpp"
#include "lockstep/kernels/host_ops.hpp"
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
        // Every parameter's update in one call: on CUDA one launch for many tensors.
        std::size_t count = 0;
        for_each_parameter(module, [&](const std::string&, Parameter<B>&) { ++count; });
        if (buffers.size() < count) buffers.resize(count);  // no reallocation while `items` points into it
        state.items.clear();
        std::size_t i = 0;
        for_each_parameter(module, [&](const std::string&, Parameter<B>& p) {
            auto& buf = buffers[i++];
            const bool first = options_.momentum != 0 && buf.numel() != p.numel();
            if (first) buf = Tensor<float, B>::empty_like(p.value);
            state.items.push_back({&p.value, &p.grad, &buf, first});
        });
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
        std::vector<kernels::SgdTensors<B>> items;  // the last step's entries, kept for their capacity
    };
    SgdOptions options_;
    std::vector<State> states_;
};

Sgd(SgdOptions) -> Sgd<Host>;

}  // namespace lockstep::nn
