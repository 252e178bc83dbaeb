// SPDX-License-Identifier: MIT
//! `comm::NcclCalls`, the NCCL and CUDA runtime calls of a stream group of CUDA replicas with no
//! lockstep kernel in them, so that a host compiler builds them for a real GPU (the torch
//! component's gradient group: Note [libtorch NCCL buckets] in torch/nccl_group.hpp), and the NCCL
//! check macro. `comm::NcclApi` (cuda_group.cuh) adds the kernels.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "lockstep/comm/collectives.hpp"
#include "lockstep/core/cuda_runtime.cuh"
#include "lockstep/core/device_watch.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/kernels/cuda_execution.cuh"

//! Throws `lockstep::DeviceError` when an NCCL call fails, with NCCL's own error string.
#define LOCKSTEP_NCCL_CHECK(expr)                                                                          \
    do {                                                                                                   \
        const ncclResult_t lockstep_res_ = (expr);                                                         \
        if (lockstep_res_ != ncclSuccess) [[unlikely]]                                                     \
            ::lockstep::cuda::detail::raise("NCCL", static_cast<int>(lockstep_res_), "ncclResult_t",       \
                                            ncclGetErrorString(lockstep_res_), #expr, __FILE__, __LINE__); \
    } while (0)

namespace lockstep::comm {

namespace detail {
inline std::once_flag& nccl_environment_once() noexcept {
    static std::once_flag once;
    return once;
}
}  // namespace detail

//! The NCCL and CUDA runtime calls of a group of CUDA replicas, one per GPU (most of the `Api` of
//! `StreamGroup`): NCCL communicators (blocking or not: Note [blocking communicators]) polled
//! against deadlines, CUDA streams and events. No lockstep kernel: `NcclApi` adds the rank-order
//! kernel of replicas that share a GPU. `Api`, the derived Api, may replace prepare_nccl().
template <class Api>
struct NcclCalls {
    using backend = Cuda;
    using Stream = cudaStream_t;
    using Event = cudaEvent_t;
    using Comm = ncclComm_t;
    using clock = std::chrono::steady_clock;

    static int device_count() { return cuda::device_count(); }

    static Stream compute_stream(const Execution<Cuda>& ex, int device) {
        LOCKSTEP_CHECK_AS(DeviceMismatch, ex.device == device && ex.stream != nullptr, "a replica of cuda:", device,
                          " bound an execution context of cuda:", ex.device, ex.stream == nullptr ? " without a stream" : "",
                          "; bind each replica's own resources (kernels::Ops<Cuda>::ReplicaResources)");
        return ex.stream;
    }

    static void watch(Execution<Cuda>& ex, DeviceWatch* w, std::chrono::milliseconds timeout) { ex.waits.watch(w, timeout); }

    //! A non-blocking stream on `device`, the group's communication stream there.
    static Stream make_stream(int device) {
        cuda::DeviceGuard guard(device);
        Stream s = nullptr;
        LOCKSTEP_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
        return s;
    }
    //! What expires with a replica's compute stream (Note [current stream]); empty for a stream
    //! its owner keeps alive otherwise.
    using StreamToken = std::weak_ptr<const void>;
    static StreamToken stream_token(const Execution<Cuda>& ex) { return ex.stream_owner; }

    //! Whether everything enqueued on `s` so far has run by `deadline` (polled); a stream whose
    //! token expired was destroyed, after its work drained, and is not touched.
    static bool idle(int device, Stream s, const StreamToken& token, clock::time_point deadline) noexcept {
        if (s == nullptr || (cuda::detail::has_owner(token) && token.expired())) return true;
        return drained(device, s, deadline);
    }
    static void destroy_stream(int device, Stream s, clock::time_point deadline) noexcept {
        if (s == nullptr) return;
        cuda::DeviceGuard guard(device);
        while (cudaStreamQuery(s) == cudaErrorNotReady && clock::now() < deadline) std::this_thread::yield();
        (void)cudaGetLastError();
        (void)cudaStreamDestroy(s);
    }
    static Event make_event(int device) {
        cuda::DeviceGuard guard(device);
        Event e = nullptr;
        LOCKSTEP_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
        return e;
    }
    static void destroy_event(int device, Event e) noexcept {
        if (e == nullptr) return;
        cuda::DeviceGuard guard(device);
        (void)cudaEventDestroy(e);
    }
    static void record(Event e, Stream s) { LOCKSTEP_CUDA_CHECK(cudaEventRecord(e, s)); }
    static void wait(Stream s, Event e) { LOCKSTEP_CUDA_CHECK(cudaStreamWaitEvent(s, e, 0)); }

    static ncclDataType_t nccl_type(DType t) {
        switch (t) {
            case DType::f32: return ncclFloat32;
            case DType::f64: return ncclFloat64;
            case DType::i64: return ncclInt64;
            case DType::f16: return ncclFloat16;
            case DType::bf16: return ncclBfloat16;
            default: throw UsageError("NCCL collectives take float, double or int64 buffers");
        }
    }

    //! The GPU's identity across processes (NCCL refuses one GPU in two ranks of a
    //! communicator): a hash of its UUID below 2^52, so that it travels exactly as a double,
    //! whatever number each process gives the GPU (CUDA_VISIBLE_DEVICES).
    static std::uint64_t device_key(int device) {
        cudaDeviceProp prop{};
        LOCKSTEP_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
        std::uint64_t h = 1469598103934665603ull;  // FNV-1a
        for (const char c : prop.uuid.bytes) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
        return h & ((std::uint64_t{1} << 52) - 1);
    }

    using UniqueId = ncclUniqueId;
    static UniqueId unique_id() {
        Api::prepare_nccl();  // before NCCL initializes (Note [two communicators on one device])
        UniqueId id;
        LOCKSTEP_NCCL_CHECK(ncclGetUniqueId(&id));
        return id;
    }

    // Note [blocking communicators]
    // A non-blocking communicator (ncclConfig_t::blocking = 0) returns from every call at once and
    // says when the work is done through ncclCommGetAsyncError, which lockstep polls against its
    // deadlines: its init can wait for other processes without hanging. But NCCL 2.28 launches each
    // (implicitly grouped) call of a non-blocking communicator on an OS thread it starts for the
    // call (groupLaunchNonBlocking), on the critical path of every bucket and every SyncBatchNorm
    // collective, and lockstep waits for that thread before its next call. A blocking
    // communicator enqueues in the calling thread. So a group within one process, whose init
    // involves no other process (one group call of this thread for all its ranks), makes blocking
    // communicators; a group across processes makes non-blocking ones. What a blocking one could
    // wait for, and how it stays bounded:
    // - its init: only this process's ranks, in this thread's one group call; a rebuild makes them
    //   outside the mutex abort() takes, so an abort never waits for an init;
    // - connection setup: NCCL (2.22 and newer) connects a communicator's peers at the first
    //   collective that needs them, where a blocking call would wait for its peers; lockstep sets
    //   NCCL_RUNTIME_CONNECT=0 (unless the user set it) so that every connection is made at init,
    //   and a collective, entered only once every rank passed the rendezvous, only enqueues;
    // - its finalize: teardown finalizes only once every rank's streams are idle, else it aborts;
    // - its abort: on a helper thread (Note [aborting communicators]).
    // bench_cuda_allreduce measures both kinds ("NCCL eager collectives per second"), as
    // scripts/gpu-check.sh reports.

    //! The communicators of ranks `first_rank`.. of a clique of `ranks` made from `id`, one per
    //! device in `devices` (one rank per GPU), in one group call, polled until ready or
    //! `deadline`; blocking ones or not (Note [blocking communicators]). Across processes every
    //! process calls this with the same id (Note [stream groups across processes]).
    static std::vector<Comm> init(const std::vector<int>& devices, const UniqueId& id, int first_rank, int ranks,
                                  clock::time_point deadline, const std::atomic<bool>& stop, bool blocking = false) {
        Api::prepare_nccl();
        const int n = static_cast<int>(devices.size());
        ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
        config.blocking = blocking ? 1 : 0;
        std::vector<Comm> comms(devices.size(), nullptr);
        ncclResult_t first_error = ncclSuccess;
        cudaError_t device_error = cudaSuccess;
        {
            cuda::DeviceGuard guard(devices[0]);
            LOCKSTEP_NCCL_CHECK(ncclGroupStart());
            // Nothing throws between the group's start and end (an open group would defer every
            // later NCCL call of this thread): errors are kept and raised after ncclGroupEnd.
            for (int r = 0; r < n && device_error == cudaSuccess; ++r) {
                device_error = cudaSetDevice(devices[static_cast<std::size_t>(r)]);
                if (device_error != cudaSuccess) break;
                const ncclResult_t res =
                    ncclCommInitRankConfig(&comms[static_cast<std::size_t>(r)], ranks, id, first_rank + r, &config);
                if (res != ncclSuccess && res != ncclInProgress && first_error == ncclSuccess) first_error = res;
            }
            const ncclResult_t res = ncclGroupEnd();
            if (res != ncclSuccess && res != ncclInProgress && first_error == ncclSuccess) first_error = res;
        }
        try {
            LOCKSTEP_CUDA_CHECK(device_error);
            if (first_error != ncclSuccess) LOCKSTEP_NCCL_CHECK(first_error);
            for (auto& c : comms) settle(c, deadline, stop, "creating NCCL communicators");
        } catch (...) {
            for (auto& c : comms) abort(c);
            throw;
        }
        return comms;
    }

    // Note [two communicators on one device]
    // Each CUDA replica uses two NCCL communicators on its GPU: the layer group's on its compute
    // stream and the gradient group's on its communication stream. Collectives of two
    // communicators on one device may deadlock unless NCCL launches them in one order on every
    // device; NCCL >= 2.26 does that under NCCL_LAUNCH_ORDER_IMPLICIT, following the order the
    // host enqueues them in, which lockstep makes the same on every rank (the replica thread
    // itself enqueues every collective at the same program point). The variable is read when
    // NCCL initializes, at its first ncclGetUniqueId or communicator init, whose bootstrap
    // thread then reads the environment: so it is set before either (after ncclGetVersion alone,
    // which initializes nothing), unless the user set it; an older NCCL is refused with its
    // version, as is one a test pins below 2.26. (The torch component's replicas have one
    // communicator per GPU and take any NCCL release as recent as its headers: Note [libtorch NCCL buckets].)

    //! The NCCL version that supports NCCL_LAUNCH_ORDER_IMPLICIT (2.26.0, as ncclGetVersion counts).
    static constexpr int launch_order_version = 22600;

    //! Before NCCL initializes: require_launch_order(), require_headers_release(), then set_environment().
    static void prepare_nccl() {
        require_launch_order();
        require_headers_release();
        set_environment();
    }

    //! NCCL's version as ncclGetVersion counts it (major * 10000 + minor * 100 + patch, from 2.9).
    static int loaded_version() {
        int version = 0;
        LOCKSTEP_NCCL_CHECK(ncclGetVersion(&version));
        return version;
    }
    static std::string version_text(int version) {
        return std::to_string(version / 10000) + "." + std::to_string((version / 100) % 100) + "." +
               std::to_string(version % 100);
    }

    //! Refuses an NCCL library of an older release (major.minor) than the headers lockstep was
    //! compiled against: a function those headers declare may be missing from it, and the loader
    //! reports a missing function only at its first call, by ending the process.
    static void require_headers_release() {
        const int version = loaded_version();
        LOCKSTEP_CHECK_AS(UsageError, version / 100 >= NCCL_VERSION_CODE / 100, "NCCL ", version_text(version),
                          " is loaded, but lockstep was compiled against the headers of NCCL ", NCCL_MAJOR, ".", NCCL_MINOR,
                          "; point the loader at the libnccl.so.2 of NCCL ", NCCL_MAJOR, ".", NCCL_MINOR,
                          " or newer (LD_LIBRARY_PATH), or build against the headers of the NCCL that is loaded");
    }

    //! Refuses an NCCL too old for two communicators per device (Note [two communicators on one device]).
    static void require_launch_order() {
        const int version = loaded_version();
        LOCKSTEP_CHECK_AS(NotImplemented, version >= launch_order_version, "NCCL ", version_text(version),
                          " is loaded, but lockstep runs two NCCL communicators per GPU (layer and "
                          "gradient collectives), which needs NCCL 2.26 or newer (NCCL_LAUNCH_ORDER_IMPLICIT); point "
                          "the loader at a newer libnccl.so.2 (LD_LIBRARY_PATH)");
    }

    //! Sets NCCL_LAUNCH_ORDER_IMPLICIT=1 (Note [two communicators on one device]) and
    //! NCCL_RUNTIME_CONNECT=0 (Note [blocking communicators]) where the user has not set them.
    static void set_environment() {
        // Once per process, whichever Api calls: setenv races with getenv on threads NCCL already runs.
        std::call_once(detail::nccl_environment_once(), [] {
            (void)::setenv("NCCL_LAUNCH_ORDER_IMPLICIT", "1", 0);
            (void)::setenv("NCCL_RUNTIME_CONNECT", "0", 0);
        });
    }

    //! A named NVTX range around each enqueue, so Nsight shows every collective on its thread.
    using Range = cuda::NvtxRange;

    static void all_reduce(Comm c, void* buf, std::size_t count, DType t, Stream s, clock::time_point deadline,
                           const std::atomic<bool>& stop) {
        const Range range("lockstep ncclAllReduce");
        enqueued(c, ncclAllReduce(buf, buf, count, nccl_type(t), ncclSum, c, s), deadline, stop, "ncclAllReduce");
    }
    static void broadcast(Comm c, void* buf, std::size_t count, DType t, int root, Stream s, clock::time_point deadline,
                          const std::atomic<bool>& stop) {
        const Range range("lockstep ncclBroadcast");
        enqueued(c, ncclBroadcast(buf, buf, count, nccl_type(t), root, c, s), deadline, stop, "ncclBroadcast");
    }

    static void check(Comm c) {
        ncclResult_t async = ncclSuccess;
        LOCKSTEP_NCCL_CHECK(ncclCommGetAsyncError(c, &async));
        if (async != ncclSuccess && async != ncclInProgress) LOCKSTEP_NCCL_CHECK(async);
    }

    static void abort(Comm c) noexcept {
        if (c != nullptr) (void)ncclCommAbort(c);
    }
    //! Finalizes this process's communicators of a group in one group call (finalize is a
    //! collective of the ranks: one thread finalizing its ranks one by one would wait on itself),
    //! then polls each until it has finished or `deadline` passes.
    static void finalize(std::span<const Comm> comms, clock::time_point deadline) noexcept {
        if (ncclGroupStart() != ncclSuccess) return;
        for (const Comm c : comms)
            if (c != nullptr) (void)ncclCommFinalize(c);
        (void)ncclGroupEnd();
        for (const Comm c : comms) {
            if (c == nullptr) continue;
            ncclResult_t async = ncclInProgress;
            while (ncclCommGetAsyncError(c, &async) == ncclSuccess && async == ncclInProgress && clock::now() < deadline)
                std::this_thread::yield();
        }
    }
    static void destroy(Comm c) noexcept {
        if (c == nullptr) return;
        ncclResult_t async = ncclSuccess;
        // A communicator whose finalize did not finish in time, or that holds an error, is
        // aborted instead of destroyed.
        if (ncclCommGetAsyncError(c, &async) != ncclSuccess || async != ncclSuccess)
            (void)ncclCommAbort(c);
        else
            (void)ncclCommDestroy(c);
    }

protected:
    // Whether everything enqueued on `s` (the legacy default stream too) has run by `deadline`.
    static bool drained(int device, Stream s, clock::time_point deadline) noexcept {
        cuda::QuietDeviceGuard guard(device);
        cudaError_t e = cudaStreamQuery(s);
        while (e == cudaErrorNotReady && clock::now() < deadline) {
            std::this_thread::yield();
            e = cudaStreamQuery(s);
        }
        (void)cudaGetLastError();
        return e == cudaSuccess;
    }

    // A non-blocking communicator's call may return ncclInProgress: poll until it settles.
    static void enqueued(Comm c, ncclResult_t res, clock::time_point deadline, const std::atomic<bool>& stop, const char* what) {
        if (res == ncclInProgress)
            settle(c, deadline, stop, what);
        else if (res != ncclSuccess)
            LOCKSTEP_NCCL_CHECK(res);
    }
    static void settle(Comm c, clock::time_point deadline, const std::atomic<bool>& stop, const char* what) {
        for (;;) {
            ncclResult_t async = ncclSuccess;
            LOCKSTEP_NCCL_CHECK(ncclCommGetAsyncError(c, &async));
            if (async == ncclSuccess) return;
            if (async != ncclInProgress) LOCKSTEP_NCCL_CHECK(async);
            if (stop.load(std::memory_order_acquire))
                throw CollectiveAborted(std::string(what) + " was abandoned: the replica group was aborted");
            if (clock::now() >= deadline) throw Timeout(std::string(what) + " did not complete within the group's timeout");
            std::this_thread::yield();
        }
    }
};

}  // namespace lockstep::comm
