// SPDX-License-Identifier: MIT
//! One training step of the MNIST example network (batch 64, 1x28x28) on 1 and 2 host replicas,
//! and what overlapping the gradient all-reduce with backward buys; the residual example's step
//! (batch 128, AdamW) on 1 and 2 replicas, which scripts/bench-resnet.sh sets against PyTorch.
#include <benchmark/benchmark.h>

#include <atomic>
#include <chrono>
#include <random>
#include <thread>
#include <vector>

#include <lockstep/kernels/host_blas.hpp>
#include <lockstep/parallel.hpp>

#include "../examples/mnist/net.hpp"
#include "../examples/resnet/net.hpp"

namespace {

using namespace lockstep;
using Model = mnist::Net<Host>;

struct Data {
    Tensor<float> x{Shape{64, 1, 28, 28}};
    std::vector<std::int64_t> labels = std::vector<std::int64_t>(64);
    Data() {
        std::mt19937 gen(3);
        std::uniform_real_distribution<float> u(0.0f, 1.0f);
        for (auto& v : x.span()) v = u(gen);
        for (std::size_t i = 0; i < labels.size(); ++i) labels[i] = static_cast<std::int64_t>(i % 10);
    }
};

// Images per second of `steps` training steps with `replicas` replicas; `overlapped` receives the
// buckets replica 0 had all-reduced before its backward ended, in the last step.
double images_per_second(int replicas, int steps, DataParallelOptions opts = {}, std::size_t* overlapped = nullptr) {
    static const Data data;
    nn::Generator gen(1);
    DataParallel<Model> dp(Model(gen), replicas, opts);
    nn::Sgd sgd({.lr = 0.01, .momentum = 0.9});
    dp.train_step(data.x, data.labels, nn::SoftmaxCrossEntropy{}, sgd);  // warm-up: caches, allocations
    const auto t0 = std::chrono::steady_clock::now();
    for (int s = 0; s < steps; ++s) dp.train_step(data.x, data.labels, nn::SoftmaxCrossEntropy{}, sgd);
    if (overlapped != nullptr) *overlapped = dp.overlapped_buckets(0);
    return 64.0 * steps / std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Training FLOPs of one image: 2 x the multiply-adds of forward, backward-data and
// backward-weights of every convolution and linear layer of the network (about 98 MFLOP).
double training_flops_per_image() {
    const double conv1 = 2.0 * 32 * 28 * 28 * (1 * 3 * 3), conv2 = 2.0 * 64 * 28 * 28 * (32 * 3 * 3);
    const double fc1 = 2.0 * (64 * 14 * 14) * 128, fc2 = 2.0 * 128 * 10;
    return 3.0 * (conv1 + conv2 + fc1 + fc2);
}

// FLOP/s of two threads running conv2's per-sample GEMM (64 x 784 x 288, single-threaded
// OpenBLAS each) at the same time: what the machine's two cores give the network's largest GEMM.
double gemm_ceiling() {
    kernels::blas::SingleThreadScope one_thread;
    constexpr std::int64_t M = 64, N = 28 * 28, K = 32 * 3 * 3;
    std::atomic<long> calls{0};
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(600);
    const auto work = [&] {
        std::vector<float> a(M * K, 0.5f), b(K * N, 0.25f), c(M * N);
        while (std::chrono::steady_clock::now() < until) {
            kernels::blas::gemm(false, false, M, N, K, 1.0f, a.data(), K, b.data(), N, 0.0f, c.data(), N);
            calls.fetch_add(1, std::memory_order_relaxed);
        }
        benchmark::DoNotOptimize(c.data());
    };
    const auto t0 = std::chrono::steady_clock::now();
    std::thread other(work);
    work();
    other.join();
    return 2.0 * M * N * K * static_cast<double>(calls.load()) /
           std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Throughput of 1 and 2 replicas measured back to back in this process: `scaling` is their ratio;
// `vs_gemm_ceiling` is the 2-replica FLOP rate (training FLOPs per image x images/s) over
// `gemm_ceiling`, measured in the same run.
void BM_TrainStepScaling(benchmark::State& state) {
    double one = 0, two = 0, ceiling = 0;
    for (auto _ : state) {
        one = images_per_second(1, 8);
        two = images_per_second(2, 8);
        ceiling = gemm_ceiling();
    }
    state.counters["images_per_s_1"] = one;
    state.counters["images_per_s_2"] = two;
    state.counters["scaling"] = two / one;
    state.counters["gemm_ceiling_GFLOPs"] = ceiling / 1e9;
    state.counters["vs_gemm_ceiling"] = training_flops_per_image() * two / ceiling;
}
BENCHMARK(BM_TrainStepScaling)->Iterations(2)->Unit(benchmark::kMillisecond)->UseRealTime();

// Overlap: a training step with the bucket all-reduces on the communication threads while
// backward continues, against the same step with every all-reduce after backward. Small buckets
// (1 MiB) give backward something to overlap with.
void BM_TrainStepOverlap(benchmark::State& state) {
    double overlapped = 0, serial = 0;
    std::size_t buckets_during_backward = 0;
    for (auto _ : state) {
        overlapped = images_per_second(2, 8, {.bucket_bytes = 1 << 20, .overlap = true}, &buckets_during_backward);
        serial = images_per_second(2, 8, {.bucket_bytes = 1 << 20, .overlap = false});
    }
    state.counters["buckets_done_during_backward"] = static_cast<double>(buckets_during_backward);
    state.counters["images_per_s_overlap"] = overlapped;
    state.counters["images_per_s_serial"] = serial;
    state.counters["overlap_speedup"] = overlapped / serial;
}
BENCHMARK(BM_TrainStepOverlap)->Iterations(2)->Unit(benchmark::kMillisecond)->UseRealTime();

// The residual example (examples/resnet): images per second of `steps` AdamW steps of batch 128
// on `replicas` replicas.
double resnet_images_per_second(int replicas, int steps) {
    static const auto data = [] {
        std::pair<Tensor<float>, std::vector<std::int64_t>> d{Tensor<float>(Shape{128, 1, 28, 28}),
                                                              std::vector<std::int64_t>(128)};
        std::mt19937 gen(5);
        std::uniform_real_distribution<float> u(0.0f, 1.0f);
        for (auto& v : d.first.span()) v = u(gen);
        for (std::size_t i = 0; i < d.second.size(); ++i) d.second[i] = static_cast<std::int64_t>(i % 10);
        return d;
    }();
    nn::Generator gen(1);
    DataParallel dp(resnet::make_net<Host>(16, gen), replicas);
    nn::AdamW adamw({.lr = 3e-3, .weight_decay = 0.05}, {nn::no_decay_on_norms_and_biases()});
    dp.train_step(data.first, data.second, nn::SoftmaxCrossEntropy{}, adamw);  // warm-up
    const auto t0 = std::chrono::steady_clock::now();
    for (int s = 0; s < steps; ++s) dp.train_step(data.first, data.second, nn::SoftmaxCrossEntropy{}, adamw);
    return 128.0 * steps / std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The residual example's step on 1 and 2 replicas, back to back: `resnet_scaling` is their ratio.
void BM_ResnetSteps(benchmark::State& state) {
    double one = 0, two = 0;
    for (auto _ : state) {
        one = resnet_images_per_second(1, 6);
        two = resnet_images_per_second(2, 6);
    }
    state.counters["resnet_images_per_s_1"] = one;
    state.counters["resnet_images_per_s_2"] = two;
    state.counters["resnet_scaling"] = two / one;
}
BENCHMARK(BM_ResnetSteps)->Iterations(2)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
