// SPDX-License-Identifier: MIT
//! The small network and batches that the CUDA DataParallel tests train: tests/gpu on a GPU and
//! tests/on_host_cuda on the host CUDA device.
#pragma once

#include <lockstep/nn.hpp>
#include <lockstep/host.hpp>
#include <lockstep/parallel.hpp>

#include <cstdint>
#include <random>
#include <vector>

namespace lockstep::gpu_test {

template <class B>
using Small = nn::Sequential<nn::Conv2d<B>, nn::SyncBatchNorm<B>, nn::ReLU<B>, nn::MaxPool2d<B>, nn::Flatten<B>, nn::Linear<B>>;

//! The same initial values on every backend (a fixed generator).
template <class B>
Small<B> make_small() {
    nn::Generator g(5);
    return Small<B>(nn::Conv2d<B>(2, 6, 3, {.padding = 1}, g), nn::SyncBatchNorm<B>(6), nn::ReLU<B>(), nn::MaxPool2d<B>(2),
                    nn::Flatten<B>(), nn::Linear<B>(6 * 5 * 5, 7, true, g));
}

struct Batch {
    Tensor<float, Host> x;
    std::vector<std::int64_t> labels;
};

//! `n` samples of (2, 10, 10) and labels in 0..6, drawn from `seed`.
inline Batch make_batch(std::int64_t n, std::uint64_t seed) {
    std::mt19937_64 gen(seed);
    std::normal_distribution<float> d(0.3f, 1.0f);
    std::uniform_int_distribution<std::int64_t> l(0, 6);
    Batch b{Tensor<float, Host>(Shape{n, 2, 10, 10}), {}};
    for (auto& v : b.x.span()) v = d(gen);
    for (std::int64_t i = 0; i < n; ++i) b.labels.push_back(l(gen));
    return b;
}

}  // namespace lockstep::gpu_test
