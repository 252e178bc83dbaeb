// SPDX-License-Identifier: MIT
//! The CUDA backend's code between kernels on the host CUDA device (label hostcuda): current
//! streams and resource lifetimes, bounded host waits on a stalled device, the gather of
//! DataParallel::forward, a caller's input reused at once, a device failure after the commit
//! point, and the NCCL version and launch-order rules. Each test names the defect it catches
//! (issue 23 of the first GPU run) and was run against that defect put back.
#include <catch2/catch.hpp>

#include <lockstep/cuda.cuh>
#include <lockstep/data/loader.hpp>
#include <lockstep/nn.hpp>
#include <lockstep/host.hpp>
#include <lockstep/parallel.hpp>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <stdexcept>
#include <thread>
#include <vector>

#include "../gpu/small_model.hpp"
#include "../host_cuda/host_cuda.hpp"

using namespace lockstep;
using Clock = std::chrono::steady_clock;

namespace {

using gpu_test::make_batch;
using gpu_test::make_small;
using gpu_test::Small;

std::vector<float> values(const Tensor<float, Cuda>& t) {
    const auto h = t.to_host();
    return {h.data(), h.data() + h.numel()};
}

// Forward and backward through `dev` and `host` (convolutions whose input has 2 channels of 10 x 10)
// on a batch of N: every layer's output and parameter gradients, and dx, as the host's.
void run_conv_stack(nn::Context<Cuda>& ctx, std::vector<nn::Conv2d<Cuda>>& dev, std::vector<nn::Conv2d<Host>>& host,
                    std::int64_t N, std::mt19937& rng) {
    nn::Context<Host> hctx;
    std::normal_distribution<float> d;
    Tensor<float, Host> x(Shape{N, 2, 10, 10});
    for (float& v : x.span()) v = d(rng);
    std::vector<Tensor<float, Cuda>> ys{x.to<Cuda>(Device::cuda(ctx.exec.device))};
    std::vector<Tensor<float, Host>> hs{x};
    for (std::size_t l = 0; l < dev.size(); ++l) {
        ys.push_back(dev[l].forward(ctx, ys.back()));
        hs.push_back(host[l].forward(hctx, hs.back()));
    }
    Tensor<float, Host> dy(hs.back().shape());
    for (float& v : dy.span()) v = d(rng);
    auto dxc = dy.to<Cuda>(Device::cuda(ctx.exec.device));
    auto dxh = dy;
    for (std::size_t l = dev.size(); l-- > 0;) {
        dxc = dev[l].backward(ctx, dxc);
        dxh = host[l].backward(hctx, dxh);
    }
    // Every layer's output and parameter gradients, and dx: the columns feed the outputs and
    // weight gradients, dyt and dcols the gradients and dx.
    const auto rel = [](const std::vector<float>& got, const Tensor<float, Host>& want) {
        double err = 0, norm = 0;
        for (std::size_t i = 0; i < got.size(); ++i) {
            err += (static_cast<double>(got[i]) - want.data()[i]) * (static_cast<double>(got[i]) - want.data()[i]);
            norm += static_cast<double>(want.data()[i]) * want.data()[i];
        }
        return got.size() == static_cast<std::size_t>(want.numel()) ? std::sqrt(err / norm) : INFINITY;
    };
    CAPTURE(N);
    CHECK(rel(values(dxc), dxh) <= 1e-5);
    for (std::size_t l = 0; l < dev.size(); ++l) {
        CAPTURE(l);
        CHECK(rel(values(ys[l + 1]), hs[l + 1]) <= 1e-5);
        CHECK(rel(values(dev[l].weight.grad), host[l].weight.grad) <= 1e-5);
        if (dev[l].bias.value.numel() > 0) CHECK(rel(values(dev[l].bias.grad), host[l].bias.grad) <= 1e-5);
    }
}

// Every test starts from a clean device: no injection left, no sticky error.
using host_cuda::Clean;

//! The small network with a head that leaves its output in a buffer it keeps, past an offset, and
//! returns a view of it: an output that is not an allocation of its own (as a layer with a
//! persistent output buffer gives), so only the gather's own wait orders a copy of it.
template <class B>
struct KeptOutput {
    using backend = B;
    Small<B> body = make_small<B>();
    Tensor<float, B> kept;  // made at the first forward, on the replica's thread

    Tensor<float, B> forward(const nn::Context<B>& ctx, Tensor<float, B> x) {
        auto y = body.forward(ctx, std::move(x));
        constexpr std::int64_t at = 64;
        if (kept.numel() < at + y.numel())
            kept = Tensor<float, B>(Shape{at + y.numel()}, MemoryFormat::nchw, y.device(), uninitialized);
        kernels::Ops<B>::copy(ctx.exec, kept, at, y, 0, y.numel());
        return Tensor<float, B>::view(kept, at, y.shape(), y.format());
    }
    Tensor<float, B> backward(const nn::Context<B>& ctx, const Tensor<float, B>& dy) { return body.backward(ctx, dy); }
    template <class V>
    void visit(V&& v) {
        v.module("body", body);
    }
};

}  // namespace

// Issue 23, item 3: ReplicaResources::enter() left the thread's current stream on the replica's
// stream, and the next allocation after the resources were destroyed used a destroyed stream
// (cudaErrorContextIsDestroyed on the GPU). Mutation-checked (release build): bind_thread()
// setting the stream without its token fails this case.
TEST_CASE("a thread's current stream never names destroyed resources", "[hostcuda]") {
    Clean clean;
    const cudaStream_t before = cuda::current_stream();
    {
        kernels::Ops<Cuda>::ReplicaResources res(Device::cuda(0));
        {
            const auto entered = res.enter();
            CHECK(cuda::current_stream() == res.stream.get());
            Tensor<float, Cuda> t(Shape{64}, MemoryFormat::nchw, Device::cuda(0));
        }
        CHECK(cuda::current_stream() == before);  // the guard restored it
        res.bind_thread();
        CHECK(cuda::current_stream() == res.stream.get());
    }
    // The resources are gone: the thread's current stream reads as the legacy stream again.
    CHECK(cuda::current_stream() == nullptr);
    Tensor<float, Cuda> after(Shape{1000}, MemoryFormat::nchw, Device::cuda(0));
    CHECK(values(after) == std::vector<float>(1000, 0.0f));

    // A tensor made on a replica's stream and freed after its resources: freed in order, no error.
    Tensor<float, Cuda> outlives;
    {
        kernels::Ops<Cuda>::ReplicaResources res(Device::cuda(0));
        const auto entered = res.enter();
        outlives = Tensor<float, Cuda>(Shape{256}, MemoryFormat::nchw, Device::cuda(0));
    }
    outlives = Tensor<float, Cuda>();
    CHECK(cudaGetLastError() == cudaSuccess);
}

