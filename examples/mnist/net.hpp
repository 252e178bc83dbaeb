// SPDX-License-Identifier: MIT
//! The seed's MNIST conv-net with SyncBatchNorm, written once for any backend.
#pragma once

#include <lockstep/nn.hpp>
#include <lockstep/host.hpp>

namespace mnist {

using lockstep::Tensor;
namespace nn = lockstep::nn;

//! conv1 (1->32, 3x3, pad 1) -> bn1 -> ReLU -> conv2 (32->64, 3x3, pad 1) -> bn2 -> ReLU ->
//! MaxPool2d(2) -> Flatten -> fc1 (12544->128) -> ReLU -> fc2 (128->10). Each ReLU is fused into
//! the layer before it (BatchNormOptions::fused_relu, LinearOptions::fused_relu): the same
//! function with three memory passes fewer. The attribute names are the checkpoint names, as
//! PyTorch's state_dict() gives them for a module with these attributes.
template <class B = lockstep::Host>
struct Net {
    using backend = B;

    explicit Net(nn::Generator& gen)
        : conv1(1, 32, 3, {.padding = 1}, gen),
          bn1(32, {.fused_relu = true}),
          conv2(32, 64, 3, {.padding = 1}, gen),
          bn2(64, {.fused_relu = true}),
          pool(2),
          fc1(64 * 14 * 14, 128, {.fused_relu = true}, gen),
          fc2(128, 10, true, gen) {}

    nn::Conv2d<B> conv1;
    nn::SyncBatchNorm<B> bn1;  // + ReLU
    nn::Conv2d<B> conv2;
    nn::SyncBatchNorm<B> bn2;  // + ReLU
    nn::MaxPool2d<B> pool;
    nn::Flatten<B> flatten;
    nn::Linear<B> fc1;  // + ReLU
    nn::Linear<B> fc2;

    Tensor<float, B> forward(const nn::Context<B>& ctx, Tensor<float, B> x) {
        x = bn1.forward(ctx, conv1.forward(ctx, std::move(x)));
        x = bn2.forward(ctx, conv2.forward(ctx, std::move(x)));
        x = flatten.forward(ctx, pool.forward(ctx, std::move(x)));
        return fc2.forward(ctx, fc1.forward(ctx, std::move(x)));
    }

    Tensor<float, B> backward(const nn::Context<B>& ctx, const Tensor<float, B>& dy) {
        auto g = fc1.backward(ctx, fc2.backward(ctx, dy));
        g = pool.backward(ctx, flatten.backward(ctx, g));
        g = conv2.backward(ctx, bn2.backward(ctx, g));
        return conv1.backward(ctx, bn1.backward(ctx, g));
    }

    template <class V>
    void visit(V&& v) {
        v.module("conv1", conv1);
        v.module("bn1", bn1);
        v.module("conv2", conv2);
        v.module("bn2", bn2);
        v.module("fc1", fc1);
        v.module("fc2", fc2);
    }
};

}  // namespace mnist
