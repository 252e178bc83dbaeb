// SPDX-License-Identifier: MIT
//! The grid model every lockstep CUDA kernel is written against, and its host emulator.
//! Compiles under g++ (the emulator, the host tests) and nvcc (the kernels): nothing here needs a GPU.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "lockstep/core/config.hpp"

//! Unrolls the next loop in device code (host compilers unroll as they see fit).
#if defined(__CUDACC__)
#define LOCKSTEP_UNROLL _Pragma("unroll")
#else
#define LOCKSTEP_UNROLL
#endif

namespace lockstep::kernels::device {

// Note [kernels proven on the host]
// There is no GPU where lockstep is built and tested, so a CUDA kernel is written as
// `__host__ __device__` phase functions over explicit (block, thread) indices, split where the
// device would synchronize, and driven two ways:
// - on the device by the `__global__` drivers of launch.cuh, with CUB block reductions between
//   the phases, `__syncthreads`, `__threadfence` and an atomic ticket;
// - on the host by the emulator below, which runs a block's threads one after another through a
//   phase, then the block's reduction, then the next phase, and runs the blocks one after another,
//   so a kernel's index math, tails, reduction shape and last-block-done logic all run in the host
//   tests (CTest label `emulation`) with the launch configuration the device would use.
// Two kinds of kernel exist:
// - a map kernel: `run(params, where)` per thread, no barrier (per-channel constants each thread
//   needs are computed by that thread in its prologue);
// - a reducing kernel over a (chunks, groups) grid, whose block is `lanes` x `rows` threads: each
//   thread `accumulate`s a value, the values are summed over the rows of each lane (lanes == 1:
//   the whole block, a CUB BlockReduce), each lane's sum is stored as the block's partial, the
//   block takes a ticket on its group's counter, and the block that takes the last ticket `gather`s
//   the group's partials in chunk order, sums them again and `finish`es, then resets the counter
//   to zero for the next launch. The partials are summed in chunk order whichever block comes
//   last, so the result does not depend on the blocks' schedule: the device gives the same bits
//   run after run.

//! A thread's place in the grid: its block (x: chunk, y: group), the grid's size and its index in the block.
struct Where {
    int bx = 0, by = 0;
    int gx = 1, gy = 1;
    int t = 0;
};

//! A launch: grid (x, y) and threads per block.
struct Grid {
    int x = 1, y = 1;
    int threads = 256;
};

//! What a launch configuration depends on: the device's multiprocessors and L2 cache.
struct DeviceInfo {
    int multiprocessors = 132;          // H200
    std::int64_t l2_bytes = 60 << 20;   // H200: 60 MiB
};

//! Where reducing kernels keep their partials and tickets (a replica's, from `Execution<Cuda>`;
//! host vectors in the emulation tests). Tickets are zero between launches.
struct Scratch {
    unsigned int* counters = nullptr;
    int counter_count = 0;
    void* partials = nullptr;
    std::size_t partial_bytes = 0;

