// SPDX-License-Identifier: MIT
//! `nn::Sequential`: layers applied in order, named "0", "1", ... as PyTorch's nn.Sequential.
#pragma once

#include <array>
#include <cstddef>
#include <string>
#include <tuple>
#include <utility>

#include "lockstep/nn/activation_precision.hpp"
#include "lockstep/nn/module.hpp"

namespace lockstep::nn {

//! A chain of modules on one backend; backward runs them in reverse. Activations pass between the
//! children in the precision each gives (Note [activation precision]): a child with the
//! activation protocol gets them as they are, any other widened to fp32. The fp32 protocol's
//! output and dx are fp32.
template <class First, class... Rest>
class Sequential {
public:
    using backend = typename First::backend;

    explicit Sequential(First first, Rest... rest) : layers_(std::move(first), std::move(rest)...) {}

    template <std::size_t I>
    auto& get() noexcept {
        return std::get<I>(layers_);
    }
    template <std::size_t I>
    const auto& get() const noexcept {
        return std::get<I>(layers_);
    }

    Tensor<float, backend> forward(const Context<backend>& ctx, Tensor<float, backend> x) {
        return widened(ctx, forward(ctx, Activation<backend>(std::move(x))));
    }

    Tensor<float, backend> backward(const Context<backend>& ctx, const Tensor<float, backend>& dy) {
        // The last layer reads dy in place, through a view.
        return widened(ctx, backward(ctx, Activation<backend>::view_of(dy)));
    }

    //! Each child on the previous one's output, in the precision it gave; what each child was
    //! given is kept for backward.
    Activation<backend> forward(const Context<backend>& ctx, Activation<backend> x) {
        std::size_t i = 0;
        std::apply([&](auto&... layer) { ((given_[i++] = x.precision(), x = forward_any(layer, ctx, std::move(x))), ...); },
                   layers_);
        output_ = x.precision();
        return x;
    }

    //! dy taken in the precision of the last forward's output, each child's dx in the precision
    //! that child was given; dx in the precision of the forward's input.
    Activation<backend> backward(const Context<backend>& ctx, const Activation<backend>& dy) {
        if (dy.precision() != output_) return backward_all(ctx, converted(ctx, dy, output_));
        return backward_all(ctx, dy);
    }

    template <class V>
    void visit(V&& v) {
        visit_from<0>(v);
    }

private:
    static constexpr std::size_t count = 1 + sizeof...(Rest);

    Activation<backend> backward_all(const Context<backend>& ctx, const Activation<backend>& dy) {
        auto g = backward_any(std::get<count - 1>(layers_), ctx, dy, given_[count - 1]);
        if constexpr (count > 1) backward_from<count - 2>(ctx, g);
        return g;
    }
    template <std::size_t I>
    void backward_from(const Context<backend>& ctx, Activation<backend>& g) {
        g = backward_any(std::get<I>(layers_), ctx, g, given_[I]);
        if constexpr (I > 0) backward_from<I - 1>(ctx, g);
    }
    template <std::size_t I, class V>
    void visit_from(V& v) {
        if constexpr (I < count) {
            v.module(std::to_string(I), std::get<I>(layers_));
            visit_from<I + 1>(v);
        }
    }

    std::tuple<First, Rest...> layers_;
    // The precision each child was given in the last forward, and the last child's output's.
    std::array<Precision, count> given_{};
    Precision output_ = Precision::fp32;
};

}  // namespace lockstep::nn
