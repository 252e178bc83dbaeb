// SPDX-License-Identifier: MIT
//! DataParallel<Cuda> with one replica per device, through the host NCCL (label hostcuda): the
//! failures of the NCCL path that a machine of one GPU never reaches -- two communicators per
//! device without NCCL's launch-order rule, a rank whose stream never reaches a collective, and
//! teardown after an abort (docs/design.md, "The NCCL double").
#include <catch2/catch.hpp>

#include <lockstep/cuda.cuh>
#include <lockstep/nn.hpp>
#include <lockstep/host.hpp>
#include <lockstep/parallel.hpp>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <regex>
#include <set>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "../gpu/small_model.hpp"
#include "../host_cuda/host_cuda.hpp"
#include "../thread_processes.hpp"

using namespace lockstep;
using Clock = std::chrono::steady_clock;

namespace {

using gpu_test::make_batch;
using gpu_test::make_small;
using gpu_test::Small;

using host_cuda::Clean;

const std::vector<Device> two{Device::cuda(0), Device::cuda(1)};

DataParallelOptions options(std::chrono::milliseconds timeout) {
    DataParallelOptions o;
    o.timeout = timeout;
    o.bucket_bytes = 1024;  // 3 buckets on the communication stream, between SyncBatchNorm's collectives
    return o;
}

//! Runs `step`; meanwhile samples what the host NCCL's collectives wait for.
struct Observed {
    bool threw = false;
    std::string message;
    double seconds = 0;
    std::vector<std::string> waits;  // every distinct line nccl_waits() gave
};

template <class F>
Observed observe(F&& step) {
    Observed o;
    std::atomic<bool> done{false};
    std::mutex m;
    std::thread sampler([&] {
        while (!done.load()) {
            for (auto& line : host_cuda::nccl_waits()) {
                std::lock_guard lock(m);
                o.waits.push_back(std::move(line));
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(5));
        }
    });
    const auto t0 = Clock::now();
    try {
        step();
    } catch (const std::exception& e) {
        o.threw = true;
        o.message = e.what();
    }
    o.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    done = true;
    sampler.join();
    return o;
}

//! Whether a line says a collective has waited at least `ms` milliseconds and contains `what`.
bool waited(const std::vector<std::string>& lines, const std::string& what, long ms) {
    static const std::regex for_how_long("has waited ([0-9]+) ms");
    for (const auto& l : lines) {
        std::smatch m;
        if (l.find(what) != std::string::npos && std::regex_search(l, m, for_how_long) && std::stol(m[1].str()) >= ms)
            return true;
    }
    return false;
}

std::size_t threads_now() {
    std::size_t n = 0;
    for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/task")) ++n;
    return n;
}

//! Every tensor of checkpoint `got` holds the bits of the same tensor of `want`.
void check_same(const nn::Checkpoint& got, const nn::Checkpoint& want) {
    for (const auto& name : want.names()) {
        CAPTURE(name);
        CHECK(got.at(name).data == want.at(name).data);
    }
}

//! A replica's parameters and float buffers (the checkpoint shows replica 0's only).
std::vector<float> replica_values(const Small<Cuda>& m) {
    std::vector<float> all;
    nn::walk(
        m,
        [&](const std::string&, const auto& p) {
            const auto h = p.value.to_host();
            all.insert(all.end(), h.data(), h.data() + h.numel());
        },
        [&](const std::string&, const auto& t) {
            if constexpr (std::is_same_v<std::remove_cvref_t<decltype(t)>, Tensor<float, Cuda>>) {
                const auto h = t.to_host();
                all.insert(all.end(), h.data(), h.data() + h.numel());
            }
        });
    return all;
}

//! The small model trained eagerly and with graphs (DataParallelOptions::graphs), otherwise alike,
//! on the same devices and batches: where a captured step must end.
struct EagerAndGraphed {
    EagerAndGraphed(const std::vector<Device>& devices, DataParallelOptions o, nn::SgdOptions sgd)
        : eager(make_small<Cuda>(), devices, o), graphed(make_small<Cuda>(), devices, graphs_on(o)), sgd_eager(sgd),
          sgd_graphed(sgd) {}
    DataParallel<Small<Cuda>> eager, graphed;
    nn::Sgd<Cuda> sgd_eager, sgd_graphed;

    //! One step of each on the same batch.
    void both(const Tensor<float, Cuda>& x, const std::vector<std::int64_t>& labels) {
        (void)eager.train_step(x, labels, nn::SoftmaxCrossEntropy{}, sgd_eager);
        (void)graphed.train_step(x, labels, nn::SoftmaxCrossEntropy{}, sgd_graphed);
    }
    StepResult graphed_step(const Tensor<float, Cuda>& x, const std::vector<std::int64_t>& labels) {
        return graphed.train_step(x, labels, nn::SoftmaxCrossEntropy{}, sgd_graphed);
    }
    //! Both hold the same bits: replica 0's state and momentum, and replica 1's values.
    void check_equal() {
        check_same(graphed.checkpoint(sgd_graphed), eager.checkpoint(sgd_eager));
        CHECK(replica_values(graphed.replica(1)) == replica_values(eager.replica(1)));
    }

private:
    static DataParallelOptions graphs_on(DataParallelOptions o) {
        o.graphs = true;
        return o;
    }
};

}  // namespace

// The layer group (SyncBatchNorm, on the compute stream) and the gradient group (buckets, on the
// communication stream) are two NCCL communicators on every GPU. Their collectives may start on
// a device in either order unless NCCL orders them by the host's calls
// (NCCL_LAUNCH_ORDER_IMPLICIT, which lockstep sets unless the user did; NCCL reads it once per
// process, so each half is a case of its own): under the double's hazard model two devices that
// choose differently deadlock. Mutation-checked (release build): without prepare_nccl's setenv
// the first case fails (a deadlock, reported at the timeout); so it does with the variable set
// only after ncclGetUniqueId (issue 43, item 5), which the double, as NCCL, reads it at.
TEST_CASE("two communicators per device train under NCCL's launch-order rule", "[hostcuda]") {
    Clean clean;
    REQUIRE(host_cuda::set_device_count(2));
    host_cuda::set_nccl_hazard(true);
    ::unsetenv("NCCL_LAUNCH_ORDER_IMPLICIT");
    const auto b = make_batch(12, 21);
    const auto x = b.x.to<Cuda>(Device::cuda(0));
    DataParallel<Small<Cuda>> dp(make_small<Cuda>(), two, options(std::chrono::seconds(10)));
    nn::Sgd<Cuda> sgd({.lr = 0.05, .momentum = 0.9});
    for (int s = 0; s < 6; ++s) {
        CAPTURE(s, host_cuda::seed());
        CHECK_NOTHROW(dp.train_step(x, b.labels, nn::SoftmaxCrossEntropy{}, sgd));
    }
}

TEST_CASE("two communicators per device without NCCL's launch-order rule deadlock, and the step fails within the timeout",
          "[hostcuda]") {
    Clean clean;
    REQUIRE(host_cuda::set_device_count(2));
    host_cuda::set_nccl_hazard(true);
    ::setenv("NCCL_LAUNCH_ORDER_IMPLICIT", "0", 1);  // the user's setting is kept: the devices choose
    const auto b = make_batch(12, 21);
    const auto x = b.x.to<Cuda>(Device::cuda(0));
    DataParallel<Small<Cuda>> dp(make_small<Cuda>(), two, options(std::chrono::seconds(4)));
    nn::Sgd<Cuda> sgd({.lr = 0.05, .momentum = 0.9});
    Observed o;
    int steps = 0;
    for (; steps < 20 && !o.threw; ++steps)
        o = observe([&] { (void)dp.train_step(x, b.labels, nn::SoftmaxCrossEntropy{}, sgd); });
    CAPTURE(steps, o.message, o.seconds, host_cuda::seed());
    REQUIRE(o.threw);
    CHECK(o.seconds < 12.0);
    CHECK(o.message.find("took longer than 4000 ms") != std::string::npos);
    // The double saw the deadlock: a rank stood for a second behind a collective its device ran
    // first, which waited for a peer that had started the other one.
    CHECK(waited(o.waits, "its device runs another collective first", 1000));
    ::setenv("NCCL_LAUNCH_ORDER_IMPLICIT", "1", 1);
}

#if LOCKSTEP_WITH_CUDNN
namespace {
// Two steps of Small on two devices at `batch` (shards a shape no other case of this process
// meets) in `precision`: every convolution call of that shard size was cuDNN's in that precision,
// on both devices, and each direction ran one algorithm.
void expect_one_cudnn_choice(std::int64_t batch, std::uint64_t seed, Precision precision) {
    const auto b = make_batch(batch, seed);
    const auto x = b.x.to<Cuda>(Device::cuda(0));
    auto o = options(std::chrono::seconds(10));
    o.precision = precision;
    DataParallel<Small<Cuda>> dp(make_small<Cuda>(), two, o);
    nn::Sgd<Cuda> sgd({.lr = 0.05, .momentum = 0.9});
    for (int s = 0; s < 2; ++s) CHECK_NOTHROW(dp.train_step(x, b.labels, nn::SoftmaxCrossEntropy{}, sgd));
    std::map<char, std::set<int>> algorithms;
    std::set<int> devices;
    std::size_t calls = 0, in_precision = 0;
    for (const auto& c : host_cuda::cudnn_calls())
        if (c.n == batch / 2) {
            algorithms[c.direction].insert(c.algorithm), devices.insert(c.device), ++calls;
            if (c.bf16 == (precision == Precision::bf16)) ++in_precision;
        }
    CHECK(calls == 2 * 2 * 3);  // two steps, two replicas, three directions
    CHECK(in_precision == calls);
    CHECK(devices == std::set<int>{0, 1});
    for (const char d : {'f', 'd', 'w'}) {
        CAPTURE(d);
        CHECK(algorithms[d].size() == 1);
    }
}
}  // namespace

