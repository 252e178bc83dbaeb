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

    // The layers pass activations in the precision each gives (Note [activation precision]):
    // under Precision::bf16 on CUDA every activation between layers is stored in bf16; the logits
    // are widened for the loss.
    Tensor<float, B> forward(const nn::Context<B>& ctx, Tensor<float, B> x) {
        trail_.clear();
        auto a = trail_.forward(conv1, ctx, lockstep::Activation<B>(std::move(x)));
        a = trail_.forward(bn1, ctx, std::move(a));
        a = trail_.forward(conv2, ctx, std::move(a));
        a = trail_.forward(bn2, ctx, std::move(a));
        a = trail_.forward(pool, ctx, std::move(a));
        a = trail_.forward(flatten, ctx, std::move(a));
        a = trail_.forward(fc1, ctx, std::move(a));
        return nn::widened(ctx, trail_.forward(fc2, ctx, std::move(a)));
    }

    Tensor<float, B> backward(const nn::Context<B>& ctx, const Tensor<float, B>& dy) {
        auto g = trail_.backward(fc2, ctx, lockstep::Activation<B>::view_of(dy));
        g = trail_.backward(fc1, ctx, g);
        g = trail_.backward(flatten, ctx, g);
        g = trail_.backward(pool, ctx, g);
        g = trail_.backward(bn2, ctx, g);
        g = trail_.backward(conv2, ctx, g);
        g = trail_.backward(bn1, ctx, g);
        return nn::widened(ctx, trail_.backward(conv1, ctx, g));
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

private:
    nn::ActivationTrail<B> trail_;  // what each layer was given and gave, for backward
};

}  // namespace mnist
