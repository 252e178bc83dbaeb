// SPDX-License-Identifier: MIT
//! Tests of lockstep's host CUDA device itself: each behaviour it models, as a GPU shows it.
#include <cublas_v2.h>
#if LOCKSTEP_WITH_CUDNN
#include <cudnn.h>
#endif
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <catch2/catch.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "host_cuda.hpp"

namespace hc = lockstep::host_cuda;
using namespace std::chrono_literals;

namespace {

//! Resets the double before and checks for leaks of device blocks after each test case.
struct Fresh {
    std::size_t blocks;
    Fresh() {
        hc::reset();
        hc::set_device_count(1);
        (void)cudaSetDevice(0);
        blocks = hc::live_device_blocks();
    }
    ~Fresh() {
        hc::release_stalls();
        for (int d = 0; d < 4; ++d)
            if (cudaSetDevice(d) == cudaSuccess) (void)cudaDeviceSynchronize();
        (void)cudaSetDevice(0);
        hc::reset();
    }
};

//! "Kernels" for the tests: closures owned here (one skipped after a fault must not leak).
struct Kernels {
    std::deque<std::function<void()>> bodies;
    cudaError_t launch(cudaStream_t s, std::function<void()> f) {
        bodies.push_back(std::move(f));
        return cudaLaunchHostFunc(
            s, [](void* p) { (*static_cast<std::function<void()>*>(p))(); }, &bodies.back());
    }
};

//! Polls `done` until it holds or 5 s passed.
template <class F>
bool eventually(F done) {
    const auto deadline = std::chrono::steady_clock::now() + 5s;
    while (!done()) {
        if (std::chrono::steady_clock::now() > deadline) return false;
        std::this_thread::sleep_for(1ms);
    }
    return true;
}

float* device_floats(std::size_t n) {
    void* p = nullptr;
    REQUIRE(cudaMalloc(&p, n * sizeof(float)) == cudaSuccess);
    return static_cast<float*>(p);
}

std::vector<float> read_back(const float* d, std::size_t n) {
    std::vector<float> h(n);
    REQUIRE(cudaMemcpy(h.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost) == cudaSuccess);
    return h;
}

}  // namespace

TEST_CASE("host CUDA: an H200's properties on 1 to 4 devices") {
    Fresh fresh;
    REQUIRE(hc::set_device_count(4));
    int n = 0;
    REQUIRE(cudaGetDeviceCount(&n) == cudaSuccess);
    CHECK(n == 4);
    cudaDeviceProp p0{}, p1{};
    REQUIRE(cudaGetDeviceProperties(&p0, 0) == cudaSuccess);
    REQUIRE(cudaGetDeviceProperties(&p1, 1) == cudaSuccess);
    CHECK(std::string(p0.name).find("H200") != std::string::npos);
    CHECK(std::string(p0.name).find("lockstep") != std::string::npos);
    CHECK(p0.multiProcessorCount == 132);
    CHECK(p0.major == 9);
    CHECK(p0.minor == 0);
    CHECK(p0.warpSize == 32);
    CHECK(p0.maxThreadsPerBlock == 1024);
    CHECK(p0.sharedMemPerBlock == 48 * 1024);
    CHECK(p0.sharedMemPerBlockOptin == 227 * 1024);
    CHECK(p0.l2CacheSize == 60 * 1024 * 1024);
    CHECK(p0.totalGlobalMem == std::size_t{8} << 30);
    CHECK(std::memcmp(&p0.uuid, &p1.uuid, sizeof p0.uuid) != 0);
    int v = 0;
    REQUIRE(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, 3) == cudaSuccess);
    CHECK(v == 132);
    REQUIRE(cudaDeviceGetAttribute(&v, cudaDevAttrL2CacheSize, 0) == cudaSuccess);
    CHECK(v == 60 * 1024 * 1024);
    REQUIRE(cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0) == cudaSuccess);
    CHECK(v == 227 * 1024);
    cudaFuncAttributes fa{};
    REQUIRE(cudaFuncGetAttributes(&fa, reinterpret_cast<const void*>(&read_back)) == cudaSuccess);
    CHECK(fa.numRegs == 32);
    CHECK(fa.localSizeBytes == 0);
    CHECK(cudaFuncGetAttributes(&fa, nullptr) == cudaErrorInvalidDeviceFunction);

    // An invalid ordinal is an API error: returned, recorded, cleared, not sticky.
    (void)cudaGetLastError();
    CHECK(cudaSetDevice(4) == cudaErrorInvalidDevice);
    CHECK(cudaPeekAtLastError() == cudaErrorInvalidDevice);
    CHECK(cudaGetLastError() == cudaErrorInvalidDevice);
    CHECK(cudaGetLastError() == cudaSuccess);
    REQUIRE(cudaSetDevice(2) == cudaSuccess);
    int d = -1;
    REQUIRE(cudaGetDevice(&d) == cudaSuccess);
    CHECK(d == 2);
    int other = -1;
    std::thread([&] { (void)cudaGetDevice(&other); }).join();
    CHECK(other == 0);  // the current device is per thread
    CHECK(std::string(cudaGetErrorName(cudaErrorMisalignedAddress)) == "cudaErrorMisalignedAddress");
    CHECK(std::string(cudaGetErrorName(cudaErrorIllegalAddress)) == "cudaErrorIllegalAddress");
    CHECK(std::string(cudaGetErrorString(cudaErrorMemoryAllocation)) == "out of memory");
    CHECK(std::string(cublasGetStatusString(CUBLAS_STATUS_INVALID_VALUE)).find("invalid") != std::string::npos);
}

TEST_CASE("host CUDA: device blocks are 256-byte aligned, NaN-filled, counted against the capacity") {
    Fresh fresh;
    float* a = device_floats(1000);
    CHECK(reinterpret_cast<std::uintptr_t>(a) % 256 == 0);
    for (float x : read_back(a, 1000)) CHECK(std::isnan(x));
    CHECK(hc::live_device_blocks() == fresh.blocks + 1);

    cudaPointerAttributes attr{};
    REQUIRE(cudaPointerGetAttributes(&attr, a + 10) == cudaSuccess);
    CHECK(attr.type == cudaMemoryTypeDevice);

    REQUIRE(hc::set_memory_capacity(0, std::size_t{1} << 20));
    void* big = nullptr;
    CHECK(cudaMalloc(&big, std::size_t{2} << 20) == cudaErrorMemoryAllocation);
    CHECK(cudaGetLastError() == cudaErrorMemoryAllocation);
    std::size_t free = 0, total = 0;
    REQUIRE(cudaMemGetInfo(&free, &total) == cudaSuccess);  // not sticky
    CHECK(total == std::size_t{1} << 20);
    CHECK(free == total - 4096);

    hc::fail_allocation(2);
    void* p1 = nullptr;
    void* p2 = nullptr;
    void* p3 = nullptr;
    CHECK(cudaMalloc(&p1, 64) == cudaSuccess);
    CHECK(cudaMalloc(&p2, 64) == cudaErrorMemoryAllocation);
    CHECK(cudaMalloc(&p3, 64) == cudaSuccess);
    CHECK(cudaFree(p1) == cudaSuccess);
    CHECK(cudaFree(p3) == cudaSuccess);
    CHECK(cudaFree(p1) == cudaErrorInvalidValue);  // freed twice
    int on_stack = 0;
    CHECK(cudaFree(&on_stack) == cudaErrorInvalidValue);
    CHECK(cudaFree(a + 1) == cudaErrorInvalidValue);  // not a block's base

    // A copy or memset whose device side leaves the block is refused, not sticky.
    std::vector<float> h(1001);
    CHECK(cudaMemcpy(h.data(), a, 1001 * sizeof(float), cudaMemcpyDeviceToHost) == cudaErrorInvalidValue);
    CHECK(cudaMemcpy(a + 1000, h.data(), 64 * sizeof(float), cudaMemcpyHostToDevice) == cudaErrorInvalidValue);
    CHECK(cudaMemset(a, 0, 1001 * sizeof(float)) == cudaErrorInvalidValue);
    CHECK(cudaMemcpy(h.data(), h.data() + 1, 4, cudaMemcpyDeviceToHost) == cudaErrorInvalidValue);
    REQUIRE(cudaMemset(a, 0, 1000 * sizeof(float)) == cudaSuccess);
    for (float x : read_back(a, 1000)) CHECK(x == 0.0f);
    REQUIRE(cudaFree(a) == cudaSuccess);
    CHECK(hc::live_device_blocks() == fresh.blocks);
}

TEST_CASE("host CUDA: cudaFreeAsync frees when its stream reaches the free") {
    Kernels k;  // outlives the drain in ~Fresh
    Fresh fresh;
    cudaStream_t s = nullptr;
    REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
    void* p = nullptr;
    REQUIRE(cudaMallocAsync(&p, 4096, s) == cudaSuccess);
    hc::stall_launch(1);
    REQUIRE(k.launch(s, [] {}) == cudaSuccess);
    REQUIRE(cudaFreeAsync(p, s) == cudaSuccess);
    std::this_thread::sleep_for(20ms);
    CHECK(hc::live_device_blocks() == fresh.blocks + 1);  // still held: the stream has not got there
    CHECK(cudaFree(p) == cudaErrorInvalidValue);          // and no longer the caller's
    CHECK(cudaMemsetAsync(p, 0, 16, s) == cudaErrorInvalidValue);
    float h = 0.0f;
    CHECK(cudaMemcpyAsync(&h, p, sizeof h, cudaMemcpyDefault, s) == cudaErrorInvalidValue);
    CHECK(cudaStreamQuery(s) == cudaErrorNotReady);
    hc::release_stalls();
    REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
    CHECK(hc::live_device_blocks() == fresh.blocks);
    REQUIRE(cudaStreamDestroy(s) == cudaSuccess);
}

TEST_CASE("host CUDA: a read into pageable memory returns after the copy, into pinned memory at once") {
    Kernels k;  // outlives the drain in ~Fresh
    Fresh fresh;
    cudaStream_t s = nullptr;
    REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
    float* d = device_floats(4);

    SECTION("pinned: asynchronous, the event is not ready while the stream stalls") {
        float* pinned = nullptr;
        REQUIRE(cudaMallocHost(reinterpret_cast<void**>(&pinned), 64 * sizeof(float)) == cudaSuccess);
        pinned[9] = -1.0f;
        cudaEvent_t e = nullptr;
        REQUIRE(cudaEventCreateWithFlags(&e, cudaEventDisableTiming) == cudaSuccess);
        hc::stall_launch(1);
        REQUIRE(k.launch(s, [d] { d[0] = 42.0f; }) == cudaSuccess);
        // An interior pointer of a pinned block is pinned too.
        REQUIRE(cudaMemcpyAsync(pinned + 8, d, sizeof(float), cudaMemcpyDeviceToHost, s) == cudaSuccess);
        REQUIRE(cudaEventRecord(e, s) == cudaSuccess);
        std::this_thread::sleep_for(20ms);
        CHECK(cudaEventQuery(e) == cudaErrorNotReady);
        hc::release_stalls();
        REQUIRE(cudaEventSynchronize(e) == cudaSuccess);
        CHECK(pinned[8] == 42.0f);
        CHECK(pinned[9] == -1.0f);
        REQUIRE(cudaEventDestroy(e) == cudaSuccess);
        REQUIRE(cudaFreeHost(pinned) == cudaSuccess);
    }
    SECTION("pageable: the call waits for the stream") {
        hc::stall_launch(1);
        REQUIRE(k.launch(s, [d] { d[0] = 42.0f; }) == cudaSuccess);
        std::atomic<bool> released{false};
        std::thread releaser([&] {
            std::this_thread::sleep_for(50ms);
            released = true;
            hc::release_stalls();
        });
        float h = 0.0f;
        REQUIRE(cudaMemcpyAsync(&h, d, sizeof(float), cudaMemcpyDeviceToHost, s) == cudaSuccess);
        CHECK(released.load());
        CHECK(h == 42.0f);
        releaser.join();
    }
    REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
    REQUIRE(cudaFree(d) == cudaSuccess);
    REQUIRE(cudaStreamDestroy(s) == cudaSuccess);
}

