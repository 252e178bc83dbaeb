// SPDX-License-Identifier: MIT
//! Stateless layers: `nn::ReLU`, `nn::MaxPool2d` (NCHW) and `nn::Flatten`.
#pragma once

#include <cstdint>
#include <limits>
#include <string>

#include "lockstep/core/error.hpp"
#include "lockstep/core/tensor.hpp"
#include "lockstep/nn/context.hpp"

namespace lockstep::nn {

//! y = max(x, 0), in place on the input it takes by value.
template <BackendTag B = Host>
class ReLU {
public:
    using backend = B;
    template <class V>
    void visit(V&&) {}

    Tensor<float, B> forward(const Context& ctx, Tensor<float, B> x) {
        float* p = x.data();
        const std::int64_t n = x.numel();
        const auto relu = [](float v) { return v > 0.0f ? v : (v == v ? 0.0f : v); };  // NaN stays NaN
        if (!ctx.training) {
            for (std::int64_t i = 0; i < n; ++i) p[i] = relu(p[i]);
            return x;
        }
        mask_ = Tensor<std::uint8_t, B>::empty_like(x);
        for (std::int64_t i = 0; i < n; ++i) {
            mask_[i] = p[i] > 0.0f;
            p[i] = relu(p[i]);
        }
        return x;
    }

    Tensor<float, B> backward(const Context&, const Tensor<float, B>& dy) {
        LOCKSTEP_CHECK_AS(ShapeError, dy.shape() == mask_.shape(), "ReLU: dy has shape ", dy.shape(),
                          " but the forward input had ", mask_.shape(), mask_.numel() == 0 && dy.numel() != 0 ? " (no training-mode forward before backward?)" : "");
        auto dx = Tensor<float, B>::empty_like(dy);
        const std::int64_t n = dy.numel();
        for (std::int64_t i = 0; i < n; ++i) dx[i] = mask_[i] ? dy[i] : 0.0f;
        mask_ = Tensor<std::uint8_t, B>();
        return dx;
    }

private:
    Tensor<std::uint8_t, B> mask_;
};

//! Max pooling over square windows (stride = kernel by default), NCHW input.
template <BackendTag B = Host>
class MaxPool2d {
public:
    using backend = B;
    explicit MaxPool2d(std::int64_t kernel, std::int64_t stride = 0) : k_(kernel), s_(stride > 0 ? stride : kernel) {
        LOCKSTEP_CHECK(kernel > 0, "MaxPool2d needs kernel > 0, got ", kernel);
    }
    template <class V>
    void visit(V&&) {}
    std::string describe() const { return "MaxPool2d(" + std::to_string(k_) + ")"; }

    Tensor<float, B> forward(const Context& ctx, Tensor<float, B> x) {
        LOCKSTEP_CHECK_AS(ShapeError, x.rank() == 4 && x.format() == MemoryFormat::nchw, describe(),
                          ": expected an NCHW (N, C, H, W) input, got shape ", x.shape(), " ", to_string(x.format()));
        LOCKSTEP_CHECK_AS(ShapeError, x.dim(2) >= k_ && x.dim(3) >= k_, describe(), ": input ", x.shape(),
                          " is smaller than the window");
        const std::int64_t N = x.dim(0), C = x.dim(1), H = x.dim(2), W = x.dim(3);
        const std::int64_t OH = (H - k_) / s_ + 1, OW = (W - k_) / s_ + 1;
        Tensor<float, B> y(Shape{N, C, OH, OW}, MemoryFormat::nchw, x.device(), uninitialized);
        Tensor<std::int32_t, B> arg(Shape{N, C, OH, OW}, MemoryFormat::nchw, x.device(), uninitialized);
        for (std::int64_t nc = 0; nc < N * C; ++nc) {
            const float* src = x.data() + nc * H * W;
            for (std::int64_t oh = 0; oh < OH; ++oh)
                for (std::int64_t ow = 0; ow < OW; ++ow) {
                    std::int64_t best = (oh * s_) * W + ow * s_;
                    for (std::int64_t i = 0; i < k_; ++i)
                        for (std::int64_t j = 0; j < k_; ++j) {
                            const std::int64_t at = (oh * s_ + i) * W + ow * s_ + j;
                            if (src[at] > src[best] || src[at] != src[at]) best = at;  // NaN wins, as in PyTorch
                        }
                    const std::int64_t o = (nc * OH + oh) * OW + ow;
                    y[o] = src[best];
                    arg[o] = static_cast<std::int32_t>(best);
                }
        }
        if (ctx.training) {
            argmax_ = std::move(arg);
            input_shape_ = x.shape();
        }
        return y;
    }

    Tensor<float, B> backward(const Context&, const Tensor<float, B>& dy) {
        LOCKSTEP_CHECK_AS(ShapeError, dy.shape() == argmax_.shape() && input_shape_.rank() == 4, describe(), ": dy has shape ",
                          dy.shape(), " but the forward output had ", argmax_.shape());
        Tensor<float, B> dx(input_shape_, MemoryFormat::nchw, dy.device());
        const std::int64_t HW = input_shape_[2] * input_shape_[3], per = argmax_.dim(2) * argmax_.dim(3);
        for (std::int64_t o = 0; o < dy.numel(); ++o) dx[(o / per) * HW + argmax_[o]] += dy[o];
        argmax_ = Tensor<std::int32_t, B>();
        input_shape_ = Shape{};
        return dx;
    }

private:
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

    Tensor<float, B> forward(const Context&, Tensor<float, B> x) {
        LOCKSTEP_CHECK_AS(ShapeError, x.rank() >= 2, "Flatten: expected at least 2 dimensions, got shape ", x.shape());
        LOCKSTEP_CHECK_AS(ShapeError, x.format() == MemoryFormat::nchw,
                          "Flatten: flattening an NHWC tensor would give H, W, C order; convert it to NCHW first");
        input_shape_ = x.shape();
        return std::move(x).reshaped(Shape{x.dim(0), x.shape().row_numel()});
    }

    Tensor<float, B> backward(const Context&, const Tensor<float, B>& dy) {
        LOCKSTEP_CHECK_AS(ShapeError, dy.numel() == input_shape_.numel(), "Flatten: dy has shape ", dy.shape(),
                          " but the forward input had ", input_shape_);
        Tensor<float, B> dx = dy;
        return std::move(dx).reshaped(input_shape_);
    }

private:
    Shape input_shape_{};
};

}  // namespace lockstep::nn
