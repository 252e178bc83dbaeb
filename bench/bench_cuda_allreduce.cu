// SPDX-License-Identifier: MIT
//! The CUDA replica group's all-reduce (comm::CudaGroup): latency of SyncBatchNorm's payload
//! (129 doubles, the size of a SyncBatchNorm collective at C = 64) and bus bandwidth at 25 MiB of floats, through the group (the host
//! rendezvous, then the enqueue) against the bare device call (ncclAllReduce on communicators of
//! its own, or the rank-order kernel where replicas share a GPU) in the same process. Reports
//! `rendezvous_overhead`, group time over bare time (goal <= 1.2 at the 129-double payload). Replicas:
//! every GPU where there are at least 2 (NCCL), else 2 on cuda:0 (the device-local group). Each
//! measurement is 100 collectives per replica, then one wait for the replica's stream.
//! The device-local group also runs its device calls alone (`calls`: one thread makes every
//! replica's calls of a collective in the group's order, with no host rendezvous), so that its
//! overhead splits into the stream events between the replicas (calls over bare) and the host
//! rendezvous (group over calls).
//! `BM_NcclLaunch` enqueues eager ncclAllReduce calls of the 129-double payload on blocking and on
//! non-blocking communicators (one per GPU, a 1-rank one where there is one GPU), each call
//! polled to completion as lockstep does before its next: what NCCL's launch costs either way
//! (Note [blocking communicators] in comm/cuda_group.cuh), reported as eager collectives per second.
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
    std::vector<Api::Event> ready;  // the `calls` path: each replica's buffer is final
    Api::Event done{};              // the `calls` path: the sum is written
    std::vector<int> launch_devices;                  // BM_NcclLaunch: a rank on each
    std::vector<Api::Comm> launch_comms[2];           // BM_NcclLaunch: non-blocking [0], blocking [1]
};
std::unique_ptr<World> world;
std::map<std::string, double> seconds_per_op;  // "group/129", "bare/129", ...

//! Seconds per collective of `job` on every replica, `batch` collectives a run, after a warm-up run.
template <class Job>
double seconds_per_collective(benchmark::State& state, Job&& job) {
    world->pool->run(job);  // warm-up
    double total = 0;
    for (auto _ : state) {
        const auto t0 = clock_type::now();
        world->pool->run(job);
        const double s = std::chrono::duration<double>(clock_type::now() - t0).count();
        state.SetIterationTime(s);
        total += s;
    }
    return total / (static_cast<double>(state.iterations()) * batch);
}

// How a measurement makes its collectives: the bare device call, the device-local group's device
// calls without the rendezvous, or through the group.
enum class Path { bare, calls, group };
const char* path_key(Path p) { return p == Path::bare ? "bare/" : p == Path::calls ? "calls/" : "group/"; }