// Found by the host CUDA device: DataParallel cloned its replicas on their streams from a
// prototype allocated on the caller's stream, and the caller freed the prototype (a temporary)
// on that stream before the replicas' copies had run: replicas began from freed memory.
// Mutation-checked (release build): without the readers AllocationStreams::use_on records (so the
// free no longer waits for the copying stream), this case reads freed memory and fails.
TEST_CASE("a tensor copied on another stream is freed only after that copy", "[hostcuda]") {
    Clean clean;
    std::vector<float> want(4099);
    for (std::size_t i = 0; i < want.size(); ++i) want[i] = 0.5f * static_cast<float>(i);
    kernels::Ops<Cuda>::ReplicaResources res(Device::cuda(0));
    for (int round = 0; round < 20; ++round) {
        Tensor<float, Cuda> copy;
        {
            const auto source = make_tensor<float>(Shape{4099}, want).to<Cuda>(Device::cuda(0));  // this thread's stream
            std::thread replica([&] {
                const auto entered = res.enter();
                copy = Tensor<float, Cuda>(source);  // on the replica's stream
            });
            replica.join();
        }  // the source is freed here, on this thread's stream
        CAPTURE(round);
        REQUIRE(values(copy) == want);
    }
    // DataParallel from a temporary prototype: every replica starts from the prototype's values.
    const auto reference = make_small<Host>();
    std::vector<std::vector<float>> expected;
    nn::for_each_parameter(reference, [&](const std::string&, const auto& p) {
        expected.emplace_back(p.value.data(), p.value.data() + p.value.numel());
    });
    for (int round = 0; round < 3; ++round) {
        DataParallel<Small<Cuda>> dp(make_small<Cuda>(), std::vector<Device>(3, Device::cuda(0)));
        for (int r = 0; r < 3; ++r) {
            std::size_t i = 0;
            nn::for_each_parameter(dp.replica(r), [&](const std::string& name, const auto& p) {
                CAPTURE(round, r, name);
                CHECK(values(p.value) == expected[i++]);
            });
        }
    }
}

// Issue 23, item 6: the step's scalars were read into pageable memory, which returns only when
// the stream has drained; a stuck device then hung the step past every deadline. Mutation-checked
// (release build): Ops<Cuda>::to_vector copying straight into the std::vector (pageable) makes this
// step hang until the watchdog below releases the stall after 20 s, and the case fails.
TEST_CASE("a step whose device work stalls fails within the group's timeout", "[hostcuda]") {
    Clean clean;
    DataParallelOptions o;
    o.timeout = std::chrono::milliseconds(1500);
    DataParallel<Small<Cuda>> dp(make_small<Cuda>(), {Device::cuda(0), Device::cuda(0)}, o);
    nn::Sgd<Cuda> sgd({.lr = 0.05, .momentum = 0.9});
    const auto b = make_batch(8, 1);
    const auto x = b.x.to<Cuda>(Device::cuda(0));
    (void)dp.train_step(x, b.labels, nn::SoftmaxCrossEntropy{}, sgd);

    host_cuda::stall_launch(3);  // a kernel of the next step's forward never finishes
    std::atomic<bool> done{false};
    std::thread watchdog([&] {
        const auto give_up = Clock::now() + std::chrono::seconds(20);
        while (!done.load() && Clock::now() < give_up) std::this_thread::sleep_for(std::chrono::milliseconds(20));
        host_cuda::release_stalls();
    });
    const auto t0 = Clock::now();
    std::string message;
    bool threw = false;
    try {
        (void)dp.train_step(x, b.labels, nn::SoftmaxCrossEntropy{}, sgd);
    } catch (const Error& e) {
        threw = true;
        message = e.what();
    }
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    done = true;
    watchdog.join();
    CAPTURE(message, s);
    CHECK(threw);
    CHECK(s < 8.0);
    CHECK(message.find("took longer than") != std::string::npos);
}

// Issue 43, item 6: a copy from pageable host memory may block in the driver until its stream
// drains (the double always blocks), so a kernel that hangs before it held the caller past every
// deadline. The copy goes through pinned staging now, with the polled, bounded wait reads use.
// Mutation-checked (release build): with transfer() copying from the pageable source itself, the
// upload returns only when the stall is released here after 20 s, and the case fails.
TEST_CASE("an upload to a stream whose kernel hangs fails within the wait's deadline", "[hostcuda]") {
    Clean clean;
    cuda::Stream stream(0);
    const cuda::StreamGuard on(stream);
    const auto deadline = cuda::default_wait_timeout();
    cuda::default_wait_timeout() = std::chrono::milliseconds(500);
    host_cuda::stall_launch(1);
    REQUIRE(cudaLaunchHostFunc(stream.get(), [](void*) {}, nullptr) == cudaSuccess);  // stands still
    std::atomic<bool> done{false};
    std::thread watchdog([&] {
        const auto give_up = Clock::now() + std::chrono::seconds(20);
        while (!done.load() && Clock::now() < give_up) std::this_thread::sleep_for(std::chrono::milliseconds(20));
        host_cuda::release_stalls();
    });
    Tensor<float, Host> x(Shape{3000});
    for (std::int64_t i = 0; i < x.numel(); ++i) x[i] = static_cast<float>(i);
    const auto t0 = Clock::now();
    CHECK_THROWS_AS(x.to<Cuda>(Device::cuda(0)), Timeout);
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    done = true;
    watchdog.join();
    cuda::default_wait_timeout() = deadline;
    stream.synchronize();
    CHECK(s < 5.0);
    const auto y = x.to<Cuda>(Device::cuda(0));  // once the stream moves, the same upload succeeds
    CHECK(values(y) == std::vector<float>(x.data(), x.data() + x.numel()));
}

// Issue 23, item 1: the gather of DataParallel::forward copied every replica's output on replica
// 0's stream without waiting for the other replicas' streams, and allocated and freed on the
// caller's legacy stream: evaluation read unfinished outputs (chance accuracy on the GPU).
// Two layers order it now: gather_rows makes the caller's stream wait for every replica's, and
// Ops<Cuda>::copy orders itself after its operands' allocation streams. Mutation-checked (release
// build): with both removed this case fails (fresh device memory is NaN-filled on the host CUDA
// device).
TEST_CASE("DataParallel::forward gathers outputs the replicas have finished", "[hostcuda]") {
    Clean clean;
    const std::vector<Device> devices(4, Device::cuda(0));
    DataParallel<Small<Cuda>> gpu(make_small<Cuda>(), devices, {.math = Math::strict_fp32});  // parity with the host
    DataParallel<Small<Host>> host(make_small<Host>(), 4);
    gpu.eval();
    host.eval();
    for (int round = 0; round < 3; ++round) {
        const auto b = make_batch(11, 50 + static_cast<std::uint64_t>(round));
        const auto yc = values(gpu.forward(b.x.to<Cuda>(Device::cuda(0))));
        const auto yh_t = host.forward(b.x);
        const std::vector<float> yh(yh_t.data(), yh_t.data() + yh_t.numel());
        REQUIRE(yc.size() == yh.size());
        double d = 0, n = 0;
        for (std::size_t i = 0; i < yc.size(); ++i) {
            d += (static_cast<double>(yc[i]) - yh[i]) * (static_cast<double>(yc[i]) - yh[i]);
            n += static_cast<double>(yh[i]) * yh[i];
        }
        CAPTURE(round);
        CHECK(std::sqrt(d / n) <= 1e-5);
    }
}

