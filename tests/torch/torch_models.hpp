// SPDX-License-Identifier: MIT
//! The libtorch models the torch component's tests train: a small residual network with
//! SyncBatchNorm (the same architecture as tests/golden/make_torch_golden.py's `ResNet`), and
//! the comparisons they make.
#pragma once

#include <torch/torch.h>

#include <cmath>
#include <string>
#include <vector>

#include "lockstep/torch.hpp"

namespace lockstep_test_torch {

namespace tnn = ::torch::nn;

struct BlockImpl : tnn::Cloneable<BlockImpl> {
    explicit BlockImpl(std::int64_t channels) : channels(channels) { reset(); }
    void reset() override {
        conv1 = register_module("conv1", tnn::Conv2d(tnn::Conv2dOptions(channels, channels, 3).padding(1).bias(false)));
        bn1 = register_module("bn1", lockstep::torch::SyncBatchNorm(channels));
        conv2 = register_module("conv2", tnn::Conv2d(tnn::Conv2dOptions(channels, channels, 3).padding(1).bias(false)));
        bn2 = register_module("bn2", lockstep::torch::SyncBatchNorm(channels));
    }
    at::Tensor forward(const at::Tensor& x) {
        auto y = ::torch::relu(bn1(conv1(x)));
        return ::torch::relu(bn2(conv2(y)) + x);
    }
    std::int64_t channels;
    tnn::Conv2d conv1{nullptr}, conv2{nullptr};
    lockstep::torch::SyncBatchNorm bn1{nullptr}, bn2{nullptr};
};
TORCH_MODULE(Block);

//! stem (conv 1->C, SyncBatchNorm, ReLU), two residual blocks, global average pool, linear to 10.
struct ResNetImpl : tnn::Cloneable<ResNetImpl> {
    explicit ResNetImpl(std::int64_t channels = 6) : channels(channels) { reset(); }
    void reset() override {
        stem = register_module("stem", tnn::Conv2d(tnn::Conv2dOptions(1, channels, 3).padding(1).bias(false)));
        bn = register_module("bn", lockstep::torch::SyncBatchNorm(channels));
        block1 = register_module("block1", Block(channels));
        block2 = register_module("block2", Block(channels));
        fc = register_module("fc", tnn::Linear(channels, 10));
    }
    at::Tensor forward(const at::Tensor& x) {
        auto y = ::torch::relu(bn(stem(x)));
        y = block2(block1(y));
        return fc(y.mean({2, 3}));
    }
    std::int64_t channels;
    tnn::Conv2d stem{nullptr};
    lockstep::torch::SyncBatchNorm bn{nullptr};
    Block block1{nullptr}, block2{nullptr};
    tnn::Linear fc{nullptr};
};
TORCH_MODULE(ResNet);

//! A batch of n 1x8x8 images and its n class labels, drawn from `seed`.
inline at::Tensor images(std::int64_t n, std::uint64_t seed) {
    ::torch::manual_seed(seed);
    return ::torch::randn({n, 1, 8, 8});
}
inline at::Tensor labels(std::int64_t n, std::uint64_t seed) {
    ::torch::manual_seed(seed + 1000);
    return ::torch::randint(0, 10, {n}, ::torch::kLong);
}

inline at::Tensor cross_entropy(const at::Tensor& out, const at::Tensor& targets) {
    return ::torch::nn::functional::cross_entropy(out, targets);
}

inline std::unique_ptr<::torch::optim::Optimizer> sgd(tnn::Module& m) {
    return std::make_unique<::torch::optim::SGD>(m.parameters(),
                                                 ::torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(1e-4));
}

//! The largest of ||a - b|| / ||b|| over every parameter and buffer of two modules of one architecture
//! (integer buffers: 0 when equal, 1 otherwise).
inline double worst_relative(const tnn::Module& a, const tnn::Module& b, std::string* where = nullptr) {
    double worst = 0;
    auto ta = a.named_parameters(true);
    auto tb = b.named_parameters(true);
    const auto visit = [&](const std::string& name, const at::Tensor& x, const at::Tensor& y) {
        double r = 0;
        if (x.is_floating_point()) {
            const double denom = std::max(y.to(at::kDouble).norm().item<double>(), 1e-30);
            r = (x.to(at::kDouble) - y.to(at::kDouble)).norm().item<double>() / denom;
        } else {
            r = x.equal(y) ? 0.0 : 1.0;
        }
        if (!(r <= worst)) {
            worst = std::isnan(r) ? INFINITY : r;
            if (where) *where = name;
        }
    };
    for (const auto& item : ta) visit(item.key(), item.value(), tb[item.key()]);
    auto ba = a.named_buffers(true);
    auto bb = b.named_buffers(true);
    for (const auto& item : ba) visit(item.key(), item.value(), bb[item.key()]);
    return worst;
}

//! Whether two modules hold bit-identical parameters and buffers.
inline bool identical(const tnn::Module& a, const tnn::Module& b) {
    auto pa = a.parameters(true), pb = b.parameters(true);
    auto ba = a.buffers(true), bb = b.buffers(true);
    if (pa.size() != pb.size() || ba.size() != bb.size()) return false;
    for (std::size_t i = 0; i < pa.size(); ++i)
        if (!pa[i].equal(pb[i])) return false;
    for (std::size_t i = 0; i < ba.size(); ++i)
        if (!ba[i].equal(bb[i])) return false;
    return true;
}

}  // namespace lockstep_test_torch
