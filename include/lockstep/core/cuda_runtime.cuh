// SPDX-License-Identifier: MIT
//! CUDA runtime glue: the CUDA check macro, RAII device guard / stream / event, `Allocator<Cuda>`
//! and the copies between host and device memory (graphs: core/cuda_graph.cuh). NCCL and cuBLAS belong to the layers that use
//! them (comm/cuda_group.cuh, kernels/cuda_ops.cuh).
#pragma once

#include <cuda_runtime.h>
#include <nvtx3/nvToolsExt.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "lockstep/core/backend.hpp"
#include "lockstep/core/device_watch.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/tensor.hpp"

namespace lockstep::cuda {
namespace detail {

[[noreturn]] inline void raise(const char* domain, int code, const std::string& code_name, const char* text, const char* expr,
                               const char* file, int line) {
    int device = -1;
    if (cudaGetDevice(&device) != cudaSuccess) device = -1;
    std::string message = std::string(domain) + " error " + std::to_string(code) + " (" + code_name + ": " + text + ") in `" +
                          expr + "` at " + file + ":" + std::to_string(line);
    if (code >= cudaErrorStreamCaptureUnsupported && code <= cudaErrorStreamCaptureWrongThread && std::string(domain) == "CUDA")
        throw CaptureRefused(std::move(message), ::lockstep::detail::replica_rank_slot(), device);
    throw DeviceError(std::move(message), ::lockstep::detail::replica_rank_slot(), device);
}

}  // namespace detail
}  // namespace lockstep::cuda

