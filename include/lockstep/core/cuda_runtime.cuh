// SPDX-License-Identifier: MIT
//! CUDA runtime glue: the CUDA check macro, RAII device guard / stream / event, `Allocator<Cuda>`
//! and the copies between host and device memory. NCCL and cuBLAS belong to the layers that use
//! them (comm/cuda_group.cuh, kernels/cuda_ops.cuh).
#pragma once

#include <cuda_runtime.h>
#include <nvtx3/nvToolsExt.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>
#include <string>
#include <thread>
#include <utility>

#include "lockstep/core/backend.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/tensor.hpp"

namespace lockstep::cuda {
namespace detail {

[[noreturn]] inline void raise(const char* domain, int code, const std::string& code_name, const char* text,
                               const char* expr, const char* file, int line) {
    int device = -1;
    if (cudaGetDevice(&device) != cudaSuccess) device = -1;
    throw DeviceError(std::string(domain) + " error " + std::to_string(code) + " (" + code_name + ": " + text +
                          ") in `" + expr + "` at " + file + ":" + std::to_string(line),
                      ::lockstep::detail::replica_rank_slot(), device);
}

}  // namespace detail
}  // namespace lockstep::cuda

//! Throws `lockstep::DeviceError` (with rank and device) when a CUDA runtime call fails.
#define LOCKSTEP_CUDA_CHECK(expr)                                                                   \
    do {                                                                                              \
        const cudaError_t lockstep_err_ = (expr);                                                     \
        if (lockstep_err_ != cudaSuccess) [[unlikely]]                                                \
            ::lockstep::cuda::detail::raise("CUDA", static_cast<int>(lockstep_err_),                 \
                                            cudaGetErrorName(lockstep_err_),                          \
                                            cudaGetErrorString(lockstep_err_), #expr, __FILE__, __LINE__); \
    } while (0)

namespace lockstep::cuda {

//! Number of usable CUDA devices. No driver, no device or a driver older than the runtime all
//! mean "no GPU" (0), never an error: host-only machines run the host backend.
inline int device_count() noexcept {
    int n = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();  // clear the sticky error so later calls start clean
        return 0;
    }
    return n;
}

//! Makes `device` current for the guard's lifetime and restores the previous one after.
class DeviceGuard {
public:
    explicit DeviceGuard(int device) {
        LOCKSTEP_CUDA_CHECK(cudaGetDevice(&previous_));
        if (device != previous_) LOCKSTEP_CUDA_CHECK(cudaSetDevice(device));
    }
    DeviceGuard(const DeviceGuard&) = delete;
    DeviceGuard& operator=(const DeviceGuard&) = delete;
    ~DeviceGuard() { (void)cudaSetDevice(previous_); }

private:
    int previous_ = 0;
};

namespace detail {

//! Bytes the stream-ordered pool of a device keeps cached after a free instead of returning them
//! to the driver: all of it, so a training step's allocations are served from the pool after the
//! first step (the default threshold of 0 would give memory back at every synchronization).
inline constexpr std::uint64_t pool_release_threshold = UINT64_MAX;

//! Sets the release threshold of `device`'s default memory pool, once per device and process.
inline void configure_pool(int device) {
    static std::mutex mutex;
    static std::vector<bool> done;
    std::lock_guard lock(mutex);
    if (device < static_cast<int>(done.size()) && done[static_cast<std::size_t>(device)]) return;
    cudaMemPool_t pool = nullptr;
    LOCKSTEP_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, device));
    std::uint64_t threshold = pool_release_threshold;
    LOCKSTEP_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold));
    if (device >= static_cast<int>(done.size())) done.resize(static_cast<std::size_t>(device) + 1, false);
    done[static_cast<std::size_t>(device)] = true;
}

}  // namespace detail

//! An owned, non-blocking CUDA stream on one device (move-only).
class Stream {
public:
    Stream() = default;
    explicit Stream(int device) : device_(device) {
        DeviceGuard guard(device);
        LOCKSTEP_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    }
    Stream(Stream&& o) noexcept : stream_(std::exchange(o.stream_, nullptr)), device_(o.device_) {}
    Stream& operator=(Stream&& o) noexcept {
        if (this != &o) {
            destroy();
            stream_ = std::exchange(o.stream_, nullptr);
            device_ = o.device_;
        }
        return *this;
    }
    ~Stream() { destroy(); }

