// SPDX-License-Identifier: MIT
//! The CUDA replica group's all-reduce (comm::CudaGroup): latency of SyncBatchNorm's payload
//! (2C + 1 doubles, C = 64) and bus bandwidth at 25 MiB of floats, through the group (the host
//! rendezvous, then the enqueue) against the bare device call (ncclAllReduce on communicators of
//! its own, or the rank-order kernel where replicas share a GPU) in the same process. Reports
//! `rendezvous_overhead`, group time over bare time (goal <= 1.2 at the 2C + 1 payload). Replicas:
//! every GPU where there are at least 2 (NCCL), else 2 on cuda:0 (the device-local group). Each
//! measurement is 100 collectives per replica, then one wait for the replica's stream.
#include <benchmark/benchmark.h>

#include <lockstep/cuda.cuh>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "bench_util.hpp"

namespace {

using namespace lockstep;
using Api = comm::NcclApi;
using clock_type = std::chrono::steady_clock;

constexpr int batch = 100;  // collectives per measurement

struct World {
    std::vector<Device> devices;
    std::unique_ptr<comm::CudaGroup> group;
    std::vector<Api::Comm> bare_comms;  // peer mode: communicators of the bare path
    std::vector<std::unique_ptr<kernels::Ops<Cuda>::ReplicaResources>> res;
    std::vector<Execution<Cuda>> ex;
    std::unique_ptr<ReplicaPool> pool;
};
std::unique_ptr<World> world;
std::map<std::string, double> seconds_per_op;  // "group/129", "bare/129", ...

template <class T>
void run_case(benchmark::State& state, bool through_group) {
    const auto count = static_cast<std::int64_t>(state.range(0));
    World& w = *world;
    const int n = static_cast<int>(w.devices.size());
    std::vector<std::unique_ptr<Tensor<T, Cuda>>> bufs(static_cast<std::size_t>(n));
    w.pool->run([&](int r) { bufs[static_cast<std::size_t>(r)] = std::make_unique<Tensor<T, Cuda>>(Shape{count}); });
    const bool local = w.group->mode() == comm::StreamGroupMode::local;
    const auto dtype = comm::dtype_of<T>();
    const auto job = [&](int r) {
        const auto ur = static_cast<std::size_t>(r);
        auto& buf = *bufs[ur];
        for (int i = 0; i < batch; ++i) {
            if (through_group) {
                w.group->communicator(r).all_reduce_sum(DeviceSpan(buf),
                                                        comm::CollectiveSite::user(static_cast<std::uint64_t>(i)));
            } else if (!local) {
                static const std::atomic<bool> never{false};
                Api::all_reduce(w.bare_comms[ur], buf.data(), static_cast<std::size_t>(count), dtype, w.ex[ur].stream,
                                clock_type::now() + std::chrono::seconds(60), never);
            } else if (r == 0) {
                std::vector<void*> all;
                for (auto& b : bufs) all.push_back(b->data());
                Api::rank_sum(w.devices[0].index, w.ex[0].stream, all, static_cast<std::size_t>(count), dtype);
            }
        }
        kernels::Ops<Cuda>::wait(w.ex[ur], "the benchmark's collectives");
    };
    w.pool->run(job);  // warm-up
    double total = 0;
    for (auto _ : state) {
        const auto t0 = clock_type::now();
        w.pool->run(job);
        const double s = std::chrono::duration<double>(clock_type::now() - t0).count();
        state.SetIterationTime(s);
        total += s;
    }
    const double per_op = total / (static_cast<double>(state.iterations()) * batch);
    const double bytes = static_cast<double>(count) * sizeof(T);
    state.counters["us_per_op"] = per_op * 1e6;
    state.counters["busbw_GBps"] = 2.0 * (n - 1) / n * bytes / per_op / 1e9;
    const std::string key = std::to_string(count);
    seconds_per_op[(through_group ? "group/" : "bare/") + key] = per_op;
    if (through_group && seconds_per_op.count("bare/" + key) != 0)
        state.counters["rendezvous_overhead"] = per_op / seconds_per_op["bare/" + key];
    w.pool->run([&](int r) { bufs[static_cast<std::size_t>(r)].reset(); });
}

void BM_Bare(benchmark::State& state) {
    if (state.range(0) == 129)
        run_case<double>(state, false);
    else
        run_case<float>(state, false);
}
void BM_Group(benchmark::State& state) {
    if (state.range(0) == 129)
        run_case<double>(state, true);
    else
        run_case<float>(state, true);
}
// 129 doubles: SyncBatchNorm's 2C + 1 at C = 64; 6553600 floats: 25 MiB, a gradient bucket.
BENCHMARK(BM_Bare)->ArgName("count")->Arg(129)->Arg(6553600)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_Group)->ArgName("count")->Arg(129)->Arg(6553600)->UseManualTime()->Unit(benchmark::kMicrosecond);

}  // namespace

int main(int argc, char** argv) {
    const int gpus = lockstep::cuda::device_count();
    if (const auto done = lockstep::bench::start_gpu_benchmark(gpus, &argc, argv)) return *done;
    try {
        world = std::make_unique<World>();
        World& w = *world;
        if (gpus >= 2)
            for (int g = 0; g < gpus; ++g) w.devices.push_back(Device::cuda(g));
        else
            w.devices = {Device::cuda(0), Device::cuda(0)};
        const int n = static_cast<int>(w.devices.size());
        w.group = std::make_unique<comm::CudaGroup>(w.devices, std::chrono::seconds(60));
        if (w.group->mode() == comm::StreamGroupMode::peer) {
            std::vector<int> idx;
            for (const auto& d : w.devices) idx.push_back(d.index);
            static const std::atomic<bool> never{false};
            w.bare_comms = Api::init(idx, Api::unique_id(), 0, static_cast<int>(idx.size()),
                                     clock_type::now() + std::chrono::seconds(60), never);
        }
        w.res.resize(static_cast<std::size_t>(n));
        w.ex.resize(static_cast<std::size_t>(n));
        w.pool = std::make_unique<ReplicaPool>(n, [&w](int r) {
            const auto ur = static_cast<std::size_t>(r);
            w.res[ur] = std::make_unique<kernels::Ops<Cuda>::ReplicaResources>(w.devices[ur]);
            w.res[ur]->bind_thread();
        });
        w.pool->run([&w](int r) {
            const auto ur = static_cast<std::size_t>(r);
            w.ex[ur] = w.res[ur]->execution();
            w.group->bind(r, w.ex[ur]);
        });
        benchmark::AddCustomContext("replicas", std::to_string(n) + " (" + comm::to_string(w.group->mode()) + " group)");
    } catch (const std::exception& e) {
        std::fprintf(stderr, "bench_cuda_allreduce: %s\n", e.what());
        return 1;
    }
    benchmark::RunSpecifiedBenchmarks();
    benchmark::Shutdown();
    for (const char* key : {"129", "6553600"})
        if (seconds_per_op.count(std::string("group/") + key) != 0 && seconds_per_op.count(std::string("bare/") + key) != 0)
            std::printf("rendezvous_overhead at %s elements: %.3f%s\n", key,
                        seconds_per_op[std::string("group/") + key] / seconds_per_op[std::string("bare/") + key],
                        std::string(key) == "129" ? " (goal <= 1.2)" : "");
    for (auto& c : world->bare_comms) Api::destroy(c);
    world->pool.reset();
    world.reset();
    return 0;
}
