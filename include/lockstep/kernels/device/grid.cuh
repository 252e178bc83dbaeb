// SPDX-License-Identifier: MIT
//! The grid model every lockstep CUDA kernel is written against, and its host emulator.
//! Compiles under g++ (the emulator, the host tests) and nvcc (the kernels): nothing here needs a GPU.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <type_traits>
#include <vector>

#include "lockstep/core/config.hpp"
#include "lockstep/core/error.hpp"

//! Unrolls the next loop in device code (host compilers unroll as they see fit);
//! LOCKSTEP_NO_UNROLL keeps it rolled there, where copies of its body would exceed a register budget.
#if defined(__CUDACC__)
#define LOCKSTEP_UNROLL _Pragma("unroll")
#define LOCKSTEP_NO_UNROLL _Pragma("unroll 1")
#else
#define LOCKSTEP_UNROLL
#define LOCKSTEP_NO_UNROLL
#endif

namespace lockstep::kernels::device {

// Note [kernels proven on the host]
// A CUDA kernel is written as `__host__ __device__` phase functions over explicit (block, thread)
// indices, split where the device would synchronize, so that its arithmetic runs in host tests;
// it is driven two ways:
// - on the device by the `__global__` drivers of launch.cuh, with CUB block reductions between
//   the phases, `__syncthreads`, `__threadfence` and an atomic ticket;
// - on the host by the emulator below, which runs a block's threads one after another (in a
//   seeded random order) through a phase, then the block's reduction, then the next phase, and
//   runs the blocks one after another in a seeded random order, over the device's scratch layout
//   (Note [one scratch layout]), so a kernel's index math, tails, reduction shape and
//   last-block-done logic all run in the host tests (CTest label `emulation`) with the launch
//   configuration the device would use. Compiled by a host compiler, launch.cuh runs the same
//   emulator on a stream of the host CUDA device (tests/host_cuda).
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
    int multiprocessors = 132;         // H200
    std::int64_t l2_bytes = 60 << 20;  // H200: 60 MiB
};

//! Scratch sizes a replica reserves: tickets for 65535 groups (the grid's y limit), 4 MiB of partials.
inline constexpr int scratch_counters = 65535;
inline constexpr std::size_t scratch_partial_bytes = std::size_t{4} << 20;

//! Where reducing kernels keep their partials and tickets (a replica's, from `Execution<Cuda>`;
//! the emulator's `HostScratch`, laid out alike). Tickets are zero between launches.
struct Scratch {
    unsigned int* counters = nullptr;
    int counter_count = 0;
    void* partials = nullptr;
    std::size_t partial_bytes = 0;

    //! The partials as an array of `count` values of `Value`. Throws `ShapeError` when they do
    //! not fit the scratch, and `UsageError` when the partials are not aligned for `Value` (a
    //! scratch not laid out by `ScratchLayout`): a kernel never gets a null or misaligned array.
    template <class Value>
    Value* partials_as(std::int64_t count) const {
        const std::size_t want = static_cast<std::size_t>(count) * sizeof(Value);
        LOCKSTEP_CHECK_AS(ShapeError, count >= 0 && want <= partial_bytes, "a CUDA reduction needs ", count, " partials of ",
                          sizeof(Value), " bytes (", want, " bytes), more than the replica's scratch of ", partial_bytes,
                          " bytes; use fewer channels per layer (or a smaller batch per replica)");
        LOCKSTEP_CHECK_AS(UsageError, reinterpret_cast<std::uintptr_t>(partials) % alignof(Value) == 0,
                          "a reduction's partials are not aligned for ", sizeof(Value),
                          "-byte values; lay a scratch out with kernels::device::ScratchLayout");
        return static_cast<Value*>(partials);
    }
};

// Note [one scratch layout]
// A replica's scratch is ONE device allocation: the tickets, then the partials on a 256-byte
// boundary (cudaMalloc's own alignment, enough for any partial a kernel stores: 8- and 16-byte
// values). The device (kernels::Ops<Cuda>::ReplicaResources) and the emulator (HostScratch) both
// take their offsets from ScratchLayout, so a layout that misaligns the partials fails in the
// host tests (the static_assert below, `Scratch::partials_as`, and UBSan's alignment check of the
// emulation label) instead of on a GPU only. The first GPU run crashed on exactly that: the
// partials began at byte 262140, after 65535 four-byte tickets.

