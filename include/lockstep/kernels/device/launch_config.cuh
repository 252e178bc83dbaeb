// SPDX-License-Identifier: MIT
//! The launch configurations the layer, loss, optimizer and rank-sum kernels share (Note [layer
//! kernels]): blocks, grids, vector widths and index limits, the per-thread helpers of their
//! grid-stride loops and the fp64 values their reductions carry.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <initializer_list>

#include "lockstep/core/error.hpp"
#include "lockstep/kernels/device/grid.cuh"

namespace lockstep::kernels::device::layer_kernels {

// Note [layer kernels]
// Launch configurations (the grid functions below are what both the device and the emulator use):
// - Every map kernel is a grid-stride loop over its items with blocks of 256 threads and
//   min_blocks = 4 (so at most 64 registers a thread: 4 blocks are resident on every
//   multiprocessor), and the grid is as many blocks as the items need, capped at 4 blocks per
//   multiprocessor (`map_grid`): the whole grid is resident in one wave, and a launch's size does
//   not grow with the tensor.
// - Elementwise maps (fill, scale, add, ReLU, SGD, clipping, the loss gradients) take 16-byte
//   vectors where every pointer they touch is aligned for them (the ReLU mask: V bytes for V
//   floats), and the n % V elements left over go to the grid's first threads, one each.
// - Kernels that decompose an index (pooling, im2col, col2im, bias, transposition, per-channel
//   sums) do it with `Divider`s fixed for the launch, so their index spaces stay below 2^31
//   (checked: ShapeError beyond).
// - Reducing kernels (per-channel sums, sums of squares, loss totals) run over a (chunks,
//   groups) grid: blocks of 1 lane x 256 rows (32 channel lanes x 8 rows for the per-channel sums
//   of (N, C) rows), each block strides over its group's items, chunks capped so that all groups
//   together stay at 4 blocks per multiprocessor and their partials fit the replica's scratch
//   (`reduce_grid`). The sums are fp64.
// - Backward passes that would scatter (max-pool backward, col2im) are gathers: each output
//   element sums what lands on it in the order the host's scatter adds it, so the result is the
//   host's bit for bit and needs no atomics.
// - Losses run a thread per sample (softmax cross-entropy: three passes over a row; a block per
//   row would need barriers between the passes, which map kernels do not have); the per-sample
//   results are summed by the same kernel as a reducing kernel, and its last block writes the
//   totals (=, as the host).
// - SGD multiplies and adds with round-to-nearest intrinsics on the device, never contracted into
//   FMAs, so it rounds exactly as the host's loop (which is compiled without FMA contraction).
// - SGD and the gradient buckets' pack and unpack take many tensors per launch (Note [tensor tables]).
// - The device-local all-reduce of replicas sharing a GPU is a map kernel like these
//   (comm_kernels.cuh, Note [rank-order sum]).

inline constexpr int threads = 256;
//! Blocks each multiprocessor must hold at once: the register budget is 65536 / (256 x 4) = 64.
inline constexpr int min_blocks = 4;
inline constexpr int blocks_per_sm = 4;
inline constexpr int tile = 32;  // channel lanes of the (N, C) per-channel sums
inline constexpr int tile_rows = threads / tile;
//! Index spaces decomposed with `Divider` stay below this.
inline constexpr std::int64_t index_limit = 2147483647;

// ---- launch configurations ----------------------------------------------------------------------

//! The most blocks one launch on `info` has: 4 per multiprocessor.
inline int max_blocks(const DeviceInfo& info) { return std::max(1, blocks_per_sm * info.multiprocessors); }

//! A grid-stride map over `items` items (Note [layer kernels]); no blocks when there are none.
inline Grid map_grid(std::int64_t items, const DeviceInfo& info) {
    Grid g;
    g.threads = threads;
    g.x = items <= 0 ? 0 : static_cast<int>(std::min<std::int64_t>((items + threads - 1) / threads, max_blocks(info)));
    return g;
}

//! The items of an elementwise map over n elements in vectors of V: n / V vectors and n % V
//! tail elements (which the first threads take, one each).
inline std::int64_t vector_items(std::int64_t n, int V) { return n / V + n % V; }

//! A reducing kernel's grid (Note [layer kernels]): `groups` groups (grid y) of `items` items each,
//! `rows` threads a block per lane, `lanes` partials a block, each thread taking about
//! `per_thread` items; no blocks when there is nothing to sum.
inline Grid reduce_grid(std::int64_t items, std::int64_t groups, int rows, int lanes, int per_thread, std::size_t value_bytes,
                        const DeviceInfo& info) {
    Grid g;
    g.threads = rows * lanes;
    LOCKSTEP_CHECK_AS(ShapeError, groups <= scratch_counters, "a CUDA reduction takes at most ", scratch_counters,
                      " groups (channels or tiles of ", lanes, " channels), got ", groups);
    const std::int64_t slots = static_cast<std::int64_t>(scratch_partial_bytes / value_bytes) / lanes;
    LOCKSTEP_CHECK_AS(ShapeError, groups <= slots, "a CUDA reduction over ", groups, " groups of ", lanes,
                      " lanes does not fit the replica's scratch of ", scratch_partial_bytes, " bytes");
    g.y = static_cast<int>(std::max<std::int64_t>(groups, 1));
    if (items <= 0 || groups <= 0) {
        g.x = 0;
        return g;
    }
    const std::int64_t by_work =
        std::max<std::int64_t>(1, (items + std::int64_t{rows} * per_thread - 1) / (std::int64_t{rows} * per_thread));
    const std::int64_t by_occupancy = std::max<std::int64_t>(1, (max_blocks(info) + groups - 1) / groups);
    const std::int64_t by_scratch = std::max<std::int64_t>(1, slots / groups);
    g.x = static_cast<int>(std::min({by_work, by_occupancy, by_scratch}));
    return g;
}

//! Whether every non-null pointer is aligned to `bytes`.
inline bool all_aligned(std::size_t bytes, std::initializer_list<const void*> pointers) {
    for (const void* q : pointers)
        if (q != nullptr && reinterpret_cast<std::uintptr_t>(q) % bytes != 0) return false;
    return true;
}

//! A Divider for a size that may be 0 (nothing is divided then).
inline Divider divider(std::int64_t d) { return Divider(static_cast<unsigned int>(std::max<std::int64_t>(d, 1))); }

//! Throws ShapeError when an index space is too large for the launch's 32-bit index math.
inline void check_index_space(std::int64_t items, const char* what) {
    LOCKSTEP_CHECK_AS(ShapeError, items <= index_limit, what, " on CUDA handles fewer than 2^31 elements, got ", items,
                      "; split the batch over more replicas or smaller shards");
}

// ---- per-thread helpers and the reductions' values ----------------------------------------------

//! A map thread's first item, and the items between its iterations (the grid's threads).
LOCKSTEP_HD inline std::int64_t first_index(const Where& w) { return static_cast<std::int64_t>(w.bx) * threads + w.t; }
LOCKSTEP_HD inline std::int64_t grid_threads(const Where& w) { return static_cast<std::int64_t>(w.gx) * threads; }

//! One fp64 sum (per-channel sums, sums of squares, the MSE total).
struct Sum1 {
    double v = 0;
    LOCKSTEP_HD Sum1 operator+(const Sum1& o) const { return {v + o.v}; }
};
//! Two fp64 sums (the cross-entropy's loss and correct count).
struct Sum2 {
    double a = 0, b = 0;
    LOCKSTEP_HD Sum2 operator+(const Sum2& o) const { return {a + o.a, b + o.b}; }
};

// Note [kernel runners]
// A runner launches kernels and GEMMs: `run.template map<K>(params, grid)`, `run.template
// reduce<K>(params, grid)`, `run.gemm(call)`, and says `run.info()` (the device's DeviceInfo) and
// `run.scratch()`. The CUDA operations (cuda_layer_ops.cuh) use the device runner, the emulation
// tests a host one whose GEMM is a column-major reference, so both go through the same kernels,
// vector widths, grids and GEMM arguments.

}  // namespace lockstep::kernels::device::layer_kernels
