// SPDX-License-Identifier: MIT
//! `nn::Conv2d`: 2-D convolution (NCHW or NHWC) through the backend's convolution operations.
#pragma once

#include <cstdint>
#include <string>

#include "lockstep/core/error.hpp"
#include "lockstep/core/tensor.hpp"
#include "lockstep/kernels/ops.hpp"
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
        check_input(x);
        check_device(weight.value.device(), x.device(), describe() + ": the input");
        const auto g = geometry(x.shape(), x.format());
        Tensor<float, B> y(Shape{g.batch, out_, g.out_height(), g.out_width()}, x.format(), x.device(), uninitialized);
        K::conv2d_forward(ctx.exec, g, x, weight.value, options_.bias ? &bias.value : nullptr, y, scratch_);
        if (ctx.training) saved_x_ = std::move(x);
        return y;
    }

    Tensor<float, B> backward(const Context<B>& ctx, const Tensor<float, B>& dy) {
        LOCKSTEP_CHECK_AS(UsageError, saved_x_.rank() == 4, describe(),
                          ": backward called without a training-mode forward before it");
        const auto g = geometry(saved_x_.shape(), saved_x_.format());
        const Shape out{g.batch, out_, g.out_height(), g.out_width()};
        LOCKSTEP_CHECK_AS(ShapeError, dy.shape() == out && dy.format() == saved_x_.format(), describe(), ": dy has shape ",
                          dy.shape(), " ", to_string(dy.format()), " but the forward output had ", out, " ",
                          to_string(saved_x_.format()));
        check_device(saved_x_.device(), dy.device(), describe() + ": dy");
        Tensor<float, B> dx(saved_x_.shape(), saved_x_.format(), saved_x_.device(), uninitialized);
        K::conv2d_backward(ctx.exec, g, saved_x_, dy, weight.value, weight.grad, options_.bias ? &bias.grad : nullptr, dx,
                           scratch_);
        ctx.mark_grad_ready(&weight);
        if (options_.bias) ctx.mark_grad_ready(&bias);
        saved_x_ = Tensor<float, B>();
        return dx;
    }

private:
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

    void check_input(const Tensor<float, B>& x) const {
        LOCKSTEP_CHECK_AS(ShapeError, x.rank() == 4 && x.dim(1) == in_, describe(), ": expected input (N, ", in_,
                          ", H, W), got shape ", x.shape());
        LOCKSTEP_CHECK_AS(ShapeError, x.dim(2) + 2 * options_.padding >= k_ && x.dim(3) + 2 * options_.padding >= k_, describe(),
                          ": input ", x.shape(), " is smaller than the kernel (", k_, ") plus padding");
    }

    std::int64_t in_, out_, k_;
    Conv2dOptions options_;
    Tensor<float, B> saved_x_;
    typename kernels::Ops<B>::ConvScratch scratch_;  // the backend's per-layer buffers
};

}  // namespace lockstep::nn