//! The layout of a replica's scratch (Note [one scratch layout]).
struct ScratchLayout {
    static constexpr std::size_t alignment = 256;
    static constexpr std::size_t counters_offset = 0;
    static constexpr std::size_t counter_bytes = sizeof(unsigned int) * scratch_counters;
    static constexpr std::size_t partials_offset = (counter_bytes + alignment - 1) / alignment * alignment;
    static constexpr std::size_t partial_bytes = scratch_partial_bytes;
    static constexpr std::size_t total_bytes = partials_offset + partial_bytes;

    //! The scratch over an allocation of `total_bytes` at `base` (aligned to `alignment`).
    static Scratch view(void* base) {
        LOCKSTEP_CHECK_AS(UsageError, reinterpret_cast<std::uintptr_t>(base) % alignment == 0,
                          "a replica's scratch must start on a ", alignment, "-byte boundary");
        auto* bytes = static_cast<unsigned char*>(base);
        return {reinterpret_cast<unsigned int*>(bytes + counters_offset), scratch_counters, bytes + partials_offset,
                partial_bytes};
    }
};
static_assert(ScratchLayout::partials_offset % ScratchLayout::alignment == 0 &&
                  ScratchLayout::partials_offset >= ScratchLayout::counter_bytes,
              "the partials must follow the tickets on a 256-byte boundary (Note [one scratch layout])");

//! The emulator's scratch: one host allocation laid out as a replica's (Note [one scratch
//! layout]), tickets zeroed, partials filled with NaN bytes as fresh device memory may hold.
class HostScratch {
public:
    HostScratch()
        : block_(static_cast<unsigned char*>(
              std::aligned_alloc(ScratchLayout::alignment, (ScratchLayout::total_bytes + ScratchLayout::alignment - 1) /
                                                               ScratchLayout::alignment * ScratchLayout::alignment))) {
        LOCKSTEP_CHECK_AS(OutOfMemory, block_ != nullptr, "no host memory for an emulated replica's scratch");
        std::memset(block_.get(), 0, ScratchLayout::counter_bytes);
        std::memset(block_.get() + ScratchLayout::partials_offset, 0xff, ScratchLayout::partial_bytes);
    }
    Scratch view() { return ScratchLayout::view(block_.get()); }

private:
    struct Free {
        void operator()(unsigned char* p) const noexcept { std::free(p); }
    };
    std::unique_ptr<unsigned char[], Free> block_;
};

// ---- storage types: fp32, fp16, bf16 with fp32 math -------------------------------------------

LOCKSTEP_HD inline float to_float(float v) { return v; }
LOCKSTEP_HD inline float to_float(__half v) { return __half2float(v); }
LOCKSTEP_HD inline float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <class T>
LOCKSTEP_HD inline T from_float(float v) {
    if constexpr (std::is_same_v<T, float>)
        return v;
    else if constexpr (std::is_same_v<T, __half>)
        return __float2half_rn(v);
    else
        return __float2bfloat16_rn(v);
}

//! Elements of T in 16 bytes: the widest vector a thread loads or stores.
template <class T>
inline constexpr int vec16 = static_cast<int>(16 / sizeof(T));

//! V consecutive elements of T, loaded or stored as one access (16 bytes when V = vec16<T>).
template <class T, int V>
struct alignas(sizeof(T) * V) Pack {
    T v[V];
};

//! On the host (the emulator, the host CUDA device) a vector access off its alignment ends the
//! process, as it would fault on the device: the host's loads would let it pass unseen.
template <int V, class T>
LOCKSTEP_HD inline void check_pack_alignment([[maybe_unused]] const T* p) {
#if !defined(__CUDA_ARCH__)
    if (reinterpret_cast<std::uintptr_t>(p) % sizeof(Pack<T, V>) != 0) {
        std::fprintf(stderr, "lockstep: a kernel accessed a %d-element vector at %p, off its %zu-byte alignment\n", V,
                     static_cast<const void*>(p), sizeof(Pack<T, V>));
        std::abort();
    }
#endif
}