    cudaStream_t get() const noexcept { return stream_; }
    int device() const noexcept { return device_; }
    void synchronize() const { LOCKSTEP_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

private:
    void destroy() noexcept {
        if (stream_ != nullptr) {
            (void)cudaStreamSynchronize(stream_);
            (void)cudaStreamDestroy(stream_);
            stream_ = nullptr;
        }
    }
    cudaStream_t stream_ = nullptr;
    int device_ = -1;
};

//! An owned CUDA event without timing (move-only), to order work between streams.
class Event {
public:
    Event() { LOCKSTEP_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming)); }
    //! No event yet (one is moved in later).
    explicit Event(std::nullptr_t) noexcept {}
    Event(Event&& o) noexcept : event_(std::exchange(o.event_, nullptr)) {}
    Event& operator=(Event&& o) noexcept {
        if (this != &o) {
            if (event_ != nullptr) (void)cudaEventDestroy(event_);
            event_ = std::exchange(o.event_, nullptr);
        }
        return *this;
    }
    ~Event() {
        if (event_ != nullptr) (void)cudaEventDestroy(event_);
    }
    void record(cudaStream_t s) { LOCKSTEP_CUDA_CHECK(cudaEventRecord(event_, s)); }
    void wait_on(cudaStream_t s) const { LOCKSTEP_CUDA_CHECK(cudaStreamWaitEvent(s, event_, 0)); }
    void synchronize() const { LOCKSTEP_CUDA_CHECK(cudaEventSynchronize(event_)); }
    cudaEvent_t get() const noexcept { return event_; }

private:
    cudaEvent_t event_ = nullptr;
};

//! How long a host wait on the device may last where no replica group says (a DataParallel
//! replica's step waits through Ops<Cuda>::wait, with its group's timeout).
inline std::chrono::milliseconds& default_wait_timeout() noexcept {
    static std::chrono::milliseconds t{std::chrono::minutes(5)};
    return t;
}

//! The one way the host waits for the device: polls `event` until it completes, calling `poll()`
//! each round (it may throw, ending the wait), and `expired()` (which must throw) once `timeout`
//! has passed. Never an unbounded cudaEventSynchronize.
template <class Poll, class Expired>
void poll_event(cudaEvent_t event, std::chrono::milliseconds timeout, Poll&& poll, Expired&& expired) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (std::uint64_t spin = 0;; ++spin) {
        const cudaError_t e = cudaEventQuery(event);
        if (e == cudaSuccess) return;
        if (e != cudaErrorNotReady) LOCKSTEP_CUDA_CHECK(e);
        poll();
        if (std::chrono::steady_clock::now() >= deadline) expired();
        if (spin > 64) std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
}

//! Waits for `event` with a deadline (`poll_event`); throws `Timeout` naming `what` past it.
inline void wait_event(cudaEvent_t event, const char* what, std::chrono::milliseconds timeout = default_wait_timeout()) {
    poll_event(event, timeout, [] {}, [&] {
        throw Timeout(std::string(what) + " did not finish on the device within " + std::to_string(timeout.count()) +
                      " ms (the device is stuck or busy with other work)");
    });
}

//! A named NVTX range for the scope's lifetime (Nsight Systems shows it on the calling thread).
class NvtxRange {
public:
    explicit NvtxRange(const char* name) noexcept { nvtxRangePushA(name); }
    NvtxRange(const NvtxRange&) = delete;
    NvtxRange& operator=(const NvtxRange&) = delete;
    ~NvtxRange() { nvtxRangePop(); }
};

//! Waits for everything enqueued on `stream` so far, with a deadline (see `wait_event`).
inline void wait_stream(cudaStream_t stream, const char* what, std::chrono::milliseconds timeout = default_wait_timeout()) {
    cudaEvent_t event = nullptr;
    LOCKSTEP_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    struct Release {
        cudaEvent_t e;
        ~Release() { (void)cudaEventDestroy(e); }
    } release{event};
    LOCKSTEP_CUDA_CHECK(cudaEventRecord(event, stream));
    wait_event(event, what, timeout);
}

//! The stream a replica thread allocates and launches on. Each replica thread sets it once
//! (DataParallel does); threads that never set it use the legacy default stream.
inline cudaStream_t& current_stream() noexcept {
    thread_local cudaStream_t stream = nullptr;
    return stream;
}