// Issue 27 (Note [cuDNN convolutions]): each replica asking cuDNN's heuristics for itself would run
// different algorithms where its GPU ranks them differently (the double rotates its ranking by
// device), and replicas would no longer be bit-identical. The process chooses once per shape,
// with the first replica that meets it, and every replica runs that choice.
TEST_CASE("replicas on different devices run the cuDNN algorithms the process chose once", "[hostcuda]") {
    Clean clean;
    REQUIRE(host_cuda::set_device_count(2));
    expect_one_cudnn_choice(14, 24, Precision::fp32);  // shards of 7
}

// The same under Precision::bf16: cuDNN's bf16 configuration has its own choices (the table is
// keyed by the data type), made once and run by every replica.
TEST_CASE("replicas on different devices run the bf16 cuDNN algorithms the process chose once", "[hostcuda]") {
    Clean clean;
    REQUIRE(host_cuda::set_device_count(2));
    expect_one_cudnn_choice(18, 25, Precision::bf16);  // shards of 9
}
#endif

// Issue 27, item 3 (Note [graphs] in core/cuda_graph.cuh): a replica's forward and backward
// captured once, SyncBatchNorm's collectives with them. The host rendezvous of the replica
// threads happens at capture; at each launch the captured collectives meet their peers' on the
// devices alone, and every replica gets the eager step's bits (outputs, gradients, dx and the
// running statistics it updates). A capture that ran its work, dropped a node, or a collective
// numbered at capture instead of at each launch, would not.
TEST_CASE("replicas' graphs of forward and backward meet in SyncBatchNorm's collectives at each launch", "[hostcuda]") {
    Clean clean;
    REQUIRE(host_cuda::set_device_count(2));
    DataParallel<Small<Cuda>> dp(make_small<Cuda>(), two, options(std::chrono::seconds(10)));
    const auto b = make_batch(10, 41);  // shards of 5
    struct Replica {
        Tensor<float, Cuda> x, dy, dx;  // what the graph reads and writes: made before its capture
        std::vector<Tensor<float, Cuda>> floats;
        std::vector<Tensor<std::int64_t, Cuda>> counts;   // the buffers as the eager steps found them
        std::vector<std::vector<float>> eager, replayed;  // read on the replica threads, checked here
        cuda::Graph graph;
    };
    std::vector<Replica> reps(2);
    const auto values_of = [](const auto& t) {
        const auto h = t.to_host();
        return std::vector<float>(h.data(), h.data() + h.numel());
    };
    // After a step: dx, every gradient, every float buffer (the running statistics).
    const auto snapshot = [&](Small<Cuda>& m, Replica& rep) {
        auto all = values_of(rep.dx);
        nn::for_each_parameter(m, [&](const std::string&, auto& p) {
            const auto v = values_of(p.grad);
            all.insert(all.end(), v.begin(), v.end());
        });
        nn::for_each_buffer(m, [&](const std::string&, auto& t) {
            if constexpr (std::is_same_v<std::remove_cvref_t<decltype(t)>, Tensor<float, Cuda>>) {
                const auto v = values_of(t);
                all.insert(all.end(), v.begin(), v.end());
            }
        });
        return all;
    };
    const auto step = [](Small<Cuda>& m, nn::Context<Cuda>& ctx, Replica& rep) {
        (void)m.forward(ctx, Tensor<float, Cuda>(rep.x));
        auto dx = m.backward(ctx, Tensor<float, Cuda>(rep.dy));
        LOCKSTEP_CUDA_CHECK(
            cudaMemcpyAsync(rep.dx.data(), dx.data(), rep.dx.numel() * sizeof(float), cudaMemcpyDeviceToDevice, ctx.exec.stream));
    };
    dp.parallel_apply([&](Small<Cuda>& m, nn::Context<Cuda>& ctx) {
        auto& rep = reps[static_cast<std::size_t>(ctx.local_rank)];
        const auto device = Device::cuda(ctx.exec.device);
        Tensor<float, Host> x(Shape{5, 2, 10, 10}), dy(Shape{5, 7});
        std::copy_n(b.x.data() + 5 * 200 * ctx.local_rank, 5 * 200, x.data());
        std::mt19937 rng(static_cast<unsigned>(ctx.local_rank));
        std::normal_distribution<float> d;
        for (float& v : dy.span()) v = d(rng);
        rep.x = x.to<Cuda>(device), rep.dy = dy.to<Cuda>(device);
        rep.dx = Tensor<float, Cuda>(rep.x.shape(), MemoryFormat::nchw, device);
        nn::for_each_buffer(m, [&](const std::string&, auto& t) {
            if constexpr (std::is_same_v<std::remove_cvref_t<decltype(t)>, Tensor<float, Cuda>>)
                rep.floats.push_back(t);
            else
                rep.counts.push_back(t);
        });
        nn::zero_grad(m);
        for (int i = 0; i < 2; ++i) {  // two eager steps: the gradients and running statistics move on
            step(m, ctx, rep);
            rep.eager.push_back(snapshot(m, rep));
        }
    });
    // Back to where the eager steps began, then one capture per replica, side by side.
    std::atomic<std::uint64_t> launched{0};
    dp.parallel_apply([&](Small<Cuda>& m, nn::Context<Cuda>& ctx) {
        auto& rep = reps[static_cast<std::size_t>(ctx.local_rank)];
        std::size_t f = 0, c = 0;
        nn::for_each_buffer(m, [&](const std::string&, auto& t) {
            if constexpr (std::is_same_v<std::remove_cvref_t<decltype(t)>, Tensor<float, Cuda>>)
                t.copy_from(rep.floats[f++]);
            else
                t.copy_from(rep.counts[c++]);
        });
        nn::zero_grad(m);
        rep.dx.zero();
        kernels::Ops<Cuda>::wait(ctx.exec, "the reset");
        launched = host_cuda::launches();
        rep.graph = cuda::Graph::capture(ctx.exec.stream, [&] { step(m, ctx, rep); });
    });
    CHECK(host_cuda::launches() == launched.load());  // recorded on both replicas, run on neither
    for (int i = 0; i < 2; ++i)
        dp.parallel_apply([&, i](Small<Cuda>& m, nn::Context<Cuda>& ctx) {
            auto& rep = reps[static_cast<std::size_t>(ctx.local_rank)];
            rep.graph.launch(ctx.exec.stream);  // no host rendezvous: the collectives meet on the devices
            rep.replayed.push_back(snapshot(m, rep));
        });
    for (std::size_t r = 0; r < 2; ++r) {
        CAPTURE(r);
        REQUIRE(reps[r].replayed.size() == 2);
        CHECK(reps[r].replayed[0] == reps[r].eager[0]);
        CHECK(reps[r].replayed[1] == reps[r].eager[1]);
        CHECK(reps[r].eager[0] != reps[r].eager[1]);  // the second step moved on
    }
    CHECK(reps[0].eager[0] != reps[1].eager[0]);  // the replicas' shards differ: each its own graph
    dp.parallel_apply([&](Small<Cuda>&, nn::Context<Cuda>& ctx) { reps[static_cast<std::size_t>(ctx.local_rank)].graph = {}; });
}

// A rank whose stream stands still before a collective (a kernel that never ends) leaves its
// peer waiting in that collective on its own device; the host waits of the step end at the
// group's timeout, the step fails on both replicas, and the next one runs on rebuilt
// communicators. The double names the rank that never arrived.
TEST_CASE("a rank whose stream never reaches a collective fails the step within the timeout, named", "[hostcuda]") {
    Clean clean;
    REQUIRE(host_cuda::set_device_count(2));
    const bool check_finite = GENERATE(false, true);
    CAPTURE(check_finite);
    const auto b = make_batch(12, 22);
    const auto x = b.x.to<Cuda>(Device::cuda(0));
    auto o_ = options(std::chrono::seconds(4));
    o_.check_finite = check_finite;
    DataParallel<Small<Cuda>> dp(make_small<Cuda>(), two, o_);
    nn::Sgd<Cuda> sgd({.lr = 0.05, .momentum = 0.9});
    (void)dp.train_step(x, b.labels, nn::SoftmaxCrossEntropy{}, sgd);
    const auto before = dp.checkpoint(sgd);

    host_cuda::stall_launch(1, nullptr, 1);  // device 1's first kernel of the step: before SyncBatchNorm's all-reduce
    std::atomic<bool> done{false};
    std::thread releaser([&] {  // bounded: the stall ends even if the step never gives up
        const auto give_up = Clock::now() + std::chrono::seconds(20);
        while (!done.load() && Clock::now() < give_up) std::this_thread::sleep_for(std::chrono::milliseconds(20));
        host_cuda::release_stalls();
    });
    const Observed o = observe([&] { (void)dp.train_step(x, b.labels, nn::SoftmaxCrossEntropy{}, sgd); });
    done = true;
    releaser.join();
    CAPTURE(o.message, o.seconds);
    for (const auto& w : o.waits) UNSCOPED_INFO(w);
    REQUIRE(o.threw);
    CHECK(o.seconds < 12.0);
    CHECK(o.message.find("took longer than 4000 ms") != std::string::npos);
    CHECK(waited(o.waits, "rank 0 (device 0)", 1000));
    CHECK(waited(o.waits, "rank(s) 1 never arrived", 1000));
    if (check_finite) {  // the step's scalars are read before the commit barrier: no replica applies it
        CHECK_FALSE(dp.diverged());
        const auto after = dp.checkpoint(sgd);
        for (const auto& name : before.names()) {
            CAPTURE(name);
            CHECK(after.at(name).data == before.at(name).data);
        }
    } else {  // seen after every replica enqueued its update: both are marked, with what to do
        CHECK(dp.diverged());
        CHECK_THROWS_WITH(dp.train_step(x, b.labels, nn::SoftmaxCrossEntropy{}, sgd), Catch::Contains("load() a checkpoint"));
        dp.load(before, sgd);
    }
    CHECK_NOTHROW(dp.train_step(x, b.labels, nn::SoftmaxCrossEntropy{}, sgd));  // on rebuilt communicators
}