template <int V, class T>
LOCKSTEP_HD inline Pack<T, V> load_pack(const T* p) {
    if constexpr (V == 1) {
        return Pack<T, 1>{{*p}};
    } else {
        check_pack_alignment<V>(p);
        return *reinterpret_cast<const Pack<T, V>*>(p);
    }
}
template <int V, class T>
LOCKSTEP_HD inline void store_pack(T* p, const Pack<T, V>& v) {
    if constexpr (V == 1) {
        *p = v.v[0];
    } else {
        check_pack_alignment<V>(p);
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

//! The seed of the emulator's block and thread orders: LOCKSTEP_TEST_SEED when set (a failing
//! run's orders replay), else drawn once per process.
inline std::uint64_t emulation_seed() {
    static const std::uint64_t seed = []() -> std::uint64_t {
        if (const char* s = std::getenv("LOCKSTEP_TEST_SEED"); s != nullptr && *s != '\0') return std::strtoull(s, nullptr, 0);
        const std::uint64_t drawn = (static_cast<std::uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}();
        std::fprintf(
            stderr,
            "lockstep: emulated kernels run their blocks in the order of seed %llu (LOCKSTEP_TEST_SEED=%llu replays it)\n",
            static_cast<unsigned long long>(drawn), static_cast<unsigned long long>(drawn));
        return drawn;
    }();
    return seed;
}

namespace detail {
//! A random order of 0..n-1 from the calling thread's emulation generator.
inline const std::vector<int>& shuffled(int n, std::vector<int>& order) {
    thread_local std::mt19937_64 rng(emulation_seed());
    order.resize(static_cast<std::size_t>(n));
    for (int i = 0; i < n; ++i) order[static_cast<std::size_t>(i)] = i;
    std::shuffle(order.begin(), order.end(), rng);
    return order;
}
}  // namespace detail

//! Runs map kernel K over `grid` on the host: the blocks in a random order (emulation_seed), each
//! block's threads in a random order, one after another. A kernel whose result depends on either
//! order is wrong on the device too.
template <class K>
void emulate_map(const typename K::Params& p, const Grid& grid) {
    if (grid.x <= 0 || grid.y <= 0) return;
    std::vector<int> blocks, threads;
    for (const int b : detail::shuffled(grid.x * grid.y, blocks)) {
        const int bx = b % grid.x, by = b / grid.x;
        for (const int t : detail::shuffled(grid.threads, threads)) K::run(p, Where{bx, by, grid.x, grid.y, t});
    }
}

//! Runs reducing kernel K over `grid` on the host (Note [kernels proven on the host]): blocks in a
//! random order, so the last block of a group to take its ticket changes from run to run, and
//! each phase's threads in a random order.
template <class K>
void emulate_reduce(const typename K::Params& p, const Grid& grid) {
    using Value = typename K::Value;
    constexpr int lanes = K::lanes, rows = K::rows;
    static_assert(lanes * rows == K::threads, "a reducing kernel's block is lanes x rows threads");
    if (grid.x <= 0 || grid.y <= 0) return;
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
    std::vector<int> blocks, threads;
    for (const int b : detail::shuffled(grid.x * grid.y, blocks)) {
        const int bx = b % grid.x, by = b / grid.x;
        const Where w0{bx, by, grid.x, grid.y, 0};
        for (const int t : detail::shuffled(K::threads, threads))
            values[static_cast<std::size_t>(t)] = K::accumulate(p, Where{bx, by, grid.x, grid.y, t});
        const auto partial = column_sums();
        for (int lane = 0; lane < lanes; ++lane) K::store_partial(p, w0, lane, partial[static_cast<std::size_t>(lane)]);
        if (!take_ticket(K::counter(p, w0), grid.x)) continue;
        for (const int t : detail::shuffled(K::threads, threads))
            values[static_cast<std::size_t>(t)] = K::gather(p, w0, t % lanes, t / lanes);
        const auto total = column_sums();
        for (int lane = 0; lane < lanes; ++lane) K::finish(p, w0, lane, total[static_cast<std::size_t>(lane)]);
        *K::counter(p, w0) = 0;
    }
}

}  // namespace lockstep::kernels::device
