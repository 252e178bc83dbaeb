// SPDX-License-Identifier: MIT
//! `nn::Conv2d`: 2-D convolution (NCHW) through im2col and GEMM.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "lockstep/core/error.hpp"
#include "lockstep/core/tensor.hpp"
#include "lockstep/nn/blas.hpp"
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
//! initialization is PyTorch's default.
template <BackendTag B = Host>
class Conv2d {
    static_assert(std::same_as<B, Host>, "Conv2d<Cuda> lives in <lockstep/cuda.cuh>");

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
            bias = Parameter<B>(Shape{out_channels});
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

    Tensor<float, B> forward(const Context& ctx, Tensor<float, B> x) {
        check_input(x);
        const std::int64_t N = x.dim(0), H = x.dim(2), W = x.dim(3);
        const std::int64_t OH = out_extent(H), OW = out_extent(W), P = OH * OW, K = in_ * k_ * k_;
        Tensor<float, B> y(Shape{N, out_, OH, OW}, MemoryFormat::nchw, x.device(), uninitialized);
        cols_.resize(static_cast<std::size_t>(K * P));
        for (std::int64_t n = 0; n < N; ++n) {
            im2col(x.data() + n * in_ * H * W, H, W, OH, OW);
            float* yn = y.data() + n * out_ * P;
            blas::gemm(false, false, out_, P, K, 1.0f, weight.value.data(), K, cols_.data(), P, 0.0f, yn, P);
            if (options_.bias)
                for (std::int64_t o = 0; o < out_; ++o) {
                    const float b = bias.value[o];
                    for (std::int64_t p = 0; p < P; ++p) yn[o * P + p] += b;
                }
        }
        if (ctx.training) saved_x_ = std::move(x);
        return y;
    }

    Tensor<float, B> backward(const Context& ctx, const Tensor<float, B>& dy) {
        LOCKSTEP_CHECK_AS(UsageError, saved_x_.rank() == 4, describe(),
                          ": backward called without a training-mode forward before it");
        const std::int64_t N = saved_x_.dim(0), H = saved_x_.dim(2), W = saved_x_.dim(3);
        const std::int64_t OH = out_extent(H), OW = out_extent(W), P = OH * OW, K = in_ * k_ * k_;
        LOCKSTEP_CHECK_AS(ShapeError, dy.shape() == (Shape{N, out_, OH, OW}), describe(), ": dy has shape ", dy.shape(),
                          " but the forward output had ", Shape{N, out_, OH, OW});
        auto dx = Tensor<float, B>(saved_x_.shape(), MemoryFormat::nchw, saved_x_.device());  // zeroed: col2im adds
        cols_.resize(static_cast<std::size_t>(K * P));
        dcols_.resize(static_cast<std::size_t>(K * P));
        for (std::int64_t n = 0; n < N; ++n) {
            const float* dyn = dy.data() + n * out_ * P;
            im2col(saved_x_.data() + n * in_ * H * W, H, W, OH, OW);
            blas::gemm(false, true, out_, K, P, 1.0f, dyn, P, cols_.data(), P, 1.0f, weight.grad.data(), K);
            if (options_.bias)
                for (std::int64_t o = 0; o < out_; ++o) {
                    float s = 0;
                    for (std::int64_t p = 0; p < P; ++p) s += dyn[o * P + p];
                    bias.grad[o] += s;
                }
            blas::gemm(true, false, K, P, out_, 1.0f, weight.value.data(), K, dyn, P, 0.0f, dcols_.data(), P);
            col2im(dx.data() + n * in_ * H * W, H, W, OH, OW);
        }
        ctx.mark_grad_ready(&weight);
        if (options_.bias) ctx.mark_grad_ready(&bias);
        saved_x_ = Tensor<float, B>();
        return dx;
    }

private:
    void check_input(const Tensor<float, B>& x) const {
        LOCKSTEP_CHECK_AS(ShapeError, x.rank() == 4 && x.dim(1) == in_, describe(), ": expected input (N, ", in_,
                          ", H, W), got shape ", x.shape());
        LOCKSTEP_CHECK_AS(ShapeError, x.format() == MemoryFormat::nchw, describe(),
                          ": the host Conv2d takes NCHW input, got an NHWC tensor of shape ", x.shape());
        LOCKSTEP_CHECK_AS(ShapeError, x.dim(2) + 2 * options_.padding >= k_ && x.dim(3) + 2 * options_.padding >= k_,
                          describe(), ": input ", x.shape(), " is smaller than the kernel (", k_, ") plus padding");
    }

    // cols[(c, i, j), (oh, ow)] = x[c, oh*s - p + i, ow*s - p + j], zero outside the image.
    void im2col(const float* x, std::int64_t H, std::int64_t W, std::int64_t OH, std::int64_t OW) {
        const std::int64_t s = options_.stride, pad = options_.padding, P = OH * OW;
        float* col = cols_.data();
        for (std::int64_t c = 0; c < in_; ++c)
            for (std::int64_t i = 0; i < k_; ++i)
                for (std::int64_t j = 0; j < k_; ++j) {
                    float* row = col + ((c * k_ + i) * k_ + j) * P;
                    for (std::int64_t oh = 0; oh < OH; ++oh) {
                        const std::int64_t h = oh * s - pad + i;
                        float* out = row + oh * OW;
                        if (h < 0 || h >= H) {
                            std::fill(out, out + OW, 0.0f);
                            continue;
                        }
                        const float* src = x + (c * H + h) * W;
                        for (std::int64_t ow = 0; ow < OW; ++ow) {
                            const std::int64_t w = ow * s - pad + j;
                            out[ow] = (w >= 0 && w < W) ? src[w] : 0.0f;
                        }
                    }
                }
    }

    // The adjoint of im2col: adds dcols back onto the image positions they were read from.
    void col2im(float* dx, std::int64_t H, std::int64_t W, std::int64_t OH, std::int64_t OW) const {
        const std::int64_t s = options_.stride, pad = options_.padding, P = OH * OW;
        const float* col = dcols_.data();
        for (std::int64_t c = 0; c < in_; ++c)
            for (std::int64_t i = 0; i < k_; ++i)
                for (std::int64_t j = 0; j < k_; ++j) {
                    const float* row = col + ((c * k_ + i) * k_ + j) * P;
                    for (std::int64_t oh = 0; oh < OH; ++oh) {
                        const std::int64_t h = oh * s - pad + i;
                        if (h < 0 || h >= H) continue;
                        float* dst = dx + (c * H + h) * W;
                        const float* in = row + oh * OW;
                        for (std::int64_t ow = 0; ow < OW; ++ow) {
                            const std::int64_t w = ow * s - pad + j;
                            if (w >= 0 && w < W) dst[w] += in[ow];
                        }
                    }
                }
    }

    std::int64_t in_, out_, k_;
    Conv2dOptions options_;
    Tensor<float, B> saved_x_;
    std::vector<float> cols_, dcols_;  // scratch, reused across calls
};

}  // namespace lockstep::nn
