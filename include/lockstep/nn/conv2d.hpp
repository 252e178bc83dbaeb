// SPDX-License-Identifier: MIT
//! `nn::Conv2d`: 2-D convolution (NCHW or NHWC) through the backend's convolution operations.
#pragma once

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

struct Conv2dOptions {
    std::int64_t stride = 1;
    std::int64_t padding = 0;
    bool bias = true;
};

//! Convolution with a square kernel. `weight` is [out, in, k, k] and `bias` [out], as PyTorch;
//! initialization is PyTorch's default. Input NCHW or NHWC; the output has the input's format.
template <BackendTag B = Host>
class Conv2d {
    using K = kernels::Ops<B>;

public:
    using backend = B;

    Conv2d(std::int64_t in_channels, std::int64_t out_channels, std::int64_t kernel, Conv2dOptions options = {},
           Generator& gen = default_generator())
        : in_(in_channels), out_(out_channels), k_(kernel), options_(options) {
        LOCKSTEP_CHECK(in_channels > 0 && out_channels > 0 && kernel > 0, "Conv2d needs positive channels and kernel, got (",
                       in_channels, ", ", out_channels, ", ", kernel, ")");
        LOCKSTEP_CHECK(options.stride > 0 && options.padding >= 0, "Conv2d needs stride > 0 and padding >= 0, got stride ",
                       options.stride, ", padding ", options.padding);
        weight = Parameter<B>(Shape{out_channels, in_channels, kernel, kernel});
        fan_in_uniform(weight.value, in_channels * kernel * kernel, gen);
        if (options.bias) {
            bias = Parameter<B>(Shape{out_channels}, weight.value.device());
            fan_in_uniform(bias.value, in_channels * kernel * kernel, gen);
        }
    }

    Parameter<B> weight;
    Parameter<B> bias;

    std::string describe() const {
        return "Conv2d(" + std::to_string(in_) + ", " + std::to_string(out_) + ", kernel_size=" + std::to_string(k_) + ")";
    }

    template <class V>
    void visit(V&& v) {
        v.parameter("weight", weight);
        if (options_.bias) v.parameter("bias", bias);
    }

    //! Output extent of one spatial dimension of `extent`.
    std::int64_t out_extent(std::int64_t extent) const { return (extent + 2 * options_.padding - k_) / options_.stride + 1; }

    Tensor<float, B> forward(const Context<B>& ctx, Tensor<float, B> x) {
        use_.enter(ctx, [&] { return describe(); });
        check_input(x.shape(), x.device());
        const auto g = geometry(x.shape(), x.format());
        Tensor<float, B> y(Shape{g.batch, out_, g.out_height(), g.out_width()}, x.format(), x.device(), uninitialized);
        K::conv2d_forward(ctx.exec, g, x, weight.value, options_.bias ? &bias.value : nullptr, y, scratch_);
        if (ctx.training) saved_x_ = Activation<B>(std::move(x));
        given_ = Precision::fp32;
        return y;
    }

    Tensor<float, B> backward(const Context<B>& ctx, const Tensor<float, B>& dy) {
        if constexpr (K::bf16_activations) {  // a bf16 forward: dx in fp32, as this protocol says
            if (!saved_x_.is_fp32()) return widened(ctx, backward(ctx, Activation<B>::view_of(dy)));
        }
        const auto g = check_dy(dy.shape(), dy.format(), dy.device());
        const auto& x = saved_x_.template get<float>();
        Tensor<float, B> dx(x.shape(), x.format(), x.device(), uninitialized);
        K::conv2d_backward(ctx.exec, g, x, dy, weight.value, weight.grad, options_.bias ? &bias.grad : nullptr, dx, scratch_);
        finish_backward(ctx);
        return dx;
    }

