// SPDX-License-Identifier: MIT
//! The seed's MNIST conv-net as a libtorch module with lockstep's SyncBatchNorm (the example's,
//! and bench/bench_torch_train_step.cpp's).
#pragma once

#include <lockstep/torch.hpp>

namespace torch_mnist {

namespace tnn = torch::nn;

//! conv1 (1->32, 3x3, pad 1) -> bn1 -> ReLU -> conv2 (32->64, 3x3, pad 1) -> bn2 -> ReLU ->
//! MaxPool2d(2) -> Flatten -> fc1 (12544->128) -> ReLU -> fc2 (128->10): the seed's network.
struct NetImpl : tnn::Cloneable<NetImpl> {
    NetImpl() { reset(); }
    void reset() override {
        conv1 = register_module("conv1", tnn::Conv2d(tnn::Conv2dOptions(1, 32, 3).padding(1)));
        bn1 = register_module("bn1", lockstep::torch::SyncBatchNorm(32));
        conv2 = register_module("conv2", tnn::Conv2d(tnn::Conv2dOptions(32, 64, 3).padding(1)));
        bn2 = register_module("bn2", lockstep::torch::SyncBatchNorm(64));
        fc1 = register_module("fc1", tnn::Linear(64 * 14 * 14, 128));
        fc2 = register_module("fc2", tnn::Linear(128, 10));
    }
    torch::Tensor forward(const torch::Tensor& x) {
        auto y = torch::relu(bn1(conv1(x)));
        y = torch::max_pool2d(torch::relu(bn2(conv2(y))), 2);
        return fc2(torch::relu(fc1(y.flatten(1))));
    }
    tnn::Conv2d conv1{nullptr}, conv2{nullptr};
    lockstep::torch::SyncBatchNorm bn1{nullptr}, bn2{nullptr};
    tnn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Net);

}  // namespace torch_mnist