// Issue 43, item 7: the gather's wait (gather_rows: the caller's stream waits for every
// replica's) was proven by no test: Ops<Cuda>::copy also orders itself after its operands'
// allocation streams, which covers an output that is a whole allocation of the replica's stream.
// Here the outputs are views into a buffer past its start, which only the gather's wait orders,
// and replica 1's stream stands still at its first kernel (a stall on device 1): until it is
// released, the caller's stream, which holds the gather's copies, must not finish. Mutation-checked
// (release build): without the order_after loop of gather_rows the caller's stream finishes at
// once and the gathered rows of replica 1 are stale (NaN from fresh device memory).
TEST_CASE("DataParallel::forward's gather waits for every replica's stream, whatever its outputs are", "[hostcuda]") {
    Clean clean;
    REQUIRE(host_cuda::set_device_count(2));
    DataParallel<KeptOutput<Cuda>> gpu(KeptOutput<Cuda>{}, {Device::cuda(0), Device::cuda(1)}, {.math = Math::strict_fp32});
    DataParallel<Small<Host>> host(make_small<Host>(), 2);
    gpu.eval();
    host.eval();
    for (int round = 0; round < 2; ++round) {
        const auto b = make_batch(11, 70 + static_cast<std::uint64_t>(round));
        const auto x = b.x.to<Cuda>(Device::cuda(0));
        host_cuda::stall_launch(1, nullptr, 1);  // replica 1's first kernel of this forward
        const auto y = gpu.forward(x);
        bool finished_early = false;  // the caller's stream (the legacy one) done while replica 1 stands still
        for (const auto until = Clock::now() + std::chrono::milliseconds(300); !finished_early && Clock::now() < until;) {
            finished_early = cudaStreamQuery(cudaStreamLegacy) == cudaSuccess;
            std::this_thread::sleep_for(std::chrono::milliseconds(5));
        }
        host_cuda::release_stalls();
        CAPTURE(round);
        CHECK_FALSE(finished_early);
        const auto yc = values(y);
        const auto yh_t = host.forward(b.x);
        REQUIRE(yc.size() == static_cast<std::size_t>(yh_t.numel()));
        double d = 0, n = 0;
        for (std::size_t i = 0; i < yc.size(); ++i) {
            d += (static_cast<double>(yc[i]) - yh_t.data()[i]) * (static_cast<double>(yc[i]) - yh_t.data()[i]);
            n += static_cast<double>(yh_t.data()[i]) * yh_t.data()[i];
        }
        CHECK(std::sqrt(d / n) <= 1e-5);
    }
}

// Issue 23, item 5: accumulate() returned with its copies of the caller's input still queued, so
// a caller that freed or refilled its input trained on the next batch's bytes. Mutation-checked
// (release build): without the wait of Ops<Cuda>::wait_inputs_read the losses and parameters
// differ here (the in-place refill overtakes the replicas' copies).
TEST_CASE("accumulate's input may be freed and refilled as soon as the call returns", "[hostcuda]") {
    Clean clean;
    const std::vector<Device> devices(3, Device::cuda(0));
    DataParallel<Small<Cuda>> reuse(make_small<Cuda>(), devices), fresh(make_small<Cuda>(), devices);
    nn::Sgd<Cuda> sgd_a({.lr = 0.05, .momentum = 0.9}), sgd_b({.lr = 0.05, .momentum = 0.9});
    for (int s = 0; s < 3; ++s) {
        const auto b1 = make_batch(13, 200 + static_cast<std::uint64_t>(s)),
                   b2 = make_batch(13, 300 + static_cast<std::uint64_t>(s));
        const auto x1 = b1.x.to<Cuda>(Device::cuda(0)), x2 = b2.x.to<Cuda>(Device::cuda(0));
        Tensor<float, Cuda> buffer = x1;
        reuse.accumulate(buffer, b1.labels, nn::SoftmaxCrossEntropy{});
        buffer.copy_from(x2);  // refilled in place, on this thread's stream, as soon as the call returns
        const double la = reuse.train_step(buffer, b2.labels, nn::SoftmaxCrossEntropy{}, sgd_a).loss;
        fresh.accumulate(x1, b1.labels, nn::SoftmaxCrossEntropy{});
        const double lb = fresh.train_step(x2, b2.labels, nn::SoftmaxCrossEntropy{}, sgd_b).loss;
        CAPTURE(s);
        CHECK(la == lb);
    }
    const auto pa = nn::Checkpoint(reuse.checkpoint()), pb = nn::Checkpoint(fresh.checkpoint());
    for (const auto& name : pa.names()) {
        CAPTURE(name);
        CHECK(pa.at(name).data == pb.at(name).data);
    }
}

// Issue 23, item 7: two NCCL communicators per GPU (layer and gradient groups) need NCCL's
// launch-order rule, which exists from NCCL 2.26; the loaded NCCL can be older than the headers.
// Mutation-checked (release build): without NcclApi::prepare_nccl this case fails.
// The variables are set once per process, before NCCL's first call: like every case here, this one
// runs in a process of its own (catch_discover_tests), not after another case's communicators.
TEST_CASE("NCCL older than 2.26 is refused with its version, and the launch-order rule is set unless the user set it",
          "[hostcuda]") {
    Clean clean;
    REQUIRE(host_cuda::set_device_count(2));
    const std::vector<Device> two{Device::cuda(0), Device::cuda(1)};
    ::unsetenv("NCCL_LAUNCH_ORDER_IMPLICIT");
    ::unsetenv("NCCL_RUNTIME_CONNECT");
    host_cuda::set_nccl_version(22503);
    CHECK_THROWS_WITH(DataParallel<Small<Cuda>>(make_small<Cuda>(), two), Catch::Contains("NCCL 2.25.3 is loaded"));
    CHECK(std::getenv("NCCL_LAUNCH_ORDER_IMPLICIT") == nullptr);
    host_cuda::set_nccl_version(22805);
    {
        DataParallel<Small<Cuda>> dp(make_small<Cuda>(), two);
        const char* rule = std::getenv("NCCL_LAUNCH_ORDER_IMPLICIT");
        REQUIRE(rule != nullptr);
        CHECK(std::string(rule) == "1");
        // Connections made at init, so a blocking collective only enqueues (Note [blocking communicators]).
        const char* connect = std::getenv("NCCL_RUNTIME_CONNECT");
        REQUIRE(connect != nullptr);
        CHECK(std::string(connect) == "0");
    }
    ::setenv("NCCL_LAUNCH_ORDER_IMPLICIT", "0", 1);  // the user's own setting is kept
    {
        DataParallel<Small<Cuda>> dp(make_small<Cuda>(), two);
        CHECK(std::string(std::getenv("NCCL_LAUNCH_ORDER_IMPLICIT")) == "0");
    }
    ::unsetenv("NCCL_LAUNCH_ORDER_IMPLICIT");
}