// After a step that aborted its communicators, destroying the DataParallel object joins every
// replica thread and ends every stream worker it made: the process has the threads it had.
TEST_CASE("teardown after an aborted step leaves no thread running", "[hostcuda]") {
    Clean clean;
    REQUIRE(host_cuda::set_device_count(2));
    const auto b = make_batch(12, 23);
    const auto x = b.x.to<Cuda>(Device::cuda(0));
    { DataParallel<Small<Cuda>> warm(make_small<Cuda>(), two); }  // the devices' legacy streams exist from here
    // Stream workers end once their destroyed streams drained: the count, once steady for 200 ms
    // (or down to `want`), within 5 s.
    const auto settle = [](std::size_t want) {
        const auto give_up = Clock::now() + std::chrono::seconds(5);
        std::size_t n = threads_now();
        auto steady_since = Clock::now();
        while (n > want && Clock::now() < give_up && Clock::now() - steady_since < std::chrono::milliseconds(200)) {
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
            if (const std::size_t now = threads_now(); now != n) n = now, steady_since = Clock::now();
        }
        return n;
    };
    const std::size_t baseline = settle(0);
    {
        DataParallel<Small<Cuda>> dp(make_small<Cuda>(), two, options(std::chrono::seconds(5)));
        nn::Sgd<Cuda> sgd({.lr = 0.05});
        (void)dp.train_step(x, b.labels, nn::SoftmaxCrossEntropy{}, sgd);
        CHECK(threads_now() > baseline);
        host_cuda::fail_nccl(0, 3);  // a bucket fails on rank 0 (after SyncBatchNorm's two): every communicator is aborted
        CHECK_THROWS(dp.train_step(x, b.labels, nn::SoftmaxCrossEntropy{}, sgd));
        host_cuda::fail_nccl(0, 0);
    }
    CHECK(settle(baseline) <= baseline);
}

// Issue 27, item 3 (Note [captured steps]): DataParallelOptions::graphs runs a replica's step as
// graph (a) (forward, loss, backward, SyncBatchNorm and bucket collectives) and graph (b)
// (clipping and the update) with the commit point between them. Each step must give the bits of
// an eager step, for a first shape, an uneven second one and the first again from the cache.
// Mutation-checked: a graph (a) without finish_buckets (its buckets never joined) fails the
// capture; clipping left out of graph (b) fails the comparison.
TEST_CASE("captured steps train as eager steps do, bit for bit, across shapes and from the cache", "[hostcuda]") {
    Clean clean;
    REQUIRE(host_cuda::set_device_count(2));
    auto o = options(std::chrono::seconds(10));
    o.clip_grad_norm = 0.5;
    DataParallel<Small<Cuda>> eager(make_small<Cuda>(), two, o);
    o.graphs = true;
    DataParallel<Small<Cuda>> graphed(make_small<Cuda>(), two, o);
    nn::Sgd<Cuda> sgd_eager({.lr = 0.05, .momentum = 0.9}), sgd_graphed({.lr = 0.05, .momentum = 0.9});
    const auto a = make_batch(10, 51), b = make_batch(9, 52);  // shards of 5 and 5, then of 5 and 4
    const auto xa = a.x.to<Cuda>(Device::cuda(0)), xb = b.x.to<Cuda>(Device::cuda(0));
    const auto step = [&](const Tensor<float, Cuda>& x, const std::vector<std::int64_t>& labels) {
        const auto e = eager.train_step(x, labels, nn::SoftmaxCrossEntropy{}, sgd_eager);
        const auto g = graphed.train_step(x, labels, nn::SoftmaxCrossEntropy{}, sgd_graphed);
        CHECK(g.loss == e.loss);
        CHECK(g.correct == e.correct);
    };
    const auto same = [&] { check_same(graphed.checkpoint(sgd_graphed), eager.checkpoint(sgd_eager)); };
    for (int i = 0; i < 5; ++i) step(xa, a.labels);
    same();
    // (a) and (b): eager (the workspace grown, the momentum buffers made), then captured and
    // launched, then launched 3 more times.
    for (int r = 0; r < 2; ++r) {
        CAPTURE(r);
        CHECK(graphed.captured_graphs(r) == 2);
        CHECK(graphed.graph_launches(r) == 8);
    }
    for (int i = 0; i < 2; ++i) step(xb, b.labels);  // a new shape: eager, then captured; (b) launched
    for (int i = 0; i < 2; ++i) step(xa, a.labels);  // the first shape's graph, from the cache
    same();
    CHECK(replica_values(graphed.replica(1)) == replica_values(eager.replica(1)));
    CHECK(graphed.captured_graphs(0) == 3);
    CHECK(graphed.graph_launches(0) == 15);
    CHECK(eager.captured_graphs(0) == 0);
}

// bf16 products (Note [precision]) in a whole DataParallel: the replicas stay bit-identical, a
// captured step gives the eager step's bits across batch sizes, the rounding reaches training
// (the losses differ from fp32's from the first step, by little), and the master weights stay
// fp32 values (their low bits set), as do the checkpoint's tensors. Mutation-checked: with the
// products left in fp32 the first loss equals fp32's.
TEST_CASE("bf16 products train with bit-identical replicas, captured as eagerly, and keep fp32 state", "[hostcuda]") {
    Clean clean;
    REQUIRE(host_cuda::set_device_count(2));
    auto o = options(std::chrono::seconds(10));
    o.math = Math::strict_fp32;
    DataParallel<Small<Cuda>> fp32(make_small<Cuda>(), two, o);
    o.precision = Precision::bf16;
    DataParallel<Small<Cuda>> eager(make_small<Cuda>(), two, o);
    o.graphs = true;
    DataParallel<Small<Cuda>> graphed(make_small<Cuda>(), two, o);
    nn::Sgd<Cuda> sgd32({.lr = 0.05, .momentum = 0.9}), sgd_eager({.lr = 0.05, .momentum = 0.9}),
        sgd_graphed({.lr = 0.05, .momentum = 0.9});
    const auto a = make_batch(10, 81), b = make_batch(16, 82);
    const auto xa = a.x.to<Cuda>(Device::cuda(0)), xb = b.x.to<Cuda>(Device::cuda(0));
    std::vector<double> losses32, losses16;
    const auto step = [&](const Tensor<float, Cuda>& x, const std::vector<std::int64_t>& labels) {
        const auto f = fp32.train_step(x, labels, nn::SoftmaxCrossEntropy{}, sgd32);
        const auto e = eager.train_step(x, labels, nn::SoftmaxCrossEntropy{}, sgd_eager);
        const auto g = graphed.train_step(x, labels, nn::SoftmaxCrossEntropy{}, sgd_graphed);
        CHECK(g.loss == e.loss);
        CHECK(g.correct == e.correct);
        losses32.push_back(f.loss);
        losses16.push_back(e.loss);
    };
    for (int i = 0; i < 4; ++i) step(xa, a.labels);
    // A larger batch grows the workspace's buffers after (a) was captured for the first shape: the
    // first shape runs eagerly again, then from a new capture.
    for (int i = 0; i < 3; ++i) step(xb, b.labels);
    for (int i = 0; i < 2; ++i) step(xa, a.labels);
    check_same(graphed.checkpoint(sgd_graphed), eager.checkpoint(sgd_eager));
    CHECK(graphed.graph_launches(0) > 8);
    CHECK(replica_values(eager.replica(0)) == replica_values(eager.replica(1)));
    CHECK(replica_values(graphed.replica(0)) == replica_values(graphed.replica(1)));
    REQUIRE(losses16.size() == losses32.size());
    CHECK(losses16[0] != losses32[0]);
    for (std::size_t i = 0; i < losses16.size(); ++i) {
        CAPTURE(i, losses16[i], losses32[i]);
        CHECK(std::abs(losses16[i] - losses32[i]) <= 0.02 * std::abs(losses32[i]));
    }
    // The master weights are fp32 values, not bf16 ones: the updates' low bits are kept.
    const auto weights = replica_values(eager.replica(0));
    CHECK(std::count_if(weights.begin(), weights.end(),
                        [](float v) { return (std::bit_cast<std::uint32_t>(v) & 0xFFFFu) != 0; }) > 0);
    const auto ck = eager.checkpoint(sgd_eager);
    for (const auto& name : ck.names()) {
        CAPTURE(name);
        CHECK((ck.at(name).dtype == "F32" || name.ends_with("num_batches_tracked")));
    }
}

