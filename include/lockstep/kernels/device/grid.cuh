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
#if !defined(__CUDA_ARCH__)
#include "lockstep/kernels/device/emulated_memory.cuh"
#endif

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
// Both run the same drivers, `map_block` and `reduce_block` (Note [one barrier placement]): the
// emulator checks the barriers, fences and ticket the device relies on, not a sequential
// stand-in. It models global memory within a launch (Note [the emulator's memory model]): a
// read of another block's store that was not released to the reader, or of a byte no block
// wrote, and two blocks writing one byte, end the process as a misaligned access does; every
// global store of a kernel goes through `store` or `store_pack` so that the emulator sees it.
// What it does not model: blocks running at once (reads through plain loads of another block's
// store in the same launch are not checked) and races between threads of one block outside the
// drivers' shared flag and reduction storage.
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

//! Reports a global store of `bytes` bytes at `p` to the emulator's memory model (Note [the
//! emulator's memory model]); nothing on the device.
LOCKSTEP_HD inline void note_store([[maybe_unused]] const void* p, [[maybe_unused]] std::size_t bytes) {
#if !defined(__CUDA_ARCH__)
    if (emulated::Memory* m = emulated::active) m->store(p, bytes);
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
    note_store(p, sizeof(T) * V);
    if constexpr (V == 1) {
        *p = v.v[0];
    } else {
        check_pack_alignment<V>(p);
        *reinterpret_cast<Pack<T, V>*>(p) = v;
    }
}

//! Stores one value to global memory. Every global store of a kernel goes through this or
//! `store_pack`, so that the emulator sees it (Note [the emulator's memory model]).
template <class T>
LOCKSTEP_HD inline void store(T* p, const std::type_identity_t<T>& v) {
    note_store(p, sizeof(T));
    *p = v;
}

//! Whether `p` may be read in vectors of V elements (16-byte aligned for the widest).
template <class T>
inline bool aligned_for(const T* p, int V) {
    return reinterpret_cast<std::uintptr_t>(p) % (sizeof(T) * static_cast<std::size_t>(V)) == 0;
}

// ---- the device primitives a kernel body uses, with their host meaning ------------------------

//! Reads a value another block wrote in this launch (through L2 on the device, never a stale L1 line).
//! In the emulator, a read of a value no block wrote in this launch, or of another block's
//! store not released to this thread, ends the process (Note [the emulator's memory model]).
template <class T>
LOCKSTEP_HD inline T load_other_block(const T* p) {
#if defined(__CUDA_ARCH__)
    return __ldcg(p);
#else
    if (emulated::Memory* m = emulated::active) m->read_other(p, sizeof(T));
    return *p;
#endif
}

//! Orders this thread's earlier global writes before its later ones, for every other block.
LOCKSTEP_HD inline void fence() {
#if defined(__CUDA_ARCH__)
    __threadfence();
#else
    if (emulated::Memory* m = emulated::active) m->fence();
#endif
}

