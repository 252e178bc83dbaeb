// SPDX-License-Identifier: MIT
//! `nn::Linear`: y = x W^T + b through the backend's GEMM.
#pragma once

#include <concepts>
#include <cstdint>
#include <string>

#include "lockstep/core/activation.hpp"
#include "lockstep/core/bfloat16.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/tensor.hpp"
#include "lockstep/kernels/ops.hpp"
#include "lockstep/nn/activation_precision.hpp"
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
        use_.enter(ctx, [&] { return describe(); });
        check_input(x.shape(), x.device());
        Tensor<float, B> y(Shape{x.dim(0), out_}, MemoryFormat::nchw, x.device(), uninitialized);
        if (relu_ && ctx.training) relu_mask_ = Tensor<std::uint8_t, B>::empty_like(y);
        K::linear_forward(ctx.exec, x, weight.value, has_bias_ ? &bias.value : nullptr, y, relu_,
                          relu_ && ctx.training ? &relu_mask_ : nullptr);
        if (ctx.training) saved_x_ = Activation<B>(std::move(x));
        given_ = Precision::fp32;
        return y;
    }

    Tensor<float, B> backward(const Context<B>& ctx, const Tensor<float, B>& dy) {
        if constexpr (K::bf16_activations) {  // a bf16 forward: dx in fp32, as this protocol says
            if (!saved_x_.is_fp32()) return widened(ctx, backward(ctx, Activation<B>::view_of(dy)));
        }
        const std::int64_t N = check_dy(dy.shape(), dy.device());
        Tensor<float, B> dx(Shape{N, in_}, MemoryFormat::nchw, dy.device(), uninitialized);
        K::linear_backward(ctx.exec, saved_x_.template get<float>(), dy, relu_ ? &relu_mask_ : nullptr, weight.value, weight.grad,
                           has_bias_ ? &bias.grad : nullptr, dx);
        finish_backward(ctx);
        return dx;
    }

    //! The activation protocol where the backend has bf16 linear layers (Note [activation
    //! precision]): under Precision::bf16 y is stored in bf16 (the products on bf16 operands, the
    //! bias and ReLU in fp32, one rounding), x of either type is kept as given for backward and dx
    //! has its type; under fp32 the fp32 protocol on x widened.
    Activation<B> forward(const Context<B>& ctx, Activation<B> x) requires K::bf16_activations {
        if (activation_precision(ctx) == Precision::fp32) {
            const Precision given = x.precision();
            auto y = Activation<B>(forward(ctx, widened(ctx, std::move(x))));
            given_ = given;
            return y;
        }
        use_.enter(ctx, [&] { return describe(); });
        given_ = x.precision();
        check_input(x.shape(), x.device());
        Tensor<BFloat16, B> y(Shape{x.dim(0), out_}, MemoryFormat::nchw, x.device(), uninitialized);
        if (relu_ && ctx.training) relu_mask_ = Tensor<std::uint8_t, B>::empty_like(y);
        Tensor<std::uint8_t, B>* mask = relu_ && ctx.training ? &relu_mask_ : nullptr;
        const Tensor<float, B>* b = has_bias_ ? &bias.value : nullptr;
        if (x.is_fp32())
            K::linear_forward(ctx.exec, x.template get<float>(), weight.value, b, y, relu_, mask);
        else
            K::linear_forward(ctx.exec, x.template get<BFloat16>(), weight.value, b, y, relu_, mask);
        if (ctx.training) saved_x_ = std::move(x);
        return Activation<B>(std::move(y));
    }

    Activation<B> backward(const Context<B>& ctx, const Activation<B>& dy) requires K::bf16_activations {
        if (saved_x_.is_fp32() && dy.is_fp32()) {  // dx in the type the forward was given
            const Precision given = given_;
            return converted(ctx, Activation<B>(backward(ctx, dy.template get<float>())), given);
        }
        const std::int64_t N = check_dy(dy.shape(), dy.device());
        const auto run = [&]<class X, class D>() {
            Tensor<X, B> dx(Shape{N, in_}, MemoryFormat::nchw, dy.device(), uninitialized);
            K::linear_backward(ctx.exec, saved_x_.template get<X>(), dy.template get<D>(), relu_ ? &relu_mask_ : nullptr,
                               weight.value, weight.grad, has_bias_ ? &bias.grad : nullptr, dx);
            return Activation<B>(std::move(dx));
        };
        Activation<B> dx = with_bf16_types(saved_x_, dy, run);
        finish_backward(ctx);
        return dx;
    }

private:
    OneUse use_;  // Note [one instance, one use]
    void check_input(const Shape& x, const Device& device) const {
        LOCKSTEP_CHECK_AS(ShapeError, x.rank() == 2 && x[1] == in_, describe(), ": expected input (N, ", in_, "), got shape ", x,
                          x.rank() == 4 ? "; put a Flatten before it" : "");
        check_device(weight.value.device(), device, describe() + ": the input");
    }

    // The batch of the saved input, after checking dy against the forward's output.
    std::int64_t check_dy(const Shape& dy, const Device& device) const {
        LOCKSTEP_CHECK_AS(UsageError, saved_x_.rank() == 2, describe(),
                          ": backward called without a training-mode forward before it");
        const std::int64_t N = saved_x_.dim(0);
        LOCKSTEP_CHECK_AS(ShapeError, dy == (Shape{N, out_}), describe(), ": dy has shape ", dy, " but the forward output had ",
                          Shape{N, out_});
        check_device(saved_x_.device(), device, describe() + ": dy");
        return N;
    }

    void finish_backward(const Context<B>& ctx) {
        ctx.mark_grad_ready(&weight);
        if (has_bias_) ctx.mark_grad_ready(&bias);
        saved_x_ = Activation<B>();
        relu_mask_ = Tensor<std::uint8_t, B>();
    }

    std::int64_t in_, out_;
    bool has_bias_;
    bool relu_;
    Precision given_ = Precision::fp32;  // what the last forward was given (its input was widened under fp32)
    Activation<B> saved_x_;              // the forward's input, in the type it was given
    Tensor<std::uint8_t, B> relu_mask_;  // with fused_relu: where the output was positive
};

}  // namespace lockstep::nn
