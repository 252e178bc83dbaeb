// SPDX-License-Identifier: MIT
//! Stateless layers: `nn::ReLU`, `nn::MaxPool2d` (NCHW) and `nn::Flatten`.
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

namespace lockstep::nn {

//! y = max(x, 0), in place on the input it takes by value.
template <BackendTag B = Host>
class ReLU {
    using K = kernels::Ops<B>;

public:
    using backend = B;
    template <class V>
    void visit(V&&) {}

    Tensor<float, B> forward(const Context<B>& ctx, Tensor<float, B> x) { return run_forward(ctx, std::move(x)); }

    Tensor<float, B> backward(const Context<B>& ctx, const Tensor<float, B>& dy) { return run_backward(ctx, dy); }

    //! The activation protocol where the backend has bf16 activation kernels (Note [activation
    //! precision]): y and dx in the type of x and dy, exact (a selection needs no rounding).
    Activation<B> forward(const Context<B>& ctx, Activation<B> x) requires K::bf16_activations {
        const Precision given = x.precision();
        auto y = x.visit([&](auto& t) { return Activation<B>(run_forward(ctx, std::move(t))); });
        gave_ = given;  // after run_forward's OneUse check (Note [one instance, one use])
        return y;
    }
    Activation<B> backward(const Context<B>& ctx, const Activation<B>& dy) requires K::bf16_activations {
        if (dy.precision() != gave_) return backward(ctx, converted(ctx, dy, gave_));  // dy in y's type
        return dy.visit([&](const auto& t) { return Activation<B>(run_backward(ctx, t)); });
    }

private:
    OneUse use_;  // Note [one instance, one use]
    template <class T>
    Tensor<T, B> run_forward(const Context<B>& ctx, Tensor<T, B> x) {
        use_.enter(ctx, [] { return std::string("ReLU"); });
        if (!ctx.training) {
            K::relu_forward(ctx.exec, x, nullptr);
            return x;
        }
        mask_ = Tensor<std::uint8_t, B>::empty_like(x);
        K::relu_forward(ctx.exec, x, &mask_);
        return x;
    }

    template <class T>
    Tensor<T, B> run_backward(const Context<B>& ctx, const Tensor<T, B>& dy) {
        LOCKSTEP_CHECK_AS(ShapeError, dy.shape() == mask_.shape(), "ReLU: dy has shape ", dy.shape(),
                          " but the forward input had ", mask_.shape(),
                          mask_.numel() == 0 && dy.numel() != 0 ? " (no training-mode forward before backward?)" : "");
        check_device(mask_.device(), dy.device(), "ReLU: dy");
        auto dx = Tensor<T, B>::empty_like(dy);
        K::relu_backward(ctx.exec, dy, mask_, dx);
        mask_ = Tensor<std::uint8_t, B>();
        return dx;
    }

    Tensor<std::uint8_t, B> mask_;
    Precision gave_ = Precision::fp32;  // the type of the last forward's output
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

    Tensor<float, B> forward(const Context<B>& ctx, Tensor<float, B> x) { return run_forward(ctx, x); }

    Tensor<float, B> backward(const Context<B>& ctx, const Tensor<float, B>& dy) { return run_backward(ctx, dy); }

    //! The activation protocol where the backend has bf16 pooling kernels (Note [activation
    //! precision]): y and dx in the type of x and dy; y exact, dx summed in fp32, rounded once.
    Activation<B> forward(const Context<B>& ctx, Activation<B> x) requires K::bf16_activations {
        const Precision given = x.precision();
        auto y = x.visit([&](const auto& t) { return Activation<B>(run_forward(ctx, t)); });
        gave_ = given;  // after run_forward's OneUse check (Note [one instance, one use])
        return y;
    }
    Activation<B> backward(const Context<B>& ctx, const Activation<B>& dy) requires K::bf16_activations {
        if (dy.precision() != gave_) return backward(ctx, converted(ctx, dy, gave_));  // dy in y's type
        return dy.visit([&](const auto& t) { return Activation<B>(run_backward(ctx, t)); });
    }

private:
    OneUse use_;  // Note [one instance, one use]
    template <class T>
    Tensor<T, B> run_forward(const Context<B>& ctx, const Tensor<T, B>& x) {
        use_.enter(ctx, [&] { return describe(); });
        LOCKSTEP_CHECK_AS(ShapeError, x.rank() == 4 && x.format() == MemoryFormat::nchw, describe(),
                          ": expected an NCHW (N, C, H, W) input, got shape ", x.shape(), " ", to_string(x.format()));
        LOCKSTEP_CHECK_AS(ShapeError, x.dim(2) >= k_ && x.dim(3) >= k_, describe(), ": input ", x.shape(),
                          " is smaller than the window");
        const auto g = geometry(x.shape());
        const Shape out{g.batch, g.channels, g.out_height(), g.out_width()};
        Tensor<T, B> y(out, MemoryFormat::nchw, x.device(), uninitialized);
        Tensor<std::int32_t, B> arg(out, MemoryFormat::nchw, x.device(), uninitialized);
        K::maxpool_forward(ctx.exec, g, x, y, arg);
        if (ctx.training) {
            argmax_ = std::move(arg);
            input_shape_ = x.shape();
        }
        return y;
    }

