// SPDX-License-Identifier: MIT
//! Host all-reduce bandwidth, reported as bus bandwidth (nccl-tests' definition) and as a ratio
//! to memcpy bandwidth measured in the same process (`vs_memcpy`).
#include <benchmark/benchmark.h>

#include <lockstep/lockstep.hpp>

#include <chrono>
#include <vector>

#include "bench_util.hpp"

namespace {

void BM_HostAllReduce(benchmark::State& state) {
    const auto bytes = static_cast<std::size_t>(state.range(0));
    const int world = static_cast<int>(state.range(1));
    const std::size_t count = bytes / sizeof(float);
    auto comms = lockstep::comm::HostCommunicator::create_group(world);
    lockstep::ReplicaPool pool(world);
    std::vector<std::vector<float>> bufs(static_cast<std::size_t>(world), std::vector<float>(count, 1.0f));
    const double memcpy_bw = lockstep::bench::memcpy_bandwidth(bytes);
    auto job = [&](int r) {
        auto& b = bufs[static_cast<std::size_t>(r)];
        comms[static_cast<std::size_t>(r)].all_reduce_sum(std::span<float>(b));
        benchmark::DoNotOptimize(b.data());
    };
    pool.run(job);  // warm up: pages faulted in, threads awake
    double seconds = 0;
    for (auto _ : state) {
        const auto t0 = std::chrono::steady_clock::now();
        pool.run(job);
        seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    const double algbw = static_cast<double>(bytes) * static_cast<double>(state.iterations()) / seconds;
    const double busbw = algbw * 2.0 * (world - 1) / world;
    state.SetBytesProcessed(static_cast<std::int64_t>(bytes) * state.iterations());
    state.counters["busbw_GBps"] = busbw / 1e9;
    state.counters["memcpy_GBps"] = memcpy_bw / 1e9;
    state.counters["vs_memcpy"] = busbw / memcpy_bw;
}

BENCHMARK(BM_HostAllReduce)
    ->ArgNames({"bytes", "replicas"})
    ->ArgsProduct({{1 << 10, 1 << 20, 25 << 20}, {2, 4}})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