// A driver may stage pageable memory synchronously, behind the stream's earlier work; the double
// always does: a copy from pageable memory returns only once its stream drained (a kernel that
// hangs before it holds the caller), and the caller may reuse its memory at once.
TEST_CASE("host CUDA: a write from pageable memory returns once its stream drained, from pinned memory at once") {
    Kernels k;  // outlives the drain in ~Fresh
    Fresh fresh;
    cudaStream_t s = nullptr;
    REQUIRE(cudaStreamCreate(&s) == cudaSuccess);
    float* d = device_floats(2);
    float* pinned = nullptr;
    REQUIRE(cudaMallocHost(reinterpret_cast<void**>(&pinned), sizeof(float)) == cudaSuccess);
    std::vector<float> pageable{1.0f};
    *pinned = 1.0f;
    hc::stall_launch(1);
    REQUIRE(k.launch(s, [] {}) == cudaSuccess);
    REQUIRE(cudaMemcpyAsync(d + 1, pinned, sizeof(float), cudaMemcpyDefault, s) == cudaSuccess);  // at once
    *pinned = 2.0f;  // the device reads this one when the copy runs
    std::atomic<bool> returned{false};
    cudaError_t copied = cudaErrorUnknown;
    std::thread writer([&] {
        copied = cudaMemcpyAsync(d, pageable.data(), sizeof(float), cudaMemcpyHostToDevice, s);
        returned = true;
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    CHECK_FALSE(returned.load());  // behind the stalled kernel
    hc::release_stalls();
    writer.join();
    CHECK(copied == cudaSuccess);
    pageable[0] = 2.0f;  // after the call: the device has the bytes of the call
    REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
    const auto h = read_back(d, 2);
    CHECK(h[0] == 1.0f);
    CHECK(h[1] == 2.0f);
    REQUIRE(cudaFreeHost(pinned) == cudaSuccess);
    REQUIRE(cudaFree(d) == cudaSuccess);
    REQUIRE(cudaStreamDestroy(s) == cudaSuccess);
}

TEST_CASE("host CUDA: cudaStreamWaitEvent waits for the event as recorded at the call") {
    Kernels k;  // outlives the drain in ~Fresh
    Fresh fresh;
    cudaStream_t a = nullptr, b = nullptr, c = nullptr;
    REQUIRE(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking) == cudaSuccess);
    REQUIRE(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking) == cudaSuccess);
    REQUIRE(cudaStreamCreateWithFlags(&c, cudaStreamNonBlocking) == cudaSuccess);
    cudaEvent_t e = nullptr, never = nullptr;
    REQUIRE(cudaEventCreate(&e) == cudaSuccess);
    REQUIRE(cudaEventCreate(&never) == cudaSuccess);

    CHECK(cudaEventQuery(never) == cudaSuccess);  // never recorded: complete
    REQUIRE(cudaStreamWaitEvent(b, never, 0) == cudaSuccess);
    REQUIRE(cudaStreamSynchronize(b) == cudaSuccess);

    hc::stall_launch(1);
    REQUIRE(k.launch(a, [] {}) == cudaSuccess);
    REQUIRE(cudaEventRecord(e, a) == cudaSuccess);
    REQUIRE(cudaStreamWaitEvent(b, e, 0) == cudaSuccess);
    REQUIRE(cudaEventRecord(e, c) == cudaSuccess);  // re-recorded on an idle stream: b still waits for a
    std::atomic<bool> ran{false};
    REQUIRE(k.launch(b, [&] { ran = true; }) == cudaSuccess);
    REQUIRE(cudaEventSynchronize(e) == cudaSuccess);
    std::this_thread::sleep_for(30ms);
    CHECK(cudaStreamQuery(b) == cudaErrorNotReady);
    CHECK_FALSE(ran.load());
    hc::release_stalls();
    REQUIRE(cudaStreamSynchronize(b) == cudaSuccess);
    CHECK(ran.load());

    cudaEvent_t t0 = nullptr, t1 = nullptr;
    REQUIRE(cudaEventCreate(&t0) == cudaSuccess);
    REQUIRE(cudaEventCreate(&t1) == cudaSuccess);
    REQUIRE(cudaEventRecord(t0, a) == cudaSuccess);
    REQUIRE(k.launch(a, [] { std::this_thread::sleep_for(5ms); }) == cudaSuccess);
    REQUIRE(cudaEventRecord(t1, a) == cudaSuccess);
    REQUIRE(cudaEventSynchronize(t1) == cudaSuccess);
    float ms = 0.0f;
    REQUIRE(cudaEventElapsedTime(&ms, t0, t1) == cudaSuccess);
    CHECK(ms >= 4.0f);
    for (cudaEvent_t x : {e, never, t0, t1}) REQUIRE(cudaEventDestroy(x) == cudaSuccess);
    for (cudaStream_t x : {a, b, c}) REQUIRE(cudaStreamDestroy(x) == cudaSuccess);
}

TEST_CASE("host CUDA: the legacy stream orders with blocking streams, not with non-blocking ones") {
    Kernels k;  // outlives the drain in ~Fresh
    Fresh fresh;
    cudaStream_t blocking = nullptr, nonblocking = nullptr;
    REQUIRE(cudaStreamCreate(&blocking) == cudaSuccess);
    REQUIRE(cudaStreamCreateWithFlags(&nonblocking, cudaStreamNonBlocking) == cudaSuccess);
    std::atomic<int> legacy_ran{0}, blocking_ran{0};

    SECTION("legacy work waits for earlier blocking-stream work") {
        hc::stall_launch(1);
        REQUIRE(k.launch(blocking, [] {}) == cudaSuccess);
        REQUIRE(k.launch(nullptr, [&] { ++legacy_ran; }) == cudaSuccess);
        REQUIRE(k.launch(nonblocking, [] {}) == cudaSuccess);
        REQUIRE(cudaStreamSynchronize(nonblocking) == cudaSuccess);  // not held back
        std::this_thread::sleep_for(20ms);
        CHECK(cudaStreamQuery(cudaStreamLegacy) == cudaErrorNotReady);
        CHECK(legacy_ran == 0);
    }
    SECTION("blocking-stream work waits for earlier legacy work") {
        hc::stall_launch(1);
        REQUIRE(k.launch(nullptr, [] {}) == cudaSuccess);
        REQUIRE(k.launch(blocking, [&] { ++blocking_ran; }) == cudaSuccess);
        REQUIRE(k.launch(nonblocking, [] {}) == cudaSuccess);
        REQUIRE(cudaStreamSynchronize(nonblocking) == cudaSuccess);
        std::this_thread::sleep_for(20ms);
        CHECK(cudaStreamQuery(blocking) == cudaErrorNotReady);
        CHECK(blocking_ran == 0);
    }
    hc::release_stalls();
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    CHECK(legacy_ran + blocking_ran == 1);
    REQUIRE(cudaStreamDestroy(blocking) == cudaSuccess);
    REQUIRE(cudaStreamDestroy(nonblocking) == cudaSuccess);
}

TEST_CASE("host CUDA: destroyed streams and events are refused; a destroyed stream finishes its work") {
    Kernels k;  // outlives the drain in ~Fresh
    Fresh fresh;
    cudaStream_t s = nullptr;
    REQUIRE(cudaStreamCreate(&s) == cudaSuccess);
    cudaEvent_t e = nullptr;
    REQUIRE(cudaEventCreate(&e) == cudaSuccess);
    hc::stall_launch(1);
    std::atomic<bool> ran{false};
    REQUIRE(k.launch(s, [&] { ran = true; }) == cudaSuccess);
    REQUIRE(cudaEventRecord(e, s) == cudaSuccess);
    REQUIRE(cudaStreamDestroy(s) == cudaSuccess);  // returns with the work pending
    REQUIRE(cudaEventDestroy(e) == cudaSuccess);
    CHECK(k.launch(s, [] {}) == cudaErrorInvalidResourceHandle);
    CHECK(cudaStreamSynchronize(s) == cudaErrorInvalidResourceHandle);
    CHECK(cudaStreamDestroy(s) == cudaErrorInvalidResourceHandle);
    CHECK(cudaEventRecord(e, nullptr) == cudaErrorInvalidResourceHandle);
    CHECK(cudaEventQuery(e) == cudaErrorInvalidResourceHandle);
    CHECK(cudaStreamWaitEvent(nullptr, e, 0) == cudaErrorInvalidResourceHandle);
    CHECK(cudaGetLastError() == cudaErrorInvalidResourceHandle);
    CHECK_FALSE(ran.load());
    hc::release_stalls();
    CHECK(eventually([&] { return ran.load(); }));
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);  // also waits for destroyed streams' work
    CHECK(k.launch(cudaStreamPerThread, [] {}) == cudaErrorNotSupported);
}

TEST_CASE("host CUDA: work on a stream of another device than the current one is refused") {
    Kernels k;  // outlives the drain in ~Fresh
    Fresh fresh;
    REQUIRE(hc::set_device_count(2));
    REQUIRE(cudaSetDevice(1) == cudaSuccess);
    cudaStream_t s1 = nullptr;
    REQUIRE(cudaStreamCreate(&s1) == cudaSuccess);
    float* d1 = device_floats(4);
    cudaEvent_t e1 = nullptr;
    REQUIRE(cudaEventCreate(&e1) == cudaSuccess);
    REQUIRE(cudaSetDevice(0) == cudaSuccess);
    cudaEvent_t e0 = nullptr;
    REQUIRE(cudaEventCreate(&e0) == cudaSuccess);
    CHECK(k.launch(s1, [] {}) == cudaErrorInvalidResourceHandle);
    CHECK(cudaMemsetAsync(d1, 0, 16, s1) == cudaErrorInvalidResourceHandle);
    CHECK(cudaMemcpyAsync(d1, d1 + 2, 8, cudaMemcpyDeviceToDevice, s1) == cudaErrorInvalidResourceHandle);
    CHECK(cudaEventRecord(e1, s1) == cudaErrorInvalidResourceHandle);
    REQUIRE(cudaSetDevice(1) == cudaSuccess);
    CHECK(cudaEventRecord(e0, s1) == cudaErrorInvalidResourceHandle);  // the event is device 0's
    REQUIRE(cudaEventRecord(e1, s1) == cudaSuccess);
    REQUIRE(cudaSetDevice(0) == cudaSuccess);
    REQUIRE(cudaStreamWaitEvent(nullptr, e1, 0) == cudaSuccess);  // waiting across devices is allowed
    REQUIRE(cudaStreamSynchronize(s1) == cudaSuccess);
    REQUIRE(cudaEventDestroy(e0) == cudaSuccess);
    REQUIRE(cudaEventDestroy(e1) == cudaSuccess);
    REQUIRE(cudaStreamDestroy(s1) == cudaSuccess);
    REQUIRE(cudaFree(d1) == cudaSuccess);
}

TEST_CASE("host CUDA: a kernel fault is sticky on its device; a failed launch is not") {
    Kernels k;  // outlives the drain in ~Fresh
    Fresh fresh;
    REQUIRE(hc::set_device_count(2));
    cudaStream_t s = nullptr;
    REQUIRE(cudaStreamCreate(&s) == cudaSuccess);

    const auto before = hc::launches();
    hc::fail_launch(1);
    std::atomic<int> ran{0};
    CHECK(k.launch(s, [&] { ++ran; }) == cudaErrorLaunchFailure);
    CHECK(hc::launches() == before);  // nothing enqueued
    CHECK(cudaGetLastError() == cudaErrorLaunchFailure);
    CHECK(cudaGetLastError() == cudaSuccess);
    REQUIRE(k.launch(s, [&] { ++ran; }) == cudaSuccess);
    REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
    CHECK(ran == 1);

    hc::fault_launch(1);
    hc::stall_launch(1);
    REQUIRE(k.launch(s, [&] { ++ran; }) == cudaSuccess);  // faults after running, once released
    REQUIRE(k.launch(s, [&] { ran += 100; }) == cudaSuccess);
    hc::release_stalls();
    CHECK(cudaStreamSynchronize(s) == cudaErrorIllegalAddress);
    CHECK(ran == 2);  // the launch behind the fault never ran
    CHECK(cudaGetLastError() == cudaErrorIllegalAddress);
    CHECK(cudaGetLastError() == cudaErrorIllegalAddress);
    void* p = nullptr;
    CHECK(cudaMalloc(&p, 16) == cudaErrorIllegalAddress);
    CHECK(k.launch(s, [] {}) == cudaErrorIllegalAddress);
    CHECK(std::string(cudaGetErrorName(cudaGetLastError())) == "cudaErrorIllegalAddress");

    // Device 1 has its own context: still healthy.
    REQUIRE(cudaSetDevice(1) == cudaSuccess);
    CHECK(cudaGetLastError() == cudaSuccess);
    REQUIRE(cudaMalloc(&p, 16) == cudaSuccess);
    REQUIRE(cudaFree(p) == cudaSuccess);
    REQUIRE(cudaSetDevice(0) == cudaSuccess);
    (void)cudaStreamDestroy(s);
    hc::reset();
    CHECK(cudaGetLastError() == cudaSuccess);
}

namespace {

//! C = alpha op(A) op(B) + beta C in double, column-major.
void reference_gemm(bool ta, bool tb, int m, int n, int k, float alpha, const std::vector<float>& a, int lda,
                    const std::vector<float>& b, int ldb, float beta, std::vector<double>& c, int ldc) {
    for (int j = 0; j < n; ++j)
        for (int i = 0; i < m; ++i) {
            double acc = 0;
            for (int p = 0; p < k; ++p) {
                const double x = ta ? a[static_cast<std::size_t>(i) * lda + p] : a[static_cast<std::size_t>(p) * lda + i];
                const double y = tb ? b[static_cast<std::size_t>(p) * ldb + j] : b[static_cast<std::size_t>(j) * ldb + p];
                acc += x * y;
            }
            double& out = c[static_cast<std::size_t>(j) * ldc + i];
            out = alpha * acc + (beta == 0.0f ? 0.0 : beta * out);
        }
}

}  // namespace