// bf16 products need bf16 tensor cores (compute capability 8.0): on an older GPU DataParallel
// refuses Precision::bf16 at construction, and a layer run directly in bf16 refuses its product,
// both naming the device; bf16 gradient all-reduces need no tensor cores and are taken.
TEST_CASE("bf16 products are refused on a GPU older than compute capability 8.0, naming it", "[hostcuda]") {
    Clean clean;
    REQUIRE(host_cuda::set_device_count(2));
    REQUIRE(host_cuda::set_compute_capability(7, 5));
    auto o = options(std::chrono::seconds(5));
    o.precision = Precision::bf16;
    CHECK_THROWS_AS((DataParallel<Small<Cuda>>(make_small<Cuda>(), two, o)), UsageError);
    CHECK_THROWS_WITH((DataParallel<Small<Cuda>>(make_small<Cuda>(), two, o)),
                      Catch::Contains("DataParallelOptions::precision: bf16 needs a GPU of compute capability 8.0 or newer") &&
                          Catch::Contains("cuda:0 is 7.5"));
    o.precision = Precision::fp32;
    o.gradient_precision = Precision::bf16;
    DataParallel<Small<Cuda>> dp(make_small<Cuda>(), two, o);
    nn::Sgd<Cuda> sgd({.lr = 0.05});
    const auto a = make_batch(10, 97);
    CHECK_NOTHROW(dp.train_step(a.x.to<Cuda>(Device::cuda(0)), a.labels, nn::SoftmaxCrossEntropy{}, sgd));
    {
        kernels::Ops<Cuda>::ReplicaResources res(Device::cuda(1));
        const auto entered = res.enter();
        nn::Context<Cuda> ctx;
        ctx.exec = res.execution();
        ctx.exec.precision = Precision::bf16;
        nn::Generator g(3);
        nn::Linear<Cuda> lin(4, 3, true, g);
        CHECK_THROWS_WITH(lin.forward(ctx, Tensor<float, Cuda>(Shape{2, 4}, MemoryFormat::nchw, Device::cuda(1))),
                          Catch::Contains("Precision::bf16 products: bf16 needs a GPU of compute capability 8.0") &&
                              Catch::Contains("cuda:1 is 7.5"));
        // A convolution too, whichever engine runs it (cuDNN's bf16 configuration where built in).
        nn::Conv2d<Cuda> conv(2, 3, 3, {.padding = 1}, g);
        CHECK_THROWS_WITH(
            conv.forward(ctx, Activation<Cuda>(Tensor<float, Cuda>(Shape{2, 2, 5, 5}, MemoryFormat::nchw, Device::cuda(1)))),
            Catch::Contains("Precision::bf16 products: bf16 needs a GPU of compute capability 8.0") &&
                Catch::Contains("cuda:1 is 7.5"));
    }
    REQUIRE(host_cuda::set_compute_capability(9, 0));
}

// A captured step holds the bf16 buffer's address (Note [precision]): a linear model uses no fp32
// workspace, so a larger batch grows the bf16 buffer alone, and the first batch size's graph,
// whose buffer is gone, must not be launched again. Mutation-checked: without the bf16 buffer's
// address in the key (Ops<Cuda>::add_graph_key) the old graph launches on the freed buffer and the
// step fails.
TEST_CASE("a captured bf16 step is keyed by its bf16 buffer, which a larger batch grows alone", "[hostcuda]") {
    Clean clean;
    REQUIRE(host_cuda::set_device_count(2));
    using Lin = nn::Sequential<nn::Flatten<Cuda>, nn::Linear<Cuda>>;
    const auto make_lin = [] {
        nn::Generator g(9);
        return Lin(nn::Flatten<Cuda>(), nn::Linear<Cuda>(2 * 10 * 10, 7, true, g));
    };
    auto o = options(std::chrono::seconds(10));
    o.precision = Precision::bf16;
    DataParallel<Lin> eager(make_lin(), two, o);
    o.graphs = true;
    DataParallel<Lin> graphed(make_lin(), two, o);
    nn::Sgd<Cuda> sgd_eager({.lr = 0.05}), sgd_graphed({.lr = 0.05});
    const auto a = make_batch(10, 95), b = make_batch(40, 96);
    const auto xa = a.x.to<Cuda>(Device::cuda(0)), xb = b.x.to<Cuda>(Device::cuda(0));
    const auto step = [&](const Tensor<float, Cuda>& x, const std::vector<std::int64_t>& labels) {
        const auto e = eager.train_step(x, labels, nn::SoftmaxCrossEntropy{}, sgd_eager);
        const auto g = graphed.train_step(x, labels, nn::SoftmaxCrossEntropy{}, sgd_graphed);
        CHECK(g.loss == e.loss);
    };
    for (int i = 0; i < 3; ++i) step(xa, a.labels);  // eager, captured, launched
    REQUIRE(graphed.captured_graphs(0) == 2);
    for (int i = 0; i < 3; ++i) step(xb, b.labels);  // the bf16 buffer grows at the first of these
    for (int i = 0; i < 3; ++i) step(xa, a.labels);  // a new key: eager, captured, launched
    check_same(graphed.checkpoint(sgd_graphed), eager.checkpoint(sgd_eager));
    CHECK(graphed.captured_graphs(0) == 4);
}

// Gradient buckets all-reduced in bf16 (DataParallelOptions::gradient_precision): each bucket is
// rounded to bf16, summed, and widened back, so after a step every gradient element is a bf16
// value (its low 16 bits zero), the same on both replicas, where fp32 buckets hold values that are
// not, and the fp32 sums to bf16's rounding; captured steps give the eager bits; training tracks
// fp32's. Mutation-checked: without the widening after join() the gradients are the unreduced
// fp32 ones (low bits set); with the all-reduce skipped, the first step's gradients miss the sums.
TEST_CASE("gradients all-reduced in bf16 are bf16 sums on every replica, captured as eagerly", "[hostcuda]") {
    Clean clean;
    REQUIRE(host_cuda::set_device_count(2));
    auto o = options(std::chrono::seconds(10));
    o.math = Math::strict_fp32;
    DataParallel<Small<Cuda>> fp32(make_small<Cuda>(), two, o);
    o.gradient_precision = Precision::bf16;
    DataParallel<Small<Cuda>> eager(make_small<Cuda>(), two, o);
    o.graphs = true;
    DataParallel<Small<Cuda>> graphed(make_small<Cuda>(), two, o);
    nn::Sgd<Cuda> sgd32({.lr = 0.05, .momentum = 0.9}), sgd_eager({.lr = 0.05, .momentum = 0.9}),
        sgd_graphed({.lr = 0.05, .momentum = 0.9});
    const auto a = make_batch(10, 91);
    const auto xa = a.x.to<Cuda>(Device::cuda(0));
    const auto gradients = [](const Small<Cuda>& m) {
        std::vector<std::vector<float>> out;
        nn::for_each_parameter(m, [&](const std::string&, const nn::Parameter<Cuda>& p) {
            const auto h = p.grad.to_host();
            out.emplace_back(h.data(), h.data() + h.numel());
        });
        return out;
    };
    std::vector<double> losses32, losses16;
    for (int i = 0; i < 5; ++i) {
        const auto f = fp32.train_step(xa, a.labels, nn::SoftmaxCrossEntropy{}, sgd32);
        const auto e = eager.train_step(xa, a.labels, nn::SoftmaxCrossEntropy{}, sgd_eager);
        const auto g = graphed.train_step(xa, a.labels, nn::SoftmaxCrossEntropy{}, sgd_graphed);
        CHECK(g.loss == e.loss);
        losses32.push_back(f.loss);
        losses16.push_back(e.loss);
        if (i > 0) continue;
        // The first step's gradients are the fp32 sums to bf16's rounding: each replica's
        // gradient and the sum rounded once each (relative 2^-8), normwise per parameter. A
        // bucket left unreduced, or one replica's alone, misses by its peer's share.
        const auto g16 = gradients(eager.replica(0)), g32 = gradients(fp32.replica(0));
        REQUIRE(g16.size() == g32.size());
        for (std::size_t t = 0; t < g16.size(); ++t) {
            double d2 = 0, n2 = 0;
            for (std::size_t k = 0; k < g16[t].size(); ++k) {
                d2 += (static_cast<double>(g16[t][k]) - g32[t][k]) * (static_cast<double>(g16[t][k]) - g32[t][k]);
                n2 += static_cast<double>(g32[t][k]) * g32[t][k];
            }
            CAPTURE(t, std::sqrt(d2 / n2));
            // Plus 1e-6: the conv bias's gradient is zero but for rounding noise (batch norm
            // cancels it), where nothing relative holds.
            CHECK(std::sqrt(d2) <= std::ldexp(3.0, -8) * std::sqrt(n2) + 1e-6);
        }
    }
    check_same(graphed.checkpoint(sgd_graphed), eager.checkpoint(sgd_eager));
    CHECK(graphed.graph_launches(0) >= 6);
    // The last step's gradients, as the optimizer took them.
    const auto gradient_bits = [](const Small<Cuda>& m) {
        std::vector<std::uint32_t> bits;
        nn::for_each_parameter(m, [&](const std::string&, const nn::Parameter<Cuda>& p) {
            const auto h = p.grad.to_host();
            for (std::int64_t i = 0; i < h.numel(); ++i) bits.push_back(std::bit_cast<std::uint32_t>(h.data()[i]));
        });
        return bits;
    };
    const auto low_bits_set = [](const std::vector<std::uint32_t>& bits) {
        return std::count_if(bits.begin(), bits.end(), [](std::uint32_t b) { return (b & 0xFFFFu) != 0; });
    };
    const auto g0 = gradient_bits(eager.replica(0)), g1 = gradient_bits(eager.replica(1));
    REQUIRE(!g0.empty());
    CHECK(g0 == g1);
    CHECK(low_bits_set(g0) == 0);
    CHECK(gradient_bits(graphed.replica(0)) == g0);
    CHECK(low_bits_set(gradient_bits(fp32.replica(0))) > 0);
    CHECK(losses16[0] == losses32[0]);  // the first forward precedes any reduction
    CHECK(losses16.back() != losses32.back());
    for (std::size_t i = 0; i < losses16.size(); ++i) {
        CAPTURE(i, losses16[i], losses32[i]);
        CHECK(std::abs(losses16[i] - losses32[i]) <= 0.02 * std::abs(losses32[i]));
    }
}