// A loaded NCCL of an older release than the headers lockstep was compiled against may lack a
// function they declare, which the loader would report only at its first call, ending the
// process: it is refused before NCCL's first call, naming both versions. A newer patch passes.
TEST_CASE("NCCL older than the headers lockstep was compiled against is refused, naming both", "[hostcuda]") {
    Clean clean;
    REQUIRE(host_cuda::set_device_count(2));
    const std::vector<Device> two{Device::cuda(0), Device::cuda(1)};
    const int older = (NCCL_VERSION_CODE / 100 - 1) * 100 + 9;  // the release before the headers', patch 9
    REQUIRE(older >= 22600);                                    // past the launch-order refusal
    host_cuda::set_nccl_version(older);
    const std::string headers = std::to_string(NCCL_MAJOR) + "." + std::to_string(NCCL_MINOR);
    CHECK_THROWS_AS(DataParallel<Small<Cuda>>(make_small<Cuda>(), two), UsageError);
    CHECK_THROWS_WITH(DataParallel<Small<Cuda>>(make_small<Cuda>(), two),
                      Catch::Contains("NCCL 2." + std::to_string((older / 100) % 100) + ".9 is loaded") &&
                          Catch::Contains("compiled against the headers of NCCL " + headers));
    host_cuda::set_nccl_version(NCCL_VERSION_CODE / 100 * 100);  // the headers' release, patch 0
    { DataParallel<Small<Cuda>> dp(make_small<Cuda>(), two); }
    host_cuda::set_nccl_version(22805);
}

// Issue 23, item 7: finalize is a collective of the ranks; one thread finalizing its ranks one
// by one waits on itself until the deadline. Mutation-checked (release build): NcclApi::finalize
// finalizing and polling one communicator after the other (as before) fails this case.
TEST_CASE("a thread's NCCL communicators are finalized in one group call", "[hostcuda]") {
    Clean clean;
    REQUIRE(host_cuda::set_device_count(2));
    DataParallelOptions o;
    o.timeout = std::chrono::seconds(20);
    auto dp =
        std::make_unique<DataParallel<Small<Cuda>>>(make_small<Cuda>(), std::vector<Device>{Device::cuda(0), Device::cuda(1)}, o);
    nn::Sgd<Cuda> sgd({.lr = 0.05});
    const auto b = make_batch(8, 3);
    (void)dp->train_step(b.x.to<Cuda>(Device::cuda(0)), b.labels, nn::SoftmaxCrossEntropy{}, sgd);
    const auto t0 = Clock::now();
    dp.reset();
    CHECK(std::chrono::duration<double>(Clock::now() - t0).count() < 5.0);
}

// Issue 23, item 8, and issue 25: without check_finite, a collective that fails on the device
// is seen only after every replica enqueued its optimizer step; the step must not pass for
// applied on replicas that may hold a partly reduced update. Rank 1 enqueues, per step:
// SyncBatchNorm's two forward all-reduces (1, 2), the buckets of the linear layer's bias and
// weight (3, 4), SyncBatchNorm's backward all-reduce (5), then the last bucket (6), which nothing
// reads before the commit barrier unless check_finite does. Each one fails in turn: the step fails on
// both replicas, none applies it or both are marked diverged, and the next step runs on rebuilt
// communicators. Mutation-checked
// (release build): without the device_failed mark (a step counted as applied once enqueued, as
// before) this case fails; so does the finite check moved after the optimizer's enqueue.
TEST_CASE("an NCCL failure after the commit point marks the replicas diverged, and with check_finite none applies it",
          "[hostcuda]") {
    Clean clean;
    REQUIRE(host_cuda::set_device_count(2));
    const std::vector<Device> two{Device::cuda(0), Device::cuda(1)};
    const auto b = make_batch(8, 4);
    const auto x = b.x.to<Cuda>(Device::cuda(0));
    const int failing = GENERATE(1, 2, 5, 6);
    const bool check_finite = GENERATE(false, true);
    CAPTURE(failing, check_finite);
    DataParallelOptions o;
    o.timeout = std::chrono::seconds(5);
    o.check_finite = check_finite;
    o.bucket_bytes = 1024;  // 3 buckets
    DataParallel<Small<Cuda>> dp(make_small<Cuda>(), two, o);
    nn::Sgd<Cuda> sgd({.lr = 0.05, .momentum = 0.9});
    (void)dp.train_step(x, b.labels, nn::SoftmaxCrossEntropy{}, sgd);
    const auto before = dp.checkpoint(sgd);
    host_cuda::fail_nccl(1, failing);
    const auto t0 = Clock::now();
    CHECK_THROWS(dp.train_step(x, b.labels, nn::SoftmaxCrossEntropy{}, sgd));
    CHECK(std::chrono::duration<double>(Clock::now() - t0).count() < 5.0);  // within the timeout, on every replica
    host_cuda::fail_nccl(1, 0);
    // A failure in SyncBatchNorm's collectives may also be seen before the commit barrier, by a
    // later enqueue on the failed communicator: then, too, no replica applies the step.
    if (!check_finite && failing == 6) CHECK(dp.diverged());
    if (check_finite) CHECK_FALSE(dp.diverged());
    if (dp.diverged()) {
        CHECK_THROWS_WITH(dp.train_step(x, b.labels, nn::SoftmaxCrossEntropy{}, sgd), Catch::Contains("load() a checkpoint"));
        dp.load(before, sgd);
    } else {
        const auto after = dp.checkpoint(sgd);
        for (const auto& name : before.names()) {
            CAPTURE(name);
            CHECK(after.at(name).data == before.at(name).data);  // no replica applied the step
        }
    }
    CHECK_NOTHROW(dp.train_step(x, b.labels, nn::SoftmaxCrossEntropy{}, sgd));  // the group was rebuilt
}