TEST_CASE("host CUDA: cuBLAS SGEMM matches a double reference and checks its arguments as cuBLAS does") {
    Fresh fresh;
    std::mt19937 rng(static_cast<unsigned>(hc::seed()));
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    cublasHandle_t h = nullptr;
    REQUIRE(cublasCreate(&h) == CUBLAS_STATUS_SUCCESS);
    // Blocking: it waits for the cudaMemcpy uploads, which return before their legacy-stream
    // copy ran (pageable sources are staged).
    cudaStream_t s = nullptr;
    REQUIRE(cudaStreamCreate(&s) == cudaSuccess);
    REQUIRE(cublasSetStream(h, s) == CUBLAS_STATUS_SUCCESS);
    cudaStream_t got = nullptr;
    REQUIRE(cublasGetStream(h, &got) == CUBLAS_STATUS_SUCCESS);
    CHECK(got == s);

    const int m = 13, n = 7, k = 9, batch = 3;
    for (const bool ta : {false, true})
        for (const bool tb : {false, true})
            for (const float beta : {0.0f, 0.5f}) {
                const int lda = (ta ? k : m) + 3, ldb = (tb ? n : k) + 1, ldc = m + 2;
                const std::size_t sa = static_cast<std::size_t>(lda) * (ta ? m : k);
                const std::size_t sb = static_cast<std::size_t>(ldb) * (tb ? k : n);
                const std::size_t sc = static_cast<std::size_t>(ldc) * n;
                std::vector<float> a(sa * batch), b(sb * batch), c(sc * batch);
                for (auto& x : a) x = dist(rng);
                for (auto& x : b) x = dist(rng);
                for (auto& x : c) x = dist(rng);
                float* da = device_floats(a.size());
                float* db = device_floats(b.size());
                float* dc = device_floats(c.size());  // NaN-filled: beta == 0 must not read it
                REQUIRE(cudaMemcpy(da, a.data(), a.size() * 4, cudaMemcpyHostToDevice) == cudaSuccess);
                REQUIRE(cudaMemcpy(db, b.data(), b.size() * 4, cudaMemcpyHostToDevice) == cudaSuccess);
                if (beta != 0.0f) REQUIRE(cudaMemcpy(dc, c.data(), c.size() * 4, cudaMemcpyHostToDevice) == cudaSuccess);
                const float alpha = 1.25f;
                const auto opa = ta ? CUBLAS_OP_T : CUBLAS_OP_N, opb = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
                REQUIRE(cublasSgemmStridedBatched(h, opa, opb, m, n, k, &alpha, da, lda, static_cast<long long>(sa), db, ldb,
                                                  static_cast<long long>(sb), &beta, dc, ldc, static_cast<long long>(sc),
                                                  batch) == CUBLAS_STATUS_SUCCESS);
                REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
                const auto out = read_back(dc, c.size());
                for (int i = 0; i < batch; ++i) {
                    std::vector<float> ai(a.begin() + static_cast<long>(sa * i), a.begin() + static_cast<long>(sa * (i + 1)));
                    std::vector<float> bi(b.begin() + static_cast<long>(sb * i), b.begin() + static_cast<long>(sb * (i + 1)));
                    std::vector<double> ref(c.begin() + static_cast<long>(sc * i), c.begin() + static_cast<long>(sc * (i + 1)));
                    reference_gemm(ta, tb, m, n, k, alpha, ai, lda, bi, ldb, beta, ref, ldc);
                    for (int col = 0; col < n; ++col)
                        for (int row = 0; row < m; ++row) {
                            const std::size_t at = static_cast<std::size_t>(col) * ldc + row;
                            REQUIRE(std::abs(out[sc * i + at] - ref[at]) < 1e-4);
                        }
                }
                REQUIRE(cublasSgemm(h, opa, opb, m, n, k, &alpha, da, lda, db, ldb, &beta, dc, ldc) == CUBLAS_STATUS_SUCCESS);
                // Leading dimensions below cuBLAS's minimum are refused.
                CHECK(cublasSgemm(h, opa, opb, m, n, k, &alpha, da, (ta ? k : m) - 1, db, ldb, &beta, dc, ldc) ==
                      CUBLAS_STATUS_INVALID_VALUE);
                CHECK(cublasSgemm(h, opa, opb, m, n, k, &alpha, da, lda, db, (tb ? n : k) - 1, &beta, dc, ldc) ==
                      CUBLAS_STATUS_INVALID_VALUE);
                CHECK(cublasSgemm(h, opa, opb, m, n, k, &alpha, da, lda, db, ldb, &beta, dc, m - 1) ==
                      CUBLAS_STATUS_INVALID_VALUE);
                REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
                for (float* p : {da, db, dc}) REQUIRE(cudaFree(p) == cudaSuccess);
            }

    float* d = device_floats(16);
    std::vector<float> host(16);
    const float one = 1.0f, zero = 0.0f;
    CHECK(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, -1, 4, 4, &one, d, 4, d, 4, &zero, d, 4) == CUBLAS_STATUS_INVALID_VALUE);
    CHECK(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, 4, 4, 4, &one, host.data(), 4, d, 4, &zero, d, 4) ==
          CUBLAS_STATUS_INVALID_VALUE);  // not device memory
    CHECK(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, 4, 4, 5, &one, d, 4, d, 5, &zero, d, 4) ==
          CUBLAS_STATUS_INVALID_VALUE);  // B runs past its block
    CHECK(cublasSgemmStridedBatched(h, CUBLAS_OP_N, CUBLAS_OP_N, 2, 2, 2, &one, d, 2, 4, d, 2, 4, &zero, d, 2, 4, -1) ==
          CUBLAS_STATUS_INVALID_VALUE);
    CHECK(cublasSgemmStridedBatched(h, CUBLAS_OP_N, CUBLAS_OP_N, 2, 2, 2, &one, d, 2, 4, d, 2, 4, &zero, d, 2, 4, 5) ==
          CUBLAS_STATUS_INVALID_VALUE);  // the fifth matrix runs past the block
    CHECK(cublasSetWorkspace(h, d + 1, 32) == CUBLAS_STATUS_INVALID_VALUE);
    REQUIRE(cublasSetWorkspace(h, d, 64) == CUBLAS_STATUS_SUCCESS);
    cublasMath_t mode{};
    REQUIRE(cublasSetMathMode(h, CUBLAS_TF32_TENSOR_OP_MATH) == CUBLAS_STATUS_SUCCESS);
    REQUIRE(cublasGetMathMode(h, &mode) == CUBLAS_STATUS_SUCCESS);
    CHECK(mode == CUBLAS_TF32_TENSOR_OP_MATH);

    // A stream destroyed under the handle fails the next call.
    REQUIRE(cudaStreamDestroy(s) == cudaSuccess);
    CHECK(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, 4, 4, 4, &one, d, 4, d, 4, &zero, d, 4) == CUBLAS_STATUS_EXECUTION_FAILED);
    REQUIRE(cublasSetStream(h, nullptr) == CUBLAS_STATUS_SUCCESS);
    REQUIRE(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, 4, 4, 4, &one, d, 4, d, 4, &zero, d, 4) == CUBLAS_STATUS_SUCCESS);
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    REQUIRE(cudaFree(d) == cudaSuccess);
    CHECK(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, 1, 1, 1, &one, d, 1, d, 1, &zero, d, 1) == CUBLAS_STATUS_INVALID_VALUE);
    REQUIRE(cublasDestroy(h) == CUBLAS_STATUS_SUCCESS);
    CHECK(cublasDestroy(h) == CUBLAS_STATUS_NOT_INITIALIZED);
    CHECK(cublasSetStream(h, nullptr) == CUBLAS_STATUS_NOT_INITIALIZED);
}

#if LOCKSTEP_WITH_CUDNN
// A convolution through the cuDNN double against a direct fp64 loop, in every direction, and the
// checks a real cuDNN makes (or a GPU would fault on) refused.
TEST_CASE("host cuDNN: convolutions match a double reference and check descriptors, algorithm and workspace") {
    Fresh fresh;
    const int N = 2, C = 3, H = 7, W = 6, O = 4, k = 3, pad = 1, u = 2;
    const int OH = (H + 2 * pad - k) / u + 1, OW = (W + 2 * pad - k) / u + 1;
    cudaStream_t s = nullptr;
    REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
    cudnnHandle_t h = nullptr;
    REQUIRE(cudnnCreate(&h) == CUDNN_STATUS_SUCCESS);
    REQUIRE(cudnnSetStream(h, s) == CUDNN_STATUS_SUCCESS);
    cudnnTensorDescriptor_t xd = nullptr, yd = nullptr, bad = nullptr;
    cudnnFilterDescriptor_t wd = nullptr;
    cudnnConvolutionDescriptor_t cd = nullptr;
    REQUIRE(cudnnCreateTensorDescriptor(&xd) == CUDNN_STATUS_SUCCESS);
    REQUIRE(cudnnCreateTensorDescriptor(&yd) == CUDNN_STATUS_SUCCESS);
    REQUIRE(cudnnCreateTensorDescriptor(&bad) == CUDNN_STATUS_SUCCESS);
    REQUIRE(cudnnCreateFilterDescriptor(&wd) == CUDNN_STATUS_SUCCESS);
    REQUIRE(cudnnCreateConvolutionDescriptor(&cd) == CUDNN_STATUS_SUCCESS);
    REQUIRE(cudnnSetTensor4dDescriptor(xd, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, N, C, H, W) == CUDNN_STATUS_SUCCESS);
    REQUIRE(cudnnSetTensor4dDescriptor(yd, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, N, O, OH, OW) == CUDNN_STATUS_SUCCESS);
    REQUIRE(cudnnSetTensor4dDescriptor(bad, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, N, O, OH + 1, OW) == CUDNN_STATUS_SUCCESS);
    REQUIRE(cudnnSetFilter4dDescriptor(wd, CUDNN_DATA_FLOAT, CUDNN_TENSOR_NCHW, O, C, k, k) == CUDNN_STATUS_SUCCESS);
    REQUIRE(cudnnSetConvolution2dDescriptor(cd, pad, pad, u, u, 1, 1, CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT) ==
            CUDNN_STATUS_SUCCESS);
    REQUIRE(cudnnSetConvolutionMathType(cd, CUDNN_FMA_MATH) == CUDNN_STATUS_SUCCESS);
    CHECK(cudnnSetConvolution2dDescriptor(cd, pad, pad, u, u, 2, 2, CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT) ==
          CUDNN_STATUS_NOT_SUPPORTED);  // dilation: not what lockstep asks for

    std::mt19937 rng(3);
    std::uniform_real_distribution<float> dist(-1, 1);
    const auto fill = [&](std::size_t n) {
        std::vector<float> v(n);
        for (float& e : v) e = dist(rng);
        return v;
    };
    const auto x = fill(std::size_t(N * C * H * W)), w = fill(std::size_t(O * C * k * k)),
               dy = fill(std::size_t(N * O * OH * OW));
    float *dx_ = device_floats(x.size()), *dw_ = device_floats(w.size()), *ddy = device_floats(dy.size()),
          *dxg = device_floats(x.size()), *dwg = device_floats(w.size()), *dyo = device_floats(dy.size());
    REQUIRE(cudaMemcpy(dx_, x.data(), x.size() * 4, cudaMemcpyHostToDevice) == cudaSuccess);
    REQUIRE(cudaMemcpy(dw_, w.data(), w.size() * 4, cudaMemcpyHostToDevice) == cudaSuccess);
    REQUIRE(cudaMemcpy(ddy, dy.data(), dy.size() * 4, cudaMemcpyHostToDevice) == cudaSuccess);
    REQUIRE(cudaMemcpy(dwg, w.data(), w.size() * 4, cudaMemcpyHostToDevice) == cudaSuccess);  // beta = 1 adds to it
    // Pageable uploads run on the legacy stream, which a non-blocking stream does not wait for.
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);

    // fp64 references.
    std::vector<double> ry(dy.size()), rdx(x.size()), rdw(w.begin(), w.end());
    for (int n = 0; n < N; ++n)
        for (int o = 0; o < O; ++o)
            for (int oh = 0; oh < OH; ++oh)
                for (int ow = 0; ow < OW; ++ow)
                    for (int c = 0; c < C; ++c)
                        for (int i = 0; i < k; ++i)
                            for (int j = 0; j < k; ++j) {
                                const int ih = oh * u - pad + i, iw = ow * u - pad + j;
                                if (ih < 0 || ih >= H || iw < 0 || iw >= W) continue;
                                const std::size_t yi = std::size_t(((n * O + o) * OH + oh) * OW + ow),
                                                  xi = std::size_t(((n * C + c) * H + ih) * W + iw),
                                                  wi = std::size_t(((o * C + c) * k + i) * k + j);
                                ry[yi] += double(x[xi]) * w[wi];
                                rdx[xi] += double(dy[yi]) * w[wi];
                                rdw[wi] += double(dy[yi]) * x[xi];
                            }

    // The heuristics: what a caller must skip comes first.
    cudnnConvolutionFwdAlgoPerf_t fp[CUDNN_CONVOLUTION_FWD_ALGO_COUNT];
    int n_fwd = 0;
    REQUIRE(cudnnGetConvolutionForwardAlgorithm_v7(h, xd, wd, cd, yd, CUDNN_CONVOLUTION_FWD_ALGO_COUNT, &n_fwd, fp) ==
            CUDNN_STATUS_SUCCESS);
    REQUIRE(n_fwd >= 3);
    CHECK(fp[0].status == CUDNN_STATUS_NOT_SUPPORTED);
    CHECK(fp[1].memory > (std::size_t{1} << 30));
    CHECK(cudnnGetConvolutionForwardAlgorithm_v7(h, xd, wd, cd, bad, CUDNN_CONVOLUTION_FWD_ALGO_COUNT, &n_fwd, fp) ==
          CUDNN_STATUS_BAD_PARAM);  // y's size does not follow from x, w and the convolution

    const float one = 1.0f, zero = 0.0f;
    const auto gemm = CUDNN_CONVOLUTION_FWD_ALGO_GEMM;
    std::size_t need = 0;
    REQUIRE(cudnnGetConvolutionForwardWorkspaceSize(h, xd, wd, cd, yd, gemm, &need) == CUDNN_STATUS_SUCCESS);
    REQUIRE(need > 0);
    float* ws = device_floats(need / 4);
    CHECK(cudnnConvolutionForward(h, &one, xd, dx_, wd, dw_, cd, gemm, ws, need - 4, &zero, yd, dyo) ==
          CUDNN_STATUS_BAD_PARAM);  // a workspace smaller than the algorithm needs
    CHECK(cudnnConvolutionForward(h, &one, xd, dx_, wd, dw_, cd, CUDNN_CONVOLUTION_FWD_ALGO_FFT, ws, need, &zero, yd, dyo) ==
          CUDNN_STATUS_NOT_SUPPORTED);
    CHECK(cudnnConvolutionForward(h, &one, xd, x.data(), wd, dw_, cd, gemm, ws, need, &zero, yd, dyo) ==
          CUDNN_STATUS_EXECUTION_FAILED);  // host memory
    CHECK(cudnnConvolutionForward(h, &one, xd, dx_, wd, dw_, cd, gemm, ws, need, &zero, bad, dyo) == CUDNN_STATUS_BAD_PARAM);
    CHECK(hc::cudnn_calls().empty());  // nothing refused was run

    REQUIRE(cudnnConvolutionForward(h, &one, xd, dx_, wd, dw_, cd, gemm, ws, need, &zero, yd, dyo) == CUDNN_STATUS_SUCCESS);
    REQUIRE(cudnnConvolutionBackwardData(h, &one, wd, dw_, yd, ddy, cd, CUDNN_CONVOLUTION_BWD_DATA_ALGO_1, nullptr, 0, &zero, xd,
                                         dxg) == CUDNN_STATUS_SUCCESS);
    REQUIRE(cudnnConvolutionBackwardFilter(h, &one, xd, dx_, yd, ddy, cd, CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT_TILING, ws, need,
                                           &one, wd, dwg) == CUDNN_STATUS_SUCCESS);
    REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
    const auto close = [](const std::vector<float>& got, const std::vector<double>& want) {
        double worst = 0;
        for (std::size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::abs(got[i] - want[i]));
        return got.size() == want.size() && worst < 1e-5;
    };
    CHECK(close(read_back(dyo, dy.size()), ry));
    CHECK(close(read_back(dxg, x.size()), rdx));
    CHECK(close(read_back(dwg, w.size()), rdw));
    const auto calls = hc::cudnn_calls();
    REQUIRE(calls.size() == 3);
    CHECK((calls[0].direction == 'f' && calls[0].algorithm == gemm && calls[0].workspace_bytes == need && !calls[0].tf32));
    CHECK((calls[1].direction == 'd' && calls[2].direction == 'w'));

    // A workspace freed under the call, and a destroyed descriptor, are refused.
    REQUIRE(cudaFree(ws) == cudaSuccess);
    CHECK(cudnnConvolutionForward(h, &one, xd, dx_, wd, dw_, cd, gemm, ws, need, &zero, yd, dyo) ==
          CUDNN_STATUS_EXECUTION_FAILED);
    REQUIRE(cudnnDestroyTensorDescriptor(bad) == CUDNN_STATUS_SUCCESS);
    CHECK(cudnnSetTensor4dDescriptor(bad, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, 1, 1, 1, 1) == CUDNN_STATUS_BAD_PARAM);
    REQUIRE(cudnnDestroyTensorDescriptor(xd) == CUDNN_STATUS_SUCCESS);
    REQUIRE(cudnnDestroyTensorDescriptor(yd) == CUDNN_STATUS_SUCCESS);
    REQUIRE(cudnnDestroyFilterDescriptor(wd) == CUDNN_STATUS_SUCCESS);
    REQUIRE(cudnnDestroyConvolutionDescriptor(cd) == CUDNN_STATUS_SUCCESS);
    REQUIRE(cudnnDestroy(h) == CUDNN_STATUS_SUCCESS);
    CHECK(cudnnSetStream(h, s) == CUDNN_STATUS_NOT_INITIALIZED);
    for (float* p : {dx_, dw_, ddy, dxg, dwg, dyo}) REQUIRE(cudaFree(p) == cudaSuccess);
    REQUIRE(cudaStreamDestroy(s) == cudaSuccess);
}

