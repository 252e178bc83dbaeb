// SPDX-License-Identifier: MIT
//! SyncBatchNorm training forward + backward on host replicas. Effective bandwidth counts the
//! minimum traffic (5 x tensor bytes: read x twice, write y, read dy, write dx is the classic
//! figure) and `vs_memcpy` divides it by memcpy bandwidth measured in the same process. The label
//! names the SIMD level of the host kernels (LOCKSTEP_SIMD=baseline|avx2|avx512 picks another).
#include <benchmark/benchmark.h>

#include <lockstep/lockstep.hpp>
#include <lockstep/nn/sync_batch_norm.hpp>

#include <chrono>
#include <random>
#include <string>
#include <vector>

#include "bench_util.hpp"

namespace {

using namespace lockstep;

void BM_SyncBatchNorm(benchmark::State& state) {
    const std::int64_t N = state.range(0), C = state.range(1), HW = state.range(2);
    const auto format = state.range(3) == 0 ? MemoryFormat::nchw : MemoryFormat::nhwc;
    const int world = static_cast<int>(state.range(4));
    const std::int64_t per_replica = N / world;  // each replica holds N / world samples
    auto comms = comm::HostCommunicator::create_group(world);
    std::vector<comm::CollectivesOf<comm::HostCommunicator>> adapters(comms.begin(), comms.end());
    ReplicaPool pool(world);
    nn::SyncBatchNorm<> proto(C, {.format = format});
    std::vector<nn::SyncBatchNorm<>> bns(static_cast<std::size_t>(world), proto);
    std::vector<Tensor<float>> xs, dys;
    std::mt19937 gen(1);
    std::normal_distribution<float> dist;
    for (int r = 0; r < world; ++r) {
        xs.emplace_back(Shape{per_replica, C, HW, HW}, format);
        dys.emplace_back(Shape{per_replica, C, HW, HW}, format);
        for (auto& v : xs.back().span()) v = dist(gen);
        for (auto& v : dys.back().span()) v = dist(gen);
    }
    const auto bytes = static_cast<std::size_t>(xs[0].bytes());
    const double memcpy_bw = lockstep::bench::memcpy_bandwidth(bytes);
    auto job = [&](int r) {
        const auto ur = static_cast<std::size_t>(r);
        nn::Context ctx;
        ctx.rank = r;
        ctx.world = world;
        ctx.comm = &adapters[ur];
        // The input is moved in, as a network hands over its activations; the output (normalized
        // data again, since weight = 1 and bias = 0) is the next iteration's input.
        auto y = bns[ur].forward(ctx, std::move(xs[ur]));
        auto dx = bns[ur].backward(ctx, dys[ur]);
        benchmark::DoNotOptimize(dx.data());
        xs[ur] = std::move(y);
    };
    pool.run(job);
    double seconds = 0;
    for (auto _ : state) {
        const auto t0 = std::chrono::steady_clock::now();
        pool.run(job);
        seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    // Per replica: 5 x its tensor bytes in the measured time.
    const double per_replica_bw = 5.0 * static_cast<double>(bytes) * static_cast<double>(state.iterations()) / seconds;
    state.SetBytesProcessed(static_cast<std::int64_t>(5 * bytes * static_cast<std::size_t>(world)) * state.iterations());
    state.counters["replica_GBps"] = per_replica_bw / 1e9;
    state.counters["vs_memcpy"] = per_replica_bw / memcpy_bw;
    state.SetLabel(std::string(kernels::simd::to_string(kernels::simd::active())));
}

// The four host passes of one replica's step (statistics, normalize, backward sums, dx written
// over x, as the layer does) alone, on the same x, y and dy every iteration: the step above
// without the module, the collectives and the replica threads.
void BM_SyncBatchNormPasses(benchmark::State& state) {
    const std::int64_t N = state.range(0), C = state.range(1), HW = state.range(2);
    const kernels::host::BnGeometry g{N, C, HW * HW, state.range(3) != 0};
    const auto count = static_cast<std::size_t>(N * C * HW * HW);
    std::vector<float> x(count), dy(count), y(count);
    std::mt19937 gen(1);
    std::normal_distribution<float> dist;
    for (auto& v : x) v = dist(gen);
    for (auto& v : dy) v = dist(gen);
    // Constants that keep every value where it is: mean 0, scale 1, dx = dy * 0 + x * 1 + 0.
    const std::vector<float> zero(static_cast<std::size_t>(C), 0.0f), one(static_cast<std::size_t>(C), 1.0f);
    std::vector<double> payload(static_cast<std::size_t>(2 * C + 1));
    const auto bytes = count * sizeof(float);
    const double memcpy_bw = lockstep::bench::memcpy_bandwidth(bytes);
    double seconds = 0;
    for (auto _ : state) {
        const auto t0 = std::chrono::steady_clock::now();
        kernels::host::bn_local_stats(x.data(), g, zero.data(), payload.data());
        kernels::host::bn_normalize(x.data(), y.data(), g, zero.data(), one.data(), zero.data());
        kernels::host::bn_backward_sums(x.data(), dy.data(), g, zero.data(), zero.data(), payload.data());
        kernels::host::bn_backward_dx(x.data(), dy.data(), x.data(), g, zero.data(), zero.data(), one.data(), zero.data());
        benchmark::DoNotOptimize(x.data());
        benchmark::ClobberMemory();
        seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    const double bw = 5.0 * static_cast<double>(bytes) * static_cast<double>(state.iterations()) / seconds;
    state.SetBytesProcessed(static_cast<std::int64_t>(5 * bytes) * state.iterations());
    state.counters["replica_GBps"] = bw / 1e9;
    state.counters["vs_memcpy"] = bw / memcpy_bw;
    state.SetLabel(std::string(kernels::simd::to_string(kernels::simd::active())));
}

// (N, C, H=W, layout 0=NCHW 1=NHWC, replicas): the global batch is split over the replicas.
BENCHMARK(BM_SyncBatchNorm)
    ->ArgNames({"N", "C", "HW", "nhwc", "replicas"})
    ->ArgsProduct({{64}, {64}, {28}, {0, 1}, {1, 2}})
    ->ArgsProduct({{32}, {256}, {14}, {0, 1}, {1, 2}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

BENCHMARK(BM_SyncBatchNormPasses)
    ->ArgNames({"N", "C", "HW", "nhwc"})
    ->ArgsProduct({{64}, {64}, {28}, {0, 1}})
    ->ArgsProduct({{32}, {256}, {14}, {0, 1}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