//! Throws `lockstep::DeviceError` (with rank and device) when a CUDA runtime call fails.
#define LOCKSTEP_CUDA_CHECK(expr)                                                                                     \
    do {                                                                                                              \
        const cudaError_t lockstep_err_ = (expr);                                                                     \
        if (lockstep_err_ != cudaSuccess) [[unlikely]]                                                                \
            ::lockstep::cuda::detail::raise("CUDA", static_cast<int>(lockstep_err_), cudaGetErrorName(lockstep_err_), \
                                            cudaGetErrorString(lockstep_err_), #expr, __FILE__, __LINE__);            \
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

//! Page-locked host memory for batches on their way to a GPU, as `data::LoaderOptions::memory`
//! takes it: `to<Cuda>()` copies from it to the device in one DMA transfer, where a batch in
//! pageable memory is first copied, a chunk at a time, into a staging buffer (`write_from_host`).
//! The function is thread-safe (the loader calls it from its worker thread and batches release
//! their blocks on the caller's). Blocks are pinned once and reused
//! (pinning is slow): a block returns to the function's pool when the last batch holding it is
//! gone, and the pool frees them all when nothing holds the function or a block any more.
inline std::function<std::shared_ptr<void>(std::size_t)> pinned_batch_memory() {
    struct Pool {
        std::mutex mutex;
        std::multimap<std::size_t, void*> free;
        ~Pool() {
            for (auto& [bytes, p] : free) (void)cudaFreeHost(p);
        }
    };
    auto pool = std::make_shared<Pool>();
    return [pool](std::size_t bytes) -> std::shared_ptr<void> {
        bytes = std::max<std::size_t>(bytes, 1);
        void* p = nullptr;
        {
            std::lock_guard lock(pool->mutex);
            if (auto it = pool->free.find(bytes); it != pool->free.end()) {
                p = it->second;
                pool->free.erase(it);
            }
        }
        if (p == nullptr) LOCKSTEP_CUDA_CHECK(cudaHostAlloc(&p, bytes, cudaHostAllocPortable));
        return std::shared_ptr<void>(p, [pool, bytes](void* q) {
            std::lock_guard lock(pool->mutex);
            pool->free.emplace(bytes, q);
        });
    };
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

//! Makes `device` current for the guard's lifetime, as far as it can (never throws: for teardown).
class QuietDeviceGuard {
public:
    explicit QuietDeviceGuard(int device) noexcept {
        switched_ = cudaGetDevice(&previous_) == cudaSuccess && previous_ != device && cudaSetDevice(device) == cudaSuccess;
    }
    QuietDeviceGuard(const QuietDeviceGuard&) = delete;
    QuietDeviceGuard& operator=(const QuietDeviceGuard&) = delete;
    ~QuietDeviceGuard() {
        if (switched_) (void)cudaSetDevice(previous_);
    }

private:
    int previous_ = 0;
    bool switched_ = false;
};

namespace detail {

//! Whether `w` was ever given an owner (expired or not): a stream held by a token.
inline bool has_owner(const std::weak_ptr<const void>& w) noexcept {
    const std::weak_ptr<const void> none;
    return w.owner_before(none) || none.owner_before(w);
}

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

//! An owned, non-blocking CUDA stream on one device (move-only). Its `token()` expires when the
//! stream is destroyed: a thread's current stream and a tensor's allocation stream that name a
//! destroyed stream read as the legacy default stream instead (Note [current stream]).
class Stream {
public:
    Stream() = default;
    explicit Stream(int device) : device_(device) {
        DeviceGuard guard(device);
        LOCKSTEP_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
        alive_ = std::make_shared<int>(device);
    }
    Stream(Stream&& o) noexcept : stream_(std::exchange(o.stream_, nullptr)), device_(o.device_), alive_(std::move(o.alive_)) {}
    Stream& operator=(Stream&& o) noexcept {
        if (this != &o) {
            destroy();
            stream_ = std::exchange(o.stream_, nullptr);
            device_ = o.device_;
            alive_ = std::move(o.alive_);
        }
        return *this;
    }
    ~Stream() { destroy(); }

    cudaStream_t get() const noexcept { return stream_; }
    int device() const noexcept { return device_; }
    //! Expires when this stream is destroyed.
    std::weak_ptr<const void> token() const noexcept { return alive_; }
    void synchronize() const { LOCKSTEP_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

private:
    void destroy() noexcept {
        if (stream_ != nullptr) {
            QuietDeviceGuard guard(device_);
            // Drained with a bound (a stuck device must not hang teardown), then released anyway.
            const auto deadline = std::chrono::steady_clock::now() + std::chrono::minutes(5);
            while (cudaStreamQuery(stream_) == cudaErrorNotReady && std::chrono::steady_clock::now() < deadline)
                std::this_thread::sleep_for(std::chrono::microseconds(50));
            alive_.reset();  // after the drain: a free that reads it as expired has no work to wait for
            (void)cudaStreamDestroy(stream_);
            stream_ = nullptr;
        }
        alive_.reset();
    }
    cudaStream_t stream_ = nullptr;
    int device_ = -1;
    std::shared_ptr<int> alive_;
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
        if (e == cudaSuccess) {
            poll();  // a collective that failed may still have let the event complete
            return;
        }
        if (e != cudaErrorNotReady) LOCKSTEP_CUDA_CHECK(e);
        poll();
        if (std::chrono::steady_clock::now() >= deadline) expired();
        if (spin > 64) std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
}

//! Waits for `event` with a deadline (`poll_event`); throws `Timeout` naming `what` past it.
inline void wait_event(cudaEvent_t event, const char* what, std::chrono::milliseconds timeout = default_wait_timeout()) {
    poll_event(
        event, timeout, [] {},
        [&] {
            throw Timeout(std::string(what) + " did not finish on the device within " + std::to_string(timeout.count()) +
                          " ms (the device is stuck or busy with other work)");
        });
}

//! A replica's host wait for `event` on `device` (`poll_event`), bounded by `waits.timeout()` and
//! consulting the replica's groups meanwhile (an aborted group or an NCCL error ends it). Past the
//! deadline the groups are aborted and `Timeout` is thrown, naming `what` and the option
//! (`timeout_option`) that sets the bound.
inline void wait_watched(cudaEvent_t event, int device, const DeviceWaits& waits, const char* what, const char* timeout_option) {
    poll_event(
        event, waits.timeout(), [&] { waits.poll(); },
        [&] {
            const std::string message = std::string(what) + " on cuda:" + std::to_string(device) + " took longer than " +
                                        std::to_string(waits.timeout().count()) + " ms; a peer replica may be stuck (raise " +
                                        timeout_option + " if the step is legitimately that slow)";
            waits.timed_out(message);
            throw Timeout(message);
        });
}

//! A named NVTX range for the scope's lifetime (Nsight Systems shows it on the calling thread).
//! NVTX initializes itself lazily on first use, unsynchronized: several replica threads opening
//! their first range at once race on its function table, so it is initialized once, first.
class NvtxRange {
public:
    explicit NvtxRange(const char* name) noexcept {
        static std::once_flag initialized;
        std::call_once(initialized, [] { nvtxInitialize(nullptr); });
        nvtxRangePushA(name);
    }
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

// Note [current stream]
// Each thread has a current stream: where new CUDA tensors are allocated and host copies run (a
// replica thread's is its replica's stream; other threads use the legacy default stream). A
// stream set through `StreamGuard(const Stream&)` (ReplicaResources::enter and bind_thread) is
// held by its token, so once that stream is destroyed the thread's current stream reads as the
// legacy default stream again instead of naming a destroyed stream (the first GPU run failed
// every test after one that destroyed a replica's resources this way: cudaErrorContextIsDestroyed).
// Every allocation remembers the stream it was made on and is freed in that stream's order,
// whichever thread frees it (`Allocator<Cuda>`). A copy on another stream (a tensor's copy or
// transfer, Ops<Cuda>::copy) first orders its stream after the allocation's, and is recorded as a
// reader: the free then waits for it too, as PyTorch's record_stream does by hand. Kernels that
// read a tensor on another stream are ordered by whoever starts them (DataParallel's gather:
// parallel/scatter.hpp). The first GPU run's replicas read a prototype the caller had freed, and
// copied a batch the caller's stream had not finished writing: both were such cross-stream uses.

namespace detail {
struct CurrentStream {
    cudaStream_t stream = nullptr;
    int device = -1;                  // the stream's device (-1: the legacy stream of any device)
    std::weak_ptr<const void> owner;  // empty for a stream the caller owns (StreamGuard(cudaStream_t))
    bool owned = false;
};
inline CurrentStream& current_stream_slot() noexcept {
    thread_local CurrentStream slot;
    return slot;
}
}  // namespace detail

//! The calling thread's current stream (Note [current stream]): the legacy default stream when
//! none was set, or when the stream that was set has been destroyed since.
inline cudaStream_t current_stream() noexcept {
    auto& slot = detail::current_stream_slot();
    if (slot.owned && slot.owner.expired()) slot = {};
    return slot.stream;
}

//! Makes a stream the calling thread's current stream for the guard's lifetime, then restores the
//! previous one (Note [current stream]).
class StreamGuard {
public:
    //! A stream of `device` that the caller keeps alive while the guard lives (or nullptr: the
    //! legacy stream).
    //! When `s` is already current and owned, it stays held by its owner's token.
    StreamGuard(cudaStream_t s, int device) noexcept : previous_(detail::current_stream_slot()) {
        auto& slot = detail::current_stream_slot();
        if (!(slot.stream == s && slot.device == device && s != nullptr)) slot = detail::CurrentStream{s, device, {}, false};
    }
    //! A stream held by `owner` (a replica's, from its execution: Execution<Cuda>::stream_owner).
    StreamGuard(cudaStream_t s, int device, std::weak_ptr<const void> owner) noexcept
        : previous_(
              std::exchange(detail::current_stream_slot(), detail::CurrentStream{s, device, owner, detail::has_owner(owner)})) {}
    //! An owned stream: should it be destroyed while the guard lives, the thread's current stream
    //! reads as the legacy stream.
    explicit StreamGuard(const Stream& s) noexcept
        : previous_(std::exchange(detail::current_stream_slot(), detail::CurrentStream{s.get(), s.device(), s.token(), true})) {}
    StreamGuard(const StreamGuard&) = delete;
    StreamGuard& operator=(const StreamGuard&) = delete;
    ~StreamGuard() { detail::current_stream_slot() = std::move(previous_); }

    //! Makes `s` the calling thread's current stream for the rest of the thread's life (a replica
    //! thread that works for one replica only); it reads as the legacy stream once `s` is destroyed.
    static void bind_thread(const Stream& s) noexcept {
        detail::current_stream_slot() = detail::CurrentStream{s.get(), s.device(), s.token(), true};
    }

private:
    detail::CurrentStream previous_;
};

namespace detail {

//! A pinned host buffer of the calling thread that device-to-host reads land in: a copy into
//! pageable memory returns only when the stream has drained (NCCL kernels included), so a dead
//! peer would hang it past any deadline; a copy into pinned memory returns at once and its
//! completion is polled against a deadline.
class PinnedStaging {
public:
    PinnedStaging() = default;
    PinnedStaging(const PinnedStaging&) = delete;
    PinnedStaging& operator=(const PinnedStaging&) = delete;
    ~PinnedStaging() {
        if (block_ != nullptr) (void)cudaFreeHost(block_);
    }
    //! At least `bytes` of pinned memory (the largest asked for so far).
    void* get(std::size_t bytes) {
        if (bytes > capacity_) {
            if (block_ != nullptr) (void)cudaFreeHost(block_);
            block_ = nullptr;
            capacity_ = 0;
            const std::size_t want = std::max<std::size_t>(bytes, 4096);
            LOCKSTEP_CUDA_CHECK(cudaHostAlloc(&block_, want, cudaHostAllocPortable));
            capacity_ = want;
        }
        return block_;
    }
    //! A read that did not finish in time may still write into the buffer: it is left to that
    //! copy (never freed, never reused) and the next read gets a new one.
    void abandon() noexcept {
        block_ = nullptr;
        capacity_ = 0;
    }

private:
    void* block_ = nullptr;
    std::size_t capacity_ = 0;
};

inline PinnedStaging& pinned_staging() {
    thread_local PinnedStaging staging;
    return staging;
}

//! Bytes a read stages at a time.
inline constexpr std::size_t staging_chunk = std::size_t{8} << 20;

}  // namespace detail

//! A replica's pinned host block that its captured steps copy their scalars into, at the end of
//! graph (a) (Note [captured steps] in parallel/step.hpp). A graph holds the block's address, so
//! the block is never freed under one: a larger one is a new block (a new graph key), and every
//! block lives as long as its owner, the replica's resources, which free it after the stream's
//! last work.
class PinnedScalars {
public:
    PinnedScalars() = default;
    PinnedScalars(const PinnedScalars&) = delete;
    PinnedScalars& operator=(const PinnedScalars&) = delete;
    ~PinnedScalars() {
        for (double* b : blocks_) (void)cudaFreeHost(b);
    }
    //! Room for at least `n` values; a new block (at least twice the last) when the last is smaller.
    void reserve(std::size_t n) {
        if (n <= capacity_) return;
        const std::size_t want = std::max({n, 2 * capacity_, std::size_t{64}});
        void* block = nullptr;
        LOCKSTEP_CUDA_CHECK(cudaHostAlloc(&block, want * sizeof(double), cudaHostAllocPortable));
        blocks_.push_back(static_cast<double*>(block));
        capacity_ = want;
    }
    //! The block graphs copy into now (null before the first reserve).
    double* data() const noexcept { return blocks_.empty() ? nullptr : blocks_.back(); }
    std::size_t capacity() const noexcept { return capacity_; }
    //! After a wait for the stream that did not end: a copy may still land in the blocks, so
    //! they are left to it (never freed).
    void abandon() noexcept {
        blocks_.clear();
        capacity_ = 0;
    }

private:
    std::vector<double*> blocks_;
    std::size_t capacity_ = 0;
};

namespace detail {
//! A copy between host memory (pageable or not) and device memory, `kind` saying which way,
//! through the thread's pinned staging buffer a chunk at a time, calling `wait()` after each
//! chunk's copy (it records and polls an event against a deadline, and throws past it): a copy
//! with pageable memory may block in the driver until its stream drains, without bound when a
//! kernel before it hangs; one with pinned memory returns at once. A chunk's wait also keeps the
//! buffer from being refilled before the copy has read it.
template <class Wait>
void staged_copy(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind, cudaStream_t stream, Wait&& wait) {
    const bool upload = kind == cudaMemcpyHostToDevice;
    auto& staging = pinned_staging();
    for (std::size_t at = 0; at < bytes; at += staging_chunk) {
        const std::size_t n = std::min(staging_chunk, bytes - at);
        void* pinned = staging.get(n);
        if (upload) std::memcpy(pinned, static_cast<const char*>(src) + at, n);
        LOCKSTEP_CUDA_CHECK(cudaMemcpyAsync(upload ? static_cast<char*>(dst) + at : pinned,
                                            upload ? pinned : static_cast<const char*>(src) + at, n, kind, stream));
        try {
            wait();
        } catch (...) {
            staging.abandon();
            throw;
        }
        if (!upload) std::memcpy(static_cast<char*>(dst) + at, pinned, n);
    }
}
}  // namespace detail

//! Copies `bytes` of device memory at `src` to host memory at `dst` (pageable or not) on
//! `stream`, through pinned staging with a bounded wait per chunk (detail::staged_copy).
template <class Wait>
void read_to_host(void* dst, const void* src, std::size_t bytes, cudaStream_t stream, Wait&& wait) {
    detail::staged_copy(dst, src, bytes, cudaMemcpyDeviceToHost, stream, std::forward<Wait>(wait));
}

//! Whether `p` is page-locked host memory (cudaHostAlloc, cudaMallocHost, cudaHostRegister).
inline bool is_page_locked(const void* p) noexcept {
    cudaPointerAttributes a{};
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
        (void)cudaGetLastError();
        return false;
    }
    return a.type == cudaMemoryTypeHost;
}

//! Copies `bytes` of host memory at `src` to device memory at `dst` on `stream`: from page-locked
//! memory in one copy straight from it (a batch of `pinned_batch_memory`), from pageable memory
//! through pinned staging (detail::staged_copy); a bounded wait after each copy either way, so
//! that `src` may be reused when this returns.
template <class Wait>
void write_from_host(void* dst, const void* src, std::size_t bytes, cudaStream_t stream, Wait&& wait) {
    if (is_page_locked(src)) {
        LOCKSTEP_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream));
        wait();
        return;
    }
    detail::staged_copy(dst, src, bytes, cudaMemcpyHostToDevice, stream, std::forward<Wait>(wait));
}

//! Makes `waiter` wait (on the device) for the work enqueued on `producer` so far; a no-op when
//! they are one stream. The host does not wait.
inline void order_after(cudaStream_t waiter, int waiter_device, cudaStream_t producer, int producer_device) {
    if (waiter == producer && waiter_device == producer_device) return;
    cudaEvent_t event = nullptr;
    DeviceGuard guard(producer_device);
    LOCKSTEP_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    struct Release {
        cudaEvent_t e;
        ~Release() { (void)cudaEventDestroy(e); }  // the wait below is already enqueued
    } release{event};
    LOCKSTEP_CUDA_CHECK(cudaEventRecord(event, producer));
    if (waiter_device != producer_device) LOCKSTEP_CUDA_CHECK(cudaSetDevice(waiter_device));
    LOCKSTEP_CUDA_CHECK(cudaStreamWaitEvent(waiter, event, 0));
}

}  // namespace lockstep::cuda

namespace lockstep::cuda::detail {

//! The stream each live device allocation was made on (Note [current stream]), so that it is
//! freed in that stream's order whichever thread frees it, and host copies of it wait for it.
class AllocationStreams {
public:
    //! A stream, held by its owner's token where it has one.
    struct StreamRef {
        cudaStream_t stream = nullptr;
        int device = -1;
        std::weak_ptr<const void> owner;
        bool owned = false;
        //! The stream, or the legacy stream when the owning stream has been destroyed (whose work
        //! was drained before it was: cuda::Stream and ReplicaResources wait for it).
        cudaStream_t live() const noexcept { return owned && owner.expired() ? nullptr : stream; }
        bool expired() const noexcept { return owned && owner.expired(); }
        bool same(const StreamRef& o) const noexcept {
            return !expired() && !o.expired() && stream == o.stream && device == o.device;
        }
    };
    struct Entry : StreamRef {
        std::vector<StreamRef> readers;  // other streams that copied from it (record_stream, implicitly)
    };
    static AllocationStreams& instance() {
        static AllocationStreams* table = new AllocationStreams;  // outlives every static tensor
        return *table;
    }
    void add(void* p, Entry e) {
        std::lock_guard lock(mutex_);
        entries_[p] = std::move(e);
    }
    std::optional<Entry> take(void* p) {
        std::lock_guard lock(mutex_);
        const auto it = entries_.find(p);
        if (it == entries_.end()) return std::nullopt;
        Entry e = std::move(it->second);
        entries_.erase(it);
        return e;
    }
    //! Orders `stream` after the allocation at `p`'s stream and records `stream` as a reader, so
    //! that the allocation's free waits for it too (a tensor copied by another stream, then freed).
    void use_on(const void* p, const StreamRef& stream) {
        StreamRef producer;
        {
            std::lock_guard lock(mutex_);
            const auto it = entries_.find(const_cast<void*>(p));
            if (it == entries_.end() || it->second.same(stream)) return;
            producer = it->second;
            auto& readers = it->second.readers;
            std::erase_if(readers, [](const StreamRef& r) { return r.expired(); });  // drained when destroyed
            const bool known = std::any_of(readers.begin(), readers.end(), [&](const StreamRef& r) { return r.same(stream); });
            if (!known) readers.push_back(stream);
        }
        order_after(stream.live(), stream.device, producer.live(), producer.device);
    }

private:
    mutable std::mutex mutex_;
    std::unordered_map<void*, Entry> entries_;
};

//! The calling thread's current stream when it is of `device`, else `device`'s legacy stream,
//! with the token of its owner.
inline AllocationStreams::StreamRef stream_on(int device) noexcept {
    (void)current_stream();  // drops a stream that was destroyed
    const auto& slot = current_stream_slot();
    if (slot.stream == nullptr || slot.device != device) return {nullptr, device, {}, false};
    return {slot.stream, device, slot.owner, slot.owned};
}

//! Orders `stream` after the work of the streams the given device pointers were allocated on,
//! and makes their frees wait for `stream` (pointers that are not the start of an allocation, or
//! null, are skipped): a tensor may be copied on one stream and freed on another.
inline void after_allocations(const AllocationStreams::StreamRef& stream, std::initializer_list<const void*> pointers) {
    for (const void* p : pointers)
        if (p != nullptr) AllocationStreams::instance().use_on(p, stream);
}

}  // namespace lockstep::cuda::detail

namespace lockstep::detail {

//! Device memory through the stream-ordered allocator on the calling thread's current stream,
//! freed on that same stream (Note [current stream]).
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
        // The current stream when it is of this device, else the device's legacy stream.
        cuda::detail::AllocationStreams::Entry entry;
        static_cast<cuda::detail::AllocationStreams::StreamRef&>(entry) = cuda::detail::stream_on(device.index);
        const cudaStream_t stream = entry.stream;
        void* p = nullptr;
        const cudaError_t e = cudaMallocAsync(&p, bytes, stream);
        if (e == cudaErrorMemoryAllocation) {
            (void)cudaGetLastError();
            std::size_t free = 0, total = 0;
            (void)cudaMemGetInfo(&free, &total);
            throw OutOfMemory("out of memory on cuda:" + std::to_string(device.index) + ": asked for " + std::to_string(bytes) +
                                  " bytes, " + std::to_string(free) + " of " + std::to_string(total) +
                                  " bytes free; use a smaller batch or fewer replicas per GPU",
                              ::lockstep::detail::replica_rank_slot(), device.index);
        }
        LOCKSTEP_CUDA_CHECK(e);
        try {
            cuda::detail::AllocationStreams::instance().add(p, std::move(entry));
        } catch (...) {
            (void)cudaFreeAsync(p, stream);
            throw;
        }
        return p;
    }
    //! Freed on the stream it was allocated on, in that stream's order, whichever thread frees it,
    //! after the work of every other stream that copied from it (Note [current stream]).
    static void deallocate(void* p, std::size_t, Device device) noexcept {
        if (p == nullptr) return;
        const auto entry = cuda::detail::AllocationStreams::instance().take(p);
        int previous = 0;
        if (cudaGetDevice(&previous) != cudaSuccess) return;
        if (previous != device.index) (void)cudaSetDevice(device.index);
        const cudaStream_t stream = entry ? entry->live() : nullptr;
        if (entry)
            for (const auto& reader : entry->readers) {
                if (reader.owned && reader.owner.expired()) continue;  // drained before it was destroyed
                try {
                    cuda::order_after(stream, device.index, reader.live(), reader.device);
                } catch (...) {  // a failed device: the free below fails alike, and is ignored
                }
            }
        // A free CUDA refuses (in a capture, of memory made outside it: the capture is broken and
        // says so at its end) leaves no error behind for the thread's next launch to report.
        if (cudaFreeAsync(p, stream) != cudaSuccess) (void)cudaGetLastError();
        if (previous != device.index) (void)cudaSetDevice(previous);
    }
    // A copy or zero-fill runs on the calling thread's current stream, after the work of the
    // streams its operands were allocated on (for a tensor's constructor: the same stream).
    static void copy(void* dst, const void* src, std::size_t bytes, Device device) {
        if (bytes == 0) return;
        cuda::DeviceGuard guard(device.index);
        const auto stream = cuda::detail::stream_on(device.index);
        cuda::detail::after_allocations(stream, {dst, src});
        LOCKSTEP_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream.stream));
    }
    static void fill_zero(void* dst, std::size_t bytes, Device device) {
        if (bytes == 0) return;
        cuda::DeviceGuard guard(device.index);
        const auto stream = cuda::detail::stream_on(device.index);
        cuda::detail::after_allocations(stream, {dst});
        LOCKSTEP_CUDA_CHECK(cudaMemsetAsync(dst, 0, bytes, stream.stream));
    }
};

