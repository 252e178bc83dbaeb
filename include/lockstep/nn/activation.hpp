// SPDX-License-Identifier: MIT
//! Stateless layers: `nn::ReLU`, `nn::MaxPool2d` (NCHW) and `nn::Flatten`.
#pragma once

#include <cstdint>
#include <string>

#include "lockstep/core/error.hpp"
#include "lockstep/core/tensor.hpp"
#include "lockstep/kernels/ops.hpp"
#include "lockstep/nn/context.hpp"

namespace lockstep::nn {

//! y = max(x, 0), in place on the input it takes by value.
template <BackendTag B = Host>
class ReLU {
    using K = kernels::Ops<B>;

public:
    using backend = B;
    template <class V>
    void visit(V&&) {}

    Tensor<float, B> forward(const Context<B>& ctx, Tensor<float, B> x) {
        if (!ctx.training) {
            K::relu_forward(ctx.exec, x, nullptr);
            return x;
        }
        mask_ = Tensor<std::uint8_t, B>::empty_like(x);
        K::relu_forward(ctx.exec, x, &mask_);
        return x;
    }

    Tensor<float, B> backward(const Context<B>& ctx, const Tensor<float, B>& dy) {
        LOCKSTEP_CHECK_AS(ShapeError, dy.shape() == mask_.shape(), "ReLU: dy has shape ", dy.shape(),
                          " but the forward input had ", mask_.shape(),
                          mask_.numel() == 0 && dy.numel() != 0 ? " (no training-mode forward before backward?)" : "");
        check_device(mask_.device(), dy.device(), "ReLU: dy");
        auto dx = Tensor<float, B>::empty_like(dy);
        K::relu_backward(ctx.exec, dy, mask_, dx);
        mask_ = Tensor<std::uint8_t, B>();
        return dx;
    }

private:
    Tensor<std::uint8_t, B> mask_;
};

//! Max pooling over square windows (stride = kernel by default), NCHW input.
template <BackendTag B = Host>
class MaxPool2d {
    using K = kernels::Ops<B>;

public:
    using backend = B;
    explicit MaxPool2d(std::int64_t kernel, std::int64_t stride = 0) : k_(kernel), s_(stride > 0 ? stride : kernel) {
        LOCKSTEP_CHECK(kernel > 0, "MaxPool2d needs kernel > 0, got ", kernel);
    }
    template <class V>
    void visit(V&&) {}
    std::string describe() const { return "MaxPool2d(" + std::to_string(k_) + ")"; }

    Tensor<float, B> forward(const Context<B>& ctx, Tensor<float, B> x) {
        LOCKSTEP_CHECK_AS(ShapeError, x.rank() == 4 && x.format() == MemoryFormat::nchw, describe(),
                          ": expected an NCHW (N, C, H, W) input, got shape ", x.shape(), " ", to_string(x.format()));
        LOCKSTEP_CHECK_AS(ShapeError, x.dim(2) >= k_ && x.dim(3) >= k_, describe(), ": input ", x.shape(),
                          " is smaller than the window");
        const auto g = geometry(x.shape());
        const Shape out{g.batch, g.channels, g.out_height(), g.out_width()};
        Tensor<float, B> y(out, MemoryFormat::nchw, x.device(), uninitialized);
        Tensor<std::int32_t, B> arg(out, MemoryFormat::nchw, x.device(), uninitialized);
        K::maxpool_forward(ctx.exec, g, x, y, arg);
        if (ctx.training) {
            argmax_ = std::move(arg);
            input_shape_ = x.shape();
        }
        return y;
    }

    Tensor<float, B> backward(const Context<B>& ctx, const Tensor<float, B>& dy) {
        LOCKSTEP_CHECK_AS(ShapeError, dy.shape() == argmax_.shape() && input_shape_.rank() == 4, describe(), ": dy has shape ",
                          dy.shape(), " but the forward output had ", argmax_.shape());
        check_device(argmax_.device(), dy.device(), describe() + ": dy");
        Tensor<float, B> dx(input_shape_, MemoryFormat::nchw, dy.device(), uninitialized);
        K::maxpool_backward(ctx.exec, geometry(input_shape_), dy, argmax_, dx);
        argmax_ = Tensor<std::int32_t, B>();
        input_shape_ = Shape{};
        return dx;
    }

private:
    kernels::PoolGeometry geometry(const Shape& x) const {
        return {.batch = x[0], .channels = x[1], .height = x[2], .width = x[3], .kernel = k_, .stride = s_};
    }

    std::int64_t k_, s_;
    Tensor<std::int32_t, B> argmax_;
    Shape input_shape_{};
};

//! (N, C, H, W) -> (N, C*H*W) in C, H, W order (PyTorch's flatten of an NCHW tensor).
template <BackendTag B = Host>
class Flatten {
public:
    using backend = B;
    template <class V>
    void visit(V&&) {}

    Tensor<float, B> forward(const Context<B>&, Tensor<float, B> x) {
        LOCKSTEP_CHECK_AS(ShapeError, x.rank() >= 2, "Flatten: expected at least 2 dimensions, got shape ", x.shape());
        LOCKSTEP_CHECK_AS(ShapeError, x.format() == MemoryFormat::nchw,
                          "Flatten: flattening an NHWC tensor would give H, W, C order; convert it to NCHW first");
        input_shape_ = x.shape();
        return std::move(x).reshaped(Shape{x.dim(0), x.shape().row_numel()});
    }

    Tensor<float, B> backward(const Context<B>&, const Tensor<float, B>& dy) {
        LOCKSTEP_CHECK_AS(ShapeError, dy.numel() == input_shape_.numel(), "Flatten: dy has shape ", dy.shape(),
                          " but the forward input had ", input_shape_);
        Tensor<float, B> dx = dy;
        return std::move(dx).reshaped(input_shape_);
    }

private:
    Shape input_shape_{};
};

}  // namespace lockstep::nn
