// SPDX-License-Identifier: MIT
//! Internals of lockstep's host CUDA device shared by its runtime, cuBLAS and NCCL parts (not for tests).
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

namespace lockstep::host_cuda::detail {

inline constexpr int max_devices = 4;

struct Stream;
struct Capture;

//! "Wait until `stream` has completed its `seq`-th op" (ops are numbered from 1).
struct Dep {
    std::shared_ptr<Stream> stream;
    std::uint64_t seq = 0;
};

//! One queued operation: the streams it waits for, then its body, run by the stream's worker.
struct Op {
    std::vector<Dep> deps;
    std::function<void()> body;
    //! Device work is dropped once its device holds a sticky error (the context is dead);
    //! bookkeeping (stream-ordered frees, event timestamps) still runs.
    bool device_work = true;
    //! The device memory it reads or writes, where the call knows it (copies, memsets, cuBLAS,
    //! cuDNN): checked again at each launch of a graph that captured it (graphs.cpp).
    std::vector<std::pair<const void*, std::size_t>> device_ranges;
};

//! An asynchronous FIFO queue with its own worker thread. `m` guards the queue only (host
//! pushes, the worker pops). Completion is published by the worker alone, with a release store
//! that waiters acquire: the worker never takes a lock a waiter released, so ThreadSanitizer sees
//! a happens-before edge from a stream's work exactly where something waited for it.
struct Stream {
    int device = 0;
    bool blocking = true;  // synchronizes with the legacy default stream
    bool legacy = false;
    std::uint64_t serial = 0;
    std::mutex m;
    std::condition_variable cv;
    std::deque<Op> queue;
    std::atomic<std::uint64_t> submitted{0};  // changes under m
    std::atomic<std::uint64_t> completed{0};  // written by the worker only
    std::atomic<bool> closing{false};
    std::mt19937_64 rng;  // the worker's delays
    // Stream capture (graphs.cpp): set while the stream records into `capture` instead of
    // running; `capture` changes under graphs.cpp's lock.
    std::atomic<bool> capturing{false};
    std::shared_ptr<Capture> capture;
};

// The current device of the calling thread, and the number of modelled devices.
int current_device() noexcept;
int device_count() noexcept;

//! The sticky error of `device` (cudaSuccess when healthy).
cudaError_t sticky(int device) noexcept;
void set_sticky(int device, cudaError_t e) noexcept;

//! Records `e` as the calling thread's last error (unless it is success or "not ready") and returns it.
cudaError_t fail(cudaError_t e) noexcept;

//! `h` as a live stream (the legacy stream of the current device for nullptr/cudaStreamLegacy).
cudaError_t resolve_stream(cudaStream_t h, std::shared_ptr<Stream>& out);

//! As resolve_stream, with nullptr/cudaStreamLegacy standing for `device`'s legacy stream.
cudaError_t resolve_stream_on(cudaStream_t h, int device, std::shared_ptr<Stream>& out);

//! As resolve_stream, and refuses a stream of another device than the current one and a device
//! holding a sticky error: the checks of a kernel launch.
cudaError_t stream_for_work(cudaStream_t h, std::shared_ptr<Stream>& out);

//! Appends `op` to `s` (after the implicit waits of legacy-stream semantics) and returns its number.
std::uint64_t enqueue(const std::shared_ptr<Stream>& s, Op op);

//! Blocks until `s` has completed op `seq` (polling: no lock shared with the worker); reached()
//! says whether it has, without waiting. Both acquire the stream's work when it has.
void wait_for(Stream& s, std::uint64_t seq);
bool reached(Stream& s, std::uint64_t seq);

//! The device of the live device block holding [p, p + bytes), or -1.
int device_of_range(const void* p, std::size_t bytes);

//! Rounds to TF32 (10 mantissa bits, to nearest even), as the tensor cores read their inputs
//! (cuBLAS in CUBLAS_TF32_TENSOR_OP_MATH, cuDNN outside CUDNN_FMA_MATH).
inline float to_tf32(float x) {
    std::uint32_t u = 0;
    std::memcpy(&u, &x, sizeof u);
    if ((u & 0x7F800000u) != 0x7F800000u) {
        u += 0xFFFu + ((u >> 13) & 1u);
        u &= 0xFFFFE000u;
    }
    std::memcpy(&x, &u, sizeof x);
    return x;
}

//! A stream of `device` for the double's own use (a graph's lanes): non-blocking, waited for by
//! cudaDeviceSynchronize and reset(); close_stream() lets its worker finish and exit.
std::shared_ptr<Stream> internal_stream(int device);
void close_stream(const std::shared_ptr<Stream>& s);

//! A kernel launch's injections, drawn when it is enqueued (runtime.cpp).
struct LaunchPlan {
    bool fault = false, stall = false;
    std::uint64_t generation = 0, number = 0;
    std::string name;
};
//! Counts one launch of `name` on `device` for the injections: cudaErrorLaunchFailure when an
//! injected failure hits it (nothing is enqueued then).
cudaError_t plan_launch(std::string name, int device, LaunchPlan& plan);
//! The op that runs host function `fn(data)` as a kernel launch planned so.
Op launch_op(cudaHostFn_t fn, void* data, const LaunchPlan& plan, int device);

//! A device block a graph owns (graphs.cpp): cudaFree and cudaFreeAsync refuse it.
struct GraphBlock {
    void* p = nullptr;
    std::size_t size = 0;
    int device = 0;
    std::size_t charged = 0;
    std::shared_ptr<std::atomic<bool>> released;
};
//! Makes device block `p` a graph's.
GraphBlock own_by_graph(void* p);
//! A graph executable's allocations get memory (`bytes`) on `device` at its upload or first
//! launch, from the graph pool's cache, else from what the device has free:
//! cudaErrorMemoryAllocation when it does not fit (or an injection says so). Not recorded as the
//! thread's last error: the caller returns it.
cudaError_t map_graph_memory(int device, std::size_t bytes);
//! An executable that had its memory is destroyed: the graph pool keeps the bytes until
//! cudaDeviceGraphMemTrim.
void unmap_graph_memory(int device, std::size_t bytes);
//! cudaDeviceGraphMemTrim: the executables of `device` with no launch in flight give their
//! memory back to the graph pool (their next launch maps it again), before the pool is trimmed.
void unmap_idle_executables(int device);
//! The block is no longer usable (its graph's last handle is gone); a host call.
void retire_graph_block(const GraphBlock& b);
//! Gives a retired block back to the system allocator; lock-free (the last replay's op may do it).
void release_graph_block(const GraphBlock& b);

// --- Stream capture and graphs (graphs.cpp) ------------------------------------------------------

//! A captured node's work, run at each replay: enqueues its op on `lane` with `deps` added and
//! returns the op's number there.
using Submit = std::function<std::uint64_t(const std::shared_ptr<Stream>& lane, std::vector<Dep> deps)>;

//! Where a stream stood in a capture when an event was recorded on it.
struct CaptureMark {
    std::weak_ptr<Capture> capture;
    std::vector<int> tail;  // the nodes the stream's next node would follow
};

//! Whether work may go on `s` now, with capture: cudaErrorStreamCaptureInvalidated on a stream
//! whose capture failed; cudaErrorStreamCaptureImplicit for the legacy stream while a blocking
//! stream of its device captures (that capture is invalidated, unless `invalidate` is false: a
//! query such as cudaStreamIsCapturing leaves it alone).
cudaError_t capture_admits(const std::shared_ptr<Stream>& s, bool invalidate = true);
//! Ends every capture in progress without a graph, and the calling thread's capture mode goes back
//! to global (reset()).
void reset_captures();
//! Records `op` (without deps: a capturing stream has no implicit ones) as a node of the
//! capture of `s`; enqueue() calls it for a capturing stream.
void capture_op(const std::shared_ptr<Stream>& s, Op op);
//! Records a node whose work `submit` does at each replay (a collective, which numbers itself then).
void capture_submit(const std::shared_ptr<Stream>& s, Submit submit);
//! An op that puts `device` in a sticky cudaErrorIllegalAddress when it runs, after printing
//! "host CUDA device: <what>": a graph's work on memory or a communicator gone since its capture.
Op fault_op(int device, std::string what);
//! Records a kernel launch node: planned for the injections at each replay, as an eager launch.
void capture_launch(const std::shared_ptr<Stream>& s, cudaHostFn_t fn, void* data, std::string name);
//! A "potentially unsafe" call during a capture (cudaMalloc, cudaFree, synchronous copies,
//! cudaDeviceSynchronize, ...): cudaErrorStreamCaptureUnsupported where the capture mode forbids
//! it (the conflicting captures are invalidated), else success.
cudaError_t capture_unsafe_call();
//! An operation capture does not permit on capturing stream `s` (synchronizing with it, querying
//! it, a copy with pageable memory): cudaErrorStreamCaptureUnsupported, and the capture is
//! invalidated; success when `s` does not capture.
cudaError_t capture_refuse(const std::shared_ptr<Stream>& s);
//! A context-wide synchronization of `device` (cudaDeviceSynchronize) while any stream of it
//! captures: cudaErrorStreamCaptureUnsupported, and those captures are invalidated; else success.
cudaError_t capture_refuse_device(int device);
//! The mark of an event recorded on capturing stream `s`.
std::shared_ptr<CaptureMark> capture_mark(const std::shared_ptr<Stream>& s);
//! `s` waits for an event recorded in a capture: joins that capture, or adds the dependency.
cudaError_t capture_wait(const std::shared_ptr<Stream>& s, const CaptureMark& mark);
//! Capturing `s` waits for an event recorded outside any capture: cudaErrorStreamCaptureIsolation.
cudaError_t capture_isolation(const std::shared_ptr<Stream>& s);
//! Capturing `s` recorded work that keeps `hold` alive (a collective's communicator, nccl.cpp)
//! until the graph's last handle is destroyed (the graph and its executables).
void capture_hold(const std::shared_ptr<Stream>& s, std::shared_ptr<void> hold);
//! cudaMallocAsync on capturing `s` made block `p`: the capture's graph owns it.
void capture_allocation(const std::shared_ptr<Stream>& s, void* p);
//! cudaFreeAsync of `p` on capturing `s`: success for a block the capture allocated (freed in
//! the graph), cudaErrorStreamCaptureUnsupported otherwise (the capture is invalidated).
cudaError_t capture_free(const std::shared_ptr<Stream>& s, void* p);

//! Clears the NCCL injections (nccl.cpp), for reset().
void reset_nccl_injections();

//! Clears the cuDNN call log and offer (cudnn.cpp, built where cudnn.h is: LOCKSTEP_WITH_CUDNN).
void reset_cudnn();

}  // namespace lockstep::host_cuda::detail
