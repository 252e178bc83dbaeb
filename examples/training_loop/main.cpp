// SPDX-License-Identifier: MIT
//! A complete data-parallel training loop (the one README.md shows): a small conv-net with
//! SyncBatchNorm learns to tell bright-top images from bright-bottom ones on 3 host replicas.
#include <lockstep/nn.hpp>
#include <lockstep/host.hpp>
#include <lockstep/parallel.hpp>

#include <cstdio>
#include <random>
#include <vector>

using namespace lockstep;

int main() {
    // --- the training loop shown in README.md ---
    nn::Generator gen(42);
    nn::Sequential net(nn::Conv2d<>(1, 8, 3, {.padding = 1}, gen), nn::SyncBatchNorm<>(8), nn::ReLU<>(), nn::MaxPool2d<>(2),
                       nn::Flatten<>(), nn::Linear<>(8 * 4 * 4, 2, true, gen));
    DataParallel dp(net, 3);  // 3 replicas, persistent threads
    nn::Sgd sgd({.lr = 0.05, .momentum = 0.9});
    std::mt19937 rng(1);
    double first = 0, last = 0;
    for (int step = 0; step < 60; ++step) {
        Tensor<float> x(Shape{32, 1, 8, 8});  // global batch of 32: shards of 11, 11, 10
        std::vector<std::int64_t> labels(32);
        for (std::int64_t n = 0; n < 32; ++n) {
            labels[n] = rng() % 2;  // class 1: the bright half is the bottom
            for (std::int64_t p = 0; p < 64; ++p)
                x[n * 64 + p] = ((p / 32) == labels[n]) + 0.3f * std::normal_distribution<float>()(rng);
        }
        const auto result = dp.train_step(x, labels, nn::SoftmaxCrossEntropy{}, sgd);
        (step == 0 ? first : last) = result.loss;
    }
    nn::save("training_loop.safetensors", dp.module());  // PyTorch state_dict names
    // --- end of the training loop ---

    std::printf("loss went from %.4f to %.4f over 60 steps on 3 replicas\n", first, last);
    return last < 0.25 * first ? 0 : 1;
}