// Copies between backends run on the calling thread's current stream (after the work of the
// streams the device operands were allocated on) and are complete on return; host memory is
// read and written through pinned staging with polled, bounded waits (a pageable copy may block
// in the driver behind a hung kernel).
inline void transfer(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind, int device, const void* device_src,
                     const void* device_dst) {
    if (bytes == 0) return;
    cuda::DeviceGuard guard(device);
    const auto ref = cuda::detail::stream_on(device);
    cuda::detail::after_allocations(ref, {device_src, device_dst});
    const cudaStream_t stream = ref.stream;
    const char* what = "a copy between the host and a GPU, or between GPUs";
    if (kind == cudaMemcpyDeviceToHost) {
        cuda::read_to_host(dst, src, bytes, stream, [&] { cuda::wait_stream(stream, what); });
        return;
    }
    if (kind == cudaMemcpyHostToDevice) {
        cuda::write_from_host(dst, src, bytes, stream, [&] { cuda::wait_stream(stream, what); });
        return;
    }
    LOCKSTEP_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, kind, stream));
    cuda::wait_stream(stream, what);
}

template <>
struct Transfer<Host, Cuda> {
    static void copy(void* dst, Device to, const void* src, Device, std::size_t bytes) {
        transfer(dst, src, bytes, cudaMemcpyHostToDevice, to.index, nullptr, dst);
    }
};
template <>
struct Transfer<Cuda, Host> {
    static void copy(void* dst, Device, const void* src, Device from, std::size_t bytes) {
        transfer(dst, src, bytes, cudaMemcpyDeviceToHost, from.index, src, nullptr);
    }
};
template <>
struct Transfer<Cuda, Cuda> {
    // Unified addressing lets one copy cross devices; it runs on the destination's stream.
    static void copy(void* dst, Device to, const void* src, Device, std::size_t bytes) {
        transfer(dst, src, bytes, cudaMemcpyDefault, to.index, src, dst);
    }
};

}  // namespace lockstep::detail