template <class T>
void run_case(benchmark::State& state, Path path) {
    const auto count = static_cast<std::int64_t>(state.range(0));
    World& w = *world;
    const int n = static_cast<int>(w.devices.size());
    std::vector<std::unique_ptr<Tensor<T, Cuda>>> bufs(static_cast<std::size_t>(n));
    w.pool->run([&](int r) { bufs[static_cast<std::size_t>(r)] = std::make_unique<Tensor<T, Cuda>>(Shape{count}); });
    const bool local = w.group->mode() == comm::StreamGroupMode::local;
    const auto dtype = comm::dtype_of<T>();
    const auto job = [&](int r) {
        const auto ur = static_cast<std::size_t>(r);
        // The calls path: replica 0's thread makes every replica's calls, as the group orders
        // them, and waits for every stream; the other threads have nothing to do.
        if (path == Path::calls && r != 0) return;
        auto& buf = *bufs[ur];
        for (int i = 0; i < batch; ++i) {
            if (path == Path::group) {
                w.group->communicator(r).all_reduce_sum(DeviceSpan(buf),
                                                        comm::CollectiveSite::user(static_cast<std::uint64_t>(i)));
            } else if (path == Path::calls) {
                std::vector<void*> all;
                for (auto& b : bufs) all.push_back(b->data());
                for (int k = 1; k < n; ++k) {
                    Api::record(w.ready[static_cast<std::size_t>(k)], w.ex[static_cast<std::size_t>(k)].stream);
                    Api::wait(w.ex[0].stream, w.ready[static_cast<std::size_t>(k)]);
                }
                Api::rank_sum(w.devices[0].index, w.ex[0].stream, all, static_cast<std::size_t>(count), dtype);
                Api::record(w.done, w.ex[0].stream);
                for (int k = 1; k < n; ++k) Api::wait(w.ex[static_cast<std::size_t>(k)].stream, w.done);
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
        const int last = path == Path::calls ? n : r + 1;
        for (int k = path == Path::calls ? 0 : r; k < last; ++k)
            kernels::Ops<Cuda>::wait(w.ex[static_cast<std::size_t>(k)], "the benchmark's collectives");
    };
    const double per_op = seconds_per_collective(state, job);
    const double bytes = static_cast<double>(count) * sizeof(T);
    state.counters["us_per_op"] = per_op * 1e6;
    state.counters["busbw_GBps"] = 2.0 * (n - 1) / n * bytes / per_op / 1e9;
    const std::string key = std::to_string(count);
    seconds_per_op[path_key(path) + key] = per_op;
    if (path != Path::bare && seconds_per_op.count("bare/" + key) != 0)
        state.counters[path == Path::group ? "rendezvous_overhead" : "vs_bare"] = per_op / seconds_per_op["bare/" + key];
    if (path == Path::group && seconds_per_op.count("calls/" + key) != 0)
        state.counters["vs_calls"] = per_op / seconds_per_op["calls/" + key];
    w.pool->run([&](int r) { bufs[static_cast<std::size_t>(r)].reset(); });
}

// Eager ncclAllReduce of 129 doubles on communicators blocking (range 1) or not, one per GPU
// (replica r's thread drives rank r); each call polled to completion, as the group does.
std::map<int, double> launch_seconds;  // by blocking
void BM_NcclLaunch(benchmark::State& state) {
    World& w = *world;
    const bool blocking = state.range(0) != 0;
    const auto& comms = w.launch_comms[blocking ? 1 : 0];
    const int ranks = static_cast<int>(comms.size());
    constexpr std::size_t count = 129;
    std::vector<std::unique_ptr<Tensor<double, Cuda>>> bufs(static_cast<std::size_t>(ranks));
    w.pool->run([&](int r) {
        if (r < ranks) bufs[static_cast<std::size_t>(r)] = std::make_unique<Tensor<double, Cuda>>(Shape{count});
    });
    const auto job = [&](int r) {
        if (r >= ranks) return;
        const auto ur = static_cast<std::size_t>(r);
        static const std::atomic<bool> never{false};
        for (int i = 0; i < batch; ++i)
            Api::all_reduce(comms[ur], bufs[ur]->data(), count, comm::DType::f64, w.ex[ur].stream,
                            clock_type::now() + std::chrono::seconds(60), never);
        kernels::Ops<Cuda>::wait(w.ex[ur], "the benchmark's collectives");
    };
    const double per_op = seconds_per_collective(state, job);
    state.counters["collectives_per_s"] = 1.0 / per_op;
    launch_seconds[blocking ? 1 : 0] = per_op;
    w.pool->run([&](int r) {
        if (r < ranks) bufs[static_cast<std::size_t>(r)].reset();
    });
}

template <Path P>
void BM_Path(benchmark::State& state) {
    if (state.range(0) == 129)
        run_case<double>(state, P);
    else
        run_case<float>(state, P);
}
// 129 doubles: about a SyncBatchNorm collective at C = 64 (C + 1 and 2C forward, 2C backward); 6553600 floats: 25 MiB, a gradient bucket.
// Registered in this order (bare, calls where the group is device-local, group): each ratio
// needs its baseline measured first.
void register_paths(bool local) {
    const auto add = [](const char* bm, void (*fn)(benchmark::State&)) {
        benchmark::RegisterBenchmark(bm, fn)->ArgName("count")->Arg(129)->Arg(6553600)->UseManualTime()->Unit(
            benchmark::kMicrosecond);
    };
    add("BM_Bare", BM_Path<Path::bare>);
    if (local) add("BM_Calls", BM_Path<Path::calls>);
    add("BM_Group", BM_Path<Path::group>);
    benchmark::RegisterBenchmark("BM_NcclLaunch", BM_NcclLaunch)->ArgName("blocking")->Arg(0)->Arg(1)->UseManualTime()->Unit(
        benchmark::kMicrosecond);
}

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
        // BM_NcclLaunch: a rank per GPU (the replicas' devices, each once), both kinds.
        for (const auto& d : w.devices)
            if (std::find(w.launch_devices.begin(), w.launch_devices.end(), d.index) == w.launch_devices.end())
                w.launch_devices.push_back(d.index);
        for (const bool blocking : {false, true}) {
            static const std::atomic<bool> never{false};
            w.launch_comms[blocking ? 1 : 0] =
                Api::init(w.launch_devices, Api::unique_id(), 0, static_cast<int>(w.launch_devices.size()),
                          clock_type::now() + std::chrono::seconds(60), never, blocking);
        }
        const bool local = w.group->mode() == comm::StreamGroupMode::local;
        if (local) {
            w.ready.push_back(nullptr);  // replica 0's buffer needs no event: its stream runs the sum
            for (int r = 1; r < n; ++r) w.ready.push_back(Api::make_event(w.devices[0].index));
            w.done = Api::make_event(w.devices[0].index);
        }
        register_paths(local);
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
    // The device-local group's overhead split: its stream events, and the host rendezvous.
    for (const char* key : {"129", "6553600"})
        if (seconds_per_op.count(std::string("calls/") + key) != 0 && seconds_per_op.count(std::string("group/") + key) != 0 &&
            seconds_per_op.count(std::string("bare/") + key) != 0)
            std::printf(
                "device-local split at %s elements: device calls alone vs bare %.3f, through the group vs calls alone %.3f\n",
                key, seconds_per_op[std::string("calls/") + key] / seconds_per_op[std::string("bare/") + key],
                seconds_per_op[std::string("group/") + key] / seconds_per_op[std::string("calls/") + key]);
    if (launch_seconds.count(0) != 0 && launch_seconds.count(1) != 0)
        std::printf(
            "NCCL eager collectives per second at 129 elements: blocking %.0f, non-blocking %.0f (non-blocking over blocking "
            "time %.2f)\n",
            1.0 / launch_seconds[1], 1.0 / launch_seconds[0], launch_seconds[0] / launch_seconds[1]);
    for (auto& c : world->bare_comms) Api::destroy(c);
    for (auto& comms : world->launch_comms)
        for (auto& c : comms) Api::destroy(c);
    for (auto& e : world->ready) Api::destroy_event(world->devices[0].index, e);
    Api::destroy_event(world->devices[0].index, world->done);
    world->pool.reset();
    world.reset();
    return 0;
}
