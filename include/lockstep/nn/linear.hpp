// SPDX-License-Identifier: MIT
//! `nn::Linear`: y = x W^T + b through the backend's GEMM.
#pragma once

#include <concepts>
#include <cstdint>
#include <string>

#include "lockstep/core/error.hpp"
#include "lockstep/core/tensor.hpp"
#include "lockstep/kernels/ops.hpp"
#include "lockstep/nn/context.hpp"
#include "lockstep/nn/init.hpp"
#include "lockstep/nn/parameter.hpp"

namespace lockstep::nn {

struct LinearOptions {
    bool bias = true;
    //! Apply ReLU to the output in the same pass as the bias (backward masks dy by the output's sign).
    bool fused_relu = false;
};

//! Fully connected layer on (N, in) input. `weight` is [out, in] and `bias` [out], as PyTorch;
//! initialization is PyTorch's default.
template <BackendTag B = Host>
class Linear {
    using K = kernels::Ops<B>;

public:
    using backend = B;

    //! With a bias (PyTorch's default).
    Linear(std::int64_t in_features, std::int64_t out_features, Generator& gen = default_generator())
        : Linear(in_features, out_features, LinearOptions{}, gen) {}

    //! `with_bias` must be a bool: `Linear(a, b, {}, gen)` takes the options overload below (a bool
    //! parameter would take `{}` as false and drop the bias).
    template <std::same_as<bool> Bool>
    Linear(std::int64_t in_features, std::int64_t out_features, Bool with_bias, Generator& gen = default_generator())
        : Linear(in_features, out_features, LinearOptions{.bias = with_bias}, gen) {}

    Linear(std::int64_t in_features, std::int64_t out_features, LinearOptions options, Generator& gen = default_generator())
        : in_(in_features), out_(out_features), has_bias_(options.bias), relu_(options.fused_relu) {
        const bool with_bias = options.bias;
        LOCKSTEP_CHECK(in_features > 0 && out_features > 0, "Linear needs positive sizes, got (", in_features, ", ", out_features,
                       ")");
        weight = Parameter<B>(Shape{out_features, in_features});
        fan_in_uniform(weight.value, in_features, gen);
        if (with_bias) {
            bias = Parameter<B>(Shape{out_features}, weight.value.device());
            fan_in_uniform(bias.value, in_features, gen);
        }
    }

    Parameter<B> weight;
    Parameter<B> bias;

    std::string describe() const {
        return "Linear(" + std::to_string(in_) + ", " + std::to_string(out_) + (relu_ ? ", fused_relu" : "") + ")";
    }

    template <class V>
    void visit(V&& v) {
        v.parameter("weight", weight);
        if (has_bias_) v.parameter("bias", bias);
    }

    Tensor<float, B> forward(const Context<B>& ctx, Tensor<float, B> x) {
        LOCKSTEP_CHECK_AS(ShapeError, x.rank() == 2 && x.dim(1) == in_, describe(), ": expected input (N, ", in_, "), got shape ",
                          x.shape(), x.rank() == 4 ? "; put a Flatten before it" : "");
        check_device(weight.value.device(), x.device(), describe() + ": the input");
        Tensor<float, B> y(Shape{x.dim(0), out_}, MemoryFormat::nchw, x.device(), uninitialized);
        if (relu_ && ctx.training) relu_mask_ = Tensor<std::uint8_t, B>::empty_like(y);
        K::linear_forward(ctx.exec, x, weight.value, has_bias_ ? &bias.value : nullptr, y, relu_,
                          relu_ && ctx.training ? &relu_mask_ : nullptr);
        if (ctx.training) saved_x_ = std::move(x);
        return y;
    }

    Tensor<float, B> backward(const Context<B>& ctx, const Tensor<float, B>& dy) {
        LOCKSTEP_CHECK_AS(UsageError, saved_x_.rank() == 2, describe(),
                          ": backward called without a training-mode forward before it");
        const std::int64_t N = saved_x_.dim(0);
        LOCKSTEP_CHECK_AS(ShapeError, dy.shape() == (Shape{N, out_}), describe(), ": dy has shape ", dy.shape(),
                          " but the forward output had ", Shape{N, out_});
        check_device(saved_x_.device(), dy.device(), describe() + ": dy");
        Tensor<float, B> dx(Shape{N, in_}, MemoryFormat::nchw, dy.device(), uninitialized);
        K::linear_backward(ctx.exec, saved_x_, dy, relu_ ? &relu_mask_ : nullptr, weight.value, weight.grad,
                           has_bias_ ? &bias.grad : nullptr, dx);
        ctx.mark_grad_ready(&weight);
        if (has_bias_) ctx.mark_grad_ready(&bias);
        saved_x_ = Tensor<float, B>();
        relu_mask_ = Tensor<std::uint8_t, B>();
        return dx;
    }

private:
    std::int64_t in_, out_;
    bool has_bias_;
    bool relu_;
    Tensor<float, B> saved_x_;
    Tensor<std::uint8_t, B> relu_mask_;  // with fused_relu: where the output was positive
};

}  // namespace lockstep::nn