// cuDNN's bf16 configuration (bf16 tensors, fp32 compute): each output is the fp32 result on the
// widened operands rounded once (a weight gradient with beta 1: alpha * sum + the old value,
// then rounded); bf16 tensors take 2 bytes an element (a block of exactly that size serves);
// tensors of mixed types are refused, as cuDNN has no such configuration.
TEST_CASE("host cuDNN: bf16 convolutions round each output once and refuse mixed types") {
    Fresh fresh;
    const int N = 2, C = 3, H = 6, W = 5, O = 4, k = 3, pad = 1;
    const int OH = H, OW = W;
    cudaStream_t s = nullptr;
    REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
    cudnnHandle_t h = nullptr;
    REQUIRE(cudnnCreate(&h) == CUDNN_STATUS_SUCCESS);
    REQUIRE(cudnnSetStream(h, s) == CUDNN_STATUS_SUCCESS);
    cudnnTensorDescriptor_t xd = nullptr, yd = nullptr, y32 = nullptr;
    cudnnFilterDescriptor_t wd = nullptr;
    cudnnConvolutionDescriptor_t cd = nullptr;
    REQUIRE(cudnnCreateTensorDescriptor(&xd) == CUDNN_STATUS_SUCCESS);
    REQUIRE(cudnnCreateTensorDescriptor(&yd) == CUDNN_STATUS_SUCCESS);
    REQUIRE(cudnnCreateTensorDescriptor(&y32) == CUDNN_STATUS_SUCCESS);
    REQUIRE(cudnnCreateFilterDescriptor(&wd) == CUDNN_STATUS_SUCCESS);
    REQUIRE(cudnnCreateConvolutionDescriptor(&cd) == CUDNN_STATUS_SUCCESS);
    REQUIRE(cudnnSetTensor4dDescriptor(xd, CUDNN_TENSOR_NCHW, CUDNN_DATA_BFLOAT16, N, C, H, W) == CUDNN_STATUS_SUCCESS);
    REQUIRE(cudnnSetTensor4dDescriptor(yd, CUDNN_TENSOR_NCHW, CUDNN_DATA_BFLOAT16, N, O, OH, OW) == CUDNN_STATUS_SUCCESS);
    REQUIRE(cudnnSetTensor4dDescriptor(y32, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, N, O, OH, OW) == CUDNN_STATUS_SUCCESS);
    REQUIRE(cudnnSetFilter4dDescriptor(wd, CUDNN_DATA_BFLOAT16, CUDNN_TENSOR_NCHW, O, C, k, k) == CUDNN_STATUS_SUCCESS);
    REQUIRE(cudnnSetConvolution2dDescriptor(cd, pad, pad, 1, 1, 1, 1, CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT) ==
            CUDNN_STATUS_SUCCESS);
    REQUIRE(cudnnSetConvolutionMathType(cd, CUDNN_TENSOR_OP_MATH) == CUDNN_STATUS_SUCCESS);
    CHECK(cudnnSetTensor4dDescriptor(y32, CUDNN_TENSOR_NCHW, CUDNN_DATA_HALF, N, O, OH, OW) == CUDNN_STATUS_NOT_SUPPORTED);

    std::mt19937 rng(5);
    std::uniform_real_distribution<float> dist(-1, 1);
    const auto fill = [&](std::size_t n) {
        std::vector<__nv_bfloat16> v(n);
        for (auto& e : v) e = __float2bfloat16_rn(dist(rng));
        return v;
    };
    const auto x = fill(std::size_t(N * C * H * W)), w = fill(std::size_t(O * C * k * k)),
               dy = fill(std::size_t(N * O * OH * OW));
    auto dw_old = fill(w.size());
    const auto upload = [&](const std::vector<__nv_bfloat16>& v) {
        void* d = nullptr;
        REQUIRE(cudaMalloc(&d, v.size() * 2) == cudaSuccess);  // exactly the bf16 bytes
        REQUIRE(cudaMemcpy(d, v.data(), v.size() * 2, cudaMemcpyHostToDevice) == cudaSuccess);
        return static_cast<__nv_bfloat16*>(d);
    };
    __nv_bfloat16 *dx_ = upload(x), *dw_ = upload(w), *ddy = upload(dy), *dyo = upload(dy), *dxg = upload(x),
                  *dwg = upload(dw_old);
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);

    // The fp32 results on the widened operands, in fp64 (exact products; a sum of a few dozen
    // terms is within 2^-20 of its fp32 sum), rounded once to bf16.
    const auto f = [](__nv_bfloat16 v) { return static_cast<double>(__bfloat162float(v)); };
    std::vector<double> ry(dy.size()), rdx(x.size()), rdw(w.size());
    for (int n = 0; n < N; ++n)
        for (int o = 0; o < O; ++o)
            for (int oh = 0; oh < OH; ++oh)
                for (int ow = 0; ow < OW; ++ow)
                    for (int c = 0; c < C; ++c)
                        for (int i = 0; i < k; ++i)
                            for (int j = 0; j < k; ++j) {
                                const int ih = oh - pad + i, iw = ow - pad + j;
                                if (ih < 0 || ih >= H || iw < 0 || iw >= W) continue;
                                const std::size_t yi = std::size_t(((n * O + o) * OH + oh) * OW + ow),
                                                  xi = std::size_t(((n * C + c) * H + ih) * W + iw),
                                                  wi = std::size_t(((o * C + c) * k + i) * k + j);
                                ry[yi] += f(x[xi]) * f(w[wi]);
                                rdx[xi] += f(dy[yi]) * f(w[wi]);
                                rdw[wi] += f(dy[yi]) * f(x[xi]);
                            }
    for (std::size_t i = 0; i < rdw.size(); ++i) rdw[i] += f(dw_old[i]);  // beta = 1

    const float one = 1.0f, zero = 0.0f;
    const auto implicit = CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM;  // no workspace
    cudnnConvolutionFwdAlgoPerf_t fp[CUDNN_CONVOLUTION_FWD_ALGO_COUNT];
    int n_fwd = 0;
    CHECK(cudnnGetConvolutionForwardAlgorithm_v7(h, xd, wd, cd, y32, CUDNN_CONVOLUTION_FWD_ALGO_COUNT, &n_fwd, fp) ==
          CUDNN_STATUS_NOT_SUPPORTED);  // bf16 x and w with an fp32 y: no such configuration
    CHECK(cudnnConvolutionForward(h, &one, xd, dx_, wd, dw_, cd, implicit, nullptr, 0, &zero, y32, dyo) ==
          CUDNN_STATUS_NOT_SUPPORTED);
    // An output over an input (here dw written over x) would read what it overwrote: refused.
    CHECK(cudnnConvolutionBackwardFilter(h, &one, xd, dx_, yd, ddy, cd, CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1, nullptr, 0, &zero,
                                         wd, dx_) == CUDNN_STATUS_BAD_PARAM);
    CHECK(hc::cudnn_calls().empty());

    REQUIRE(cudnnConvolutionForward(h, &one, xd, dx_, wd, dw_, cd, implicit, nullptr, 0, &zero, yd, dyo) == CUDNN_STATUS_SUCCESS);
    REQUIRE(cudnnConvolutionBackwardData(h, &one, wd, dw_, yd, ddy, cd, CUDNN_CONVOLUTION_BWD_DATA_ALGO_1, nullptr, 0, &zero, xd,
                                         dxg) == CUDNN_STATUS_SUCCESS);
    REQUIRE(cudnnConvolutionBackwardFilter(h, &one, xd, dx_, yd, ddy, cd, CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1, nullptr, 0, &one,
                                           wd, dwg) == CUDNN_STATUS_SUCCESS);
    REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
    const auto back = [](const __nv_bfloat16* d, std::size_t n) {
        std::vector<__nv_bfloat16> v(n);
        REQUIRE(cudaMemcpy(v.data(), d, n * 2, cudaMemcpyDeviceToHost) == cudaSuccess);
        return v;
    };
    // Each output within half a bf16 unit (2^-8 relative) of the reference, plus the fp32 sum's own error.
    const auto rounded_once = [&](const std::vector<__nv_bfloat16>& got, const std::vector<double>& want) {
        bool within = got.size() == want.size();
        for (std::size_t i = 0; within && i < got.size(); ++i)
            within = std::abs(f(got[i]) - want[i]) <= std::ldexp(std::abs(want[i]), -8) + 1e-5;
        return within;
    };
    CHECK(rounded_once(back(dyo, dy.size()), ry));
    CHECK(rounded_once(back(dxg, x.size()), rdx));
    CHECK(rounded_once(back(dwg, w.size()), rdw));
    const auto calls = hc::cudnn_calls();
    REQUIRE(calls.size() == 3);
    CHECK((calls[0].bf16 && calls[1].bf16 && calls[2].bf16 && !calls[0].tf32));
    CHECK((calls[0].math == CUDNN_TENSOR_OP_MATH && calls[2].math == CUDNN_TENSOR_OP_MATH));

    for (auto* d : {xd, yd, y32}) REQUIRE(cudnnDestroyTensorDescriptor(d) == CUDNN_STATUS_SUCCESS);
    REQUIRE(cudnnDestroyFilterDescriptor(wd) == CUDNN_STATUS_SUCCESS);
    REQUIRE(cudnnDestroyConvolutionDescriptor(cd) == CUDNN_STATUS_SUCCESS);
    REQUIRE(cudnnDestroy(h) == CUDNN_STATUS_SUCCESS);
    for (auto* p : {dx_, dw_, ddy, dyo, dxg, dwg}) REQUIRE(cudaFree(p) == cudaSuccess);
    REQUIRE(cudaStreamDestroy(s) == cudaSuccess);
}
#endif

// ---------------------------------------------------------------------------------------------
// NCCL

