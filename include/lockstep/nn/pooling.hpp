// SPDX-License-Identifier: MIT
//! Average pooling: `nn::AvgPool2d` and `nn::AdaptiveAvgPool2d` (NCHW), PyTorch's windows.
#pragma once

#include <cstdint>
#include <string>

#include "lockstep/core/error.hpp"
#include "lockstep/core/tensor.hpp"
#include "lockstep/kernels/ops.hpp"
#include "lockstep/nn/context.hpp"

namespace lockstep::nn {

namespace detail {

// Forward and backward of an average pooling whose geometry `Layer::geometry(x)` gives for an
// input shape; the layer names itself with describe().
template <BackendTag B, class Layer>
class AvgPoolBase {
    using K = kernels::Ops<B>;

public:
    using backend = B;
    template <class V>
    void visit(V&&) {}

    Tensor<float, B> forward(const Context<B>& ctx, Tensor<float, B> x) {
        const auto& self = static_cast<const Layer&>(*this);
        use_.enter(ctx, [&] { return self.describe(); });
        LOCKSTEP_CHECK_AS(ShapeError, x.rank() == 4 && x.format() == MemoryFormat::nchw, self.describe(),
                          ": expected an NCHW (N, C, H, W) input, got shape ", x.shape(), " ", to_string(x.format()));
        const kernels::AvgPoolGeometry g = self.geometry(x.shape());
        Tensor<float, B> y(Shape{g.batch, g.channels, g.out_height, g.out_width}, MemoryFormat::nchw, x.device(), uninitialized);
        K::avgpool_forward(ctx.exec, g, x, y);
        if (ctx.training) input_shape_ = x.shape();
        return y;
    }

    Tensor<float, B> backward(const Context<B>& ctx, const Tensor<float, B>& dy) {
        const auto& self = static_cast<const Layer&>(*this);
        LOCKSTEP_CHECK_AS(UsageError, input_shape_.rank() == 4, self.describe(),
                          ": backward without a training-mode forward before it");
        const kernels::AvgPoolGeometry g = self.geometry(input_shape_);
        LOCKSTEP_CHECK_AS(ShapeError, dy.shape() == (Shape{g.batch, g.channels, g.out_height, g.out_width}), self.describe(),
                          ": dy has shape ", dy.shape(), " but the forward output had ",
                          Shape{g.batch, g.channels, g.out_height, g.out_width});
        Tensor<float, B> dx(input_shape_, MemoryFormat::nchw, dy.device(), uninitialized);
        K::avgpool_backward(ctx.exec, g, dy, dx);
        input_shape_ = Shape{};
        return dx;
    }

private:
    OneUse use_;  // Note [one instance, one use]
    Shape input_shape_{};
};

}  // namespace detail

//! Average pooling over kernel_h x kernel_w windows at a stride (the kernel by default), no
//! padding, as torch.nn.AvgPool2d(kernel, stride): (N, C, H, W) -> (N, C, (H - kh) / sh + 1, ...).
template <BackendTag B = Host>
class AvgPool2d : public detail::AvgPoolBase<B, AvgPool2d<B>> {
public:
    explicit AvgPool2d(std::int64_t kernel, std::int64_t stride = 0) : AvgPool2d(kernel, kernel, stride, stride) {}
    AvgPool2d(std::int64_t kernel_h, std::int64_t kernel_w, std::int64_t stride_h, std::int64_t stride_w)
        : kh_(kernel_h), kw_(kernel_w), sh_(stride_h > 0 ? stride_h : kernel_h), sw_(stride_w > 0 ? stride_w : kernel_w) {
        LOCKSTEP_CHECK(kernel_h > 0 && kernel_w > 0, "AvgPool2d needs a kernel of at least 1x1, got ", kernel_h, "x", kernel_w);
    }
    std::string describe() const {
        return "AvgPool2d(" + std::to_string(kh_) + "x" + std::to_string(kw_) + ", stride " + std::to_string(sh_) + "x" +
               std::to_string(sw_) + ")";
    }
    kernels::AvgPoolGeometry geometry(const Shape& x) const {
        LOCKSTEP_CHECK_AS(ShapeError, x[2] >= kh_ && x[3] >= kw_, describe(), ": input ", x, " is smaller than the window");
        return {.batch = x[0],
                .channels = x[1],
                .height = x[2],
                .width = x[3],
                .out_height = (x[2] - kh_) / sh_ + 1,
                .out_width = (x[3] - kw_) / sw_ + 1,
                .kernel_h = kh_,
                .kernel_w = kw_,
                .stride_h = sh_,
                .stride_w = sw_};
    }

private:
    std::int64_t kh_, kw_, sh_, sw_;
};

//! Average pooling to a fixed output size, as torch.nn.AdaptiveAvgPool2d((OH, OW)): output (i, j)
//! averages rows [floor(i H / OH), ceil((i + 1) H / OH)) and the columns likewise.
//! AdaptiveAvgPool2d(1) is the global average pool: (N, C, H, W) -> (N, C, 1, 1).
template <BackendTag B = Host>
class AdaptiveAvgPool2d : public detail::AvgPoolBase<B, AdaptiveAvgPool2d<B>> {
public:
    explicit AdaptiveAvgPool2d(std::int64_t out) : AdaptiveAvgPool2d(out, out) {}
    AdaptiveAvgPool2d(std::int64_t out_h, std::int64_t out_w) : oh_(out_h), ow_(out_w) {
        LOCKSTEP_CHECK(out_h > 0 && out_w > 0, "AdaptiveAvgPool2d needs an output of at least 1x1, got ", out_h, "x", out_w);
    }
    std::string describe() const { return "AdaptiveAvgPool2d(" + std::to_string(oh_) + "x" + std::to_string(ow_) + ")"; }
    kernels::AvgPoolGeometry geometry(const Shape& x) const {
        LOCKSTEP_CHECK_AS(ShapeError, x[2] > 0 && x[3] > 0, describe(), ": input ", x, " has no pixels");
        return {.batch = x[0],
                .channels = x[1],
                .height = x[2],
                .width = x[3],
                .out_height = oh_,
                .out_width = ow_,
                .adaptive = true};
    }

private:
    std::int64_t oh_, ow_;
};

}  // namespace lockstep::nn
