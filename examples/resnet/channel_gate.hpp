// SPDX-License-Identifier: MIT
//! A module of one's own, written with lockstep's tensor operations (lockstep/nn/tensor_ops.hpp):
//! it runs on the host and on CUDA from this one source, and its backward is checked by
//! nn::gradcheck in the tests (README, "Writing a module").
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include <lockstep/nn.hpp>

namespace resnet {

namespace nn = lockstep::nn;
namespace ops = lockstep::ops;
using lockstep::BackendTag;
using lockstep::Tensor;

//! A channel gate: each sample's channels are reweighted by a softmax over their spatial means,
//! sharpened per channel by a learned weight w (starting at 1) and scaled by C so that the gates
//! average 1:
//!     s = mean_hw(x),  a = softmax(s * w) over channels,  y = x * (C a) at every pixel.
//! (N, C, H, W) -> (N, C, H, W), NCHW or NHWC. State-dict name "weight" (C).
template <BackendTag B>
class ChannelGate {
public:
    using backend = B;

    explicit ChannelGate(std::int64_t channels) : weight(lockstep::Shape{channels}), channels_(channels) {
        nn::fill_value(weight.value, 1.0f);
    }

    nn::Parameter<B> weight;

    template <class V>
    void visit(V&& v) {
        v.parameter("weight", weight);
    }

    Tensor<float, B> forward(const nn::Context<B>& ctx, Tensor<float, B> x) {
        LOCKSTEP_CHECK_AS(lockstep::ShapeError, x.rank() == 4 && x.dim(1) == channels_, "ChannelGate(", channels_,
                          "): expected (N, ", channels_, ", H, W), got ", x.shape());
        auto s = ops::mean(ctx, x, {2, 3});                       // (N, C)
        auto w = ops::expand(ctx, weight.value, s.shape(), {0});  // w for every sample
        auto a = ops::softmax(ctx, ops::mul(ctx, s, w), 1);       // (N, C)
        const auto c = static_cast<double>(channels_);
        auto g = ops::expand(ctx, a, x.shape(), {2, 3}, x.format(), c);  // C a at every pixel
        auto y = ops::mul(ctx, x, g);
        if (ctx.training) saved_ = Saved{std::move(x), std::move(s), std::move(w), std::move(a), std::move(g)};
        return y;
    }

    Tensor<float, B> backward(const nn::Context<B>& ctx, const Tensor<float, B>& dy) {
        LOCKSTEP_CHECK_AS(lockstep::UsageError, saved_.x.numel() > 0, "ChannelGate: backward without a training forward");
        Saved t = std::move(saved_);
        saved_ = {};
        auto [dx, dg] = ops::mul_backward(ctx, t.x, t.g, dy);                                 // y = x g
        auto da = ops::scale(ctx, ops::sum(ctx, dg, {2, 3}), static_cast<float>(channels_));  // g = expand(C a)
        auto dt = ops::softmax_backward(ctx, t.a, da, 1);                                     // a = softmax(t)
        auto [ds, dw] = ops::mul_backward(ctx, t.s, t.w, dt);                                 // t = s w
        auto dweight = ops::sum(ctx, dw, {0});                                                // w = expand(weight)
        ops::axpy(ctx, 1.0f, dweight, weight.grad);
        ctx.mark_grad_ready(&weight);
        ops::axpy(ctx, 1.0f, ops::mean_backward(ctx, ds, t.x.shape(), {2, 3}, t.x.format()), dx);  // s = mean(x)
        return dx;
    }

private:
    struct Saved {
        Tensor<float, B> x, s, w, a, g;
    };
    Saved saved_;
    std::int64_t channels_;
};

}  // namespace resnet