// A step that fails drops every replica's graphs: they hold the communicators the failure
// aborted. The next step runs eagerly on rebuilt ones, the one after captures again, and the
// model ends where an eager model that never met the failure ends (with check_finite the failed
// step leaves nothing behind). The failing call returns well within the group's timeout, with its
// communicators aborted (Note [aborting communicators]). Mutation-checked: without the replicas
// dropping their graphs as the call fails (DataParallel::after_failure), the call waits out the
// timeout for the abort and this case fails (as the NaN and timeout cases below do).
TEST_CASE("a failed captured step drops the graphs, and the steps after it capture again", "[hostcuda]") {
    Clean clean;
    REQUIRE(host_cuda::set_device_count(2));
    auto o = options(std::chrono::seconds(5));
    o.check_finite = true;
    EagerAndGraphed m(two, o, {.lr = 0.05});
    const auto a = make_batch(10, 61);
    const auto x = a.x.to<Cuda>(Device::cuda(0));
    for (int i = 0; i < 3; ++i) m.both(x, a.labels);
    REQUIRE(m.graphed.captured_graphs(1) == 2);  // (a) and (b), each at the second step
    host_cuda::fail_nccl(1, 2);                  // in the launch of graph (a)
    const auto t0 = Clock::now();
    CHECK_THROWS(m.graphed_step(x, a.labels));
    CHECK(Clock::now() - t0 < std::chrono::seconds(5));
    host_cuda::fail_nccl(1, 0);
    CHECK_FALSE(m.graphed.diverged());
    const auto launched = m.graphed.graph_launches(1);
    m.both(x, a.labels);
    CHECK(m.graphed.graph_launches(1) == launched);  // eagerly, on rebuilt communicators
    for (int i = 0; i < 2; ++i) m.both(x, a.labels);
    CHECK(m.graphed.captured_graphs(1) == 4);
    m.check_equal();
}

// With check_finite a captured step's graph (a) ends with the finite check's values (the
// gradients' squared norms and the step's totals) in the replica's pinned memory, which the host
// reads with no launch of its own: a NaN in a launched step's input is refused before the commit
// barrier, with nothing applied, after (a)'s launch and without (b)'s; the graphs are dropped,
// and the steps after it capture again and end where the eager model ends. The losses and
// counts of every step are the ones the graphs left in pinned memory. Mutation-checked: without
// the finite check in (a) the NaN step is applied (the values read are the last eager step's).
TEST_CASE("a captured step with NaN is refused from the values its graph left in pinned memory", "[hostcuda]") {
    Clean clean;
    REQUIRE(host_cuda::set_device_count(2));
    auto o = options(std::chrono::seconds(5));
    o.check_finite = true;
    EagerAndGraphed m(two, o, {.lr = 0.05, .momentum = 0.9});
    auto a = make_batch(10, 81);
    const auto x = a.x.to<Cuda>(Device::cuda(0));
    const auto both = [&] {
        const auto e = m.eager.train_step(x, a.labels, nn::SoftmaxCrossEntropy{}, m.sgd_eager);
        const auto g = m.graphed_step(x, a.labels);
        CHECK(g.loss == e.loss);
        CHECK(g.correct == e.correct);
    };
    for (int i = 0; i < 3; ++i) both();
    REQUIRE(m.graphed.captured_graphs(1) == 2);
    const auto launched = m.graphed.graph_launches(1);
    const auto before = m.graphed.checkpoint(m.sgd_graphed);
    a.x[37] = std::numeric_limits<float>::quiet_NaN();  // a sample of replica 0's shard
    const auto poisoned = a.x.to<Cuda>(Device::cuda(0));
    CHECK_THROWS_AS(m.eager.train_step(poisoned, a.labels, nn::SoftmaxCrossEntropy{}, m.sgd_eager), NonFinite);
    // Issue 43, item 1: the graphs hold the communicators the failure aborts; the call returns
    // well within the group's timeout (Note [aborting communicators]).
    const auto t0 = Clock::now();
    CHECK_THROWS_WITH(m.graphed_step(poisoned, a.labels),
                      Catch::Contains("step 4: ") && Catch::Contains("no replica applied the step"));
    CHECK(Clock::now() - t0 < std::chrono::seconds(5));
    CHECK(m.graphed.graph_launches(1) == launched + 1);  // (a) ran; (b) did not
    CHECK_FALSE(m.graphed.diverged());
    check_same(m.graphed.checkpoint(m.sgd_graphed), before);
    for (int i = 0; i < 3; ++i) both();  // eagerly (the graphs dropped), captured, launched
    CHECK(m.graphed.captured_graphs(1) == 4);
    CHECK(m.graphed.graph_launches(1) == launched + 1 + 4);  // (a) and (b) in each of the last two
    m.check_equal();
}

// Issue 43, item 1: NCCL (2.26 and newer) aborts a communicator only once every graph that
// captured it is destroyed, and blocks the aborting thread meanwhile, non-blocking or not; the
// double does the same. A captured step that times out (replica 1's graph stalls at its first
// kernel) aborts the groups from a replica thread that owns graphs holding them: the abort runs on
// a helper thread, every replica drops its graphs as the call fails, and the call returns within
// two of the group's timeouts (the wait that timed out, then at most one for the aborts, which
// the stalled launch holds), with nothing applied (check_finite reads before the commit barrier). The
// steps after it run on new communicators, capture again, and end where the eager model ends.
// Mutation-checked: with the communicators aborted in place under the group's mutex (as before),
// this case hangs until the double's watchdog names the ncclCommAbort that waits for the graphs.
// (Without the replicas dropping their graphs as the call fails, the NaN case above fails: its
// call then waits out the timeout for the aborts.)
TEST_CASE("a captured step that times out returns within two timeouts though its graphs hold the communicators",
          "[hostcuda]") {
    Clean clean;
    REQUIRE(host_cuda::set_device_count(2));
    const auto timeout = std::chrono::seconds(2);
    auto o = options(timeout);
    o.check_finite = true;
    EagerAndGraphed m(two, o, {.lr = 0.05, .momentum = 0.9});
    const auto a = make_batch(10, 91);
    const auto x = a.x.to<Cuda>(Device::cuda(0));
    for (int i = 0; i < 3; ++i) m.both(x, a.labels);
    REQUIRE(m.graphed.captured_graphs(1) == 2);
    const auto launched = m.graphed.graph_launches(1);
    const auto before = m.graphed.checkpoint(m.sgd_graphed);
    host_cuda::stall_launch(1, nullptr, 1);  // the first kernel of replica 1's next launch of (a)
    const auto t0 = Clock::now();
    CHECK_THROWS_WITH(m.graphed_step(x, a.labels), Catch::Contains("took longer than"));
    const auto took = Clock::now() - t0;
    host_cuda::release_stalls();
    // Replica 0's wait ends at the timeout; then NCCL's abort waits for the launch in flight of the
    // graph that holds the communicator (the stalled one: ended only below), at most another timeout.
    CHECK(took < 2 * timeout + std::chrono::seconds(2));
    CHECK(m.graphed.graph_launches(1) == launched + 1);
    CHECK_FALSE(m.graphed.diverged());
    check_same(m.graphed.checkpoint(m.sgd_graphed), before);
    for (int i = 0; i < 3; ++i) m.both(x, a.labels);  // eagerly on new communicators, captured, launched
    CHECK(m.graphed.captured_graphs(1) == 4);
    m.check_equal();
}

// Issue 43, item 2: graph (a)'s allocations get memory at its upload or first launch; a launch
// that fails for memory after the replicas agreed to launch would leave the peers' launched
// collectives waiting for it. Each graph is uploaded at its capture, before the barrier that lets
// the replicas launch: when replica 1's graph memory cannot be had, the step fails on both with
// OutOfMemory before either launches, nothing is applied, and the steps after it capture again
// and end where the eager model ends. Mutation-checked: without the upload at the capture, replica
// 0 launches its graph (a) before replica 1's launch fails, and this case fails.
TEST_CASE("a captured step whose graph memory does not fit fails before any replica launches", "[hostcuda]") {
    Clean clean;
    REQUIRE(host_cuda::set_device_count(2));
    EagerAndGraphed m(two, options(std::chrono::seconds(5)), {.lr = 0.05, .momentum = 0.9});
    const auto a = make_batch(10, 95);
    const auto x = a.x.to<Cuda>(Device::cuda(0));
    m.both(x, a.labels);  // eagerly: the next step captures
    const auto before = m.graphed.checkpoint(m.sgd_graphed);
    host_cuda::fail_graph_memory(1, 1);  // replica 1's graph (a): (b) allocates nothing
    CHECK_THROWS_AS(m.graphed_step(x, a.labels), OutOfMemory);
    host_cuda::fail_graph_memory(0);
    CHECK(m.graphed.graph_launches(0) == 0);
    CHECK(m.graphed.graph_launches(1) == 0);
    CHECK_FALSE(m.graphed.diverged());
    check_same(m.graphed.checkpoint(m.sgd_graphed), before);
    for (int i = 0; i < 3; ++i) m.both(x, a.labels);  // eagerly, captured, launched
    CHECK(m.graphed.graph_launches(1) == 4);          // (a) and (b) in each of the last two
    m.check_equal();
}