    //! The partials as an array of `Value`, if `count` of them fit.
    template <class Value>
    Value* partials_as(std::int64_t count) const {
        return static_cast<std::size_t>(count) * sizeof(Value) <= partial_bytes ? static_cast<Value*>(partials) : nullptr;
    }
};

//! Scratch sizes a replica reserves: tickets for 65535 groups (the grid's y limit), 4 MiB of partials.
inline constexpr int scratch_counters = 65535;
inline constexpr std::size_t scratch_partial_bytes = std::size_t{4} << 20;

//! Host scratch for the emulator, sized as a replica's.
struct HostScratch {
    std::vector<unsigned int> counters = std::vector<unsigned int>(scratch_counters, 0u);
    std::vector<double> partials = std::vector<double>(scratch_partial_bytes / sizeof(double));
    Scratch view() { return {counters.data(), scratch_counters, partials.data(), scratch_partial_bytes}; }
};

// ---- storage types: fp32, fp16, bf16 with fp32 math -------------------------------------------

LOCKSTEP_HD inline float to_float(float v) { return v; }
LOCKSTEP_HD inline float to_float(__half v) { return __half2float(v); }
LOCKSTEP_HD inline float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <class T>
LOCKSTEP_HD inline T from_float(float v) {
    if constexpr (std::is_same_v<T, float>) return v;
    else if constexpr (std::is_same_v<T, __half>) return __float2half_rn(v);
    else return __float2bfloat16_rn(v);
}

//! Elements of T in 16 bytes: the widest vector a thread loads or stores.
template <class T>
inline constexpr int vec16 = static_cast<int>(16 / sizeof(T));

//! V consecutive elements of T, loaded or stored as one access (16 bytes when V = vec16<T>).
template <class T, int V>
struct alignas(sizeof(T) * V) Pack {
    T v[V];
};

template <int V, class T>
LOCKSTEP_HD inline Pack<T, V> load_pack(const T* p) {
    if constexpr (V == 1) {
        return Pack<T, 1>{{*p}};
    } else {
        return *reinterpret_cast<const Pack<T, V>*>(p);
    }
}
template <int V, class T>
LOCKSTEP_HD inline void store_pack(T* p, const Pack<T, V>& v) {
    if constexpr (V == 1) {
        *p = v.v[0];
    } else {
        *reinterpret_cast<Pack<T, V>*>(p) = v;
    }
}

//! Whether `p` may be read in vectors of V elements (16-byte aligned for the widest).
template <class T>
inline bool aligned_for(const T* p, int V) {
    return reinterpret_cast<std::uintptr_t>(p) % (sizeof(T) * static_cast<std::size_t>(V)) == 0;
}

// ---- the device primitives a kernel body uses, with their host meaning ------------------------

//! Reads a value another block wrote in this launch (through L2 on the device, never a stale L1 line).
template <class T>
LOCKSTEP_HD inline T load_other_block(const T* p) {
#if defined(__CUDA_ARCH__)
    return __ldcg(p);
#else
    return *p;
#endif
}

//! Orders this thread's earlier global writes before its later ones, for every other block.
LOCKSTEP_HD inline void fence() {
#if defined(__CUDA_ARCH__)
    __threadfence();
#endif
}

//! Takes a ticket on `counter`: true for the block that takes the last of `blocks` tickets.
LOCKSTEP_HD inline bool take_ticket(unsigned int* counter, int blocks) {
#if defined(__CUDA_ARCH__)
    return atomicAdd(counter, 1u) == static_cast<unsigned int>(blocks - 1);
#else
    return (*counter)++ == static_cast<unsigned int>(blocks - 1);
#endif
}

//! Quotient and remainder by a divisor fixed for a launch, by multiply and shift (no hardware
//! division per element): q = (umulhi(n, m) + n) >> s with s = ceil(log2 d) and
//! m = floor(2^32 (2^s - d) / d) + 1, exact for every n < 2^31.
struct Divider {
    unsigned int d = 1, m = 0, s = 0;
    Divider() = default;
    explicit Divider(unsigned int divisor) : d(divisor) {
        while ((1ull << s) < d) ++s;
        m = static_cast<unsigned int>(((1ull << 32) * ((1ull << s) - d)) / d + 1);
    }
    LOCKSTEP_HD unsigned int div(unsigned int n) const {
#if defined(__CUDA_ARCH__)
        const unsigned int hi = __umulhi(n, m);
#else
        const unsigned int hi = static_cast<unsigned int>((static_cast<std::uint64_t>(n) * m) >> 32);
#endif
        return (hi + n) >> s;
    }
};

// ---- the host emulator -------------------------------------------------------------------------

//! Runs map kernel K over `grid` on the host, block after block, thread after thread.
template <class K>
void emulate_map(const typename K::Params& p, const Grid& grid) {
    for (int by = 0; by < grid.y; ++by)
        for (int bx = 0; bx < grid.x; ++bx)
            for (int t = 0; t < grid.threads; ++t) K::run(p, Where{bx, by, grid.x, grid.y, t});
}

//! Runs reducing kernel K over `grid` on the host (Note [kernels proven on the host]).
template <class K>
void emulate_reduce(const typename K::Params& p, const Grid& grid) {
    using Value = typename K::Value;
    constexpr int lanes = K::lanes, rows = K::rows;
    static_assert(lanes * rows == K::threads, "a reducing kernel's block is lanes x rows threads");
    std::vector<Value> values(static_cast<std::size_t>(K::threads));
    const auto column_sums = [&] {
        std::vector<Value> sums(lanes);
        for (int lane = 0; lane < lanes; ++lane) {
            Value s = values[static_cast<std::size_t>(lane)];
            for (int row = 1; row < rows; ++row) s = s + values[static_cast<std::size_t>(row * lanes + lane)];
            sums[static_cast<std::size_t>(lane)] = s;
        }
        return sums;
    };
    for (int by = 0; by < grid.y; ++by)
        for (int bx = 0; bx < grid.x; ++bx) {
            const Where w0{bx, by, grid.x, grid.y, 0};
            for (int t = 0; t < K::threads; ++t) values[static_cast<std::size_t>(t)] = K::accumulate(p, Where{bx, by, grid.x, grid.y, t});
            const auto partial = column_sums();
            for (int lane = 0; lane < lanes; ++lane) K::store_partial(p, w0, lane, partial[static_cast<std::size_t>(lane)]);
            if (!take_ticket(K::counter(p, w0), grid.x)) continue;
            for (int t = 0; t < K::threads; ++t)
                values[static_cast<std::size_t>(t)] = K::gather(p, w0, t % lanes, t / lanes);
            const auto total = column_sums();
            for (int lane = 0; lane < lanes; ++lane) K::finish(p, w0, lane, total[static_cast<std::size_t>(lane)]);
            *K::counter(p, w0) = 0;
        }
}

}  // namespace lockstep::kernels::device