    template <class T>
    Tensor<T, B> run_backward(const Context<B>& ctx, const Tensor<T, B>& dy) {
        LOCKSTEP_CHECK_AS(ShapeError, dy.shape() == argmax_.shape() && input_shape_.rank() == 4, describe(), ": dy has shape ",
                          dy.shape(), " but the forward output had ", argmax_.shape());
        check_device(argmax_.device(), dy.device(), describe() + ": dy");
        Tensor<T, B> dx(input_shape_, MemoryFormat::nchw, dy.device(), uninitialized);
        K::maxpool_backward(ctx.exec, geometry(input_shape_), dy, argmax_, dx);
        argmax_ = Tensor<std::int32_t, B>();
        input_shape_ = Shape{};
        return dx;
    }

    kernels::PoolGeometry geometry(const Shape& x) const {
        return {.batch = x[0], .channels = x[1], .height = x[2], .width = x[3], .kernel = k_, .stride = s_};
    }

    std::int64_t k_, s_;
    Tensor<std::int32_t, B> argmax_;
    Shape input_shape_{};
    Precision gave_ = Precision::fp32;  // the type of the last forward's output
};

//! (N, C, H, W) -> (N, C*H*W) in C, H, W order (PyTorch's flatten of an NCHW tensor).
template <BackendTag B = Host>
class Flatten {
public:
    using backend = B;
    template <class V>
    void visit(V&&) {}

    Tensor<float, B> forward(const Context<B>& ctx, Tensor<float, B> x) {
        use_.enter(ctx, [] { return std::string("Flatten"); });
        check_input(x.shape(), x.format());
        input_shape_ = x.shape();
        return std::move(x).reshaped(Shape{x.dim(0), x.shape().row_numel()});
    }

    Tensor<float, B> backward(const Context<B>&, const Tensor<float, B>& dy) {
        check_dy(dy.shape());
        Tensor<float, B> dx = dy;
        return std::move(dx).reshaped(input_shape_);
    }

    //! The activation protocol, on every backend: the type is kept, the storage reshaped.
    Activation<B> forward(const Context<B>& ctx, Activation<B> x) {
        use_.enter(ctx, [] { return std::string("Flatten"); });
        check_input(x.shape(), x.format());
        input_shape_ = x.shape();
        gave_ = x.precision();
        const Shape out{x.dim(0), x.shape().row_numel()};
        return std::move(x).reshaped(out);
    }

    Activation<B> backward(const Context<B>& ctx, const Activation<B>& dy) {
        check_dy(dy.shape());
        Activation<B> dx = converted(ctx, dy, gave_);  // a copy, in the type the forward gave
        return std::move(dx).reshaped(input_shape_);
    }

private:
    OneUse use_;  // Note [one instance, one use]
    static void check_input(const Shape& x, MemoryFormat format) {
        LOCKSTEP_CHECK_AS(ShapeError, x.rank() >= 2, "Flatten: expected at least 2 dimensions, got shape ", x);
        LOCKSTEP_CHECK_AS(ShapeError, format == MemoryFormat::nchw,
                          "Flatten: flattening an NHWC tensor would give H, W, C order; convert it to NCHW first");
    }
    void check_dy(const Shape& dy) const {
        LOCKSTEP_CHECK_AS(ShapeError, dy.numel() == input_shape_.numel(), "Flatten: dy has shape ", dy,
                          " but the forward input had ", input_shape_);
    }

    Shape input_shape_{};
    Precision gave_ = Precision::fp32;  // the type of the last forward's output
};

}  // namespace lockstep::nn
