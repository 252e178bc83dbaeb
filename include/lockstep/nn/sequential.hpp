// SPDX-License-Identifier: MIT
//! `nn::Sequential`: layers applied in order, named "0", "1", ... as PyTorch's nn.Sequential.
#pragma once

#include <cstddef>
#include <string>
#include <tuple>
#include <utility>

#include "lockstep/nn/module.hpp"

namespace lockstep::nn {

//! A chain of modules on one backend; backward runs them in reverse.
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
        std::apply([&](auto&... layer) { ((x = layer.forward(ctx, std::move(x))), ...); }, layers_);
        return x;
    }

    Tensor<float, backend> backward(const Context<backend>& ctx, const Tensor<float, backend>& dy) {
        auto g = std::get<sizeof...(Rest)>(layers_).backward(ctx, dy);  // the last layer reads dy in place
        if constexpr (sizeof...(Rest) > 0) backward_from<sizeof...(Rest) - 1>(ctx, g);
        return g;
    }

    template <class V>
    void visit(V&& v) {
        visit_from<0>(v);
    }

private:
    template <std::size_t I>
    void backward_from(const Context<backend>& ctx, Tensor<float, backend>& g) {
        g = std::get<I>(layers_).backward(ctx, g);
        if constexpr (I > 0) backward_from<I - 1>(ctx, g);
    }
    template <std::size_t I, class V>
    void visit_from(V& v) {
        if constexpr (I <= sizeof...(Rest)) {
            v.module(std::to_string(I), std::get<I>(layers_));
            visit_from<I + 1>(v);
        }
    }

    std::tuple<First, Rest...> layers_;
};

}  // namespace lockstep::nn