namespace {

template <class T>
T make(double x) {
    return static_cast<T>(x);
}
template <>
__half make<__half>(double x) {
    return __float2half_rn(static_cast<float>(x));
}
template <>
__nv_bfloat16 make<__nv_bfloat16>(double x) {
    return __float2bfloat16_rn(static_cast<float>(x));
}

template <class T>
struct Acc {
    using type = T;
};
template <>
struct Acc<__half> {
    using type = float;
};
template <>
struct Acc<__nv_bfloat16> {
    using type = float;
};
template <class T>
typename Acc<T>::type widen(T x) {
    return x;
}
template <>
float widen(__half x) {
    return __half2float(x);
}
template <>
float widen(__nv_bfloat16 x) {
    return __bfloat162float(x);
}
template <class T>
T narrow(typename Acc<T>::type x) {
    return x;
}
template <>
__half narrow<__half>(float x) {
    return __float2half_rn(x);
}
template <>
__nv_bfloat16 narrow<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

//! Rank r's input element i: with a fraction that forces rounding in the 16-bit sums.
template <class T>
T input(int r, std::size_t i) {
    if constexpr (std::is_integral_v<T>)
        return static_cast<T>((r + 1) * 1000003LL + static_cast<long long>(i));
    else
        return make<T>((r + 1) * 1.3 + static_cast<double>(i % 11) * 0.37);
}

template <class T>
bool same_bits(T a, T b) {
    return std::memcmp(&a, &b, sizeof a) == 0;
}

constexpr std::size_t elements = 37;

//! Whether a call on a non-blocking communicator went through: at once, or once the communicator
//! leaves ncclInProgress (NCCL launches its work on a thread of its own).
bool settled(ncclComm_t comm, ncclResult_t r) {
    if (r != ncclInProgress) return r == ncclSuccess;
    ncclResult_t state = ncclInProgress;
    return eventually([&] { return ncclCommGetAsyncError(comm, &state) == ncclSuccess && state != ncclInProgress; }) &&
           state == ncclSuccess;
}

//! Whether `got` is the rank-order sum `want` up to the order of the additions, which NCCL
//! chooses (Note [the double's summation order]): exact for integers, within a few units of the
//! type's precision (a 16-bit sum is rounded once from float) for floats.
template <class T>
bool near_sum(T got, typename Acc<T>::type want) {
    if constexpr (std::is_integral_v<T>) {
        return got == want;
    } else {
        const double tolerance = std::is_same_v<T, double> ? 1e-14 : std::is_same_v<T, float> ? 1e-6 : 1e-2;
        return std::abs(static_cast<double>(widen(got)) - static_cast<double>(want)) <=
               tolerance * std::abs(static_cast<double>(want));
    }
}

//! In place all-reduce then broadcast (root 1) of T on one rank; "" when right. The results'
//! bytes are appended to `bits` (every rank must hold the same).
template <class T>
std::string collectives_of(ncclComm_t comm, cudaStream_t s, int rank, int ranks, ncclDataType_t type,
                           std::vector<unsigned char>& bits) {
    std::vector<T> h(elements);
    for (std::size_t i = 0; i < elements; ++i) h[i] = input<T>(rank, i);
    void* buf = nullptr;
    void* recv = nullptr;
    if (cudaMalloc(&buf, elements * sizeof(T)) != cudaSuccess || cudaMalloc(&recv, elements * sizeof(T)) != cudaSuccess)
        return "cudaMalloc failed";
    std::string why;
    (void)cudaMemcpyAsync(buf, h.data(), elements * sizeof(T), cudaMemcpyHostToDevice, s);
    if (!settled(comm, ncclAllReduce(buf, buf, elements, type, ncclSum, comm, s))) why += "ncclAllReduce refused; ";
    std::vector<T> out(elements), reduced(elements);
    (void)cudaMemcpyAsync(out.data(), buf, elements * sizeof(T), cudaMemcpyDeviceToHost, s);  // pageable: waits
    reduced = out;
    for (std::size_t i = 0; i < elements; ++i) {
        typename Acc<T>::type acc = widen(input<T>(0, i));
        for (int r = 1; r < ranks; ++r) acc = static_cast<typename Acc<T>::type>(acc + widen(input<T>(r, i)));
        if (!near_sum(out[i], acc)) {
            why += "all-reduce element " + std::to_string(i) + " wrong; ";
            break;
        }
    }
    if (!settled(comm, ncclBroadcast(buf, recv, elements, type, 1, comm, s))) why += "ncclBroadcast refused; ";
    (void)cudaMemcpyAsync(out.data(), recv, elements * sizeof(T), cudaMemcpyDeviceToHost, s);
    for (std::size_t i = 0; i < elements; ++i)
        if (!same_bits(out[i], reduced[i])) {  // the root's buffer held the all-reduced values
            why += "broadcast element " + std::to_string(i) + " wrong; ";
            break;
        }
    const auto* raw = reinterpret_cast<const unsigned char*>(reduced.data());
    bits.insert(bits.end(), raw, raw + elements * sizeof(T));
    (void)cudaFreeAsync(buf, s);
    (void)cudaFreeAsync(recv, s);
    return why;
}

//! One rank on its own thread: non-blocking init, every data type, finalize, destroy. Its
//! all-reduced values' bytes go to `bits`.
std::string rank_main(ncclUniqueId id, int rank, int ranks, std::vector<unsigned char>& bits) {
    if (cudaSetDevice(rank) != cudaSuccess) return "cudaSetDevice failed";
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclComm_t comm = nullptr;
    const ncclResult_t init = ncclCommInitRankConfig(&comm, ranks, id, rank, &config);
    if (init != ncclSuccess && init != ncclInProgress) return "init refused";
    ncclResult_t state = ncclInProgress;
    if (!eventually([&] { return ncclCommGetAsyncError(comm, &state) == ncclSuccess && state != ncclInProgress; }) ||
        state != ncclSuccess)
        return "init did not complete";
    cudaStream_t s = nullptr;
    (void)cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    std::string why = collectives_of<float>(comm, s, rank, ranks, ncclFloat32, bits) +
                      collectives_of<double>(comm, s, rank, ranks, ncclFloat64, bits) +
                      collectives_of<std::int64_t>(comm, s, rank, ranks, ncclInt64, bits) +
                      collectives_of<__half>(comm, s, rank, ranks, ncclFloat16, bits) +
                      collectives_of<__nv_bfloat16>(comm, s, rank, ranks, ncclBfloat16, bits);
    const ncclResult_t fin = ncclCommFinalize(comm);
    if (fin != ncclSuccess && fin != ncclInProgress) why += "finalize refused; ";
    if (!eventually([&] { return ncclCommGetAsyncError(comm, &state) == ncclSuccess && state != ncclInProgress; }) ||
        state != ncclSuccess)
        why += "finalize did not complete; ";
    if (ncclCommDestroy(comm) != ncclSuccess) why += "destroy refused; ";
    if (cudaStreamSynchronize(s) != cudaSuccess || cudaStreamDestroy(s) != cudaSuccess) why += "stream failed; ";
    return why;
}

//! Communicators of `ranks` ranks on devices 0.. made by one thread in a group, plus a stream each.
struct Clique {
    std::vector<ncclComm_t> comms;
    std::vector<cudaStream_t> streams;
    explicit Clique(int ranks) : comms(static_cast<std::size_t>(ranks)), streams(static_cast<std::size_t>(ranks)) {
        ncclUniqueId id;
        REQUIRE(ncclGetUniqueId(&id) == ncclSuccess);
        REQUIRE(ncclGroupStart() == ncclSuccess);
        for (int r = 0; r < ranks; ++r) {
            REQUIRE(cudaSetDevice(r) == cudaSuccess);
            // Blocking: inside a group the wait moves to ncclGroupEnd (no deadlock on one thread).
            REQUIRE(ncclCommInitRank(&comms[static_cast<std::size_t>(r)], ranks, id, r) == ncclSuccess);
            REQUIRE(cudaStreamCreateWithFlags(&streams[static_cast<std::size_t>(r)], cudaStreamNonBlocking) == cudaSuccess);
        }
        REQUIRE(ncclGroupEnd() == ncclSuccess);
        REQUIRE(cudaSetDevice(0) == cudaSuccess);
    }
    ~Clique() {
        for (std::size_t r = 0; r < comms.size(); ++r) {
            (void)ncclCommAbort(comms[r]);
            (void)cudaSetDevice(static_cast<int>(r));
            (void)cudaStreamSynchronize(streams[r]);
            (void)cudaStreamDestroy(streams[r]);
        }
        (void)cudaSetDevice(0);
    }
    float* buffer(int rank, float value) {
        (void)cudaSetDevice(rank);
        float* d = device_floats(elements);
        const std::vector<float> h(elements, value);
        REQUIRE(cudaMemcpy(d, h.data(), elements * sizeof(float), cudaMemcpyHostToDevice) == cudaSuccess);
        REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
        return d;
    }
    std::vector<float> read(int rank, const float* d) {
        (void)cudaSetDevice(rank);
        // The legacy stream does not wait for the non-blocking streams the collectives ran on.
        REQUIRE(cudaStreamSynchronize(streams[static_cast<std::size_t>(rank)]) == cudaSuccess);
        auto h = read_back(d, elements);
        (void)cudaSetDevice(0);
        return h;
    }
};

}  // namespace

TEST_CASE("host NCCL: all-reduce and broadcast over 2 and 4 ranks, one thread per rank, every data type") {
    Fresh fresh;
    REQUIRE(hc::set_device_count(4));
    for (const int ranks : {2, 4}) {
        ncclUniqueId id;
        REQUIRE(ncclGetUniqueId(&id) == ncclSuccess);
        std::vector<std::string> outcome(static_cast<std::size_t>(ranks));
        std::vector<std::vector<unsigned char>> bits(static_cast<std::size_t>(ranks));
        std::vector<std::thread> threads;
        for (int r = 0; r < ranks; ++r)
            threads.emplace_back([&, r] {
                const auto u = static_cast<std::size_t>(r);
                outcome[u] = rank_main(id, r, ranks, bits[u]);
            });
        for (auto& t : threads) t.join();
        for (int r = 0; r < ranks; ++r) {
            CAPTURE(ranks, r);
            INFO(outcome[static_cast<std::size_t>(r)]);
            CHECK(outcome[static_cast<std::size_t>(r)].empty());
            CHECK(bits[static_cast<std::size_t>(r)] == bits[0]);  // each element reduced once, for all
        }
    }
    CHECK(hc::live_device_blocks() == fresh.blocks);
}

TEST_CASE("host NCCL: one thread inits the ranks in a group and drives them; arguments are checked") {
    Fresh fresh;
    REQUIRE(hc::set_device_count(4));
    Clique clique(4);
    int n = 0, rank = -1, device = -1;
    REQUIRE(ncclCommCount(clique.comms[2], &n) == ncclSuccess);
    REQUIRE(ncclCommUserRank(clique.comms[2], &rank) == ncclSuccess);
    REQUIRE(ncclCommCuDevice(clique.comms[2], &device) == ncclSuccess);
    CHECK(n == 4);
    CHECK(rank == 2);
    CHECK(device == 2);
    std::vector<float*> bufs;
    for (int r = 0; r < 4; ++r) bufs.push_back(clique.buffer(r, static_cast<float>(r + 1)));
    REQUIRE(ncclGroupStart() == ncclSuccess);
    for (int r = 0; r < 4; ++r)
        REQUIRE(ncclAllReduce(bufs[r], bufs[r], elements, ncclFloat32, ncclSum, clique.comms[r], clique.streams[r]) ==
                ncclSuccess);
    REQUIRE(ncclGroupEnd() == ncclSuccess);
    for (int r = 0; r < 4; ++r)
        for (float x : clique.read(r, bufs[r])) REQUIRE(x == 10.0f);

    // A stream of another device, host memory, a bad root are refused.
    CHECK(ncclAllReduce(bufs[0], bufs[0], elements, ncclFloat32, ncclSum, clique.comms[0], clique.streams[1]) ==
          ncclInvalidUsage);
    std::vector<float> host(elements);
    CHECK(ncclAllReduce(host.data(), host.data(), elements, ncclFloat32, ncclSum, clique.comms[0], clique.streams[0]) ==
          ncclInvalidArgument);
    CHECK(ncclAllReduce(bufs[1], bufs[1], elements, ncclFloat32, ncclSum, clique.comms[0], clique.streams[0]) ==
          ncclInvalidArgument);  // device 1's memory for the rank on device 0
    CHECK(ncclBroadcast(bufs[0], bufs[0], elements, ncclFloat32, 4, clique.comms[0], clique.streams[0]) == ncclInvalidArgument);
    CHECK(std::string(ncclGetLastError(clique.comms[0])).find("root") != std::string::npos);
    for (int r = 0; r < 4; ++r) {
        (void)cudaSetDevice(r);
        REQUIRE(cudaFree(bufs[r]) == cudaSuccess);
    }
    (void)cudaSetDevice(0);
    // Blocking finalize of every rank from one thread: in a group, the wait is at ncclGroupEnd.
    REQUIRE(ncclGroupStart() == ncclSuccess);
    for (ncclComm_t c : clique.comms) REQUIRE(ncclCommFinalize(c) == ncclSuccess);
    REQUIRE(ncclGroupEnd() == ncclSuccess);
    for (ncclComm_t& c : clique.comms) {
        ncclResult_t state = ncclInProgress;
        REQUIRE(ncclCommGetAsyncError(c, &state) == ncclSuccess);
        CHECK(state == ncclSuccess);
        REQUIRE(ncclCommDestroy(c) == ncclSuccess);
        c = nullptr;
    }
}

// Note [the double's summation order]: as NCCL, the double adds the ranks' values in an order of
// its own, not rank order 0..n-1, and a captured plan may add them otherwise; each element is
// reduced once, so every rank holds the same bits. Values that cancel show the order: rank order
// gives ((1e8 + 1) - 1e8) + 1 = 1 in fp32, a tree (1e8 + 1) + (-1e8 + 1) = 0.
TEST_CASE("host NCCL: sums in an order of NCCL's kind, the same bits on every rank, a captured plan its own") {
    Fresh fresh;
    REQUIRE(hc::set_device_count(4));
    Clique clique(4);
    const auto run = [&](const std::array<float, 4>& values, bool captured) {
        std::vector<float*> bufs;
        for (int r = 0; r < 4; ++r) bufs.push_back(clique.buffer(r, values[static_cast<std::size_t>(r)]));
        std::vector<cudaGraphExec_t> execs(4, nullptr);
        for (int r = 0; r < 4; ++r) {
            const auto u = static_cast<std::size_t>(r);
            REQUIRE(cudaSetDevice(r) == cudaSuccess);
            if (!captured) {
                REQUIRE(ncclAllReduce(bufs[u], bufs[u], elements, ncclFloat32, ncclSum, clique.comms[u], clique.streams[u]) ==
                        ncclSuccess);
                continue;
            }
            cudaGraph_t graph = nullptr;
            REQUIRE(cudaStreamBeginCapture(clique.streams[u], cudaStreamCaptureModeThreadLocal) == cudaSuccess);
            REQUIRE(ncclAllReduce(bufs[u], bufs[u], elements, ncclFloat32, ncclSum, clique.comms[u], clique.streams[u]) ==
                    ncclSuccess);
            REQUIRE(cudaStreamEndCapture(clique.streams[u], &graph) == cudaSuccess);
            REQUIRE(cudaGraphInstantiate(&execs[u], graph, 0) == cudaSuccess);
            REQUIRE(cudaGraphDestroy(graph) == cudaSuccess);
        }
        for (int r = 0; r < 4 && captured; ++r) {
            REQUIRE(cudaSetDevice(r) == cudaSuccess);
            REQUIRE(cudaGraphLaunch(execs[static_cast<std::size_t>(r)], clique.streams[static_cast<std::size_t>(r)]) ==
                    cudaSuccess);
        }
        std::vector<std::vector<float>> out;
        for (int r = 0; r < 4; ++r) out.push_back(clique.read(r, bufs[static_cast<std::size_t>(r)]));
        for (int r = 0; r < 4; ++r) {
            (void)cudaSetDevice(r);
            if (execs[static_cast<std::size_t>(r)] != nullptr)
                REQUIRE(cudaGraphExecDestroy(execs[static_cast<std::size_t>(r)]) == cudaSuccess);
            REQUIRE(cudaFree(bufs[static_cast<std::size_t>(r)]) == cudaSuccess);
        }
        (void)cudaSetDevice(0);
        for (int r = 1; r < 4; ++r) CHECK(out[static_cast<std::size_t>(r)] == out[0]);
        return out[0][0];
    };
    const std::array<float, 4> cancel{1e8f, 1.0f, -1e8f, 1.0f};
    const float rank_order = ((cancel[0] + cancel[1]) + cancel[2]) + cancel[3];
    REQUIRE(rank_order == 1.0f);
    CHECK(run(cancel, false) != rank_order);
    const std::array<float, 4> pairs{1e8f, -1e8f, 1.0f, 1.0f};
    CHECK(run(pairs, false) != run(pairs, true));
}