// Issue 27: every convolution kept its own columns, grown with the batch and never given back, so
// a replica held every layer's buffers at once. Now a replica's convolutions share one workspace
// (Note [one layer workspace]): it holds the largest layer's need, grows with a larger batch, and
// layers that reuse it one after the other on the stream still compute what the host does.
TEST_CASE("a replica's convolutions share one workspace, sized by the largest layer", "[hostcuda]") {
    Clean clean;
    using Ws = kernels::cuda_ops::LayerWorkspace;
    kernels::Ops<Cuda>::ReplicaResources res(Device::cuda(0));
    const auto entered = res.enter();
    nn::Context<Cuda> ctx;
    ctx.exec = res.execution();
    ctx.exec.math = Math::strict_fp32;  // compared with the host
    ctx.exec.cudnn = nullptr;           // im2col + cuBLAS, whatever the build (cuDNN's workspace: the next case)
    // Three layers: a small one, and two alike whose need is the largest.
    const auto conv_options = nn::Conv2dOptions{.padding = 1};
    nn::Generator g1(3), g2(3);
    std::vector<nn::Conv2d<Cuda>> dev;
    std::vector<nn::Conv2d<Host>> host;
    dev.emplace_back(2, 4, 3, nn::Conv2dOptions{}, g1), host.emplace_back(2, 4, 3, nn::Conv2dOptions{}, g2);
    for (int i = 0; i < 2; ++i) dev.emplace_back(4, 4, 3, conv_options, g1), host.emplace_back(4, 4, 3, conv_options, g2);
    const auto need = [](std::int64_t N, std::int64_t C, std::int64_t O, std::int64_t P) {  // backward: cols, dcols, dyt
        const std::int64_t cols = N * C * 9 * P;
        return 2 * Ws::aligned(cols) + N * O * P;
    };
    std::mt19937 rng(5);
    const auto run_all = [&](std::int64_t N) { run_conv_stack(ctx, dev, host, N, rng); };
    run_all(3);
    const std::int64_t largest = need(3, 4, 4, 64);  // the 4 -> 4 layers on 8 x 8
    CHECK(res.layers->floats() == largest);
    // Counted once the stream has run its frees (they are in stream order).
    const auto blocks_now = [&] {
        kernels::Ops<Cuda>::wait(ctx.exec, "a round of convolutions");
        return host_cuda::live_device_blocks();
    };
    const auto blocks = blocks_now();
    run_all(3);
    CHECK(blocks_now() == blocks);  // no buffer per call or per layer
    CHECK(res.layers->floats() == largest);
    run_all(5);  // a larger batch: the workspace grows to its need
    CHECK(res.layers->floats() == need(5, 4, 4, 64));

    // An execution made by hand, without the replica's workspace, is refused with what to do.
    auto bare = ctx;
    bare.exec.layer_workspace = nullptr;
    CHECK_THROWS_WITH(dev[0].forward(bare, Tensor<float, Cuda>(Shape{1, 2, 10, 10}, MemoryFormat::nchw, Device::cuda(0))),
                      Catch::Contains("without its replica's layer workspace"));
}

#if LOCKSTEP_WITH_CUDNN
// Issue 27 (Note [cuDNN convolutions]): convolutions through cuDNN. The double checks the
// descriptors against each other, the operands and the workspace against the algorithm's need,
// and ranks an unsupported, an oversized and non-deterministic algorithms first: what the library
// runs must be what it takes from the ranking, in the math its mode sets, within its workspace.
TEST_CASE("cuDNN convolutions: deterministic algorithms in the replica's workspace, as the host computes", "[hostcuda]") {
    Clean clean;
    kernels::Ops<Cuda>::ReplicaResources res(Device::cuda(0));
    const auto entered = res.enter();
    REQUIRE(res.cudnn != nullptr);
    nn::Context<Cuda> ctx;
    ctx.exec = res.execution();
    ctx.exec.math = Math::strict_fp32;  // compared with the host
    REQUIRE(ctx.exec.cudnn == res.cudnn.get());
    nn::Generator g1(4), g2(4);
    std::vector<nn::Conv2d<Cuda>> dev;
    std::vector<nn::Conv2d<Host>> host;
    dev.emplace_back(2, 5, 3, nn::Conv2dOptions{.padding = 1}, g1),
        host.emplace_back(2, 5, 3, nn::Conv2dOptions{.padding = 1}, g2);
    dev.emplace_back(5, 3, 3, nn::Conv2dOptions{.stride = 2}, g1), host.emplace_back(5, 3, 3, nn::Conv2dOptions{.stride = 2}, g2);
    dev.emplace_back(3, 4, 1, nn::Conv2dOptions{.bias = false}, g1),
        host.emplace_back(3, 4, 1, nn::Conv2dOptions{.bias = false}, g2);
    std::mt19937 rng(6);
    run_conv_stack(ctx, dev, host, 3, rng);
    run_conv_stack(ctx, dev, host, 3, rng);  // the weight gradients accumulate over both rounds, as the host's

    const auto calls = host_cuda::cudnn_calls();
    CHECK(calls.size() == 2 * 3 * 3);  // every layer, every direction, both rounds: none fell back to im2col
    std::size_t largest = 0;
    for (const auto& c : calls) {
        CAPTURE(c.direction, c.algorithm, c.c, c.o);
        CHECK(c.device == 0);
        CHECK_FALSE(c.tf32);     // strict fp32: CUDNN_FMA_MATH
        if (c.direction == 'f')  // not the unsupported FFT, not the 2 GiB Winograd
            CHECK((c.algorithm != CUDNN_CONVOLUTION_FWD_ALGO_FFT && c.algorithm != CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD_NONFUSED));
        if (c.direction == 'd') CHECK(c.algorithm != CUDNN_CONVOLUTION_BWD_DATA_ALGO_0);  // non-deterministic
        if (c.direction == 'w')
            CHECK((c.algorithm != CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0 && c.algorithm != CUDNN_CONVOLUTION_BWD_FILTER_ALGO_3));
        largest = std::max(largest, c.workspace_bytes);
    }
    // The workspace is the replica's one (Note [one layer workspace]), as large as the largest need.
    CHECK(static_cast<std::size_t>(res.layers->floats()) * sizeof(float) >= largest);
    CHECK(largest > 0);  // device 0's ranking takes algorithms that need one: the double wrote its columns there

    // The process chose once per shape: the table holds the algorithms every call ran.
    kernels::cuda_ops::CudnnConvolutions::Choice choice;
    kernels::ConvGeometry g{
        .batch = 3, .in_channels = 2, .height = 10, .width = 10, .out_channels = 5, .kernel = 3, .padding = 1};
    REQUIRE(kernels::cuda_ops::CudnnConvolutions::chosen(kernels::device::layer_kernels::ConvPlan(g), Math::strict_fp32, choice));
    CHECK(choice.usable);
    CHECK(calls.front().algorithm == static_cast<int>(choice.forward));

    // Counted once the stream has run its frees: repeated rounds allocate nothing new.
    const auto blocks_now = [&] {
        kernels::Ops<Cuda>::wait(ctx.exec, "a round of convolutions");
        return host_cuda::live_device_blocks();
    };
    const auto blocks = blocks_now();
    run_conv_stack(ctx, dev, host, 3, rng);
    CHECK(blocks_now() == blocks);

    // PyTorch's default math lets cuDNN use TF32 for convolutions: CUDNN_DEFAULT_MATH.
    auto tf32 = ctx;
    tf32.exec.math = Math::pytorch_default;
    const auto before = host_cuda::cudnn_calls().size();
    (void)dev[0].forward(tf32, Tensor<float, Cuda>(Shape{2, 2, 10, 10}, MemoryFormat::nchw, Device::cuda(0)));
    const auto after = host_cuda::cudnn_calls();
    REQUIRE(after.size() == before + 1);
    CHECK(after.back().tf32);

    // An algorithm the ranking lists as supported but its workspace query refuses is skipped for
    // the next (device 0 ranks the GEMM forward first among the deterministic ones).
    host_cuda::refuse_cudnn_algorithm('f', CUDNN_CONVOLUTION_FWD_ALGO_GEMM);
    const auto r_before = host_cuda::cudnn_calls().size();
    run_conv_stack(ctx, dev, host, 6, rng);  // a batch of 6: shapes not chosen yet
    const auto r_after = host_cuda::cudnn_calls();
    REQUIRE(r_after.size() == r_before + 9);
    for (std::size_t i = r_before; i < r_after.size(); ++i)
        if (r_after[i].direction == 'f') CHECK(r_after[i].algorithm == CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM);

    // A shape with no deterministic backward-filter algorithm runs im2col + cuBLAS in every
    // direction, and still computes what the host does.
    host_cuda::set_cudnn_deterministic(false);
    const auto n_before = host_cuda::cudnn_calls().size();
    run_conv_stack(ctx, dev, host, 4, rng);  // a batch of 4: shapes not chosen yet
    CHECK(host_cuda::cudnn_calls().size() == n_before);
    g.batch = 4;
    REQUIRE(kernels::cuda_ops::CudnnConvolutions::chosen(kernels::device::layer_kernels::ConvPlan(g), Math::strict_fp32, choice));
    CHECK_FALSE(choice.usable);
}
#endif

