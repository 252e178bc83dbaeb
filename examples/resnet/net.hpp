// SPDX-License-Identifier: MIT
//! The residual example's network, on any backend: a stem, three residual blocks with
//! synchronized batch norm (the last two halve the resolution through a projection on the
//! shortcut), a global average pool and a linear classifier.
#pragma once

#include <cstdint>
#include <utility>

#include <lockstep/nn.hpp>

#include "channel_gate.hpp"

namespace resnet {

namespace nn = lockstep::nn;

template <class B>
using Branch = nn::Sequential<nn::Conv2d<B>, nn::SyncBatchNorm<B>, nn::Conv2d<B>, nn::SyncBatchNorm<B>>;
template <class B>
using Projection = nn::Sequential<nn::Conv2d<B>, nn::SyncBatchNorm<B>>;

//! conv3x3 - BN - ReLU - conv3x3 - BN, the first convolution at `stride` (ResNet's basic block).
template <class B>
Branch<B> branch(std::int64_t in, std::int64_t out, std::int64_t stride, nn::Generator& g) {
    return Branch<B>(nn::Conv2d<B>(in, out, 3, {.stride = stride, .padding = 1, .bias = false}, g),
                     nn::SyncBatchNorm<B>(out, {.fused_relu = true}),
                     nn::Conv2d<B>(out, out, 3, {.padding = 1, .bias = false}, g), nn::SyncBatchNorm<B>(out));
}

//! A strided 1x1 convolution and its batch norm: the shortcut where the block changes shape.
template <class B>
Projection<B> projection(std::int64_t in, std::int64_t out, std::int64_t stride, nn::Generator& g) {
    return Projection<B>(nn::Conv2d<B>(in, out, 1, {.stride = stride, .bias = false}, g), nn::SyncBatchNorm<B>(out));
}

//! (N, 1, 28, 28) -> (N, 10) logits; `width` channels at 28x28, twice and four times that at
//! 14x14 and 7x7.
template <class B>
auto make_net(std::int64_t width, nn::Generator& g) {
    const std::int64_t w = width;
    return nn::Sequential(nn::Conv2d<B>(1, w, 3, {.padding = 1, .bias = false}, g), nn::SyncBatchNorm<B>(w, {.fused_relu = true}),
                          nn::Residual(branch<B>(w, w, 1, g)),
                          nn::Residual(branch<B>(w, 2 * w, 2, g), projection<B>(w, 2 * w, 2, g)),
                          nn::Residual(branch<B>(2 * w, 4 * w, 2, g), projection<B>(2 * w, 4 * w, 2, g)),
                          nn::AdaptiveAvgPool2d<B>(1), nn::Flatten<B>(), nn::Linear<B>(4 * w, 10, true, g));
}

template <class B>
using Net = decltype(make_net<B>(1, std::declval<nn::Generator&>()));

//! The same network with a ChannelGate (channel_gate.hpp, a module of one's own written with the
//! tensor operations) after each residual block: `--gate`.
template <class B>
auto make_gated_net(std::int64_t width, nn::Generator& g) {
    const std::int64_t w = width;
    return nn::Sequential(nn::Conv2d<B>(1, w, 3, {.padding = 1, .bias = false}, g), nn::SyncBatchNorm<B>(w, {.fused_relu = true}),
                          nn::Residual(branch<B>(w, w, 1, g)), ChannelGate<B>(w),
                          nn::Residual(branch<B>(w, 2 * w, 2, g), projection<B>(w, 2 * w, 2, g)), ChannelGate<B>(2 * w),
                          nn::Residual(branch<B>(2 * w, 4 * w, 2, g), projection<B>(2 * w, 4 * w, 2, g)), ChannelGate<B>(4 * w),
                          nn::AdaptiveAvgPool2d<B>(1), nn::Flatten<B>(), nn::Linear<B>(4 * w, 10, true, g));
}

}  // namespace resnet