//! Makes `s` the calling thread's current stream for the guard's lifetime.
class StreamGuard {
public:
    explicit StreamGuard(cudaStream_t s) noexcept : previous_(std::exchange(current_stream(), s)) {}
    StreamGuard(const StreamGuard&) = delete;
    StreamGuard& operator=(const StreamGuard&) = delete;
    ~StreamGuard() { current_stream() = previous_; }

private:
    cudaStream_t previous_;
};

}  // namespace lockstep::cuda

namespace lockstep::detail {

//! Device memory through the stream-ordered allocator on the calling thread's current stream.
template <>
struct Allocator<Cuda> {
    //! The calling thread's current CUDA device (a replica thread's is its replica's).
    static Device current_device() {
        int device = 0;
        LOCKSTEP_CUDA_CHECK(cudaGetDevice(&device));
        return Device::cuda(device);
    }
    static void* allocate(std::size_t bytes, Device device) {
        if (bytes == 0) return nullptr;
        cuda::DeviceGuard guard(device.index);
        cuda::detail::configure_pool(device.index);
        void* p = nullptr;
        const cudaError_t e = cudaMallocAsync(&p, bytes, cuda::current_stream());
        if (e == cudaErrorMemoryAllocation) {
            (void)cudaGetLastError();
            std::size_t free = 0, total = 0;
            (void)cudaMemGetInfo(&free, &total);
            throw OutOfMemory("out of memory on cuda:" + std::to_string(device.index) + ": asked for " +
                                  std::to_string(bytes) + " bytes, " + std::to_string(free) + " of " +
                                  std::to_string(total) + " bytes free; use a smaller batch or fewer replicas per GPU",
                              ::lockstep::detail::replica_rank_slot(), device.index);
        }
        LOCKSTEP_CUDA_CHECK(e);
        return p;
    }
    // Freed on the calling thread's current stream, which for a tensor of a replica is the
    // replica's stream it was allocated on (tensors do not cross replicas). Never the legacy
    // default stream when a stream is set.
    static void deallocate(void* p, std::size_t, Device device) noexcept {
        if (p == nullptr) return;
        int previous = 0;
        if (cudaGetDevice(&previous) != cudaSuccess) return;
        if (previous != device.index) (void)cudaSetDevice(device.index);
        (void)cudaFreeAsync(p, cuda::current_stream());
        if (previous != device.index) (void)cudaSetDevice(previous);
    }
    static void copy(void* dst, const void* src, std::size_t bytes, Device device) {
        if (bytes == 0) return;
        cuda::DeviceGuard guard(device.index);
        LOCKSTEP_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, cuda::current_stream()));
    }
    static void fill_zero(void* dst, std::size_t bytes, Device device) {
        if (bytes == 0) return;
        cuda::DeviceGuard guard(device.index);
        LOCKSTEP_CUDA_CHECK(cudaMemsetAsync(dst, 0, bytes, cuda::current_stream()));
    }
};

}  // namespace lockstep::detail

namespace lockstep::detail {

// Copies between backends run on the calling thread's current stream and are complete on return.
inline void transfer(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind, int device) {
    if (bytes == 0) return;
    cuda::DeviceGuard guard(device);
    LOCKSTEP_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, kind, cuda::current_stream()));
    cuda::wait_stream(cuda::current_stream(), "a copy between the host and a GPU, or between GPUs");
}

template <>
struct Transfer<Host, Cuda> {
    static void copy(void* dst, Device to, const void* src, Device, std::size_t bytes) {
        transfer(dst, src, bytes, cudaMemcpyHostToDevice, to.index);
    }
};
template <>
struct Transfer<Cuda, Host> {
    static void copy(void* dst, Device, const void* src, Device from, std::size_t bytes) {
        transfer(dst, src, bytes, cudaMemcpyDeviceToHost, from.index);
    }
};
template <>
struct Transfer<Cuda, Cuda> {
    // Unified addressing lets one copy cross devices; it runs on the destination's stream.
    static void copy(void* dst, Device to, const void* src, Device, std::size_t bytes) {
        transfer(dst, src, bytes, cudaMemcpyDefault, to.index);
    }
};

}  // namespace lockstep::detail