// Issue 27 (Note [graphs]): a replica's step captured once and launched again. On the host CUDA
// device a kernel's parameters live in a block its eager launch frees after running: a captured
// launch that did the same would run freed parameters at the second launch (ASan), and a graph
// that ran its work at capture, or dropped a node, would not give the eager step's bits.
TEST_CASE("a replica's convolution step captured in a CUDA graph replays the eager step bit for bit", "[hostcuda]") {
    Clean clean;
    kernels::Ops<Cuda>::ReplicaResources res(Device::cuda(0));
    const auto entered = res.enter();
    nn::Context<Cuda> ctx;
    ctx.exec = res.execution();  // cuDNN where the build has it, im2col + cuBLAS otherwise
    nn::Generator gen(7);
    std::vector<nn::Conv2d<Cuda>> layers;
    layers.emplace_back(2, 4, 3, nn::Conv2dOptions{.padding = 1}, gen);
    layers.emplace_back(4, 3, 3, nn::Conv2dOptions{.stride = 2}, gen);
    std::mt19937 rng(8);
    std::normal_distribution<float> d;
    Tensor<float, Host> xh(Shape{3, 2, 10, 10}), dyh(Shape{3, 3, 4, 4});
    for (float& v : xh.span()) v = d(rng);
    for (float& v : dyh.span()) v = d(rng);
    // What the graph reads and writes outlives its capture; the step's temporaries do not.
    const auto x = xh.to<Cuda>(Device::cuda(0));
    const auto dy = dyh.to<Cuda>(Device::cuda(0));
    Tensor<float, Cuda> dx(x.shape(), MemoryFormat::nchw, Device::cuda(0));
    const auto step = [&] {
        Tensor<float, Cuda> y = x;
        for (auto& l : layers) y = l.forward(ctx, y);
        Tensor<float, Cuda> g = dy;
        for (std::size_t l = layers.size(); l-- > 0;) g = layers[l].backward(ctx, g);
        // In stream order (copy_from waits for the copy: the host may not wait inside a capture).
        REQUIRE(cudaMemcpyAsync(dx.data(), g.data(), dx.numel() * sizeof(float), cudaMemcpyDeviceToDevice, ctx.exec.stream) ==
                cudaSuccess);
    };
    const auto zero_grads = [&] {
        for (auto& l : layers) l.weight.grad.zero(), l.bias.grad.zero();
    };
    // Three eager steps: the weight gradients accumulate.
    std::vector<std::vector<float>> eager;
    const auto snapshot = [&] {
        std::vector<float> all = values(dx);
        for (auto& l : layers)
            for (const auto* t : {&l.weight.grad, &l.bias.grad}) {
                const auto v = values(*t);
                all.insert(all.end(), v.begin(), v.end());
            }
        return all;
    };
    zero_grads();
    for (int i = 0; i < 3; ++i) {
        step();
        eager.push_back(snapshot());
    }

    zero_grads();
    dx.zero();
    const auto blocks = [&] {
        kernels::Ops<Cuda>::wait(ctx.exec, "the replica's stream");
        return host_cuda::live_device_blocks();
    };
    const auto before = blocks();
    const auto launched = host_cuda::launches();
    auto graph = cuda::Graph::capture(ctx.exec.stream, step);
    CHECK(host_cuda::launches() == launched);  // recorded, not run
    CHECK(values(dx) == std::vector<float>(static_cast<std::size_t>(dx.numel()), 0.0f));
    CHECK(blocks() > before);  // the step's temporaries: the graph's memory while it lives
    for (int i = 0; i < 3; ++i) {
        graph.launch(ctx.exec.stream);
        CAPTURE(i);
        CHECK(snapshot() == eager[static_cast<std::size_t>(i)]);
    }
    CHECK(host_cuda::launches() > launched);
    graph = cuda::Graph();
    CHECK(blocks() == before);  // given back with the graph

    // Work the capture refuses ends it: here a read to the host, which waits for the device.
    CHECK_THROWS_AS(cuda::Graph::capture(ctx.exec.stream, [&] { (void)values(dx); }), DeviceError);
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusActive;
    REQUIRE(cudaStreamIsCapturing(ctx.exec.stream, &status) == cudaSuccess);
    CHECK(status == cudaStreamCaptureStatusNone);
    zero_grads();
    step();  // the stream runs eagerly again
    CHECK(snapshot() == eager[0]);

    // A record() that throws its own error: the capture ends, its graph and memory are dropped;
    // the stream then captures again.
    const auto kept = blocks();
    CHECK_THROWS_WITH(cuda::Graph::capture(ctx.exec.stream,
                                           [&] {
                                               step();
                                               throw std::runtime_error("the caller's own");
                                           }),
                      "the caller's own");
    CHECK(blocks() == kept);
    zero_grads();
    dx.zero();
    graph = cuda::Graph::capture(ctx.exec.stream, step);
    graph.launch(ctx.exec.stream);
    CHECK(snapshot() == eager[0]);
    graph = cuda::Graph();
    CHECK_THROWS_AS(cuda::Graph().launch(ctx.exec.stream), UsageError);
    CHECK_THROWS_AS(cuda::Graph::capture(nullptr, step), UsageError);  // the legacy stream cannot capture
}

