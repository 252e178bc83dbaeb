// SPDX-License-Identifier: MIT
//! Host all-reduce bandwidth, reported as bus bandwidth (nccl-tests' definition) and as a ratio
//! to memcpy bandwidth measured in the same process (`vs_memcpy`); and the crossing of the
//! rendezvous every collective passes (AbortableBarrier) against C++20's std::barrier on the same
//! replica threads in the same process (`vs_std_barrier`: its time over ours, above 1 is faster).
#include <benchmark/benchmark.h>

#include <lockstep/lockstep.hpp>

#include <barrier>
#include <chrono>
#include <map>
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

// Crossings of a barrier by `replicas` replica threads, 1000 a measurement (the pool's start and
// join amortised); std::barrier first, so that ours has its baseline.
std::map<int, double> std_barrier_ns;  // by replicas

template <bool Ours>
void BM_BarrierCrossing(benchmark::State& state) {
    constexpr int crossings = 1000;
    const int replicas = static_cast<int>(state.range(0));
    lockstep::ReplicaPool pool(replicas);
    lockstep::AbortableBarrier ours(replicas, std::chrono::seconds(60));
    std::barrier theirs(replicas);
    const auto job = [&](int r) {
        for (int i = 0; i < crossings; ++i) {
            if constexpr (Ours)
                ours.arrive_and_wait(r);
            else
                theirs.arrive_and_wait();
        }
    };
    pool.run(job);  // warm up: threads awake
    double seconds = 0;
    for (auto _ : state) {
        const auto t0 = std::chrono::steady_clock::now();
        pool.run(job);
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        state.SetIterationTime(s);
        seconds += s;
    }
    const double ns = seconds / (static_cast<double>(state.iterations()) * crossings) * 1e9;
    state.counters["ns_per_crossing"] = ns;
    if (!Ours) std_barrier_ns[replicas] = ns;
    if (Ours && std_barrier_ns.count(replicas) != 0) state.counters["vs_std_barrier"] = std_barrier_ns[replicas] / ns;
}

BENCHMARK(BM_BarrierCrossing<false>)->Name("BM_StdBarrierCrossing")->ArgName("replicas")->Arg(2)->Arg(4)->UseManualTime();
BENCHMARK(BM_BarrierCrossing<true>)->Name("BM_BarrierCrossing")->ArgName("replicas")->Arg(2)->Arg(4)->UseManualTime();

}  // namespace

BENCHMARK_MAIN();
