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
#include <vector>

namespace lockstep::host_cuda::detail {

inline constexpr int max_devices = 4;

struct Stream;

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

//! Clears the NCCL injections (nccl.cpp), for reset().
void reset_nccl_injections();

//! Clears the cuDNN call log and offer (cudnn.cpp, built where cudnn.h is: LOCKSTEP_WITH_CUDNN).
void reset_cudnn();

}  // namespace lockstep::host_cuda::detail
