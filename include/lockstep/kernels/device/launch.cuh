// SPDX-License-Identifier: MIT
//! The device drivers of lockstep's kernels: the `__global__` functions that run a kernel's phases
//! on the GPU with CUB reductions between them (nvcc), or, built by a host compiler for the
//! test-only host CUDA device, the grid emulator run on a stream (Note [kernels proven on the host]).
#pragma once

#include <cuda_runtime.h>

#include <memory>

#if defined(__CUDACC__)
#include <cub/block/block_reduce.cuh>
#elif !defined(LOCKSTEP_HOST_CUDA)
#error \
    "lockstep's CUDA kernels need nvcc; a host compiler builds them only against the test-only host CUDA device (tests/host_cuda)"
#endif

#include "lockstep/core/cuda_runtime.cuh"
#include "lockstep/kernels/device/grid.cuh"

namespace lockstep::kernels::device {

//! The blocks of kernel K that must fit on one multiprocessor at once (K::min_blocks, else 1):
//! with K::threads, the register budget `__launch_bounds__` gives ptxas, 65536 / (threads x
//! min_blocks) per thread (the static gate in tests/cuda_static checks it).
template <class K>
constexpr int min_blocks_of() {
    if constexpr (requires { K::min_blocks; })
        return K::min_blocks;
    else
        return 1;
}

#if defined(__CUDACC__)

namespace detail {

// Sums a value over the rows of each lane of a lanes x rows block; the sum is valid in row 0.
// lanes == 1: a CUB block reduction; otherwise a column sum through shared memory.
template <class K>
struct ColumnSum {
    using Value = typename K::Value;
    using BlockReduce = cub::BlockReduce<Value, K::threads>;
    // Raw bytes for the column values: Value has default member initializers, which a union
    // member in shared memory cannot have.
    union Storage {
        typename BlockReduce::TempStorage reduce;
        alignas(Value) unsigned char column[sizeof(Value) * K::rows * K::lanes];
    };
    __device__ static Value sum(Storage& s, const Value& v, int lane, int row) {
        if constexpr (K::lanes == 1) {
            return BlockReduce(s.reduce).Sum(v);
        } else {
            Value* column = reinterpret_cast<Value*>(s.column);
            column[row * K::lanes + lane] = v;
            __syncthreads();
            Value total = v;
            if (row == 0) {
                // Rolled: unrolled, the rows' loads of a wide Value (StatsChannelsLast<T, 4>: 4
                // channels' two fp64 sums) spill on sm_100.
                LOCKSTEP_NO_UNROLL
                for (int r = 1; r < K::rows; ++r) total = total + column[r * K::lanes + lane];
            }
            return total;
        }
    }
};

//! A block as the drivers see it (Note [one barrier placement]), on the device: this thread of
//! it, with the block's shared storage. Host-device members, as the drivers are; only the
//! device runs them.
template <class K>
struct DeviceBlock {
    using Sum = ColumnSum<K>;
    typename Sum::Storage& storage;
    bool& last_flag;
    Where w;
    typename K::Value v{};