// Issue 43, item 2: a graph's allocations get memory at its upload or first launch, from the
// graph pool, beside what the default pool keeps of freed bytes (lockstep keeps them all). Graph
// capture trims the default pool first and uploads the executable at once, so a graph that fits
// only without the pool's cache is made, and one that does not fit at all is refused at its
// capture (OutOfMemory), never at a later launch; GraphCache::clear gives the graph pool's memory
// back where no graph of the process is left on the device. Mutation-checked: without the trim
// before the capture, the first capture is refused; without the upload, the graph holds no memory
// after its capture and the refused one is made; without the trim in clear, the graph pool keeps
// the memory; with it whatever graphs are left, the other cache's launch needs memory and fails.
TEST_CASE("captured graphs take their memory at capture, after the default pool's cache is trimmed", "[hostcuda]") {
    Clean clean;
    cuda::Stream stream(0);
    const cuda::StreamGuard on(stream);
    constexpr std::int64_t mib = 1 << 18;  // floats
    {
        Tensor<float, Cuda> cached(Shape{64 * mib}, MemoryFormat::nchw, Device::cuda(0), uninitialized);
    }  // freed in stream order: the default pool keeps its bytes
    stream.synchronize();
    REQUIRE(host_cuda::pool_cached_bytes(0) >= std::size_t{64} << 20);
    std::size_t free = 0, total = 0;
    REQUIRE(cudaMemGetInfo(&free, &total) == cudaSuccess);
    // Room for a 48 MiB graph only once the pool's 64 MiB are given back.
    REQUIRE(host_cuda::set_memory_capacity(0, total - free + (std::size_t{16} << 20)));
    const auto temporaries = [](std::int64_t n) {  // a graph that allocates n floats and frees them
        return [n] {
            Tensor<float, Cuda> t(Shape{n}, MemoryFormat::nchw, Device::cuda(0), uninitialized);
            t.zero();
        };
    };
    cuda::GraphCache cache(4);
    CHECK(cache.prepare({1}, stream.get(), temporaries(48 * mib)));
    CHECK(host_cuda::pool_cached_bytes(0) == 0);
    CHECK(host_cuda::graph_memory_bytes(0) >= std::size_t{48} << 20);
    for (int i = 0; i < 3; ++i) cache.launch({1}, stream.get(), temporaries(48 * mib));
    stream.synchronize();
    // One whose memory the device cannot give is refused where it is made.
    host_cuda::fail_graph_memory(1, 0);
    CHECK_THROWS_WITH(cache.prepare({2}, stream.get(), temporaries(mib)),
                      Catch::Contains("uploading a CUDA graph failed") && Catch::Contains("cudaErrorMemoryAllocation"));
    CHECK_FALSE(cache.contains({2}));
    // Another cache's graph keeps its memory when this one is cleared: a trim of the graph pool
    // would take back the memory of every idle graph, whose next launch would need it again.
    cuda::GraphCache other(1);
    CHECK(other.prepare({3}, stream.get(), temporaries(mib)));
    cache.clear();
    host_cuda::fail_graph_memory(1, 0);  // a launch that needs memory now fails
    CHECK_NOTHROW(other.launch({3}, stream.get(), temporaries(mib)));
    host_cuda::fail_graph_memory(0);
    stream.synchronize();
    CHECK(host_cuda::graph_memory_bytes(0) >= std::size_t{4} << 20);
    other.clear();  // the device's last graph: now the pool is trimmed
    CHECK(host_cuda::graph_memory_bytes(0) == 0);
}

// Issue 27, item 3: captured steps kept per input shape and module structure, at most a
// capacity, the least recently launched dropped. A cache keyed by the shape alone would launch a
// stale graph after a parameter is replaced (its old address is in the graph): this one captures
// again, and each launch gives the eager step's bits for its batch.
TEST_CASE("a GraphCache captures each shape once, drops the least recently launched, and captures again for a changed module",
          "[hostcuda]") {
    Clean clean;
    kernels::Ops<Cuda>::ReplicaResources res(Device::cuda(0));
    const auto entered = res.enter();
    nn::Context<Cuda> ctx;
    ctx.exec = res.execution();
    nn::Generator gen(11);
    using Net = nn::Sequential<nn::Conv2d<Cuda>, nn::Conv2d<Cuda>>;
    Net net(nn::Conv2d<Cuda>(2, 3, 3, {.padding = 1}, gen), nn::Conv2d<Cuda>(3, 2, 3, {.stride = 2}, gen));
    struct Io {
        Tensor<float, Cuda> x, dy, dx;  // made before any capture, outliving the graphs
    };
    std::map<std::int64_t, Io> io;
    std::mt19937 rng(12);
    std::normal_distribution<float> d;
    for (const std::int64_t n : {2, 3, 4}) {
        Tensor<float, Host> x(Shape{n, 2, 8, 8}), dy(Shape{n, 2, 3, 3});
        for (float& v : x.span()) v = d(rng);
        for (float& v : dy.span()) v = d(rng);
        io[n] = {x.to<Cuda>(Device::cuda(0)), dy.to<Cuda>(Device::cuda(0)),
                 Tensor<float, Cuda>(Shape{n, 2, 8, 8}, MemoryFormat::nchw, Device::cuda(0))};
    }
    const auto step = [&](std::int64_t n) {
        auto& b = io.at(n);
        (void)net.forward(ctx, Tensor<float, Cuda>(b.x));
        const auto g = net.backward(ctx, b.dy);
        LOCKSTEP_CUDA_CHECK(
            cudaMemcpyAsync(b.dx.data(), g.data(), b.dx.numel() * sizeof(float), cudaMemcpyDeviceToDevice, ctx.exec.stream));
    };
    // What one step from zero gradients gives, per batch: dx and the gradients.
    const auto result = [&](std::int64_t n) {
        std::vector<float> all = values(io.at(n).dx);
        nn::for_each_parameter(net, [&](const std::string&, auto& p) {
            const auto v = values(p.grad);
            all.insert(all.end(), v.begin(), v.end());
        });
        return all;
    };
    std::map<std::int64_t, std::vector<float>> eager;
    for (const std::int64_t n : {2, 3, 4}) {  // the eager steps also grow the workspace and choose the algorithms
        nn::zero_grad(net);
        step(n);
        eager[n] = result(n);
    }
    cuda::GraphCache cache(2);
    const auto run = [&](std::int64_t n) {
        nn::zero_grad(net);
        cuda::GraphCache::Key key{n};
        const auto sig = nn::structure_signature(net);
        key.insert(key.end(), sig.begin(), sig.end());
        const bool captured = cache.launch(key, ctx.exec.stream, [&] { step(n); });
        CAPTURE(n);
        CHECK(result(n) == eager.at(n));
        return captured;
    };
    CHECK(run(2));
    CHECK_FALSE(run(2));
    CHECK(run(3));
    CHECK(run(4));  // past the capacity: batch 2's graph, the least recently launched, is dropped
    CHECK(cache.size() == 2);
    CHECK_FALSE(run(3));
    CHECK(run(2));  // captured again
    CHECK_FALSE(run(3));
    // A parameter replaced (same shape, new memory): the module's signature changes.
    const auto before = nn::structure_signature(net);
    nn::zero_grad(net);
    auto stale = cuda::Graph::capture(ctx.exec.stream, [&] { step(3); });  // made with the old weight
    auto& weight = net.get<0>().weight.value;
    weight = Tensor<float, Cuda>(weight);
    CHECK(nn::structure_signature(net) != before);
    CHECK(run(3));  // not the stale graph of the old weight's address
    // Which, launched, works on freed memory: a GPU faults, and so does the double.
    stale.launch(ctx.exec.stream);
    CHECK_THROWS_AS(kernels::Ops<Cuda>::wait(ctx.exec, "the stale graph"), DeviceError);
    host_cuda::reset();  // the device's sticky error, for the rest of the case
    stale = cuda::Graph();
    cache.clear();
    CHECK(cache.size() == 0);
    CHECK(run(3));
    CHECK_THROWS_AS(cuda::GraphCache(0), UsageError);
}

