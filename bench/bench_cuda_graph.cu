// SPDX-License-Identifier: MIT
//! The example network's forward and backward (mnist::Net<Cuda>, one replica, batch 64 and 256)
//! run eagerly and as one captured CUDA graph (Note [graphs] in core/cuda_runtime.cuh), in one
//! process. Reports images/s of each, `vs_eager` (the graph's images/s over the eager path's at the
//! same batch), and `cpu_per_gpu`: the host CPU time that enqueues a step (the calling thread's
//! CPU clock around the enqueue, the wait excluded) over the step's GPU time (CUDA events around
//! it on the stream); the goal for a captured step is under 0.1. Then the same network trained
//! by DataParallel::train_step on one replica, eagerly and with DataParallelOptions::graphs
//! (images/s, `vs_eager`). Prints "no GPU" and exits 0 where there is none.
#include <benchmark/benchmark.h>

#include <lockstep/cuda.cuh>
#include <lockstep/host.hpp>
#include <lockstep/nn.hpp>
#include <lockstep/parallel.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <map>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "../examples/mnist/net.hpp"

#include "bench_util.hpp"
#include "mnist_batch.hpp"

namespace {

using namespace lockstep;

double thread_cpu_seconds() {
    timespec t{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

struct Figures {
    double images_per_s = 0, cpu_per_gpu = 0;
};
std::map<std::pair<int, std::int64_t>, Figures> figures;  // by (graph, batch)

void BM_CudaGraphStep(benchmark::State& state) {
    const bool graph = state.range(0) != 0;
    const std::int64_t batch = state.range(1);
    try {
        kernels::Ops<Cuda>::ReplicaResources res(Device::cuda(0));
        const auto entered = res.enter();
        nn::Context<Cuda> ctx;
        ctx.exec = res.execution();
        nn::Generator gen(1);
        mnist::Net<Cuda> net(gen);
        Tensor<float, Host> xh(Shape{batch, 1, 28, 28}), dyh(Shape{batch, 10});
        std::mt19937 rng(3);
        std::normal_distribution<float> d;
        for (float& v : xh.span()) v = d(rng);
        for (float& v : dyh.span()) v = d(rng);
        // What a graph reads lives outside it; the step's temporaries are made and freed in it.
        const auto x = xh.to<Cuda>(Device::cuda(0));
        const auto dy = dyh.to<Cuda>(Device::cuda(0));
        const auto step = [&] {
            (void)net.forward(ctx, Tensor<float, Cuda>(x));
            (void)net.backward(ctx, dy);
        };
        for (int i = 0; i < 3; ++i) step();  // warm-up: workspaces grown, algorithms chosen
        kernels::Ops<Cuda>::wait(ctx.exec, "the warm-up");
        lockstep::cuda::Graph captured;
        if (graph) captured = lockstep::cuda::Graph::capture(ctx.exec.stream, step);
        cudaEvent_t timed[2] = {nullptr, nullptr};
        for (auto& e : timed) LOCKSTEP_CUDA_CHECK(cudaEventCreate(&e));
        double cpu = 0, gpu_ms = 0;
        const auto t0 = std::chrono::steady_clock::now();
        for (auto _ : state) {
            LOCKSTEP_CUDA_CHECK(cudaEventRecord(timed[0], ctx.exec.stream));
            const double c0 = thread_cpu_seconds();
            if (graph)
                captured.launch(ctx.exec.stream);
            else
                step();
            cpu += thread_cpu_seconds() - c0;
            LOCKSTEP_CUDA_CHECK(cudaEventRecord(timed[1], ctx.exec.stream));
            kernels::Ops<Cuda>::wait(ctx.exec, "a step");
            float ms = 0;
            LOCKSTEP_CUDA_CHECK(cudaEventElapsedTime(&ms, timed[0], timed[1]));
            gpu_ms += ms;
        }
        const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        for (auto& e : timed) (void)cudaEventDestroy(e);
        Figures f;
        f.images_per_s = static_cast<double>(batch) * static_cast<double>(state.iterations()) / std::max(secs, 1e-12);
        f.cpu_per_gpu = cpu / std::max(gpu_ms * 1e-3, 1e-12);
        state.counters["images_per_s"] = f.images_per_s;
        state.counters["cpu_per_gpu"] = f.cpu_per_gpu;
        figures[{graph ? 1 : 0, batch}] = f;
        if (graph && figures.count({0, batch}) != 0)
            state.counters["vs_eager"] = f.images_per_s / figures[{0, batch}].images_per_s;
    } catch (const std::exception& e) {
        state.SkipWithError(e.what());
    }
}
// The eager path before the graph at each batch: vs_eager divides by a figure of the same run.
BENCHMARK(BM_CudaGraphStep)
    ->ArgNames({"graph", "batch"})
    ->ArgsProduct({{0, 1}, {64, 256}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

// DataParallel's own captured steps (DataParallelOptions::graphs, Note [captured steps]): the
// example network trained by train_step on one replica, SGD with momentum, eager and with graphs.
std::map<std::pair<int, std::int64_t>, double> dp_images_per_s;  // by (graphs, batch)

void BM_DataParallelGraphs(benchmark::State& state) {
    const bool graphs = state.range(0) != 0;
    const std::int64_t batch = state.range(1);
    try {
        nn::Generator gen(1);
        DataParallelOptions o;
        o.graphs = graphs;
        DataParallel<mnist::Net<Cuda>> dp(mnist::Net<Cuda>(gen), {Device::cuda(0)}, o);
        nn::Sgd<Cuda> sgd({.lr = 0.01, .momentum = 0.9});
        const auto [x, labels] = lockstep::bench::mnist_batch<Cuda>(batch, Device::cuda(0));
        for (int i = 0; i < 3; ++i) (void)dp.train_step(x, labels, nn::SoftmaxCrossEntropy{}, sgd);  // captured at the 2nd
        const auto t0 = std::chrono::steady_clock::now();
        for (auto _ : state) benchmark::DoNotOptimize(dp.train_step(x, labels, nn::SoftmaxCrossEntropy{}, sgd));
        const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        const double ips = static_cast<double>(batch) * static_cast<double>(state.iterations()) / std::max(secs, 1e-12);
        state.counters["images_per_s"] = ips;
        state.counters["graph_launches"] = static_cast<double>(dp.graph_launches(0));
        dp_images_per_s[{graphs ? 1 : 0, batch}] = ips;
        if (graphs && dp_images_per_s.count({0, batch}) != 0) state.counters["vs_eager"] = ips / dp_images_per_s[{0, batch}];
    } catch (const std::exception& e) {
        state.SkipWithError(e.what());
    }
}
BENCHMARK(BM_DataParallelGraphs)
    ->ArgNames({"graphs", "batch"})
    ->ArgsProduct({{0, 1}, {64, 256}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace

int main(int argc, char** argv) {
    if (const auto done = lockstep::bench::start_gpu_benchmark(lockstep::cuda::device_count(), &argc, argv)) return *done;
    benchmark::RunSpecifiedBenchmarks();
    benchmark::Shutdown();
    for (const std::int64_t batch : {64, 256}) {
        const auto e = figures.find({0, batch}), g = figures.find({1, batch});
        if (e == figures.end() || g == figures.end()) {
            std::printf("graph step vs eager: batch %lld not run\n", static_cast<long long>(batch));
            continue;
        }
        std::printf(
            "graph step vs eager: batch %lld vs_eager %.2f (images/s %.0f vs %.0f), cpu_per_gpu graph %.3f eager %.3f "
            "(goal < 0.1)\n",
            static_cast<long long>(batch), g->second.images_per_s / e->second.images_per_s, g->second.images_per_s,
            e->second.images_per_s, g->second.cpu_per_gpu, e->second.cpu_per_gpu);
    }
    for (const std::int64_t batch : {64, 256}) {
        const auto e = dp_images_per_s.find({0, batch}), g = dp_images_per_s.find({1, batch});
        if (e == dp_images_per_s.end() || g == dp_images_per_s.end()) {
            std::printf("DataParallel graphs vs eager: batch %lld not run\n", static_cast<long long>(batch));
            continue;
        }
        std::printf("DataParallel graphs vs eager: batch %lld vs_eager %.2f (images/s %.0f vs %.0f)\n",
                    static_cast<long long>(batch), g->second / e->second, g->second, e->second);
    }
    return 0;
}