//! Takes a ticket on `counter`: true for the block that takes the last of `blocks` tickets.
LOCKSTEP_HD inline bool take_ticket(unsigned int* counter, int blocks) {
#if defined(__CUDA_ARCH__)
    return atomicAdd(counter, 1u) == static_cast<unsigned int>(blocks - 1);
#else
    if (emulated::Memory* m = emulated::active) m->ticket();
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

// ---- the drivers: one barrier placement for the device and the emulator -------------------------

// Note [one barrier placement]
// The order of a kernel's phases, barriers, fences and ticket is written once, in the drivers
// below: templates over a block, which the device and the emulator each implement.
// - launch.cuh's `DeviceBlock` is one thread of a CUDA block: `each` runs the thread's own
//   phase, `sync` is __syncthreads, `column_sum` a CUB block reduction (or a column sum through
//   shared memory), `fence` __threadfence, `ticket` an atomicAdd, `last` a shared flag.
// - the emulator's `EmulatedBlock` (below) is the whole block: `each` runs the phase over all
//   the block's threads in a seeded random order; `sync` starts a new barrier epoch; fences,
//   tickets and epochs are reported to the memory model (Note [the emulator's memory model]),
//   which orders two threads' events only across a barrier; the block reduction's storage may be
//   reused, and the flag read, only after a barrier.
// So a barrier or fence moved or dropped here changes what the emulator checks, and the
// emulation tests fail (docs/design.md, "Mutation checks").
// A block offers: `each(f)` (f(where) per thread), `sync()`, `fence(w)`, `ticket(w, counter,
// blocks)` (true for the last of `blocks`), `reset_ticket(w, counter)`, `value(w)` (a Value per
// thread), `column_sum()` (each lane's values summed over its rows, into row 0), and
// `set_last(w, flag)` / `last()` (a flag thread 0 writes and every thread reads).

//! Map kernel K over a block: every thread runs K::run.
template <class K, class Block>
LOCKSTEP_HD void map_block(const typename K::Params& p, Block& b) {
    b.each([&](const Where& w) { K::run(p, w); });
}

//! Reducing kernel K over a block of a (chunks, groups) grid: accumulate, sum over the block's
//! rows, store the block's partials, take a ticket; the last block of the group gathers the
//! group's partials in chunk order, sums them and finishes (Note [kernels proven on the host]).
template <class K, class Block>
LOCKSTEP_HD void reduce_block(const typename K::Params& p, Block& b) {
    b.each([&](const Where& w) { b.value(w) = K::accumulate(p, w); });
    b.column_sum();
    b.each([&](const Where& w) {
        if (w.t / K::lanes != 0) return;
        K::store_partial(p, w, w.t % K::lanes, b.value(w));
        b.fence(w);  // the partial is visible to every block before this block's ticket
    });
    b.sync();
    b.each([&](const Where& w) {
        if (w.t == 0) b.set_last(w, b.ticket(w, K::counter(p, w), w.gx));
    });
    b.sync();
    if (!b.last()) return;
    b.each([&](const Where& w) {
        b.fence(w);  // the partials the other blocks published before their tickets
        b.value(w) = K::gather(p, w, w.t % K::lanes, w.t / K::lanes);
    });
    b.column_sum();
    b.each([&](const Where& w) {
        if (w.t / K::lanes == 0) K::finish(p, w, w.t % K::lanes, b.value(w));
        if (w.t == 0) b.reset_ticket(w, K::counter(p, w));  // ready for the next launch on this stream
    });
}

// ---- the host emulator -------------------------------------------------------------------------
#if !defined(__CUDA_ARCH__)


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
//! The emulator's block (Note [one barrier placement]): the whole block, phase by phase.
template <class Value>
class EmulatedBlock {
public:
    EmulatedBlock(emulated::Memory& memory, const Grid& grid, int threads, int lanes, std::vector<Value>& values,
                  std::vector<int>& order)
        : memory_(memory), gx_(grid.x), gy_(grid.y), threads_(threads), lanes_(lanes), values_(values), order_(order) {}

    //! Block (bx, by) begins.
    void start(int bx, int by) {
        bx_ = bx, by_ = by;
        summed_ = false, last_ = false, last_writer_ = -1;
        memory_.enter_block(by * gx_ + bx, threads_);
    }
    template <class F>
    void each(F&& f) {
        for (const int t : shuffled(threads_, order_)) {
            memory_.set_thread(t);
            f(Where{bx_, by_, gx_, gy_, t});
        }
    }
    void sync() {
        ++epoch_;
        memory_.sync();
    }
    void fence(const Where&) { device::fence(); }
    bool ticket(const Where&, unsigned int* counter, int blocks) { return take_ticket(counter, blocks); }
    void reset_ticket(const Where&, unsigned int* counter) { *counter = 0; }
    Value& value(const Where& w) { return values_[static_cast<std::size_t>(w.t)]; }
    //! Sums each lane's values over its rows in row order, into row 0 (the device's result is valid there only).
    void column_sum() {
        if (summed_ && summed_epoch_ == epoch_) fail("reuses its block reduction's shared storage with no barrier since the last use");
        summed_ = true, summed_epoch_ = epoch_;
        const int rows = threads_ / lanes_;
        for (int lane = 0; lane < lanes_; ++lane) {
            Value s = values_[static_cast<std::size_t>(lane)];
            for (int row = 1; row < rows; ++row) s = s + values_[static_cast<std::size_t>(row * lanes_ + lane)];
            values_[static_cast<std::size_t>(lane)] = s;
        }
    }
    void set_last(const Where& w, bool last) { last_ = last, last_writer_ = w.t, last_epoch_ = epoch_; }
    bool last() const {
        if (last_writer_ >= 0 && last_epoch_ == epoch_ && threads_ > 1) fail("reads the shared flag one thread wrote with no barrier between");
        return last_;
    }

private:
    [[noreturn]] void fail(const char* what) const {
        std::fprintf(stderr, "lockstep: block (%d, %d) of an emulated launch %s\n", bx_, by_, what);
        std::abort();
    }

    emulated::Memory& memory_;
    int gx_, gy_, threads_, lanes_;
    std::vector<Value>& values_;
    std::vector<int>& order_;
    int bx_ = 0, by_ = 0;
    std::uint64_t epoch_ = 0, summed_epoch_ = 0, last_epoch_ = 0;
    bool summed_ = false, last_ = false;
    int last_writer_ = -1;
};
}  // namespace detail

//! Runs map kernel K over `grid` on the host: the blocks in a random order (emulation_seed), each
//! block's threads in a random order, one after another, under the memory model. A kernel whose
//! result depends on either order is wrong on the device too.
template <class K>
void emulate_map(const typename K::Params& p, const Grid& grid) {
    if (grid.x <= 0 || grid.y <= 0) return;
    emulated::Launch launch(grid.x * grid.y, grid.x, false);
    std::vector<int> blocks, threads;
    std::vector<char> none;
    detail::EmulatedBlock<char> block(launch.memory(), grid, grid.threads, 1, none, threads);
    for (const int b : detail::shuffled(grid.x * grid.y, blocks)) {
        block.start(b % grid.x, b / grid.x);
        map_block<K>(p, block);
    }
}

//! Runs reducing kernel K over `grid` on the host (Note [kernels proven on the host]): blocks in a
//! random order, so the last block of a group to take its ticket changes from run to run, each
//! through the reduce driver (Note [one barrier placement]) under the memory model.
template <class K>
void emulate_reduce(const typename K::Params& p, const Grid& grid) {
    static_assert(K::lanes * K::rows == K::threads, "a reducing kernel's block is lanes x rows threads");
    if (grid.x <= 0 || grid.y <= 0) return;
    emulated::Launch launch(grid.x * grid.y, grid.x, true);
    std::vector<int> blocks, threads;
    std::vector<typename K::Value> values(static_cast<std::size_t>(K::threads));
    detail::EmulatedBlock<typename K::Value> block(launch.memory(), grid, K::threads, K::lanes, values, threads);
    for (const int b : detail::shuffled(grid.x * grid.y, blocks)) {
        block.start(b % grid.x, b / grid.x);
        reduce_block<K>(p, block);
    }
}

#endif  // !__CUDA_ARCH__

}  // namespace lockstep::kernels::device
