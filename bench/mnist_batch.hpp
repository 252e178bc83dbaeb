// SPDX-License-Identifier: MIT
//! The input the CUDA training benchmarks feed the example network: uniform [0, 1) images and
//! labels 0..9 in turn, the same for every run.
#pragma once

#include <lockstep/host.hpp>

#include <cstdint>
#include <random>
#include <vector>

namespace lockstep::bench {

template <class B>
struct MnistBatch {
    Tensor<float, B> x;                // (batch, 1, 28, 28) on the device asked for
    std::vector<std::int64_t> labels;  // 0, 1, ..., 9, 0, ...
};

template <class B>
MnistBatch<B> mnist_batch(std::int64_t batch, const Device& device) {
    Tensor<float, Host> xh(Shape{batch, 1, 28, 28});
    std::mt19937 rng(3);
    std::uniform_real_distribution<float> u(0.0f, 1.0f);
    for (float& v : xh.span()) v = u(rng);
    MnistBatch<B> b{xh.to<B>(device), std::vector<std::int64_t>(static_cast<std::size_t>(batch))};
    for (std::size_t i = 0; i < b.labels.size(); ++i) b.labels[i] = static_cast<std::int64_t>(i % 10);
    return b;
}

}  // namespace lockstep::bench
