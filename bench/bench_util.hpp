// SPDX-License-Identifier: MIT
//! Helpers shared by lockstep's benchmarks: memcpy bandwidth as the in-process yardstick, and the
//! start of a benchmark that needs a GPU.
#pragma once

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <optional>
#include <vector>

namespace lockstep::bench {

//! Bytes per second of `std::memcpy` over `bytes` (best of several repetitions, one thread):
//! the yardstick every `vs_memcpy` counter divides by, measured in the same process and moment.
inline double memcpy_bandwidth(std::size_t bytes) {
    bytes = std::max<std::size_t>(bytes, 4096);
    std::vector<char> src(bytes, 1), dst(bytes, 0);
    std::memcpy(dst.data(), src.data(), bytes);  // fault the pages in
    const int reps = static_cast<int>(std::clamp<std::size_t>((256u << 20) / bytes, 3, 2000));
    double best = 1e30;
    for (int round = 0; round < 5; ++round) {
        const auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < reps; ++i) {
            std::memcpy(dst.data(), src.data(), bytes);
            src[static_cast<std::size_t>(i) % bytes] =
                static_cast<char>(dst[bytes - 1 - static_cast<std::size_t>(i) % bytes] + 1);
        }
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / reps;
        best = std::min(best, s);
    }
    return static_cast<double>(bytes) / best;
}

//! The start of a benchmark that needs a GPU, given the number of GPUs: with none it prints
//! "no GPU: nothing to benchmark" (the program exits 0: the GPU check and CI read that line);
//! otherwise Google Benchmark takes its arguments (one it does not know: exit 1). Returns the
//! status to exit with, or nothing to go on and run the benchmarks.
inline std::optional<int> start_gpu_benchmark(int gpus, int* argc, char** argv) {
    if (gpus == 0) {
        std::puts("no GPU: nothing to benchmark");
        return 0;
    }
    benchmark::Initialize(argc, argv);
    if (benchmark::ReportUnrecognizedArguments(*argc, argv)) return 1;
    return std::nullopt;
}

}  // namespace lockstep::bench