// NCCL 2.28 launches a non-blocking communicator's work on a thread it starts for the call: the
// call returns ncclInProgress, the communicator refuses more work until that thread has enqueued
// it, and the caller polls ncclCommGetAsyncError before its next call.
TEST_CASE("host NCCL: a non-blocking communicator's collective returns in progress and is enqueued on another thread") {
    Fresh fresh;
    REQUIRE(hc::set_device_count(1));
    ncclUniqueId id;
    REQUIRE(ncclGetUniqueId(&id) == ncclSuccess);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclComm_t comm = nullptr;
    const ncclResult_t init = ncclCommInitRankConfig(&comm, 1, id, 0, &config);
    REQUIRE(settled(comm, init));
    cudaStream_t s = nullptr;
    REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
    float* buf = device_floats(elements);
    int in_progress = 0;
    for (int i = 0; i < 20; ++i) {
        hc::hold_nccl_launches(true);  // the launch thread waits: the communicator stays in progress
        const ncclResult_t r = ncclAllReduce(buf, buf, elements, ncclFloat32, ncclSum, comm, s);
        in_progress += r == ncclInProgress ? 1 : 0;
        ncclResult_t state = ncclSuccess;
        REQUIRE(ncclCommGetAsyncError(comm, &state) == ncclSuccess);
        CHECK(state == ncclInProgress);
        // Until the launch thread is done the communicator takes no more work.
        CHECK(ncclAllReduce(buf, buf, elements, ncclFloat32, ncclSum, comm, s) == ncclInvalidUsage);
        hc::hold_nccl_launches(false);
        REQUIRE(settled(comm, r));
    }
    CHECK(in_progress == 20);
    REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
    REQUIRE(cudaFree(buf) == cudaSuccess);
    REQUIRE(cudaStreamDestroy(s) == cudaSuccess);
    REQUIRE(ncclCommAbort(comm) == ncclSuccess);
}

TEST_CASE("host NCCL: a failing rank releases its peers with an error and writes nothing") {
    Fresh fresh;
    REQUIRE(hc::set_device_count(2));
    Clique clique(2);
    float* b0 = clique.buffer(0, 1.0f);
    float* b1 = clique.buffer(1, 2.0f);
    hc::fail_nccl(1, 2);
    for (int round = 0; round < 2; ++round) {
        REQUIRE(ncclAllReduce(b0, b0, elements, ncclFloat32, ncclSum, clique.comms[0], clique.streams[0]) == ncclSuccess);
        REQUIRE(ncclAllReduce(b1, b1, elements, ncclFloat32, ncclSum, clique.comms[1], clique.streams[1]) == ncclSuccess);
        REQUIRE(cudaStreamSynchronize(clique.streams[0]) == cudaSuccess);  // released, not hung
        (void)cudaSetDevice(1);
        REQUIRE(cudaStreamSynchronize(clique.streams[1]) == cudaSuccess);
        (void)cudaSetDevice(0);
    }
    ncclResult_t e0 = ncclSuccess, e1 = ncclSuccess;
    REQUIRE(ncclCommGetAsyncError(clique.comms[0], &e0) == ncclSuccess);
    REQUIRE(ncclCommGetAsyncError(clique.comms[1], &e1) == ncclSuccess);
    CHECK(e0 == ncclRemoteError);
    CHECK(e1 == ncclSystemError);
    for (float x : clique.read(0, b0)) REQUIRE(x == 3.0f);  // the first round only
    for (float x : clique.read(1, b1)) REQUIRE(x == 3.0f);
    CHECK(ncclAllReduce(b0, b0, elements, ncclFloat32, ncclSum, clique.comms[0], clique.streams[0]) == ncclRemoteError);
    CHECK(std::string(ncclGetErrorString(ncclRemoteError)).find("remote") != std::string::npos);
    (void)cudaFree(b0);
    (void)cudaSetDevice(1);
    (void)cudaFree(b1);
    (void)cudaSetDevice(0);
}

TEST_CASE("host NCCL: a rank that never arrives blocks its peer until the peer's communicator is aborted") {
    Fresh fresh;
    REQUIRE(hc::set_device_count(2));
    Clique clique(2);
    float* b0 = clique.buffer(0, 1.0f);
    REQUIRE(ncclAllReduce(b0, b0, elements, ncclFloat32, ncclSum, clique.comms[0], clique.streams[0]) == ncclSuccess);
    std::this_thread::sleep_for(30ms);
    CHECK(cudaStreamQuery(clique.streams[0]) == cudaErrorNotReady);
    REQUIRE(ncclCommAbort(clique.comms[0]) == ncclSuccess);
    REQUIRE(cudaStreamSynchronize(clique.streams[0]) == cudaSuccess);
    for (float x : clique.read(0, b0)) REQUIRE(x == 1.0f);  // nothing written
    CHECK(ncclAllReduce(b0, b0, elements, ncclFloat32, ncclSum, clique.comms[0], clique.streams[0]) == ncclInvalidArgument);
    clique.comms[0] = nullptr;
    REQUIRE(cudaFree(b0) == cudaSuccess);
}

TEST_CASE("host NCCL: two ranks on one device are refused; the version is settable") {
    Fresh fresh;
    REQUIRE(hc::set_device_count(2));
    int version = 0;
    REQUIRE(ncclGetVersion(&version) == ncclSuccess);
    CHECK(version == 22805);
    hc::set_nccl_version(22703);
    REQUIRE(ncclGetVersion(&version) == ncclSuccess);
    CHECK(version == 22703);
    hc::reset();
    REQUIRE(ncclGetVersion(&version) == ncclSuccess);
    CHECK(version == 22805);

    ncclUniqueId a, b;
    REQUIRE(ncclGetUniqueId(&a) == ncclSuccess);
    REQUIRE(ncclGetUniqueId(&b) == ncclSuccess);
    CHECK(std::memcmp(&a, &b, sizeof a) != 0);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclComm_t c0 = nullptr, c1 = nullptr;
    CHECK(ncclCommInitRankConfig(&c0, 2, a, 0, &config) == ncclInProgress);
    CHECK(ncclCommInitRankConfig(&c1, 2, a, 1, &config) == ncclInvalidUsage);
    ncclResult_t state = ncclSuccess;
    REQUIRE(ncclCommGetAsyncError(c0, &state) == ncclSuccess);
    CHECK(state == ncclInProgress);
    REQUIRE(ncclCommAbort(c0) == ncclSuccess);
    CHECK(ncclCommGetAsyncError(c0, &state) == ncclInvalidArgument);
    std::vector<ncclComm_t> all(2);
    const int same[] = {1, 1};
    CHECK(ncclCommInitAll(all.data(), 2, same) == ncclInvalidUsage);
    REQUIRE(ncclCommInitAll(all.data(), 2, nullptr) == ncclSuccess);
    for (ncclComm_t c : all) REQUIRE(ncclCommDestroy(c) == ncclSuccess);  // healthy: no finalize needed
}

TEST_CASE("host CUDA: launch injections can target the launches of one named kernel") {
    Kernels k;  // outlives the drain in ~Fresh
    Fresh fresh;
    cudaStream_t s = nullptr;
    REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
    std::atomic<int> ran{0};
    hc::fail_launch(2, "rank_sum");
    lockstep_host_cuda_name_next_launch("rank_sum");
    REQUIRE(k.launch(s, [&] { ++ran; }) == cudaSuccess);
    REQUIRE(k.launch(s, [&] { ++ran; }) == cudaSuccess);  // unnamed: not counted
    lockstep_host_cuda_name_next_launch("gemm");
    REQUIRE(k.launch(s, [&] { ++ran; }) == cudaSuccess);
    lockstep_host_cuda_name_next_launch("rank_sum");
    CHECK(k.launch(s, [&] { ++ran; }) == cudaErrorLaunchFailure);
    REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
    CHECK(ran == 3);
    REQUIRE(cudaStreamDestroy(s) == cudaSuccess);
}

// ---- Stream capture and graphs ------------------------------------------------------------------

namespace {

cudaStreamCaptureStatus capture_status(cudaStream_t s) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    REQUIRE(cudaStreamIsCapturing(s, &status) == cudaSuccess);
    return status;
}

//! Instantiates `graph`, launches it `times` on `s`, waits, destroys both.
void replay(cudaGraph_t graph, cudaStream_t s, int times) {
    cudaGraphExec_t exec = nullptr;
    REQUIRE(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess);
    for (int i = 0; i < times; ++i) REQUIRE(cudaGraphLaunch(exec, s) == cudaSuccess);
    REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
    REQUIRE(cudaGraphExecDestroy(exec) == cudaSuccess);
    REQUIRE(cudaGraphDestroy(graph) == cudaSuccess);
}

}  // namespace

TEST_CASE("host graphs: a capture runs nothing; each launch replays its work in order, kernels counted each time") {
    Kernels k;  // outlives the drain in ~Fresh
    Fresh fresh;
    cudaStream_t s = nullptr;
    REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
    float* x = device_floats(4);
    float* y = device_floats(4);
    REQUIRE(cudaMemsetAsync(x, 0, 4 * sizeof(float), s) == cudaSuccess);
    std::atomic<int> runs{0};

    REQUIRE(capture_status(s) == cudaStreamCaptureStatusNone);
    REQUIRE(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal) == cudaSuccess);
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal) == cudaErrorIllegalState);
    CHECK(capture_status(s) == cudaStreamCaptureStatusActive);
    const std::uint64_t launched = hc::launches();
    lockstep_host_cuda_name_next_launch("affine");
    REQUIRE(k.launch(s, [&] {
        ++runs;
        for (int i = 0; i < 4; ++i) x[i] = x[i] * 2.0f + static_cast<float>(i);
    }) == cudaSuccess);
    REQUIRE(cudaMemsetAsync(y, 0, 4 * sizeof(float), s) == cudaSuccess);
    REQUIRE(cudaMemcpyAsync(y, x, 2 * sizeof(float), cudaMemcpyDeviceToDevice, s) == cudaSuccess);
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    unsigned long long id = 0;
    cudaGraph_t building = nullptr, graph = nullptr;
    REQUIRE(cudaStreamGetCaptureInfo(s, &status, &id, &building) == cudaSuccess);
    CHECK(status == cudaStreamCaptureStatusActive);
    CHECK(id != 0);
    REQUIRE(cudaStreamEndCapture(s, &graph) == cudaSuccess);
    CHECK(graph == building);
    CHECK(capture_status(s) == cudaStreamCaptureStatusNone);
    REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
    CHECK(runs.load() == 0);  // captured, not run
    CHECK(hc::launches() == launched);
    CHECK(read_back(x, 4) == std::vector<float>{0, 0, 0, 0});

    cudaGraphExec_t exec = nullptr;
    REQUIRE(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess);
    for (int i = 0; i < 3; ++i) REQUIRE(cudaGraphLaunch(exec, s) == cudaSuccess);
    REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
    CHECK(runs.load() == 3);
    CHECK(hc::launches() == launched + 3);
    // x_{n+1} = 2 x_n + i, from 0: 0, i, 3i, 7i; y = x's first two, the rest zeroed.
    CHECK(read_back(x, 4) == std::vector<float>{0, 7, 14, 21});
    CHECK(read_back(y, 4) == std::vector<float>{0, 7, 0, 0});

    // Injections count the graph's kernels at each launch: a failed launch enqueues nothing, a
    // fault is sticky as in an eager launch.
    hc::fail_launch(1, "affine");
    CHECK(cudaGraphLaunch(exec, s) == cudaErrorLaunchFailure);
    REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
    CHECK(runs.load() == 3);
    hc::fault_launch(1, "affine");
    REQUIRE(cudaGraphLaunch(exec, s) == cudaSuccess);
    CHECK(cudaStreamSynchronize(s) == cudaErrorIllegalAddress);
    hc::reset();
    REQUIRE(cudaGraphExecDestroy(exec) == cudaSuccess);
    CHECK(cudaGraphExecDestroy(exec) == cudaErrorInvalidValue);
    CHECK(cudaGraphLaunch(exec, s) == cudaErrorInvalidResourceHandle);
    REQUIRE(cudaGraphDestroy(graph) == cudaSuccess);
    CHECK(cudaGraphDestroy(graph) == cudaErrorInvalidValue);
    REQUIRE(cudaFree(x) == cudaSuccess);
    REQUIRE(cudaFree(y) == cudaSuccess);
    REQUIRE(cudaStreamDestroy(s) == cudaSuccess);
}

