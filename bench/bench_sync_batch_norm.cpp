// SPDX-License-Identifier: MIT
//! SyncBatchNorm training forward + backward on host replicas. Effective bandwidth counts the
//! minimum traffic (5 x tensor bytes: read x twice, write y, read dy, write dx is the classic
//! figure) and `vs_memcpy` divides it by memcpy bandwidth measured in the same process;
//! `vs_world1` compares a replica of a multi-replica step with one replica stepping the whole
//! batch, in the same process. BM_SyncBatchNormPasses runs the same passes with no layer and no
//! collectives: its `vs_world1` is what the machine's memory system allows the layer's. The label
//! names the SIMD level of the host kernels (LOCKSTEP_SIMD=baseline|avx2|avx512 picks another).
#include <benchmark/benchmark.h>

#include <lockstep/host.hpp>
#include <lockstep/lockstep.hpp>
#include <lockstep/nn/sync_batch_norm.hpp>

#include <chrono>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "bench_util.hpp"

namespace {

using namespace lockstep;

// Fills `t` with standard normal values.
void fill_normal(Tensor<float>& t, std::mt19937& gen) {
    std::normal_distribution<float> dist;
    for (auto& v : t.span()) v = dist(gen);
}

// One training step (forward + backward) of SyncBatchNorm on `world` host replicas, the global
// batch (N, C, HW, HW) split evenly over them.
class Step {
public:
    Step(std::int64_t N, std::int64_t C, std::int64_t HW, MemoryFormat format, int world)
        : world_(world), comms_(comm::HostCommunicator::create_group(world)), pool_(world) {
        const std::int64_t per_replica = N / world;
        nn::SyncBatchNorm<> proto(C, {.format = format});
        bns_.assign(static_cast<std::size_t>(world), proto);
        std::mt19937 gen(1);
        for (int r = 0; r < world; ++r) {
            fill_normal(xs_.emplace_back(Shape{per_replica, C, HW, HW}, format), gen);
            fill_normal(dys_.emplace_back(Shape{per_replica, C, HW, HW}, format), gen);
        }
        run();  // warm up: buffers allocated and faulted in
    }

    //! Bytes of one replica's input tensor.
    std::size_t replica_bytes() const { return static_cast<std::size_t>(xs_[0].bytes()); }

    //! Runs one step on every replica and returns its wall time in seconds.
    double run() {
        const auto t0 = std::chrono::steady_clock::now();
        pool_.run([this](int r) {
            const auto ur = static_cast<std::size_t>(r);
            nn::Context<> ctx;
            ctx.rank = r;
            ctx.world = world_;
            ctx.comm = &comms_[ur];
            // The input is moved in, as a network hands over its activations; the output
            // (normalized data again, since weight = 1 and bias = 0) is the next step's input.
            auto y = bns_[ur].forward(ctx, std::move(xs_[ur]));
            auto dx = bns_[ur].backward(ctx, dys_[ur]);
            benchmark::DoNotOptimize(dx.data());
            xs_[ur] = std::move(y);
        });
        return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }

private:
    int world_;
    std::vector<comm::HostCommunicator> comms_;
    ReplicaPool pool_;
    std::vector<nn::SyncBatchNorm<>> bns_;
    std::vector<Tensor<float>> xs_, dys_;
};

// The four host passes of each replica's step (statistics, normalize, backward sums, dx written
// over x, as the layer does) on `world` replica threads with no module and no collectives, the
// global batch split evenly: what the memory system allows the step, to set beside Step's figures.
// As in the layer, y becomes the next step's x (so x is not left in cache by the previous dx).
class Passes {
public:
    Passes(std::int64_t N, std::int64_t C, std::int64_t HW, MemoryFormat format, int world)
        : g_{N / world, C, HW * HW, format == MemoryFormat::nhwc},
          pool_(world),
          zero_(static_cast<std::size_t>(C), 0.0f),
          one_(static_cast<std::size_t>(C), 1.0f) {
        // Tensors, not vectors: the same allocator (and pages) as the layer's.
        const Shape shape{g_.batch * C * g_.inner};
        std::mt19937 gen(1);
        replicas_.resize(static_cast<std::size_t>(world));
        for (auto& r : replicas_) {
            r.x = Tensor<float>(shape);
            r.dy = Tensor<float>(shape);
            r.y = Tensor<float>(shape);
            r.payload.resize(static_cast<std::size_t>(3 * C + 1));
            r.shift.resize(static_cast<std::size_t>(C));
            fill_normal(r.x, gen);
            fill_normal(r.dy, gen);
        }
        run();
    }