// Issue 43, item 3: NCCL adds the ranks' values in an order of its own (by chunk, message size and
// plan, captured or not), and so does the double (Note [the double's summation order]): with four
// replicas on four devices, every replica holds the same bits after every step (each element is
// reduced once, for all), and eager steps, captured steps and the host group agree within float
// rounding, not to the bit. With two replicas any order gives the same sum.
TEST_CASE("four replicas through NCCL stay bit-identical, and eager, captured and host steps agree within rounding",
          "[hostcuda]") {
    Clean clean;
    REQUIRE(host_cuda::set_device_count(4));
    const std::vector<Device> four{Device::cuda(0), Device::cuda(1), Device::cuda(2), Device::cuda(3)};
    auto o = options(std::chrono::seconds(5));
    o.math = Math::strict_fp32;  // as the host computes
    DataParallel<Small<Cuda>> eager(make_small<Cuda>(), four, o);
    o.graphs = true;
    DataParallel<Small<Cuda>> graphed(make_small<Cuda>(), four, o);
    DataParallel<Small<Host>> host(make_small<Host>(), 4, {.bucket_bytes = o.bucket_bytes});
    nn::Sgd<Cuda> sgd_eager({.lr = 0.05, .momentum = 0.9}), sgd_graphed({.lr = 0.05, .momentum = 0.9});
    nn::Sgd<Host> sgd_host({.lr = 0.05, .momentum = 0.9});
    const auto a = make_batch(14, 97);  // shards of 4, 4, 3, 3
    const auto x = a.x.to<Cuda>(Device::cuda(0));
    bool identical = true;
    for (int step = 0; step < 5; ++step) {
        (void)eager.train_step(x, a.labels, nn::SoftmaxCrossEntropy{}, sgd_eager);
        (void)graphed.train_step(x, a.labels, nn::SoftmaxCrossEntropy{}, sgd_graphed);
        (void)host.train_step(a.x, a.labels, nn::SoftmaxCrossEntropy{}, sgd_host);
        for (const auto* dp : {&eager, &graphed}) {
            const auto first = replica_values(dp->replica(0));
            for (int r = 1; r < 4; ++r) identical = identical && replica_values(dp->replica(r)) == first;
        }
    }
    CHECK(identical);
    CHECK(graphed.graph_launches(0) >= 4);  // steps 3-5 ran graph (a)
    const auto ce = eager.checkpoint(sgd_eager), cg = graphed.checkpoint(sgd_graphed), ch = host.checkpoint(sgd_host);
    for (const auto& name : ch.names()) {
        CAPTURE(name);
        const auto rel = [&](const nn::Checkpoint& got) {
            const auto& want = ch.at(name);
            const auto& have = got.at(name);
            if (want.dtype != "F32") return have.data == want.data ? 0.0 : 1.0;
            double d = 0, n = 0;
            for (std::size_t i = 0; i + 4 <= want.data.size(); i += 4) {
                float w = 0, h = 0;
                std::memcpy(&w, want.data.data() + i, 4);
                std::memcpy(&h, have.data.data() + i, 4);
                d += (static_cast<double>(h) - w) * (static_cast<double>(h) - w);
                n += static_cast<double>(w) * w;
            }
            // Relative to the tensor's norm, with a floor: the convolution's bias feeds SyncBatchNorm,
            // which cancels it, so its gradient and momentum are rounding noise (norms near 1e-6).
            return std::sqrt(d) / std::max(std::sqrt(n), 0.1);
        };
        CHECK(rel(ce) <= 1e-5);
        CHECK(rel(cg) <= 1e-5);
    }
}

// Labels are host values a graph cannot check: before each launch the loss's check_targets
// checks them against the output shape of the capture, so a label out of range is the loss's
// own error, and no replica applies the step. Graphs are CUDA's, one replica per GPU.
TEST_CASE("captured steps check their labels before each launch, and what graphs cannot do is refused", "[hostcuda]") {
    Clean clean;
    REQUIRE(host_cuda::set_device_count(2));
    auto o = options(std::chrono::seconds(5));
    o.graphs = true;
    DataParallel<Small<Cuda>> dp(make_small<Cuda>(), two, o);
    nn::Sgd<Cuda> sgd({.lr = 0.05});
    auto a = make_batch(10, 71);
    const auto x = a.x.to<Cuda>(Device::cuda(0));
    for (int i = 0; i < 3; ++i) (void)dp.train_step(x, a.labels, nn::SoftmaxCrossEntropy{}, sgd);
    REQUIRE(dp.captured_graphs(0) == 2);
    const auto before = dp.checkpoint(sgd);
    const auto launched = std::make_pair(dp.graph_launches(0), dp.graph_launches(1));
    auto bad = a.labels;
    bad[7] = 7;  // 7 classes: [0, 7)
    CHECK_THROWS_WITH(dp.train_step(x, bad, nn::SoftmaxCrossEntropy{}, sgd), Catch::Contains("label 7 of sample 2"));
    // Checked before the replicas' vote: replica 0 launched nothing either.
    CHECK(std::make_pair(dp.graph_launches(0), dp.graph_launches(1)) == launched);
    check_same(dp.checkpoint(sgd), before);
    CHECK_NOTHROW(dp.train_step(x, a.labels, nn::SoftmaxCrossEntropy{}, sgd));

    o.graphs = true;
    CHECK_THROWS_WITH((DataParallel<Small<Cuda>>(make_small<Cuda>(), {Device::cuda(0), Device::cuda(0)}, o)),
                      Catch::Contains("one replica per GPU"));
    o.graph_capacity = 0;
    CHECK_THROWS_AS((DataParallel<Small<Cuda>>(make_small<Cuda>(), two, o)), UsageError);
}

// The other paths of a step with graphs: targets that are a tensor (MseLoss, copied into the
// graph's own tensor before each launch), buckets all-reduced after backward (overlap off), and
// a step after accumulate(), which runs eagerly (its weights are the call's host numbers), each
// giving the eager model's bits.
TEST_CASE("captured steps with tensor targets, without overlap and after accumulate give the eager bits", "[hostcuda]") {
    Clean clean;
    REQUIRE(host_cuda::set_device_count(2));
    auto o = options(std::chrono::seconds(10));
    o.overlap = GENERATE(true, false);
    CAPTURE(o.overlap);
    DataParallel<Small<Cuda>> eager(make_small<Cuda>(), two, o);
    o.graphs = true;
    DataParallel<Small<Cuda>> graphed(make_small<Cuda>(), two, o);
    nn::Sgd<Cuda> sgd_eager({.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-3}),
        sgd_graphed({.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-3});
    std::vector<Tensor<float, Cuda>> xs, ys;
    std::mt19937 rng(81);
    std::normal_distribution<float> d;
    for (int i = 0; i < 4; ++i) {
        const auto b = make_batch(11, 82 + static_cast<std::uint64_t>(i));  // shards of 6 and 5
        Tensor<float, Host> y(Shape{11, 7});
        for (float& v : y.span()) v = d(rng);
        xs.push_back(b.x.to<Cuda>(Device::cuda(0)));
        ys.push_back(y.to<Cuda>(Device::cuda(0)));
    }
    for (int i = 0; i < 6; ++i) {
        const auto& x = xs[static_cast<std::size_t>(i % 4)];
        const auto& y = ys[static_cast<std::size_t>(i % 4)];
        if (i == 4) {  // a micro-batch first: this step's (a) runs eagerly
            eager.accumulate(xs[0], ys[0], nn::MseLoss{});
            graphed.accumulate(xs[0], ys[0], nn::MseLoss{});
        }
        const auto e = eager.train_step(x, y, nn::MseLoss{}, sgd_eager);
        const auto g = graphed.train_step(x, y, nn::MseLoss{}, sgd_graphed);
        CAPTURE(i);
        CHECK(g.loss == e.loss);
        CHECK(g.count == e.count);
    }
    // (a): eager, captured at step 2, launched at 2, 3, 4 and 6 (5 followed accumulate);
    // (b): eager, then captured at 2 and launched at 2 to 6.
    CHECK(graphed.captured_graphs(1) == 2);
    CHECK(graphed.graph_launches(1) == 9);
    check_same(graphed.checkpoint(sgd_graphed), eager.checkpoint(sgd_eager));
}

namespace {
// SoftmaxCrossEntropy with a host setting: what a captured step would keep as it was at capture.
struct WeightedLoss {
    double weight = 1;
    template <class B, class Targets>
    nn::LossOutput<B> operator()(const nn::Context<B>& ctx, const Tensor<float, B>& out, const Targets& labels) const {
        auto lo = nn::SoftmaxCrossEntropy{}(ctx, out, labels);
        kernels::Ops<B>::scale(ctx.exec, lo.grad, weight);
        return lo;
    }
};
struct KeyedWeightedLoss : WeightedLoss {
    std::vector<std::int64_t> graph_key() const { return {std::bit_cast<std::int64_t>(weight)}; }
};
}  // namespace