TEST_CASE("host graphs: forks through events join the capture and must rejoin it; nothing outside it is waited for") {
    Kernels k;
    Fresh fresh;
    cudaStream_t a = nullptr, b = nullptr, c = nullptr;
    for (cudaStream_t* p : {&a, &b, &c}) REQUIRE(cudaStreamCreateWithFlags(p, cudaStreamNonBlocking) == cudaSuccess);
    cudaEvent_t fork = nullptr, join = nullptr, outside = nullptr;
    for (cudaEvent_t* p : {&fork, &join, &outside}) REQUIRE(cudaEventCreateWithFlags(p, cudaEventDisableTiming) == cudaSuccess);
    float* v = device_floats(3);
    REQUIRE(cudaMemsetAsync(v, 0, 3 * sizeof(float), a) == cudaSuccess);
    REQUIRE(cudaStreamSynchronize(a) == cudaSuccess);

    // a: v0 += 1 | fork | b: v1 = 10 v0 (after a's first kernel) | join | a: v2 = v1 + v0.
    REQUIRE(cudaStreamBeginCapture(a, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
    REQUIRE(k.launch(a, [&] { v[0] += 1.0f; }) == cudaSuccess);
    REQUIRE(cudaEventRecord(fork, a) == cudaSuccess);
    CHECK(cudaEventQuery(fork) == cudaErrorCapturedEvent);
    CHECK(cudaEventSynchronize(fork) == cudaErrorCapturedEvent);
    REQUIRE(cudaStreamWaitEvent(b, fork, 0) == cudaSuccess);
    CHECK(capture_status(b) == cudaStreamCaptureStatusActive);
    REQUIRE(k.launch(b, [&] {
        std::this_thread::sleep_for(2ms);  // a's kernel after the join would see v1 unwritten
        v[1] = 10.0f * v[0];
    }) == cudaSuccess);
    REQUIRE(cudaEventRecord(join, b) == cudaSuccess);
    cudaGraph_t graph = nullptr;
    CHECK(cudaStreamEndCapture(b, &graph) == cudaErrorStreamCaptureUnmatched);  // b joined, a began
    REQUIRE(cudaStreamWaitEvent(a, join, 0) == cudaSuccess);
    REQUIRE(k.launch(a, [&] { v[2] = v[1] + v[0]; }) == cudaSuccess);
    REQUIRE(cudaStreamEndCapture(a, &graph) == cudaSuccess);
    CHECK(capture_status(b) == cudaStreamCaptureStatusNone);
    replay(graph, c, 2);  // launched on a third stream: the lanes are the graph's own
    CHECK(read_back(v, 3) == std::vector<float>{2, 20, 22});

    // Launches of one executable run one after the other, whatever their streams: the second
    // launch's first kernel sees the first launch's forked kernel done.
    std::atomic<int> forked_done{0};
    std::vector<int> seen;  // written by kernels that CUDA orders, read after a synchronize
    REQUIRE(cudaStreamBeginCapture(a, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
    REQUIRE(k.launch(a, [&] { seen.push_back(forked_done.load()); }) == cudaSuccess);
    REQUIRE(cudaEventRecord(fork, a) == cudaSuccess);
    REQUIRE(cudaStreamWaitEvent(b, fork, 0) == cudaSuccess);
    REQUIRE(k.launch(b, [&] {
        std::this_thread::sleep_for(10ms);
        ++forked_done;
    }) == cudaSuccess);
    REQUIRE(cudaEventRecord(join, b) == cudaSuccess);
    REQUIRE(cudaStreamWaitEvent(a, join, 0) == cudaSuccess);
    REQUIRE(cudaStreamEndCapture(a, &graph) == cudaSuccess);
    cudaGraphExec_t exec = nullptr;
    REQUIRE(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess);
    REQUIRE(cudaGraphLaunch(exec, c) == cudaSuccess);
    REQUIRE(cudaGraphLaunch(exec, a) == cudaSuccess);
    REQUIRE(cudaStreamSynchronize(a) == cudaSuccess);
    REQUIRE(cudaStreamSynchronize(c) == cudaSuccess);
    CHECK(seen == std::vector<int>{0, 1});
    REQUIRE(cudaGraphExecDestroy(exec) == cudaSuccess);
    REQUIRE(cudaGraphDestroy(graph) == cudaSuccess);

    // A fork that never rejoins: no graph, and both streams leave the capture.
    REQUIRE(cudaStreamBeginCapture(a, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
    REQUIRE(cudaEventRecord(fork, a) == cudaSuccess);
    REQUIRE(cudaStreamWaitEvent(b, fork, 0) == cudaSuccess);
    REQUIRE(k.launch(b, [] {}) == cudaSuccess);
    CHECK(cudaStreamEndCapture(a, &graph) == cudaErrorStreamCaptureUnjoined);
    CHECK(graph == nullptr);
    CHECK(capture_status(a) == cudaStreamCaptureStatusNone);
    CHECK(capture_status(b) == cudaStreamCaptureStatusNone);

    // Waiting for work recorded outside the capture breaks it: only its own order crosses in.
    REQUIRE(cudaEventRecord(outside, c) == cudaSuccess);
    REQUIRE(cudaStreamBeginCapture(a, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
    CHECK(cudaStreamWaitEvent(a, outside, 0) == cudaErrorStreamCaptureIsolation);
    CHECK(capture_status(a) == cudaStreamCaptureStatusInvalidated);
    CHECK(k.launch(a, [] {}) == cudaErrorStreamCaptureInvalidated);
    CHECK(cudaStreamEndCapture(a, &graph) == cudaErrorStreamCaptureInvalidated);
    CHECK(graph == nullptr);

    // Two captures cannot merge through an event.
    REQUIRE(cudaStreamBeginCapture(a, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
    REQUIRE(cudaStreamBeginCapture(b, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
    REQUIRE(cudaEventRecord(fork, a) == cudaSuccess);
    CHECK(cudaStreamWaitEvent(b, fork, 0) == cudaErrorStreamCaptureMerge);
    CHECK(cudaStreamEndCapture(a, &graph) == cudaErrorStreamCaptureInvalidated);
    CHECK(cudaStreamEndCapture(b, &graph) == cudaErrorStreamCaptureInvalidated);
    // The event's capture has ended: it is not a position anyone can wait for.
    CHECK(cudaStreamWaitEvent(c, fork, 0) == cudaErrorCapturedEvent);
    REQUIRE(cudaEventRecord(fork, c) == cudaSuccess);  // re-recorded outside: an ordinary event again
    CHECK(cudaEventSynchronize(fork) == cudaSuccess);

    REQUIRE(cudaFree(v) == cudaSuccess);
    for (cudaEvent_t e : {fork, join, outside}) REQUIRE(cudaEventDestroy(e) == cudaSuccess);
    for (cudaStream_t s : {a, b, c}) REQUIRE(cudaStreamDestroy(s) == cudaSuccess);
}

TEST_CASE("host graphs: what a capture forbids: synchronizing, pageable copies, the legacy stream, unsafe calls in its mode") {
    Fresh fresh;
    cudaStream_t s = nullptr, blocking = nullptr;
    REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
    REQUIRE(cudaStreamCreate(&blocking) == cudaSuccess);
    float* d = device_floats(4);
    cudaGraph_t graph = nullptr;
    const auto invalidated_by = [&](cudaStream_t on, auto&& call, cudaError_t expected) {
        REQUIRE(cudaStreamBeginCapture(on, cudaStreamCaptureModeGlobal) == cudaSuccess);
        CHECK(call() == expected);
        CHECK(capture_status(on) == cudaStreamCaptureStatusInvalidated);
        CHECK(cudaStreamEndCapture(on, &graph) == cudaErrorStreamCaptureInvalidated);
        (void)cudaGetLastError();
    };
    invalidated_by(
        s, [&] { return cudaStreamSynchronize(s); }, cudaErrorStreamCaptureUnsupported);
    invalidated_by(
        s, [&] { return cudaStreamQuery(s); }, cudaErrorStreamCaptureUnsupported);
    std::vector<float> pageable(4, 1.0f);
    invalidated_by(
        s, [&] { return cudaMemcpyAsync(d, pageable.data(), 16, cudaMemcpyHostToDevice, s); }, cudaErrorStreamCaptureUnsupported);
    invalidated_by(
        blocking, [&] { return cudaMemsetAsync(d, 0, 16, nullptr); }, cudaErrorStreamCaptureImplicit);
    invalidated_by(
        s, [&] { return cudaFreeAsync(d, s); }, cudaErrorStreamCaptureUnsupported);  // not the graph's
    invalidated_by(
        s,
        [&] {
            void* p = nullptr;
            return cudaMalloc(&p, 16);
        },
        cudaErrorStreamCaptureUnsupported);
    CHECK(cudaStreamBeginCapture(nullptr, cudaStreamCaptureModeGlobal) == cudaErrorStreamCaptureUnsupported);
    // Asking the legacy stream whether it captures, beside a blocking capture, is refused but
    // breaks nothing.
    REQUIRE(cudaStreamBeginCapture(blocking, cudaStreamCaptureModeGlobal) == cudaSuccess);
    cudaStreamCaptureStatus legacy_status{};
    CHECK(cudaStreamIsCapturing(nullptr, &legacy_status) == cudaErrorStreamCaptureImplicit);
    CHECK(cudaStreamGetCaptureInfo(nullptr, &legacy_status) == cudaErrorStreamCaptureImplicit);
    CHECK(capture_status(blocking) == cudaStreamCaptureStatusActive);
    REQUIRE(cudaStreamEndCapture(blocking, &graph) == cudaSuccess);
    REQUIRE(cudaGraphDestroy(graph) == cudaSuccess);
    // reset() (between test cases) ends a capture left open, and the thread may allocate again.
    REQUIRE(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal) == cudaSuccess);
    hc::reset();
    CHECK(capture_status(s) == cudaStreamCaptureStatusNone);
    void* after_reset = nullptr;
    CHECK(cudaMalloc(&after_reset, 16) == cudaSuccess);
    CHECK(cudaFree(after_reset) == cudaSuccess);
    // The legacy stream beside a non-blocking capture is fine.
    REQUIRE(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal) == cudaSuccess);
    CHECK(cudaMemsetAsync(d, 0, 16, nullptr) == cudaSuccess);
    CHECK(cudaStreamDestroy(s) == cudaErrorStreamCaptureUnsupported);
    REQUIRE(cudaStreamEndCapture(s, &graph) == cudaSuccess);
    REQUIRE(cudaGraphDestroy(graph) == cudaSuccess);
    REQUIRE(cudaStreamSynchronize(nullptr) == cudaSuccess);  // the memset ran before d is freed

    // Unsafe calls from another thread: forbidden beside a global capture, allowed beside a
    // thread-local one; a relaxed capture forbids nothing, even on its own thread.
    const auto malloc_elsewhere = [] {
        cudaError_t e = cudaErrorUnknown;
        std::thread([&] {
            void* p = nullptr;
            e = cudaMalloc(&p, 16);
            if (e == cudaSuccess) (void)cudaFree(p);
        }).join();
        return e;
    };
    REQUIRE(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal) == cudaSuccess);
    CHECK(malloc_elsewhere() == cudaErrorStreamCaptureUnsupported);
    CHECK(cudaStreamEndCapture(s, &graph) == cudaErrorStreamCaptureInvalidated);
    REQUIRE(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
    CHECK(malloc_elsewhere() == cudaSuccess);
    cudaError_t wrong_thread = cudaSuccess;
    std::thread([&] { wrong_thread = cudaStreamEndCapture(s, &graph); }).join();
    CHECK(wrong_thread == cudaErrorStreamCaptureWrongThread);
    REQUIRE(cudaStreamEndCapture(s, &graph) == cudaSuccess);
    REQUIRE(cudaGraphDestroy(graph) == cudaSuccess);
    REQUIRE(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed) == cudaSuccess);
    void* p = nullptr;
    CHECK(cudaMalloc(&p, 16) == cudaSuccess);
    CHECK(cudaFree(p) == cudaSuccess);
    REQUIRE(cudaStreamEndCapture(s, &graph) == cudaSuccess);
    REQUIRE(cudaGraphDestroy(graph) == cudaSuccess);
    // A thread in relaxed mode may make unsafe calls beside its own global capture.
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    REQUIRE(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal) == cudaSuccess);
    REQUIRE(cudaThreadExchangeStreamCaptureMode(&mode) == cudaSuccess);
    CHECK(mode == cudaStreamCaptureModeGlobal);
    CHECK(cudaMalloc(&p, 16) == cudaSuccess);
    CHECK(cudaFree(p) == cudaSuccess);
    REQUIRE(cudaThreadExchangeStreamCaptureMode(&mode) == cudaSuccess);
    REQUIRE(cudaStreamEndCapture(s, &graph) == cudaSuccess);
    REQUIRE(cudaGraphDestroy(graph) == cudaSuccess);

    REQUIRE(cudaFree(d) == cudaSuccess);
    REQUIRE(cudaStreamDestroy(s) == cudaSuccess);
    REQUIRE(cudaStreamDestroy(blocking) == cudaSuccess);
}

TEST_CASE("host graphs: a capture's allocations and retained user objects live as long as its graph") {
    Kernels k;
    Fresh fresh;
    cudaStream_t s = nullptr;
    REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
    float* out = device_floats(2);
    static std::atomic<int> destroyed{0};
    destroyed = 0;
    cudaUserObject_t object = nullptr;
    int payload = 7;
    CHECK(cudaUserObjectCreate(
              &object, &payload, [](void*) { ++destroyed; }, 1, 0) == cudaErrorInvalidValue);
    REQUIRE(cudaUserObjectCreate(
                &object, &payload, [](void* p) { destroyed += *static_cast<int*>(p) == 7 ? 1 : 100; }, 1,
                cudaUserObjectNoDestructorSync) == cudaSuccess);

    REQUIRE(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
    cudaStreamCaptureStatus status{};
    cudaGraph_t building = nullptr;
    REQUIRE(cudaStreamGetCaptureInfo(s, &status, nullptr, &building) == cudaSuccess);
    REQUIRE(cudaGraphRetainUserObject(building, object, 1, cudaGraphUserObjectMove) == cudaSuccess);
    void* scratch = nullptr;
    REQUIRE(cudaMallocAsync(&scratch, 2 * sizeof(float), s) == cudaSuccess);
    const std::size_t with_scratch = hc::live_device_blocks();
    auto* f = static_cast<float*>(scratch);
    std::vector<float> before_write;  // what each launch's kernel finds in the block: nothing written
    REQUIRE(k.launch(s, [f, &before_write] {
        before_write.push_back(f[0]);
        f[0] = 3.0f, f[1] = 4.0f;
    }) == cudaSuccess);
    REQUIRE(cudaMemcpyAsync(out, scratch, 2 * sizeof(float), cudaMemcpyDeviceToDevice, s) == cudaSuccess);
    REQUIRE(cudaFreeAsync(scratch, s) == cudaSuccess);
    cudaGraph_t graph = nullptr;
    REQUIRE(cudaStreamEndCapture(s, &graph) == cudaSuccess);
    CHECK(hc::live_device_blocks() == with_scratch);  // the graph keeps its block
    CHECK(cudaFree(scratch) == cudaErrorInvalidValue);
    cudaGraphExec_t exec = nullptr;
    REQUIRE(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess);
    cudaGraphExec_t second = nullptr;
    CHECK(cudaGraphInstantiate(&second, graph, 0) == cudaErrorInvalidValue);  // it allocates: one executable
    REQUIRE(cudaGraphDestroy(graph) == cudaSuccess);
    CHECK(destroyed.load() == 0);  // the executable holds the object
    REQUIRE(cudaGraphLaunch(exec, s) == cudaSuccess);
    REQUIRE(cudaGraphLaunch(exec, s) == cudaSuccess);
    REQUIRE(cudaGraphExecDestroy(exec) == cudaSuccess);  // with replays queued: they finish first
    REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
    CHECK(read_back(out, 2) == std::vector<float>{3, 4});
    REQUIRE(before_write.size() == 2);
    for (float x : before_write) CHECK(std::isnan(x));  // new at each launch, not the last launch's 3
    CHECK(eventually([&] { return destroyed.load() == 1 && hc::live_device_blocks() == with_scratch - 1; }));
    CHECK(destroyed.load() == 1);
    CHECK(cudaUserObjectRelease(object, 1) == cudaErrorInvalidValue);  // its last reference went with the graph

    // An allocation that outlives its capture: the double's graphs do not take one.
    REQUIRE(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
    REQUIRE(cudaMallocAsync(&scratch, 16, s) == cudaSuccess);
    REQUIRE(cudaStreamEndCapture(s, &graph) == cudaSuccess);
    CHECK(cudaGraphInstantiate(&exec, graph, 0) == cudaErrorNotSupported);
    REQUIRE(cudaGraphDestroy(graph) == cudaSuccess);
    CHECK(hc::live_device_blocks() == with_scratch - 1);
    REQUIRE(cudaFree(out) == cudaSuccess);
    REQUIRE(cudaStreamDestroy(s) == cudaSuccess);
}

TEST_CASE("host graphs: captured collectives meet their peers' again at each replay") {
    Fresh fresh;
    REQUIRE(hc::set_device_count(2));
    Clique clique(2);
    std::vector<float*> bufs;
    for (int r = 0; r < 2; ++r) bufs.push_back(clique.buffer(r, static_cast<float>(r + 1)));
    std::vector<std::string> why(2);
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r)
        threads.emplace_back([&, r] {
            const auto u = static_cast<std::size_t>(r);
            (void)cudaSetDevice(r);
            cudaStream_t s = clique.streams[u];
            cudaGraph_t graph = nullptr;
            cudaGraphExec_t exec = nullptr;
            if (cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal) != cudaSuccess) why[u] += "begin; ";
            if (ncclAllReduce(bufs[u], bufs[u], elements, ncclFloat32, ncclSum, clique.comms[u], s) != ncclSuccess)
                why[u] += "all-reduce; ";
            if (cudaStreamEndCapture(s, &graph) != cudaSuccess) why[u] += "end; ";
            if (cudaGraphInstantiate(&exec, graph, 0) != cudaSuccess) why[u] += "instantiate; ";
            for (int i = 0; i < 3; ++i)
                if (cudaGraphLaunch(exec, s) != cudaSuccess) why[u] += "launch; ";
            if (cudaStreamSynchronize(s) != cudaSuccess) why[u] += "sync; ";
            if (cudaGraphExecDestroy(exec) != cudaSuccess || cudaGraphDestroy(graph) != cudaSuccess) why[u] += "destroy; ";
        });
    for (auto& t : threads) t.join();
    for (int r = 0; r < 2; ++r) {
        INFO(why[static_cast<std::size_t>(r)]);
        CHECK(why[static_cast<std::size_t>(r)].empty());
        for (float x : clique.read(r, bufs[static_cast<std::size_t>(r)])) REQUIRE(x == 12.0f);  // 3, 6, 12
    }
    for (int r = 0; r < 2; ++r) {
        (void)cudaSetDevice(r);
        REQUIRE(cudaFree(bufs[static_cast<std::size_t>(r)]) == cudaSuccess);
    }
    (void)cudaSetDevice(0);
}

TEST_CASE("host graphs: a collective failing at a replay fails that launch; new communicators need a new capture") {
    Fresh fresh;
    REQUIRE(hc::set_device_count(2));
    float* buf[2] = {nullptr, nullptr};
    // One thread captures and launches both ranks' graphs: a launch only enqueues.
    const auto capture = [&](Clique& q) {
        std::vector<cudaGraphExec_t> execs(2);
        for (int r = 0; r < 2; ++r) {
            const auto u = static_cast<std::size_t>(r);
            REQUIRE(cudaSetDevice(r) == cudaSuccess);
            cudaGraph_t graph = nullptr;
            REQUIRE(cudaStreamBeginCapture(q.streams[u], cudaStreamCaptureModeThreadLocal) == cudaSuccess);
            REQUIRE(ncclAllReduce(buf[r], buf[r], elements, ncclFloat32, ncclSum, q.comms[u], q.streams[u]) == ncclSuccess);
            REQUIRE(cudaStreamEndCapture(q.streams[u], &graph) == cudaSuccess);
            REQUIRE(cudaGraphInstantiate(&execs[u], graph, 0) == cudaSuccess);
            REQUIRE(cudaGraphDestroy(graph) == cudaSuccess);  // the executable keeps what it needs
        }
        REQUIRE(cudaSetDevice(0) == cudaSuccess);
        return execs;
    };
    const auto launch = [&](Clique& q, const std::vector<cudaGraphExec_t>& execs) {
        for (int r = 0; r < 2; ++r) {
            REQUIRE(cudaSetDevice(r) == cudaSuccess);
            REQUIRE(cudaGraphLaunch(execs[static_cast<std::size_t>(r)], q.streams[static_cast<std::size_t>(r)]) == cudaSuccess);
        }
        for (int r = 0; r < 2; ++r) {
            REQUIRE(cudaSetDevice(r) == cudaSuccess);
            REQUIRE(cudaStreamSynchronize(q.streams[static_cast<std::size_t>(r)]) == cudaSuccess);  // released, not hung
        }
        REQUIRE(cudaSetDevice(0) == cudaSuccess);
    };
    const auto destroy = [](const std::vector<cudaGraphExec_t>& execs) {
        for (auto e : execs) REQUIRE(cudaGraphExecDestroy(e) == cudaSuccess);
    };
    {
        Clique old(2);
        buf[0] = old.buffer(0, 1.0f), buf[1] = old.buffer(1, 2.0f);
        const auto execs = capture(old);
        launch(old, execs);
        for (int r = 0; r < 2; ++r)
            for (float x : old.read(r, buf[r])) REQUIRE(x == 3.0f);
        hc::fail_nccl(0, 1);  // counted at the replay's enqueue, not at capture
        launch(old, execs);
        ncclResult_t e0 = ncclSuccess, e1 = ncclSuccess;
        REQUIRE(ncclCommGetAsyncError(old.comms[0], &e0) == ncclSuccess);
        REQUIRE(ncclCommGetAsyncError(old.comms[1], &e1) == ncclSuccess);
        CHECK(e0 == ncclSystemError);
        CHECK(e1 == ncclRemoteError);
        for (int r = 0; r < 2; ++r)
            for (float x : old.read(r, buf[r])) REQUIRE(x == 3.0f);  // nothing written by the failed launch
        // The communicators are aborted (a group rebuild), on a thread of their own: NCCL's abort
        // returns once the graphs holding them are destroyed. One launched meanwhile faults.
        std::atomic<int> aborted{0};
        std::thread aborter([&] {
            for (auto comm : old.comms)
                if (ncclCommAbort(comm) == ncclSuccess) ++aborted;
        });
        CHECK(eventually([] {  // the abort waits for the graphs, named by the watchdog's report
            for (const auto& line : hc::nccl_waits())
                if (line.find("ncclCommAbort") != std::string::npos) return true;
            return false;
        }));
        CHECK(aborted.load() == 0);
        REQUIRE(cudaGraphLaunch(execs[0], old.streams[0]) == cudaSuccess);
        CHECK(cudaStreamSynchronize(old.streams[0]) == cudaErrorIllegalAddress);
        hc::reset();
        destroy(execs);
        aborter.join();
        CHECK(aborted.load() == 2);
    }
    Clique fresh_comms(2);
    const auto execs = capture(fresh_comms);  // captured again, on the new communicators
    launch(fresh_comms, execs);
    launch(fresh_comms, execs);
    for (int r = 0; r < 2; ++r)
        for (float x : fresh_comms.read(r, buf[r])) REQUIRE(x == 12.0f);
    destroy(execs);
    for (int r = 0; r < 2; ++r) {
        (void)cudaSetDevice(r);
        REQUIRE(cudaFree(buf[r]) == cudaSuccess);
    }
    (void)cudaSetDevice(0);
}

// NCCL 2.26 and newer: a communicator that a live graph captured is aborted, destroyed or
// finalized only once every such graph is destroyed, and ncclCommAbort blocks its caller meanwhile,
// for a non-blocking communicator too; the watchdog names such a wait.
TEST_CASE("host NCCL: abort, destroy and finalize of a communicator wait for the graphs that captured it") {
    Fresh fresh;
    REQUIRE(hc::set_device_count(2));
    const auto captured_by = [](ncclComm_t comm, cudaStream_t stream, float* buf) {
        cudaGraph_t graph = nullptr;
        cudaGraphExec_t exec = nullptr;
        REQUIRE(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
        REQUIRE(ncclAllReduce(buf, buf, elements, ncclFloat32, ncclSum, comm, stream) == ncclSuccess);
        REQUIRE(cudaStreamEndCapture(stream, &graph) == cudaSuccess);
        REQUIRE(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess);
        REQUIRE(cudaGraphDestroy(graph) == cudaSuccess);  // the executable still holds the communicator
        return exec;
    };
    // Non-blocking communicators, as lockstep makes them.
    ncclUniqueId id;
    REQUIRE(ncclGetUniqueId(&id) == ncclSuccess);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    std::vector<ncclComm_t> comms(2);
    std::vector<cudaStream_t> streams(2);
    REQUIRE(ncclGroupStart() == ncclSuccess);
    for (int r = 0; r < 2; ++r) {
        REQUIRE(cudaSetDevice(r) == cudaSuccess);
        const ncclResult_t res = ncclCommInitRankConfig(&comms[static_cast<std::size_t>(r)], 2, id, r, &config);
        REQUIRE((res == ncclSuccess || res == ncclInProgress));
        REQUIRE(cudaStreamCreateWithFlags(&streams[static_cast<std::size_t>(r)], cudaStreamNonBlocking) == cudaSuccess);
    }
    const ncclResult_t ended = ncclGroupEnd();
    REQUIRE((ended == ncclSuccess || ended == ncclInProgress));
    for (auto c : comms) {
        ncclResult_t state = ncclInProgress;
        while (ncclCommGetAsyncError(c, &state) == ncclSuccess && state == ncclInProgress) std::this_thread::yield();
        REQUIRE(state == ncclSuccess);
    }
    REQUIRE(cudaSetDevice(0) == cudaSuccess);
    float* buf = device_floats(elements);
    cudaGraphExec_t exec = captured_by(comms[0], streams[0], buf);
    std::atomic<bool> returned{false};
    std::thread aborter([&] {
        (void)ncclCommAbort(comms[0]);
        returned = true;
    });
    CHECK(eventually([] {
        for (const auto& line : hc::nccl_waits())
            if (line.find("ncclCommAbort of communicator") != std::string::npos &&
                line.find("1 collective(s) captured in CUDA graphs") != std::string::npos)
                return true;
        return false;
    }));
    CHECK_FALSE(returned.load());
    REQUIRE(cudaGraphExecDestroy(exec) == cudaSuccess);
    aborter.join();
    CHECK(returned.load());
    (void)ncclCommAbort(comms[1]);
    REQUIRE(cudaFree(buf) == cudaSuccess);

    // Blocking communicators: finalize does not complete, nor destroy return, while a graph holds them.
    Clique q(2);
    float* b0 = q.buffer(0, 1.0f);
    REQUIRE(cudaSetDevice(0) == cudaSuccess);
    exec = captured_by(q.comms[0], q.streams[0], b0);
    std::atomic<bool> finalized{false};
    std::thread finalizer([&] {
        (void)ncclGroupStart();  // no Catch2 assertion on this thread
        for (auto c : q.comms) (void)ncclCommFinalize(c);
        (void)ncclGroupEnd();  // blocking: waits for both ranks
        for (auto c : q.comms) (void)ncclCommDestroy(c);
        finalized = true;
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
    CHECK_FALSE(finalized.load());
    REQUIRE(cudaGraphExecDestroy(exec) == cudaSuccess);
    finalizer.join();
    CHECK(finalized.load());
    q.comms.assign(2, nullptr);  // destroyed
    REQUIRE(cudaSetDevice(0) == cudaSuccess);
    REQUIRE(cudaFree(b0) == cudaSuccess);
    for (auto st : streams) {
        (void)cudaStreamSynchronize(st);
        (void)cudaStreamDestroy(st);
    }
}

TEST_CASE("host graphs: a launch on device memory freed since its capture faults") {
    Fresh fresh;
    cudaStream_t s = nullptr;
    REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
    float* a = device_floats(4);
    float* b = device_floats(4);
    REQUIRE(cudaMemsetAsync(a, 0, 16, s) == cudaSuccess);
    cudaGraph_t graph = nullptr;
    REQUIRE(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
    REQUIRE(cudaMemcpyAsync(b, a, 16, cudaMemcpyDeviceToDevice, s) == cudaSuccess);
    REQUIRE(cudaStreamEndCapture(s, &graph) == cudaSuccess);
    cudaGraphExec_t exec = nullptr;
    REQUIRE(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess);
    REQUIRE(cudaGraphLaunch(exec, s) == cudaSuccess);
    REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
    REQUIRE(cudaFree(b) == cudaSuccess);  // the graph still writes it
    REQUIRE(cudaGraphLaunch(exec, s) == cudaSuccess);
    CHECK(cudaStreamSynchronize(s) == cudaErrorIllegalAddress);
    hc::reset();
    REQUIRE(cudaGraphExecDestroy(exec) == cudaSuccess);
    REQUIRE(cudaGraphDestroy(graph) == cudaSuccess);
    REQUIRE(cudaFree(a) == cudaSuccess);
    REQUIRE(cudaStreamDestroy(s) == cudaSuccess);
}