    std::size_t replica_bytes() const { return static_cast<std::size_t>(replicas_[0].x.bytes()); }

    double run() {
        const auto t0 = std::chrono::steady_clock::now();
        pool_.run([this](int rank) {
            auto& r = replicas_[static_cast<std::size_t>(rank)];
            // Constants that keep every value where it is: mean 0, scale 1, dx = dy * 0 + x * 1 + 0.
            const float* z = zero_.data();
            kernels::host::bn_local_stats(r.x.data(), g_, r.shift.data(), r.payload.data());
            kernels::host::bn_centre(g_, r.shift.data(), r.payload.data());
            kernels::host::bn_normalize(r.x.data(), r.y.data(), g_, z, one_.data(), z);
            kernels::host::bn_backward_sums(r.x.data(), r.dy.data(), g_, z, z, r.payload.data());
            kernels::host::bn_backward_dx(r.x.data(), r.dy.data(), r.x.data(), g_, z, z, one_.data(), z);
            benchmark::DoNotOptimize(r.x.data());
            benchmark::ClobberMemory();
            std::swap(r.x, r.y);
        });
        return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }

private:
    struct Replica {
        Tensor<float> x, dy, y;
        std::vector<double> payload;
        std::vector<float> shift;
    };
    kernels::BnGeometry g_;
    ReplicaPool pool_;
    std::vector<float> zero_, one_;
    std::vector<Replica> replicas_;
};

// Both benchmarks report replica_GBps (5 x a replica's tensor bytes per second of step),
// vs_memcpy (that divided by one thread's memcpy bandwidth over the same bytes) and, for more
// than one replica, vs_world1: per-replica bandwidth divided by that of one replica stepping the
// whole batch, the two alternated step by step in this process so that both see the same machine.
template <class Workload>
void run_steps(benchmark::State& state) {
    const std::int64_t N = state.range(0), C = state.range(1), HW = state.range(2);
    const auto format = state.range(3) == 0 ? MemoryFormat::nchw : MemoryFormat::nhwc;
    const int world = static_cast<int>(state.range(4));
    Workload work(N, C, HW, format, world);
    std::optional<Workload> single;
    if (world > 1) single.emplace(N, C, HW, format, 1);
    const auto bytes = work.replica_bytes();
    const double memcpy_bw = lockstep::bench::memcpy_bandwidth(bytes);
    double seconds = 0, single_seconds = 0;
    for (auto _ : state) {
        const double s = work.run();
        state.SetIterationTime(s);
        seconds += s;
        if (single) single_seconds += single->run();
    }
    const auto iterations = static_cast<double>(state.iterations());
    const double per_replica_bw = 5.0 * static_cast<double>(bytes) * iterations / seconds;
    state.SetBytesProcessed(static_cast<std::int64_t>(5 * bytes * static_cast<std::size_t>(world)) * state.iterations());
    state.counters["replica_GBps"] = per_replica_bw / 1e9;
    state.counters["vs_memcpy"] = per_replica_bw / memcpy_bw;
    if (single) {
        const double single_bw = 5.0 * static_cast<double>(single->replica_bytes()) * iterations / single_seconds;
        state.counters["vs_world1"] = per_replica_bw / single_bw;
    }
    state.SetLabel(std::string(kernels::simd::to_string(kernels::simd::active())));
}

void BM_SyncBatchNorm(benchmark::State& state) { run_steps<Step>(state); }
void BM_SyncBatchNormPasses(benchmark::State& state) { run_steps<Passes>(state); }

// (N, C, H=W, layout 0=NCHW 1=NHWC, replicas): the global batch is split over the replicas.
BENCHMARK(BM_SyncBatchNorm)
    ->ArgNames({"N", "C", "HW", "nhwc", "replicas"})
    ->ArgsProduct({{64}, {64}, {28}, {0, 1}, {1, 2}})
    ->ArgsProduct({{32}, {256}, {14}, {0, 1}, {1, 2}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

BENCHMARK(BM_SyncBatchNormPasses)
    ->ArgNames({"N", "C", "HW", "nhwc", "replicas"})
    ->ArgsProduct({{64}, {64}, {28}, {0, 1}, {1, 2}})
    ->ArgsProduct({{32}, {256}, {14}, {0, 1}, {1, 2}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