// The replicas decide together whether a step runs eagerly, is captured or is launched: a
// replica that launched while a peer captured would skip the rendezvous the peer waits in. Here
// replica 1's shard grows from 1 to 2 rows, so only its workspace moves and only its key of the
// 3-row batch changes. Then: a training-mode forward() right before a capture (the layers hold
// what a capture would free: that step runs eagerly), a new learning rate (a new key for the
// update), and a loss with a host setting (refused without a graph_key, captured with one).
// Mutation-checked: each replica deciding alone fails the first part with a collective mismatch;
// without the forward() mark the capture is refused.
TEST_CASE("replicas agree on capturing a step, and what a graph would freeze makes a new key or is refused", "[hostcuda]") {
    Clean clean;
    REQUIRE(host_cuda::set_device_count(2));
    // im2col convolutions, whose workspace grows with the shard (read once per process: ctest runs
    // each case in its own).
    ::setenv("LOCKSTEP_CUDNN", "0", 1);
    auto o = options(std::chrono::seconds(10));
    DataParallel<Small<Cuda>> eager(make_small<Cuda>(), two, o);
    o.graphs = true;
    DataParallel<Small<Cuda>> graphed(make_small<Cuda>(), two, o);
    nn::Sgd<Cuda> sgd_eager({.lr = 0.05, .momentum = 0.9}), sgd_graphed({.lr = 0.05, .momentum = 0.9});
    const auto nine = make_batch(3, 91), ten = make_batch(4, 92);  // shards of 2 and 1, then 2 and 2
    const auto x9 = nine.x.to<Cuda>(Device::cuda(0)), x10 = ten.x.to<Cuda>(Device::cuda(0));
    const auto step = [&](const Tensor<float, Cuda>& x, const std::vector<std::int64_t>& labels, const auto& loss) {
        const auto e = eager.train_step(x, labels, loss, sgd_eager);
        const auto g = graphed.train_step(x, labels, loss, sgd_graphed);
        CHECK(g.loss == e.loss);
    };
    const auto same = [&] { check_same(graphed.checkpoint(sgd_graphed), eager.checkpoint(sgd_eager)); };
    const nn::SoftmaxCrossEntropy ce;
    for (const bool big : {false, false, true, true, false, false, false})
        big ? step(x10, ten.labels, ce) : step(x9, nine.labels, ce);
    same();
    // (a) captured at steps 2, 4 and 6 (replica 1's key of 3 rows changed at step 5: both ran it
    // eagerly, then both captured), (b) once: the scenario happened on both replicas.
    CHECK(graphed.captured_graphs(0) == 4);
    CHECK(graphed.captured_graphs(1) == 4);
    // A training-mode forward before the step that would capture a new shape's graph.
    const auto eight = make_batch(8, 93);
    const auto x8 = eight.x.to<Cuda>(Device::cuda(0));
    step(x8, eight.labels, ce);  // eagerly: the key ready
    (void)eager.forward(x8), (void)graphed.forward(x8);
    const auto captured = graphed.captured_graphs(0);
    step(x8, eight.labels, ce);  // eagerly again
    CHECK(graphed.captured_graphs(0) == captured);
    step(x8, eight.labels, ce);  // captured
    CHECK(graphed.captured_graphs(0) > captured);
    same();
    // A new learning rate: the update runs eagerly once, then is captured with it.
    sgd_eager.set_lr(0.02), sgd_graphed.set_lr(0.02);
    for (int i = 0; i < 3; ++i) step(x8, eight.labels, ce);
    same();
    // A loss with a host setting: refused without graph_key, captured with it.
    CHECK_THROWS_WITH(graphed.train_step(x8, eight.labels, WeightedLoss{0.5}, sgd_graphed), Catch::Contains("graph_key()"));
    for (const double w : {0.5, 0.5, 0.5, 2.0, 2.0, 2.0}) step(x8, eight.labels, KeyedWeightedLoss{{w}});
    same();
    CHECK(replica_values(graphed.replica(1)) == replica_values(eager.replica(1)));
    ::unsetenv("LOCKSTEP_CUDNN");
}

namespace {
// Sgd whose update waits for the device first: it runs eagerly, but a capture refuses it.
struct WaitingSgd {
    nn::Sgd<Cuda> sgd{{.lr = 0.05}};
    void prepare(int replicas, const nn::BucketLayout& layout) { sgd.prepare(replicas, layout); }
    template <class M>
    void step(const nn::Context<Cuda>& ctx, M& module) {
        kernels::Ops<Cuda>::wait(ctx.exec, "the update's own wait");
        sgd.step(ctx, module);
    }
    template <class M, class F>
    void visit_state(int rank, M& module, F&& f) {
        sgd.visit_state(rank, module, std::forward<F>(f));
    }
    template <class M>
    std::vector<std::int64_t> graph_key(int rank, const M& module) const {
        return sgd.graph_key(rank, module);
    }
};
}  // namespace

// Graph (b) is captured at the start of its step, before the replicas vote on (a): an update that
// cannot be captured (here it waits for the device) fails its step on every replica before any
// replica launches anything, with UsageError naming the update, and nothing applied. Captured
// after (a)'s launch, its failure on one replica would leave a peer's launched collectives to run
// on aborted communicators.
TEST_CASE("an update that cannot be captured fails its step before any replica launches", "[hostcuda]") {
    Clean clean;
    REQUIRE(host_cuda::set_device_count(2));
    auto o = options(std::chrono::seconds(5));
    o.graphs = true;
    DataParallel<Small<Cuda>> dp(make_small<Cuda>(), two, o);
    WaitingSgd opt;
    const auto a = make_batch(10, 101);
    const auto x = a.x.to<Cuda>(Device::cuda(0));
    (void)dp.train_step(x, a.labels, nn::SoftmaxCrossEntropy{}, opt);  // eagerly: (a) and (b) ready
    const auto before = dp.checkpoint();
    const auto step = [&] { (void)dp.train_step(x, a.labels, nn::SoftmaxCrossEntropy{}, opt); };
    CHECK_THROWS_WITH(step(), Catch::Contains("update could not be captured"));
    CHECK(dp.graph_launches(0) == 0);
    CHECK(dp.graph_launches(1) == 0);
    CHECK_FALSE(dp.diverged());
    check_same(dp.checkpoint(), before);
    // The failure dropped the graphs: the next step runs eagerly, the one after fails alike.
    CHECK_NOTHROW(step());
    CHECK_THROWS_AS(step(), UsageError);
    CHECK(dp.graph_launches(0) == 0);
}

namespace {
// The small network in a module of its own, whose forward can reach a collective of its own on
// replica 1 (`diverge`), or wait for the device (`wait`): what a capture must refuse.
struct Wrapped {
    using backend = Cuda;
    Small<Cuda> inner = make_small<Cuda>();
    std::shared_ptr<std::atomic<bool>> diverge = std::make_shared<std::atomic<bool>>(false);
    bool wait = false;
    Tensor<float, Cuda> forward(const nn::Context<Cuda>& ctx, Tensor<float, Cuda> x) {
        if (diverge->load() && ctx.local_rank == 1) ctx.comm->all_reduce_sum(DeviceSpan(x), comm::CollectiveSite::user(9));
        if (wait) kernels::Ops<Cuda>::wait(ctx.exec, "the forward's own wait");
        return inner.forward(ctx, std::move(x));
    }
    Tensor<float, Cuda> backward(const nn::Context<Cuda>& ctx, const Tensor<float, Cuda>& dy) { return inner.backward(ctx, dy); }
    template <class V>
    void visit(V&& v) {
        v.module("inner", inner);
    }
};
}  // namespace

// A capture runs the host's rendezvous before each collective, as an eager step does: replicas
// that reach different collectives while capturing fail the step with the mismatch, on every
// replica, before anything is launched or applied; the next steps capture again.
TEST_CASE("replicas that reach different collectives in a capture fail the step with the mismatch", "[hostcuda]") {
    Clean clean;
    REQUIRE(host_cuda::set_device_count(2));
    auto o = options(std::chrono::seconds(5));
    o.graphs = true;
    Wrapped model;
    DataParallel<Wrapped> dp(model, two, o);
    nn::Sgd<Cuda> sgd({.lr = 0.05});
    const auto a = make_batch(10, 151);
    const auto x = a.x.to<Cuda>(Device::cuda(0));
    (void)dp.train_step(x, a.labels, nn::SoftmaxCrossEntropy{}, sgd);  // eagerly: (a) and (b) ready
    const auto before = dp.checkpoint(sgd);
    model.diverge->store(true);  // the replicas share the flag with the prototype
    CHECK_THROWS_WITH(dp.train_step(x, a.labels, nn::SoftmaxCrossEntropy{}, sgd),
                      Catch::Contains("replicas reached different collectives") && Catch::Contains("user site 9"));
    CHECK(dp.graph_launches(0) == 0);
    CHECK(dp.graph_launches(1) == 0);
    CHECK_FALSE(dp.diverged());
    check_same(dp.checkpoint(sgd), before);
    model.diverge->store(false);
    for (int i = 0; i < 3; ++i) CHECK_NOTHROW(dp.train_step(x, a.labels, nn::SoftmaxCrossEntropy{}, sgd));
    CHECK(dp.graph_launches(0) > 0);
}

// A forward that waits for the device runs eagerly, but a capture refuses it: the step fails on
// every replica with UsageError naming the rule, nothing launched or applied.
TEST_CASE("a forward that waits for the device fails its captured step with UsageError", "[hostcuda]") {
    Clean clean;
    REQUIRE(host_cuda::set_device_count(2));
    auto o = options(std::chrono::seconds(5));
    o.graphs = true;
    Wrapped model;
    model.wait = true;
    DataParallel<Wrapped> dp(model, two, o);
    nn::Sgd<Cuda> sgd({.lr = 0.05});
    const auto a = make_batch(10, 152);
    const auto x = a.x.to<Cuda>(Device::cuda(0));
    CHECK_NOTHROW(dp.train_step(x, a.labels, nn::SoftmaxCrossEntropy{}, sgd));  // eagerly
    const auto before = dp.checkpoint(sgd);
    const auto step = [&] { (void)dp.train_step(x, a.labels, nn::SoftmaxCrossEntropy{}, sgd); };
    CHECK_THROWS_AS(step(), UsageError);
    check_same(dp.checkpoint(sgd), before);
    CHECK_NOTHROW(step());  // the failure dropped the graphs: eagerly again
    CHECK_THROWS_WITH(step(), Catch::Contains("forward and backward could not be captured") &&
                                  Catch::Contains("leave graphs off for this model"));
    CHECK(dp.graph_launches(0) == 0);
    CHECK(dp.graph_launches(1) == 0);
    CHECK_FALSE(dp.diverged());
}

// ---- across processes ----------------------------------------------------------------------------
// Processes as threads of this one (thread_processes.hpp), each with its own DataParallel on a
// device of its own, as under mpirun with one GPU a process: the stream groups span the processes
// (Note [stream groups across processes]), their NCCL cliques made from a unique id process 0
// broadcasts. Catch's assertions are made on the test's thread, from what each process recorded.