// Issue 27 (Note [ReLU mask from x]): a fused ReLU after SyncBatchNorm on CUDA saved a byte per
// element for backward. The forward keeps no mask now: it holds what a plain batch norm holds,
// and backward, which finds the mask from x, still computes what the host does with its mask.
TEST_CASE("SyncBatchNorm on CUDA keeps no ReLU mask, backward finds it from x", "[hostcuda]") {
    Clean clean;
    kernels::Ops<Cuda>::ReplicaResources res(Device::cuda(0));
    const auto entered = res.enter();
    nn::Context<Cuda> ctx;
    ctx.exec = res.execution();
    nn::Context<Host> hctx;
    std::mt19937 rng(9);
    std::normal_distribution<float> d;
    Tensor<float, Host> x(Shape{4, 8, 6, 6}), dy(Shape{4, 8, 6, 6});
    for (float& v : x.span()) v = d(rng);
    for (float& v : dy.span()) v = d(rng);
    // Blocks held after a training forward, its output alive, once the stream has freed what it frees.
    const auto held = [&](nn::SyncBatchNorm<Cuda>& bn) {
        (void)bn.forward(ctx, x.to<Cuda>(Device::cuda(0)));  // the layer's constants exist from here
        (void)bn.backward(ctx, dy.to<Cuda>(Device::cuda(0)));
        kernels::Ops<Cuda>::wait(ctx.exec, "the first step");
        const auto before = host_cuda::live_device_blocks();
        const auto y = bn.forward(ctx, x.to<Cuda>(Device::cuda(0)));
        kernels::Ops<Cuda>::wait(ctx.exec, "the forward");
        return host_cuda::live_device_blocks() - before;
    };
    nn::SyncBatchNorm<Cuda> plain(8), fused(8, {.fused_relu = true});
    CHECK(held(fused) == held(plain));
    nn::SyncBatchNorm<Host> host(8, {.fused_relu = true});
    (void)host.forward(hctx, x);
    (void)host.backward(hctx, dy);
    (void)host.forward(hctx, x);
    const auto want = host.backward(hctx, dy);
    const auto got = fused.backward(ctx, dy.to<Cuda>(Device::cuda(0))).to_host();
    double err = 0, norm = 0;
    for (std::int64_t i = 0; i < want.numel(); ++i) {
        err += (static_cast<double>(got[i]) - want[i]) * (static_cast<double>(got[i]) - want[i]);
        norm += static_cast<double>(want[i]) * want[i];
    }
    CHECK(std::sqrt(err / norm) <= 1e-5);
}

namespace {

// Sample i is (i, i + 0.5) with class i % 3.
struct PairData {
    std::int64_t size() const { return 10; }
    Shape sample_shape() const { return Shape{2}; }
    void read(std::int64_t i, std::span<float> out) const {
        out[0] = static_cast<float>(i);
        out[1] = static_cast<float>(i) + 0.5f;
    }
    std::int64_t label(std::int64_t i) const { return i % 3; }
};

cudaMemoryType memory_type(const void* p) {
    cudaPointerAttributes a{};
    REQUIRE(cudaPointerGetAttributes(&a, p) == cudaSuccess);
    return a.type;
}

}  // namespace

TEST_CASE("the loader's batches in page-locked memory: pinned, reused once released, freed with the last holder", "[hostcuda]") {
    std::vector<const void*> seen;
    {
        PairData ds;
        // No prefetch: the next batch is made at next(), after the previous one was released.
        data::BatchLoader loader(ds,
                                 {.batch_size = 4, .shuffle = false, .prefetch = false, .memory = cuda::pinned_batch_memory()});
        loader.start_epoch(0);
        auto first = loader.next();
        REQUIRE(first);
        CHECK(memory_type(first->x.data()) == cudaMemoryTypeHost);
        seen.push_back(first->x.data());
        // A copy to the device from it gives the batch's values.
        const auto back = first->x.to<Cuda>(Device::cuda(0)).to_host();
        CHECK(back[5] == 2.5f);
        first.reset();  // released: the next batch of its size takes the same block
        auto second = loader.next();
        REQUIRE(second);
        CHECK(second->x.data() == seen[0]);
        CHECK(second->x[0] == 4.0f);
        auto third = loader.next();  // 2 samples: a block of another size
        REQUIRE(third);
        CHECK(third->x.dim(0) == 2);
        CHECK(third->x.data() != seen[0]);
        CHECK(memory_type(third->x.data()) == cudaMemoryTypeHost);
        seen.push_back(third->x.data());
    }
    // The loader, its batches and the function are gone: every block is unpinned and freed.
    for (const void* p : seen) CHECK(memory_type(p) == cudaMemoryTypeUnregistered);
}

TEST_CASE("a copy to the GPU from page-locked memory goes in one transfer, from pageable memory through staging", "[hostcuda]") {
    // 9 MiB: more than one staging chunk (8 MiB).
    const std::int64_t n = (std::int64_t{9} << 20) / 4;
    auto pinned = cuda::pinned_batch_memory()(static_cast<std::size_t>(n) * sizeof(float));
    auto in_pinned = Tensor<float, Host>::view(static_cast<float*>(pinned.get()), Shape{n}, Device::host());
    Tensor<float, Host> in_pageable(Shape{n});
    for (std::int64_t i = 0; i < n; i += 4096) in_pinned[i] = in_pageable[i] = static_cast<float>(i);
    const auto before = host_cuda::uploads_from_pinned();
    const auto a = in_pinned.to<Cuda>(Device::cuda(0));
    const auto direct = host_cuda::uploads_from_pinned() - before;
    const auto b = in_pageable.to<Cuda>(Device::cuda(0));
    const auto staged = host_cuda::uploads_from_pinned() - before - direct;
    CHECK(direct == 1);
    CHECK(staged == 2);  // two chunks through the staging buffer
    const auto ha = a.to_host(), hb = b.to_host();
    CHECK(ha[4096 * 100] == 409600.0f);
    CHECK(hb[4096 * 100] == 409600.0f);
}
