// SPDX-License-Identifier: MIT
//! Activations between precisions: what a layer outputs, conversions, and the adapters through
//! which nn::Sequential runs children with and without the activation protocol.
#pragma once

#include <utility>
#include <vector>

#include "lockstep/core/activation.hpp"
#include "lockstep/core/backend.hpp"
#include "lockstep/core/bfloat16.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/tensor.hpp"
#include "lockstep/kernels/ops.hpp"
#include "lockstep/nn/context.hpp"
#include "lockstep/nn/module.hpp"

namespace lockstep::nn {

//! What the replica's layers that make new activations (convolutions, linear layers) store them
//! in: the context's Precision where the backend has one (CUDA), fp32 elsewhere.
template <BackendTag B>
Precision activation_precision(const Context<B>& ctx) noexcept {
    if constexpr (requires { ctx.exec.precision; })
        return ctx.exec.precision;
    else
        return Precision::fp32;
}

namespace detail {

// `a` in the other precision `to`, a new tensor on the replica's stream.
template <BackendTag B>
Activation<B> convert(const Context<B>& ctx, const Activation<B>& a, Precision to) {
    using K = kernels::Ops<B>;
    if (to == Precision::bf16) {
        const auto& src = a.template get<float>();
        Tensor<BFloat16, B> out(src.shape(), src.format(), src.device(), uninitialized);
        K::to_bf16(ctx.exec, src, out);
        return Activation<B>(std::move(out));
    }
    const auto& src = a.template get<BFloat16>();
    Tensor<float, B> out(src.shape(), src.format(), src.device(), uninitialized);
    K::from_bf16(ctx.exec, src, out);
    return Activation<B>(std::move(out));
}

}  // namespace detail

//! `a` in `to`: moved where it already is, else converted on the replica's stream (rounding to
//! nearest, ties to even, into bf16; exactly into fp32).
template <BackendTag B>
Activation<B> converted(const Context<B>& ctx, Activation<B>&& a, Precision to) {
    if (a.precision() == to) return std::move(a);
    return detail::convert(ctx, a, to);
}

//! `a` in `to`, a new tensor (a copy where `a` already is in `to`).
template <BackendTag B>
Activation<B> converted(const Context<B>& ctx, const Activation<B>& a, Precision to) {
    if (a.precision() == to) return a;
    return detail::convert(ctx, a, to);
}

//! `a` as fp32 (exact).
template <BackendTag B>
Tensor<float, B> widened(const Context<B>& ctx, Activation<B>&& a) {
    return converted(ctx, std::move(a), Precision::fp32).template take<float>();
}

//! `m.forward` on `x`: through the activation protocol where `m` offers it; otherwise on `x`
//! widened, the fp32 output as it is (Note [activation precision]).
template <class M>
Activation<typename M::backend> forward_any(M& m, const Context<typename M::backend>& ctx, Activation<typename M::backend> x) {
    using B = typename M::backend;
    if constexpr (HasActivationPath<M>)
        return m.forward(ctx, std::move(x));
    else
        return Activation<B>(m.forward(ctx, widened(ctx, std::move(x))));
}

//! `m.backward` on `dy`, giving dx in `input`, the type `m`'s forward was given: through the
//! activation protocol where `m` offers it, else the fp32 protocol on dy widened.
template <class M>
Activation<typename M::backend> backward_any(M& m, const Context<typename M::backend>& ctx,
                                             const Activation<typename M::backend>& dy, Precision input) {
    using B = typename M::backend;
    if constexpr (HasActivationPath<M>) {
        return converted(ctx, m.backward(ctx, dy), input);
    } else {
        if (dy.is_fp32()) return converted(ctx, Activation<B>(m.backward(ctx, dy.template get<float>())), input);
        const Tensor<float, B> wide = converted(ctx, dy, Precision::fp32).template take<float>();
        return converted(ctx, Activation<B>(m.backward(ctx, wide)), input);
    }
}

//! `f.template operator()<X, D>()` with X and D the element types (float or BFloat16) that a
//! layer's saved input `x` and its `dy` hold, one of them bf16: a bf16 backward's dispatch.
template <BackendTag B, class F>
Activation<B> with_bf16_types(const Activation<B>& x, const Activation<B>& dy, F&& f) {
    LOCKSTEP_CHECK_AS(UsageError, !(x.is_fp32() && dy.is_fp32()), "with_bf16_types: x and dy are both fp32; ",
                      "take the fp32 protocol for them");
    if (x.is_fp32()) return f.template operator()<float, BFloat16>();
    if (dy.is_fp32()) return f.template operator()<BFloat16, float>();
    return f.template operator()<BFloat16, BFloat16>();
}

//! The precisions a hand-written chain of layers passed activations in, so that its backward keeps
//! Note [activation precision]'s rules as nn::Sequential does: `forward(m, ctx, x)` runs m on x
//! (through forward_any) and records what m was given and gave; `backward(m, ctx, dy)`, called in
//! the reverse order, takes dy in what m gave (converting it if needed) and returns dx in what m
//! was given. A module holds one and calls `clear()` at the start of each forward.
template <BackendTag B>
class ActivationTrail {
public:
    void clear() noexcept { steps_.clear(); }

    template <class M>
    Activation<B> forward(M& m, const Context<B>& ctx, Activation<B> x) {
        const Precision given = x.precision();
        auto y = forward_any(m, ctx, std::move(x));
        steps_.push_back({given, y.precision()});
        return y;
    }

    template <class M>
    Activation<B> backward(M& m, const Context<B>& ctx, const Activation<B>& dy) {
        LOCKSTEP_CHECK_AS(UsageError, !steps_.empty(), "a layer's backward has no forward recorded in its ActivationTrail: ",
                          "call backward once per forward, in the reverse order");
        const Step s = steps_.back();
        steps_.pop_back();
        if (dy.precision() != s.gave) return backward_any(m, ctx, converted(ctx, dy, s.gave), s.given);
        return backward_any(m, ctx, dy, s.given);
    }

private:
    struct Step {
        Precision given, gave;
    };
    std::vector<Step> steps_;
};

}  // namespace lockstep::nn