namespace {

//! Process p's rows of `b`, split over P processes of one replica each, on `device`.
std::pair<Tensor<float, Cuda>, std::vector<std::int64_t>> rows_of(const gpu_test::Batch& b, int P, int p, Device device) {
    const auto s = parallel::shard_ranges(b.x.dim(0), P)[static_cast<std::size_t>(p)];
    const std::int64_t per = b.x.numel() / b.x.dim(0);
    Tensor<float, Host> x(b.x.shape().with(0, s.count));
    std::copy(b.x.span().begin() + s.begin * per, b.x.span().begin() + (s.begin + s.count) * per, x.span().begin());
    return {x.to<Cuda>(device), std::vector<std::int64_t>(b.labels.begin() + s.begin, b.labels.begin() + s.begin + s.count)};
}

//! What a process (or the one-process reference) saw: each step's loss, and its replica 0's
//! parameters and buffers after each step.
struct Run {
    std::vector<double> losses;
    std::vector<std::vector<float>> values;
    std::uint64_t captured = 0, launches = 0;
};

//! The batches the case below trains on: 3 rows (shards of 2 and 1), then 4 (2 and 2), then 3.
std::vector<gpu_test::Batch> across_batches() {
    std::vector<gpu_test::Batch> out;
    const auto three = make_batch(3, 131), four = make_batch(4, 132);
    for (const bool big : {false, false, true, true, false, false, false}) out.push_back(big ? four : three);
    return out;
}

DataParallelOptions across_options() {
    auto o = options(std::chrono::seconds(10));
    o.clip_grad_norm = 0.5;
    o.check_finite = true;
    return o;
}

//! Trains across 2 processes of one device each; `errors` gets each process's failure.
std::vector<Run> train_across(DataParallelOptions o, const std::vector<gpu_test::Batch>& batches,
                              std::vector<std::exception_ptr>& errors) {
    std::vector<Run> runs(2);
    errors = test::as_processes(
        2,
        [&](int p, std::shared_ptr<comm::ProcessGroup> procs) {
            auto mine = o;
            mine.process_group = std::move(procs);
            const Device device = Device::cuda(p);
            // Each process builds its model, as a process of its own would; here process 1 also builds
            // a layer first, so their layers drew different ids (Note [layer ids]).
            if (p == 1) (void)make_small<Cuda>();
            DataParallel<Small<Cuda>> dp(make_small<Cuda>(), {device}, mine);
            nn::Sgd<Cuda> sgd({.lr = 0.05, .momentum = 0.9});
            auto& run = runs[static_cast<std::size_t>(p)];
            for (const auto& b : batches) {
                const auto [x, labels] = rows_of(b, 2, p, device);
                run.losses.push_back(dp.train_step(x, labels, nn::SoftmaxCrossEntropy{}, sgd).loss);
                run.values.push_back(replica_values(dp.replica(0)));
            }
            run.captured = dp.captured_graphs(0);
            run.launches = dp.graph_launches(0);
        },
        [](int) {}, std::chrono::seconds(10));
    return runs;
}

}  // namespace

// DataParallel<Cuda> across two processes of one GPU each trains as one process of two GPUs, bit
// for bit, eagerly and with graphs (Note [captured steps]). Process 1's shard grows from 1 row to
// 2, so only its im2col workspace moves and only its key of the 3-row batch changes: back at 3
// rows process 0 would launch its kept graph while process 1 runs eagerly, and the processes vote
// together so that a capture's or an eager step's rendezvous (which checks each collective's tag
// with the other process) never waits for a process that launched. Mutation-checked: each
// process voting alone fails: a process that launched waits for its step's results until the
// timeout, its collectives never met. Each process builds its own model, and the layers' ids come
// from their place in it (Note [layer ids]): without nn::number_layers the processes' ids differ
// and the first SyncBatchNorm collective is a CollectiveMismatch.
TEST_CASE("two processes of one GPU each train as one process of two GPUs, eagerly and captured", "[hostcuda]") {
    Clean clean;
    REQUIRE(host_cuda::set_device_count(2));
    // im2col convolutions, whose workspace grows with the shard (read once per process: ctest runs
    // each case in its own).
    ::setenv("LOCKSTEP_CUDNN", "0", 1);
    const auto batches = across_batches();
    Run want;
    {
        DataParallel<Small<Cuda>> dp(make_small<Cuda>(), two, across_options());
        nn::Sgd<Cuda> sgd({.lr = 0.05, .momentum = 0.9});
        for (const auto& b : batches) {
            want.losses.push_back(dp.train_step(b.x.to<Cuda>(Device::cuda(0)), b.labels, nn::SoftmaxCrossEntropy{}, sgd).loss);
            want.values.push_back(replica_values(dp.replica(0)));
        }
    }
    for (const bool graphs : {false, true}) {
        CAPTURE(graphs);
        auto o = across_options();
        o.graphs = graphs;
        std::vector<std::exception_ptr> errors;
        const auto runs = train_across(o, batches, errors);
        for (const auto& e : errors) {
            if (e) CHECK_THROWS_WITH(std::rethrow_exception(e), "no error");
            REQUIRE_FALSE(e);
        }
        for (int p = 0; p < 2; ++p) {
            CAPTURE(p);
            const auto& run = runs[static_cast<std::size_t>(p)];
            CHECK(run.losses == want.losses);
            REQUIRE(run.values.size() == want.values.size());
            for (std::size_t s = 0; s < want.values.size(); ++s) {
                CAPTURE(s);
                CHECK(run.values[s] == want.values[s]);
            }
            // (a): eager at steps 0, 2 and 4 (new keys: process 1's at 4), captured at 1, 3 and 5,
            // launched at 1, 3, 5 and 6; (b): eager at 0, then captured and launched at 1 to 6.
            CHECK(run.captured == (graphs ? 4u : 0u));
            CHECK(run.launches == (graphs ? 4u + 6u : 0u));
        }
    }
    ::unsetenv("LOCKSTEP_CUDNN");
}

// A failure in one process's launch of graph (a) (an NCCL error in its second collective) is a
// failed step in both processes, as an eager one is (Note [commit point]): with check_finite it
// is seen before the commit barrier, so neither process applies the step, and a DataParallel
// across processes ends there: the next step fails too, in both. Mutation-checked: without
// check_finite the failure is seen after the update, and both processes hold a diverged model.
TEST_CASE("a captured step that fails in one process fails in both, and neither applies it", "[hostcuda]") {
    Clean clean;
    REQUIRE(host_cuda::set_device_count(2));
    auto o = across_options();
    o.graphs = true;
    o.timeout = std::chrono::seconds(5);
    const auto prototype = make_small<Cuda>();
    const auto batch = make_batch(10, 141);
    struct Seen {
        std::vector<float> before, after;
        std::string first, failed, next;
        std::uint64_t launches = 0, launches_after = 0;
        bool diverged = true;
    };
    std::vector<Seen> seen(2);
    std::barrier sync(2);
    const auto errors = test::as_processes(
        2,
        [&](int p, std::shared_ptr<comm::ProcessGroup> procs) {
            auto mine = o;
            mine.process_group = std::move(procs);
            const Device device = Device::cuda(p);
            DataParallel<Small<Cuda>> dp(prototype, {device}, mine);
            nn::Sgd<Cuda> sgd({.lr = 0.05, .momentum = 0.9});
            const auto [x, labels] = rows_of(batch, 2, p, device);
            const auto step = [&, &x = x, &labels = labels]() -> std::string {
                try {
                    (void)dp.train_step(x, labels, nn::SoftmaxCrossEntropy{}, sgd);
                    return "";
                } catch (const std::exception& e) {
                    return std::string("threw: ") + e.what();
                }
            };
            auto& me = seen[static_cast<std::size_t>(p)];
            for (int i = 0; i < 3; ++i) me.first += step();  // eagerly, captured, launched
            me.launches = dp.graph_launches(0);
            me.before = replica_values(dp.replica(0));
            sync.arrive_and_wait();
            if (p == 0) host_cuda::fail_nccl(1, 2);  // process 1's rank, in the launch of (a)
            sync.arrive_and_wait();
            me.failed += step();
            me.after = replica_values(dp.replica(0));
            me.launches_after = dp.graph_launches(0);
            me.diverged = dp.diverged();
            sync.arrive_and_wait();
            if (p == 0) host_cuda::fail_nccl(1, 0);
            sync.arrive_and_wait();
            me.next = step();
        },
        [](int) {}, std::chrono::seconds(5));
    for (const auto& e : errors) REQUIRE_FALSE(e);
    for (int p = 0; p < 2; ++p) {
        CAPTURE(p);
        const auto& me = seen[static_cast<std::size_t>(p)];
        CHECK(me.first.empty());
        CHECK(me.launches == 2 + 2);  // (a) and (b), each captured and launched at step 1, launched at 2
        CHECK_THAT(me.failed, Catch::StartsWith("threw: "));
        CHECK(me.launches_after == me.launches + 1);  // the failure came in the launch of (a); (b) never ran
        CHECK_FALSE(me.diverged);
        CHECK(me.after == me.before);
        CHECK_THAT(me.next, Catch::StartsWith("threw: "));
    }
}

// Processes that differ in DataParallelOptions::graphs would meet a vote with an eager collective:
// every process refuses alike at construction, naming the option.
TEST_CASE("processes that differ in graphs are refused alike", "[hostcuda]") {
    Clean clean;
    REQUIRE(host_cuda::set_device_count(2));
    const auto errors = test::as_processes(
        2,
        [&](int p, std::shared_ptr<comm::ProcessGroup> procs) {
            auto o = across_options();
            o.process_group = std::move(procs);
            o.graphs = p == 1;
            DataParallel<Small<Cuda>> dp(make_small<Cuda>(), {Device::cuda(p)}, o);
        },
        [](int) {}, std::chrono::seconds(5));
    for (const auto& e : errors) {
        REQUIRE(e);
        CHECK_THROWS_AS(std::rethrow_exception(e), UsageError);
        CHECK_THROWS_WITH(std::rethrow_exception(e),
                          Catch::Contains("they differ in DataParallelOptions::graphs (off, on, by process)"));
    }
}
