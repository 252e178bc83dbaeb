// SPDX-License-Identifier: MIT
//! Regression with MseLoss and gradient accumulation (the training loop README.md shows): a small
//! MLP on 3 host replicas learns y = (x0 + x1, x0 * x1); each optimizer step takes two
//! micro-batches of different sizes, and their gradients are all-reduced once.
#include <lockstep/nn.hpp>
#include <lockstep/host.hpp>
#include <lockstep/parallel.hpp>

#include <cstdio>
#include <random>

using namespace lockstep;

namespace {
// A batch of `n` points x in [-1, 1]^2 with targets (x0 + x1, x0 * x1).
void make_batch(std::int64_t n, std::mt19937& rng, Tensor<float>& x, Tensor<float>& y) {
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    x = Tensor<float>(Shape{n, 2});
    y = Tensor<float>(Shape{n, 2});
    for (std::int64_t i = 0; i < n; ++i) {
        x[2 * i] = u(rng);
        x[2 * i + 1] = u(rng);
        y[2 * i] = x[2 * i] + x[2 * i + 1];
        y[2 * i + 1] = x[2 * i] * x[2 * i + 1];
    }
}
}  // namespace

int main() {
    std::mt19937 rng(3);
    Tensor<float> x1, y1, x2, y2;
    // --- the training loop shown in README.md ---
    nn::Generator gen(7);
    nn::Sequential net(nn::Linear<>(2, 32, true, gen), nn::ReLU<>(), nn::Linear<>(32, 2, true, gen));
    DataParallel dp(net, 3, {.clip_grad_norm = 5.0});  // 3 replicas; gradients clipped to norm 5
    nn::Sgd sgd({.lr = 0.05, .momentum = 0.9});
    double first = 0, last = 0;
    for (int step = 0; step < 150; ++step) {
        make_batch(16, rng, x1, y1);                               // micro-batch 1: shards of 6, 5, 5
        make_batch(24, rng, x2, y2);                               // micro-batch 2: shards of 8, 8, 8
        dp.accumulate(x1, y1, nn::MseLoss{});                      // forward + backward, no gradient all-reduce
        const auto r = dp.train_step(x2, y2, nn::MseLoss{}, sgd);  // one all-reduce for both, one step
        (step == 0 ? first : last) = r.loss;                       // mean over all 40 samples
    }
    dp.save("regression.safetensors", sgd);  // model and momentum, PyTorch names
    // --- end of the training loop ---

    std::printf("MSE went from %.4f to %.4f over 150 steps of 2 micro-batches on 3 replicas\n", first, last);
    return last < 0.1 * first ? 0 : 1;
}
