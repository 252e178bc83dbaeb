// SPDX-License-Identifier: MIT
//! comm::MpiCommunicator's all-reduce against MPI_Allreduce itself, in the same processes: run it
//! under mpirun (`mpirun -np 2 build/release/bench/bench_mpi_allreduce`). SyncBatchNorm's payload
//! (129 doubles, the size of a SyncBatchNorm collective at C = 64) for latency and 25 MiB of floats (a gradient bucket) for bus bandwidth.
//! Reports `vs_mpi`: MPI_Allreduce's time over lockstep's (goal >= 0.8 at 25 MiB: lockstep adds in
//! rank order to stay bit-deterministic, MPI_Allreduce may not). Rank 0 prints; every process runs
//! the same fixed iterations, so the collectives pair up.
#include <benchmark/benchmark.h>

#include <lockstep/mpi.hpp>

#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace {

using namespace lockstep;

std::unique_ptr<comm::MpiCommunicator> comm_;
std::map<std::string, double> seconds;  // "lockstep/129", "mpi/129", ...

template <class T>
void run(benchmark::State& state, bool ours) {
    const auto count = static_cast<std::size_t>(state.range(0));
    std::vector<T> data(count, T(1));
    MPI_Barrier(MPI_COMM_WORLD);
    double total = 0;
    for (auto _ : state) {
        const auto t0 = std::chrono::steady_clock::now();
        if (ours)
            comm_->all_reduce_sum(std::span<T>(data));
        else
            MPI_Allreduce(MPI_IN_PLACE, data.data(), static_cast<int>(count), sizeof(T) == 4 ? MPI_FLOAT : MPI_DOUBLE, MPI_SUM,
                          MPI_COMM_WORLD);
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        state.SetIterationTime(s);
        total += s;
        std::fill(data.begin(), data.end(), T(1));  // keep the values finite
    }
    const double per = total / static_cast<double>(state.iterations());
    const int n = comm_->size();
    state.counters["busbw_GBps"] = 2.0 * (n - 1) / n * static_cast<double>(count * sizeof(T)) / per / 1e9;
    state.counters["us_per_op"] = per * 1e6;
    const std::string key = std::to_string(count);
    seconds[(ours ? "lockstep/" : "mpi/") + key] = per;
    if (ours && seconds.count("mpi/" + key) != 0) state.counters["vs_mpi"] = seconds["mpi/" + key] / per;
}

void BM_MpiAllreduce(benchmark::State& state) {
    if (state.range(0) == 129)
        run<double>(state, false);
    else
        run<float>(state, false);
}
void BM_LockstepAllreduce(benchmark::State& state) {
    if (state.range(0) == 129)
        run<double>(state, true);
    else
        run<float>(state, true);
}
// Fixed iterations: every process makes the same number of collectives.
BENCHMARK(BM_MpiAllreduce)->ArgName("count")->Arg(129)->Iterations(2000)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_MpiAllreduce)->ArgName("count")->Arg(6553600)->Iterations(20)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_LockstepAllreduce)->ArgName("count")->Arg(129)->Iterations(2000)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_LockstepAllreduce)->ArgName("count")->Arg(6553600)->Iterations(20)->UseManualTime()->Unit(benchmark::kMillisecond);

class Silent : public benchmark::BenchmarkReporter {
public:
    bool ReportContext(const Context&) override { return true; }
    void ReportRuns(const std::vector<Run>&) override {}
};

}  // namespace

int main(int argc, char** argv) {
    mpi::Environment env(&argc, &argv);
    benchmark::Initialize(&argc, argv);
    comm_ = std::make_unique<comm::MpiCommunicator>(MPI_COMM_WORLD, std::chrono::seconds(60));
    benchmark::AddCustomContext("processes", std::to_string(env.size()));
    if (env.rank() == 0) {
        benchmark::RunSpecifiedBenchmarks();
    } else {
        Silent silent;
        benchmark::RunSpecifiedBenchmarks(&silent);
    }
    benchmark::Shutdown();
    if (env.rank() == 0)
        for (const char* key : {"129", "6553600"})
            if (seconds.count(std::string("mpi/") + key) && seconds.count(std::string("lockstep/") + key))
                std::printf("vs_mpi at %s elements: %.3f%s\n", key,
                            seconds[std::string("mpi/") + key] / seconds[std::string("lockstep/") + key],
                            std::string(key) == "6553600" ? " (goal >= 0.8)" : "");
    comm_.reset();
    return 0;
}