    template <class F>
    LOCKSTEP_HD void each(F&& f) {
        f(w);
    }
    LOCKSTEP_HD void sync() {
#if defined(__CUDA_ARCH__)
        __syncthreads();
#endif
    }
    LOCKSTEP_HD void fence(const Where&) { device::fence(); }
    LOCKSTEP_HD bool ticket(const Where&, unsigned int* counter, int blocks) { return take_ticket(counter, blocks); }
    LOCKSTEP_HD void reset_ticket(const Where&, unsigned int* counter) { *counter = 0; }
    LOCKSTEP_HD typename K::Value& value(const Where&) { return v; }
    LOCKSTEP_HD void column_sum() {
#if defined(__CUDA_ARCH__)
        v = Sum::sum(storage, v, w.t % K::lanes, w.t / K::lanes);
#endif
    }
    LOCKSTEP_HD void set_last(const Where&, bool last) { last_flag = last; }
    LOCKSTEP_HD bool last() const { return last_flag; }
};

//! A map kernel's block on the device: this thread.
struct DeviceThread {
    Where w;
    template <class F>
    LOCKSTEP_HD void each(F&& f) {
        f(w);
    }
};

__device__ inline Where this_thread() {
    return {static_cast<int>(blockIdx.x), static_cast<int>(blockIdx.y), static_cast<int>(gridDim.x),
            static_cast<int>(gridDim.y), static_cast<int>(threadIdx.x)};
}

}  // namespace detail

//! Map kernel K: every thread runs K::run (map_block).
template <class K>
__global__ void __launch_bounds__(K::threads, min_blocks_of<K>()) map_kernel(const typename K::Params p) {
    detail::DeviceThread b{detail::this_thread()};
    map_block<K>(p, b);
}

//! Reducing kernel K over a (chunks, groups) grid: the reduce driver (reduce_block) as one thread
//! of the block.
template <class K>
__global__ void __launch_bounds__(K::threads, min_blocks_of<K>()) reduce_kernel(const typename K::Params p) {
    __shared__ typename detail::ColumnSum<K>::Storage storage;
    __shared__ bool last;
    detail::DeviceBlock<K> b{storage, last, detail::this_thread()};
    reduce_block<K>(p, b);
}

//! Launches map kernel K on `stream`; an empty grid launches nothing.
template <class K>
void launch_map(const typename K::Params& p, const Grid& g, cudaStream_t stream) {
    if (g.x <= 0 || g.y <= 0) return;
    map_kernel<K>
        <<<dim3(static_cast<unsigned>(g.x), static_cast<unsigned>(g.y)), static_cast<unsigned>(g.threads), 0, stream>>>(p);
    LOCKSTEP_CUDA_CHECK(cudaGetLastError());
}

//! Launches reducing kernel K on `stream`; an empty grid launches nothing.
template <class K>
void launch_reduce(const typename K::Params& p, const Grid& g, cudaStream_t stream) {
    if (g.x <= 0 || g.y <= 0) return;
    reduce_kernel<K>
        <<<dim3(static_cast<unsigned>(g.x), static_cast<unsigned>(g.y)), static_cast<unsigned>(g.threads), 0, stream>>>(p);
    LOCKSTEP_CUDA_CHECK(cudaGetLastError());
}

#else  // a host compiler, against the host CUDA device (tests/host_cuda)

// Note [kernels on the host CUDA device]
// Built by a host compiler, a launch enqueues the kernel's emulation (grid.cuh: blocks and
// threads in a seeded random order, over the replica's own scratch layout) on the stream as a
// host function, which the host CUDA device runs in stream order with its other work. The rest
// of the backend (streams, events, copies, cuBLAS, NCCL) is the same source as on a GPU: what
// this proves is the code between kernels. No other file knows which compiler built it.

//! Stands for the `__global__` driver where code takes its address (cudaFuncGetAttributes); never run.
template <class K>
void map_kernel(const typename K::Params) {}
template <class K>
void reduce_kernel(const typename K::Params) {}

namespace detail {

template <class K, bool Reduce>
struct HostLaunch {
    typename K::Params params;
    Grid grid;
    void operator()() const {
        if constexpr (Reduce)
            emulate_reduce<K>(params, grid);
        else
            emulate_map<K>(params, grid);
    }
    //! An eager launch: runs once and frees itself.
    static void CUDART_CB run_once(void* data) {
        const std::unique_ptr<const HostLaunch> launch(static_cast<const HostLaunch*>(data));
        (*launch)();
    }
    //! A captured launch: runs at each replay of its graph, which frees it (destroy).
    static void CUDART_CB run(void* data) { (*static_cast<const HostLaunch*>(data))(); }
    static void CUDART_CB destroy(void* data) { delete static_cast<HostLaunch*>(data); }
};

template <class K, bool Reduce>
void host_launch(const typename K::Params& p, const Grid& g, cudaStream_t stream) {
    using Launch = HostLaunch<K, Reduce>;
    if (g.x <= 0 || g.y <= 0) return;
    // A configuration a GPU refuses is refused here too: grid y within 65535, a block of at most
    // 1024 threads and, for a reducing kernel, exactly its K::threads.
    if (g.y > 65535 || g.threads <= 0 || g.threads > 1024 || g.threads > K::threads || (Reduce && g.threads != K::threads))
        LOCKSTEP_CUDA_CHECK(cudaErrorInvalidConfiguration);
    auto launch = std::make_unique<Launch>(Launch{p, g});
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    cudaGraph_t graph = nullptr;
    LOCKSTEP_CUDA_CHECK(cudaStreamGetCaptureInfo(stream, &capture, nullptr, &graph));
    if (capture == cudaStreamCaptureStatusActive) {
        // A GPU graph keeps a kernel's parameters in its node for every replay; here the graph
        // keeps the launch, as a user object it frees with itself (Note [graphs]).
        cudaUserObject_t object = nullptr;
        LOCKSTEP_CUDA_CHECK(cudaUserObjectCreate(&object, launch.get(), &Launch::destroy, 1, cudaUserObjectNoDestructorSync));
        const Launch* kept = launch.release();  // the object's now
        if (const cudaError_t e = cudaGraphRetainUserObject(graph, object, 1, cudaGraphUserObjectMove); e != cudaSuccess) {
            (void)cudaUserObjectRelease(object, 1);
            LOCKSTEP_CUDA_CHECK(e);
        }
        LOCKSTEP_CUDA_CHECK(cudaLaunchHostFunc(stream, &Launch::run, const_cast<Launch*>(kept)));
        return;
    }
    LOCKSTEP_CUDA_CHECK(cudaLaunchHostFunc(stream, &Launch::run_once, launch.get()));
    launch.release();  // the stream runs it and frees it
}

}  // namespace detail

template <class K>
void launch_map(const typename K::Params& p, const Grid& g, cudaStream_t stream) {
    detail::host_launch<K, false>(p, g, stream);
}
template <class K>
void launch_reduce(const typename K::Params& p, const Grid& g, cudaStream_t stream) {
    detail::host_launch<K, true>(p, g, stream);
}

#endif  // __CUDACC__

//! The device as a runner of kernels (see bn_kernels.cuh): launches on one stream.
struct DeviceRun {
    cudaStream_t stream = nullptr;
    DeviceInfo device;
    Scratch scratch_view;
    DeviceInfo info() const { return device; }
    Scratch scratch() const { return scratch_view; }
    template <class K>
    void map(const typename K::Params& p, const Grid& g) {
        launch_map<K>(p, g, stream);
    }
    template <class K>
    void reduce(const typename K::Params& p, const Grid& g) {
        launch_reduce<K>(p, g, stream);
    }
    void zero(void* p, std::size_t bytes) {
        if (bytes > 0) LOCKSTEP_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, stream));
    }
};

}  // namespace lockstep::kernels::device