    //! The activation protocol where the backend has bf16 convolutions (Note [activation
    //! precision]): under Precision::bf16 y is stored in bf16 (the products on bf16 operands, the
    //! bias in fp32, rounded once; through cuDNN also rounded before the bias, Note [cuDNN
    //! convolutions]), x of either type is kept as given for backward and dx has its type; under
    //! fp32 the fp32 protocol on x widened.
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
        const auto g = geometry(x.shape(), x.format());
        Tensor<BFloat16, B> y(Shape{g.batch, out_, g.out_height(), g.out_width()}, x.format(), x.device(), uninitialized);
        const Tensor<float, B>* b = options_.bias ? &bias.value : nullptr;
        if (x.is_fp32())
            K::conv2d_forward(ctx.exec, g, x.template get<float>(), weight.value, b, y, scratch_);
        else
            K::conv2d_forward(ctx.exec, g, x.template get<BFloat16>(), weight.value, b, y, scratch_);
        if (ctx.training) saved_x_ = std::move(x);
        return Activation<B>(std::move(y));
    }

    Activation<B> backward(const Context<B>& ctx, const Activation<B>& dy) requires K::bf16_activations {
        if (saved_x_.is_fp32() && dy.is_fp32()) {  // dx in the type the forward was given
            const Precision given = given_;
            return converted(ctx, Activation<B>(backward(ctx, dy.template get<float>())), given);
        }
        const auto g = check_dy(dy.shape(), dy.format(), dy.device());
        const auto run = [&]<class X, class D>() {
            const auto& x = saved_x_.template get<X>();
            Tensor<X, B> dx(x.shape(), x.format(), x.device(), uninitialized);
            K::conv2d_backward(ctx.exec, g, x, dy.template get<D>(), weight.value, weight.grad,
                               options_.bias ? &bias.grad : nullptr, dx, scratch_);
            return Activation<B>(std::move(dx));
        };
        Activation<B> dx = with_bf16_types(saved_x_, dy, run);
        finish_backward(ctx);
        return dx;
    }

private:
    OneUse use_;  // Note [one instance, one use]
    kernels::ConvGeometry geometry(const Shape& x, MemoryFormat format) const {
        kernels::ConvGeometry g;
        g.channels_last = format == MemoryFormat::nhwc;
        g.batch = x[0];
        g.in_channels = in_;
        g.height = x[2];
        g.width = x[3];
        g.out_channels = out_;
        g.kernel = k_;
        g.stride = options_.stride;
        g.padding = options_.padding;
        return g;
    }

    void check_input(const Shape& x, const Device& device) const {
        LOCKSTEP_CHECK_AS(ShapeError, x.rank() == 4 && x[1] == in_, describe(), ": expected input (N, ", in_,
                          ", H, W), got shape ", x);
        LOCKSTEP_CHECK_AS(ShapeError, x[2] + 2 * options_.padding >= k_ && x[3] + 2 * options_.padding >= k_, describe(),
                          ": input ", x, " is smaller than the kernel (", k_, ") plus padding");
        check_device(weight.value.device(), device, describe() + ": the input");
    }

    // The forward's geometry, after checking dy against its output.
    kernels::ConvGeometry check_dy(const Shape& dy, MemoryFormat format, const Device& device) const {
        LOCKSTEP_CHECK_AS(UsageError, saved_x_.rank() == 4, describe(),
                          ": backward called without a training-mode forward before it");
        const auto g = geometry(saved_x_.shape(), saved_x_.format());
        const Shape out{g.batch, out_, g.out_height(), g.out_width()};
        LOCKSTEP_CHECK_AS(ShapeError, dy == out && format == saved_x_.format(), describe(), ": dy has shape ", dy, " ",
                          to_string(format), " but the forward output had ", out, " ", to_string(saved_x_.format()));
        check_device(saved_x_.device(), device, describe() + ": dy");
        return g;
    }

    void finish_backward(const Context<B>& ctx) {
        ctx.mark_grad_ready(&weight);
        if (options_.bias) ctx.mark_grad_ready(&bias);
        saved_x_ = Activation<B>();
    }

    std::int64_t in_, out_, k_;
    Conv2dOptions options_;
    Precision given_ = Precision::fp32;              // what the last forward was given (its input was widened under fp32)
    Activation<B> saved_x_;                          // the forward's input, in the type it was given
    typename kernels::Ops<B>::ConvScratch scratch_;  // the backend's per-layer buffers
};

}  // namespace lockstep::nn
