// SPDX-License-Identifier: MIT
//! The SyncBatchNorm kernels of the CUDA backend, written once for the device and the host
//! emulator (Note [kernels proven on the host]). Storage fp32, fp16 or bf16; math fp32 per
//! element, fp64 per channel; NCHW and channels-last. Their grids and the operations that launch
//! them: bn_passes.cuh.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

#include "lockstep/core/error.hpp"
#include "lockstep/kernels/batch_norm_math.hpp"
#include "lockstep/kernels/device/bn_channel_kernels.cuh"
#include "lockstep/kernels/device/grid.cuh"
#include "lockstep/kernels/ops.hpp"

namespace lockstep::kernels::device::bn_kernels {

// Note [batch-norm kernels]
// A training step runs five tensor passes per layer, each reading or writing the tensors once:
//   forward:  stats (read x) -> all-reduce -> centre (per channel) -> all-reduce -> normalize (read x, write y)
//   backward: sums (read x, dy) -> all-reduce -> dx (read x, dy, write dx)
// plus two per-channel kernels, the centring and dgamma, dbeta. Other per-channel work happens
// where it is needed, not in kernels of its own: the stats kernel's last block per channel writes the payload (sums about
// the local shift, and the channel's total: Note [shifted statistics]); between the two forward
// all-reduces, one thread per channel re-centres the sums on the batch's shift (`Centre`, in
// bn_channel_kernels.cuh); the normalize kernel's prologue finishes the statistics
// from the all-reduced payload (mean, invstd, scale, shift), and one thread per channel (the
// first block's first thread) writes the constants backward needs and updates the running
// statistics; the dx kernel's prologue turns the all-reduced backward payload into the three
// per-channel constants of `bn::backward_constants`.
// Grids (Note [kernels proven on the host]):
// - channels-first (NCHW, P > 1): grid (chunks, C), blocks of 256 threads; a channel's N planes
//   of P values are split into `chunks` contiguous ranges of items, an item being one aligned
//   window of V elements (Note [channels-first windows]; V from bn_passes.cuh: vector_width). Many
//   blocks per channel keep every multiprocessor busy when C is small (one block per channel would
//   leave most of an H200 idle at C = 64).
// - channels-last (NHWC, 2-D input, P = 1): grid (chunks, groups of L V channels), a lane taking
//   V consecutive channels (V = nhwc_vec where it fits, else 1: Note [channels-last vectors]) and
//   L lanes a row, the fewest that cover C (at most 32: Note [channels-last lanes]), so a block of
//   256 threads reads 256 / L rows at a time; a chunk is a range of rows, and the reduction sums
//   each lane's column.
// Chunks are sized for about 8 blocks per multiprocessor in all (full occupancy at 256 threads),
// at least 4 items per thread, and partials that fit the replica's scratch.
// Each thread sums in fp32 over at most `flush` items and flushes into fp64, so no long sum is
// ever formed in fp32; block and grid sums are fp64.

inline constexpr int threads = 256;
inline constexpr int tile = 32;  // channels-last lanes
inline constexpr int tile_rows = threads / tile;
//! Channels a channels-last thread handles in one vector, where C is a multiple of it and the
//! tensors are aligned (Note [channels-last vectors]).
inline constexpr int nhwc_vec = 4;
//! The backward sums' width: 2 for 16-bit storage, whose conversions with 4 channels' fp64 sums
//! and the recomputed ReLU mask would spill past the 64-register budget.
template <class T>
inline constexpr int nhwc_sums_vec = sizeof(T) == 2 ? 2 : nhwc_vec;
inline constexpr int flush = 16;  // items a thread sums in fp32 before adding into fp64
inline constexpr int blocks_per_sm = 8;
//! Register budget of the tensor passes: 4 blocks of 256 threads resident per multiprocessor,
//! so at most 64 registers a thread (half occupancy; with 16-byte loads in flight that keeps HBM busy).
inline constexpr int min_blocks = 4;

//! Two fp64 sums: (S, Q) of the forward statistics or (sum dy, sum dy (x - mean_hi)) of backward.
struct Sums2 {
    double a = 0, b = 0;
    LOCKSTEP_HD Sums2 operator+(const Sums2& o) const { return {a + o.a, b + o.b}; }
};

//! Sums2 of V consecutive channels: what a channels-last thread accumulates.
template <int V>
struct SumsV {
    Sums2 c[V];
    LOCKSTEP_HD SumsV operator+(const SumsV& o) const {
        SumsV r;
        LOCKSTEP_UNROLL
        for (int e = 0; e < V; ++e) r.c[e] = c[e] + o.c[e];
        return r;
    }
};

// Note [channels-first windows]
// A channels-first item is a window of V elements aligned to V, loaded and stored as one vector.
// Where P is a multiple of V (and the tensor is aligned, as vector_width requires), a plane is
// exactly P / V windows. Where it is not (7 x 7 planes; 3 x 6 planes of fp16/bf16), plane (n, c)
// starts at element s = (n C + c) P, anywhere in a window: it covers the windows from the one
// holding s to the one holding s + P - 1, at most (P + 2V - 2) / V of them, and every plane gets
// that many items. Item k of the plane is the window at floor(s / V) V + k V, of which the plane's
// elements are [lo, hi) (none for the items past its last window). A window wholly inside the
// plane is one vector access; one that the plane only partly covers (its first and last) reads and
// writes the plane's own elements one by one, so no pass touches another channel's values (the dx
// pass may run in place while the neighbouring channel's blocks write theirs) or anything past the
// tensor. The passes sum and write exactly the plane's elements either way.

//! Channels-first: the window of item j of a channel (Note [channels-first windows]).
struct Window {
    std::int64_t at = 0;  // its first element, a multiple of V
    int lo = 0, hi = 0;   // the plane's elements are at + lo .. at + hi - 1 (none where hi <= lo)
    LOCKSTEP_HD bool has(int e) const { return e >= lo && e < hi; }
    //! Whether the plane covers the whole window (one vector access).
    template <int V>
    LOCKSTEP_HD bool whole() const {
        return lo == 0 && hi == V;
    }
};

//! V elements of the window from `p`: one vector where the plane covers it, else the plane's own
//! elements (the others are zero and unused).
template <int V, class T>
LOCKSTEP_HD inline Pack<T, V> load_window(const T* p, const Window& w) {
    if (w.template whole<V>()) return load_pack<V>(p + w.at);
    Pack<T, V> r;
    LOCKSTEP_UNROLL
    for (int e = 0; e < V; ++e) r.v[e] = w.has(e) ? p[w.at + e] : from_float<T>(0.0f);
    return r;
}

//! Stores the plane's elements of `v` into the window at `p`: one vector where the plane covers it.
template <int V, class T>
LOCKSTEP_HD inline void store_window(T* p, const Window& w, const Pack<T, V>& v) {
    if (w.template whole<V>()) return store_pack<V>(p + w.at, v);
    LOCKSTEP_UNROLL
    for (int e = 0; e < V; ++e)
        if (w.has(e)) store(p + w.at + e, v.v[e]);
}

//! Where a launch's items are: a channel's N planes of windows split into chunks (channels-first),
//! or the rows of C values split into chunks (channels-last).
struct Span {
    std::int64_t N = 0, C = 0, P = 1;
    unsigned int items = 0;        // per channel (channels-first, in windows) or rows (channels-last)
    unsigned int chunk_items = 0;  // items per chunk (grid x)
    Divider per_plane;             // channels-first: windows per (n, c) plane
    bool reverse = false;          // blocks visit chunks and groups back to front (Note [reverse order])
    int lanes = tile;              // channels-last: the lanes of a row (Note [channels-last lanes])

    //! The chunk and group a block works on (its own, or mirrored under `reverse`).
    LOCKSTEP_HD int chunk(const Where& w) const { return reverse ? w.gx - 1 - w.bx : w.bx; }
    LOCKSTEP_HD int group(const Where& w) const { return reverse ? w.gy - 1 - w.by : w.by; }
    LOCKSTEP_HD unsigned int begin(const Where& w) const { return static_cast<unsigned int>(chunk(w)) * chunk_items; }
    //! Channels-last: thread t's lane (which V channels of the group), its first row in a chunk,
    //! and the rows between its rows (Note [channels-last lanes]).
    LOCKSTEP_HD int lane(int t) const { return t & (lanes - 1); }
    LOCKSTEP_HD unsigned int first_row(const Where& w) const {
        return begin(w) + static_cast<unsigned int>(w.t) / static_cast<unsigned int>(lanes);
    }
    LOCKSTEP_HD unsigned int row_step() const { return static_cast<unsigned int>(threads / lanes); }
    LOCKSTEP_HD unsigned int end(const Where& w) const {
        const unsigned int e = begin(w) + chunk_items;
        return e < items ? e : items;
    }
    //! Channels-first: the window of item j of channel c (Note [channels-first windows]).
    template <int V>
    LOCKSTEP_HD Window window(unsigned int j, std::int64_t c) const {
        static_assert(V > 0 && (V & (V - 1)) == 0, "a window is a power of two of elements");
        const unsigned int n = per_plane.div(j);
        const unsigned int k = j - n * per_plane.d;
        const std::int64_t start = (static_cast<std::int64_t>(n) * C + c) * P;
        // Counted in whole windows (start >= 0), not as `(start & ~(V - 1)) + k V`: from that form
        // nvcc kept a window's load one vector but split its store into V scalar stores (the static
        // gate checks the PTX for vector stores: scripts/check-kernel-resources.py).
        const std::int64_t at = (start / V + static_cast<std::int64_t>(k)) * V;
        const std::int64_t lo = start - at, hi = start + P - at;  // lo < V; hi > -V (k < per_plane)
        return {at, lo > 0 ? static_cast<int>(lo) : 0, hi < V ? static_cast<int>(hi) : V};
    }
};

// Note [reverse order]
// The normalize and dx passes read x again right after a pass that read all of it. Where x fits
// in half the L2 cache, they visit the blocks in the reverse order of that pass, so the first
// values they read are the last ones the previous pass left in L2.

// Note [channels-last vectors]
// In channels-last layout a lane handles V = nhwc_vec consecutive channels of each row it visits,
// loaded and stored as one vector (16 bytes of fp32, 8 of fp16/bf16; the backward sums of 16-bit
// storage take 2, nhwc_sums_vec), where C is a multiple of V and every tensor is aligned to V
// elements; otherwise V = 1. Each lane keeps V channels' sums and constants.

// Note [channels-last lanes]
// A group of L lanes covers L V channels of a row, L the smallest power of two with L V >= C, at
// most 32 (channels_last_lanes): thread t takes lane t % L of row t / L of its block's rows, so
// with C = 64 fp32 channels (V = 4) a warp reads two rows of 16 lanes and no thread idles, where
// 32 lanes a row would leave half of them without a channel. A reducing pass keeps its blocks'
// 32 x 8 column sums (the partials' slot of each of the 32 thread columns: ((group x chunks +
// chunk) x 32 + column) x V + e); its last block adds, for lane l < L, the columns l, l + L, ...
// of every chunk, which hold the same channels, and writes channels of lane l.

//! The first channel of lane `lane` of channel group `group` (channels-last: `lanes` lanes of V
//! channels each a group).
template <int V>
LOCKSTEP_HD inline std::int64_t lane_channel(int group, int lane, int lanes) {
    return (static_cast<std::int64_t>(group) * lanes + lane) * V;
}

//! Channels-last: the V partials of thread column `column` of chunk `chunk` of this block's group
//! (Note [channels-last lanes]).
template <int V>
LOCKSTEP_HD inline Sums2* column_slot(Sums2* partials, const Span& s, const Where& w, int chunk, int column) {
    return partials + ((static_cast<std::int64_t>(s.group(w)) * w.gx + chunk) * tile + column) * V;
}

//! Channels-last: lane `lane`'s sums over the chunks row, row + rows, ...: the columns lane,
//! lane + L, ... of each (Note [channels-last lanes]); nothing for a lane past L.
template <int V>
LOCKSTEP_HD inline SumsV<V> gather_lane(Sums2* partials, const Span& s, const Where& w, int lane, int row, int rows) {
    SumsV<V> v;
    if (lane >= s.lanes) return v;
    for (int i = row; i < w.gx; i += rows)
        for (int column = lane; column < tile; column += s.lanes) {
            const Sums2* part = column_slot<V>(partials, s, w, i, column);
            LOCKSTEP_UNROLL
            for (int e = 0; e < V; ++e) v.c[e] = v.c[e] + Sums2{load_other_block(&part[e].a), load_other_block(&part[e].b)};
        }
    return v;
}

//! k[e] = f(e) for the V channels of a channels-last lane, one channel after another. The fp64
//! prologue of the normalize and dx passes unrolled V times over needs more registers than their
//! budget on sm_100 and sm_120 (an 8-byte stack frame there); a rolled loop storing k[e] would put
//! k in local memory, so each k[i] is set by a compile-time select (the inner loop, unrolled).
template <int V, class K, class F>
LOCKSTEP_HD inline void each_channel(K (&k)[V], const F& f) {
    LOCKSTEP_NO_UNROLL
    for (int e = 0; e < V; ++e) {
        const K ke = f(e);
        LOCKSTEP_UNROLL
        for (int i = 0; i < V; ++i)
            if (i == e) k[i] = ke;
    }
}

//! The lanes of a channels-last row over C channels of V a lane (Note [channels-last lanes]).
inline int channels_last_lanes(std::int64_t C, int V) {
    int lanes = tile;
    while (lanes > 1 && std::int64_t{lanes / 2} * V >= C) lanes /= 2;
    return lanes;
}

// ---- forward statistics (reducing) -----------------------------------------------------------

template <class T>
struct StatsParams {
    const T* x = nullptr;
    Span span;
    double* payload = nullptr;   // [S | Q | M | n], 3C + 1 (bn::ForwardPayload)
    float* shift_out = nullptr;  // the local shift k per channel, for the centring kernel
    Sums2* partials = nullptr;
    unsigned int* counters = nullptr;
};

//! The local shift k of channel c: the shard's first value of the channel (close to its values,
//! so fp32 partial sums stay small).
template <class T>
LOCKSTEP_HD inline float first_value(const T* x, const Span& s, std::int64_t c, bool channels_last) {
    return to_float(x[channels_last ? c : c * s.P]);
}

template <class T, int V>
struct StatsChannelsFirst {
    using Params = StatsParams<T>;
    using Value = Sums2;
    static constexpr int threads = bn_kernels::threads, lanes = 1, rows = threads, min_blocks = bn_kernels::min_blocks;

    LOCKSTEP_HD static Value accumulate(const Params& p, const Where& w) {
        const std::int64_t c = p.span.group(w);
        const float k = first_value(p.x, p.span, c, false);
        Value total;
        float s = 0, q = 0;
        int pending = 0;
        const auto add = [&](float x) {
            const float d = x - k;
            s += d;
            q += d * d;
        };
        for (unsigned int j = p.span.begin(w) + static_cast<unsigned int>(w.t); j < p.span.end(w); j += threads) {
            const Window win = p.span.template window<V>(j, c);
            if (win.template whole<V>()) {
                const auto v = load_pack<V>(p.x + win.at);
                LOCKSTEP_UNROLL
                for (int e = 0; e < V; ++e) add(to_float(v.v[e]));
            } else {  // a plane's first or last window: its own elements alone
                LOCKSTEP_UNROLL
                for (int e = 0; e < V; ++e)
                    if (win.has(e)) add(to_float(p.x[win.at + e]));
            }
            if (++pending == flush) {
                total = total + Value{s, q};
                s = q = 0;
                pending = 0;
            }
        }
        return total + Value{s, q};
    }
    LOCKSTEP_HD static void store_partial(const Params& p, const Where& w, int, const Value& v) {
        store(p.partials + static_cast<std::int64_t>(p.span.group(w)) * w.gx + p.span.chunk(w), v);
    }
    LOCKSTEP_HD static unsigned int* counter(const Params& p, const Where& w) { return p.counters + p.span.group(w); }
    LOCKSTEP_HD static Value gather(const Params& p, const Where& w, int, int row) {
        Value v;
        const Sums2* part = p.partials + static_cast<std::int64_t>(p.span.group(w)) * w.gx;
        for (int i = row; i < w.gx; i += rows) v = v + Value{load_other_block(&part[i].a), load_other_block(&part[i].b)};
        return v;
    }
    LOCKSTEP_HD static void finish(const Params& p, const Where& w, int, const Value& total) {
        finish_channel(p, p.span.group(w), total, static_cast<double>(p.span.N) * static_cast<double>(p.span.P),
                       first_value(p.x, p.span, p.span.group(w), false));
    }

    //! Writes a channel's payload: its sums about the local shift k, and its total n k + s (Note
    //! [shifted statistics]); keeps k for the centring kernel.
    LOCKSTEP_HD static void finish_channel(const Params& p, std::int64_t c, const Value& total, double count, float k) {
        const bn::ForwardPayload layout{p.span.C};
        store(p.payload + layout.sum(c), total.a);
        store(p.payload + layout.sum_sq(c), total.b);
        store(p.payload + layout.total(c), count * static_cast<double>(k) + total.a);
        store(p.shift_out + c, k);
        if (c == 0) store(p.payload + layout.count(), count);
    }
};

template <class T, int V>
struct StatsChannelsLast {
    using Params = StatsParams<T>;
    using Value = SumsV<V>;
    static constexpr int threads = bn_kernels::threads, lanes = tile, rows = tile_rows, min_blocks = bn_kernels::min_blocks;

    LOCKSTEP_HD static Value accumulate(const Params& p, const Where& w) {
        const std::int64_t c0 = lane_channel<V>(p.span.group(w), p.span.lane(w.t), p.span.lanes);
        Value total;
        if (c0 >= p.span.C) return total;
        float k[V], s[V], q[V];
        LOCKSTEP_UNROLL
        for (int e = 0; e < V; ++e) k[e] = first_value(p.x, p.span, c0 + e, true), s[e] = q[e] = 0;
        int pending = 0;
        for (unsigned int r = p.span.first_row(w); r < p.span.end(w); r += p.span.row_step()) {
            const auto v = load_pack<V>(p.x + static_cast<std::int64_t>(r) * p.span.C + c0);
            LOCKSTEP_UNROLL
            for (int e = 0; e < V; ++e) {
                const float d = to_float(v.v[e]) - k[e];
                s[e] += d;
                q[e] += d * d;
            }
            if (++pending == flush) {
                LOCKSTEP_UNROLL
                for (int e = 0; e < V; ++e) total.c[e] = total.c[e] + Sums2{s[e], q[e]}, s[e] = q[e] = 0;
                pending = 0;
            }
        }
        LOCKSTEP_UNROLL
        for (int e = 0; e < V; ++e) total.c[e] = total.c[e] + Sums2{s[e], q[e]};
        return total;
    }
    LOCKSTEP_HD static void store_partial(const Params& p, const Where& w, int column, const Value& v) {
        Sums2* out = column_slot<V>(p.partials, p.span, w, p.span.chunk(w), column);
        LOCKSTEP_UNROLL
        for (int e = 0; e < V; ++e) store(out + e, v.c[e]);
    }
    LOCKSTEP_HD static unsigned int* counter(const Params& p, const Where& w) { return p.counters + p.span.group(w); }
    LOCKSTEP_HD static Value gather(const Params& p, const Where& w, int lane, int row) {
        return gather_lane<V>(p.partials, p.span, w, lane, row, rows);
    }
    LOCKSTEP_HD static void finish(const Params& p, const Where& w, int lane, const Value& total) {
        if (lane >= p.span.lanes) return;
        const std::int64_t c0 = lane_channel<V>(p.span.group(w), lane, p.span.lanes);
        if (c0 >= p.span.C) return;
        LOCKSTEP_UNROLL
        for (int e = 0; e < V; ++e)
            StatsChannelsFirst<T, 1>::finish_channel(p, c0 + e, total.c[e],
                                                     static_cast<double>(p.span.N) * static_cast<double>(p.span.P),
                                                     first_value(p.x, p.span, c0 + e, true));
    }
};

// ---- forward normalize (map), with the finish in its prologue --------------------------------

//! The statistics' finish a training forward leaves to the normalize kernel's prologue.
struct Finish {
    const double* payload = nullptr;  // all-reduced [S | Q | M | N], S and Q about mu = M/N
    float* running_mean = nullptr;    // null: running statistics not updated
    float* running_var = nullptr;
    std::int64_t* num_batches_tracked = nullptr;
    bool count_batch = false;  // this kernel adds the batch to num_batches_tracked (momentum mode)
    bool cumulative = false;   // momentum = 1 / (num_batches_tracked + 1), counted after the kernel
    double eps = 1e-5, momentum = 0.1;
};

template <class T>
struct NormalizeParams {
    const T* x = nullptr;
    T* y = nullptr;
    Span span;
    bool relu = false;    // y = max(0, y): backward finds where y > 0 from x (Note [ReLU mask from x])
    bool finish = false;  // compute the constants from `f` (training) or read `folded` (given)
    Finish f;
    const float* weight = nullptr;  // null: not affine
    const float* bias = nullptr;
    double* stats = nullptr;  // [mean | invstd | N], written by the channel's writer when finishing
    float* folded = nullptr;  // [mean_hi | mean_lo | scale | shift]: read, or written when finishing
};

struct ChannelConstants {
    float hi, scale, shift;
};

//! Channel c's normalize constants; when finishing and `writer`, also stores what backward needs
//! and updates the running statistics, once per channel (Note [batch-norm kernels]).
template <class T>
LOCKSTEP_HD inline ChannelConstants normalize_constants_of(const NormalizeParams<T>& p, std::int64_t c, bool writer) {
    const std::int64_t C = p.span.C;
    if (!p.finish) return {p.folded[c], p.folded[2 * C + c], p.folded[3 * C + c]};
    const bn::ForwardPayload layout{C};
    const double n = p.f.payload[layout.count()];
    const bn::ChannelStats st = bn::channel_stats(p.f.payload, layout, c, p.f.eps);
    const bn::SplitMean split = bn::split_mean(st.mean);
    const bn::NormalizeConstants k =
        bn::normalize_constants(st.mean, st.invstd, p.weight != nullptr ? p.weight[c] : 1.0, p.bias != nullptr ? p.bias[c] : 0.0);
    if (writer) {
        store(p.stats + c, st.mean);
        store(p.stats + C + c, st.invstd);
        store(p.folded + c, split.hi);
        store(p.folded + C + c, split.lo);
        store(p.folded + 2 * C + c, k.scale);
        store(p.folded + 3 * C + c, k.shift);
        if (c == 0) {
            store(p.stats + 2 * C, n);
            if (p.f.count_batch) store(p.f.num_batches_tracked, *p.f.num_batches_tracked + 1);
        }
        if (p.f.running_mean != nullptr) {
            const double factor = p.f.cumulative ? 1.0 / static_cast<double>(*p.f.num_batches_tracked + 1) : p.f.momentum;
            float mean = p.f.running_mean[c], var = p.f.running_var[c];
            bn::update_running(mean, var, st, n, factor);
            store(p.f.running_mean + c, mean);
            store(p.f.running_var + c, var);
        }
    }
    return {split.hi, k.scale, k.shift};
}

//! max(v, 0) with NaN kept, as the host's ReLU.
LOCKSTEP_HD inline float relu(float v) { return v > 0.0f ? v : (v == v ? 0.0f : v); }

// Note [ReLU mask from x]
// With a fused ReLU, backward needs dy only where the forward's y was positive. The forward does
// not save that mask (a byte per element would be a fifth of an fp32 activation's memory and
// traffic, a third of a bf16 one's): the backward passes read x anyway, and the normalize
// constants the forward used are still in `folded` [mean_hi | mean_lo | scale | shift], so they
// recompute y = bn::normalize(x, mean_hi, scale, shift) with the same function on the same
// floats, and the same bits (bn::normalize is one correctly rounded fma on the device). For
// 16-bit storage the mask is, as the forward's byte mask was, the fp32 y > 0 before the store.
// The emulation tests check, element for element, that backward lets dy through exactly where
// the forward's stored y > 0 (fp32) and where bn::normalize of x is positive in its channel (every
// type); on a GPU, fused SyncBatchNorm is compared with the host and with fp32 storage.

//! The forward's normalize constants of channel c, which backward recomputes the ReLU mask from,
//! held in registers for the pass (not reloaded per element: a store through dx could alias them).
struct ReluMask {
    float hi = 0, scale = 0, shift = 0;
    LOCKSTEP_HD static ReluMask of(const float* folded, std::int64_t C, std::int64_t c) {
        return {folded[c], folded[2 * C + c], folded[3 * C + c]};
    }
    //! Whether the fused ReLU let element x through: the forward's y > 0, recomputed.
    LOCKSTEP_HD bool passes(float x) const { return bn::normalize(x, hi, scale, shift) > 0.0f; }
    //! The dy backward sees at element x: dy, or 0 where a fused ReLU (`relu`) stopped it.
    LOCKSTEP_HD float gate(bool relu, float x, float dy) const { return !relu || passes(x) ? dy : 0.0f; }
};

template <class T, int V>
struct NormalizeChannelsFirst {
    using Params = NormalizeParams<T>;
    static constexpr int threads = bn_kernels::threads, min_blocks = bn_kernels::min_blocks;

    LOCKSTEP_HD static void run(const Params& p, const Where& w) {
        const std::int64_t c = p.span.group(w);
        const ChannelConstants k = normalize_constants_of(p, c, p.span.chunk(w) == 0 && w.t == 0);
        for (unsigned int j = p.span.begin(w) + static_cast<unsigned int>(w.t); j < p.span.end(w); j += threads) {
            const Window win = p.span.template window<V>(j, c);
            const auto in = load_window<V>(p.x, win);
            Pack<T, V> out;
            LOCKSTEP_UNROLL
            for (int e = 0; e < V; ++e) {
                const float v = bn::normalize(to_float(in.v[e]), k.hi, k.scale, k.shift);
                out.v[e] = from_float<T>(p.relu ? relu(v) : v);
            }
            store_window<V>(p.y, win, out);
        }
    }
};

template <class T, int V>
struct NormalizeChannelsLast {
    using Params = NormalizeParams<T>;
    static constexpr int threads = bn_kernels::threads, min_blocks = bn_kernels::min_blocks;

    LOCKSTEP_HD static void run(const Params& p, const Where& w) {
        const std::int64_t c0 = lane_channel<V>(p.span.group(w), p.span.lane(w.t), p.span.lanes);
        if (c0 >= p.span.C) return;
        ChannelConstants k[V]{};  // each_channel sets all; {} for g++'s -Wmaybe-uninitialized
        const bool writer = p.span.chunk(w) == 0 && w.t < p.span.lanes;  // the first row of the first chunk
        each_channel(k, [&](int e) { return normalize_constants_of(p, c0 + e, writer); });
        for (unsigned int r = p.span.first_row(w); r < p.span.end(w); r += p.span.row_step()) {
            const std::int64_t off = static_cast<std::int64_t>(r) * p.span.C + c0;
            const auto in = load_pack<V>(p.x + off);
            Pack<T, V> out;
            LOCKSTEP_UNROLL
            for (int e = 0; e < V; ++e) {
                const float v = bn::normalize(to_float(in.v[e]), k[e].hi, k[e].scale, k[e].shift);
                out.v[e] = from_float<T>(p.relu ? relu(v) : v);
            }
            store_pack<V>(p.y + off, out);
        }
    }
};

// ---- backward sums (reducing) ----------------------------------------------------------------

template <class T>
struct BackwardSumsParams {
    const T* x = nullptr;
    const T* dy = nullptr;
    bool relu = false;  // fused ReLU: dy counts only where the forward's y > 0 (Note [ReLU mask from x])
    Span span;
    const float* folded = nullptr;  // [mean_hi | mean_lo | scale | shift]
    double* payload = nullptr;      // [sum dy | sum dy (x - mean)], 2C
    Sums2* partials = nullptr;
    unsigned int* counters = nullptr;
};

template <class T>
LOCKSTEP_HD inline void backward_finish_channel(const BackwardSumsParams<T>& p, std::int64_t c, const Sums2& total) {
    const bn::BackwardPayload layout{p.span.C};
    store(p.payload + layout.sum_dy(c), total.a);
    store(p.payload + layout.sum_dy_xmu(c), bn::centred_sum(total.b, total.a, p.folded[p.span.C + c]));
}

template <class T, int V>
struct BackwardSumsChannelsFirst {
    using Params = BackwardSumsParams<T>;
    using Value = Sums2;
    static constexpr int threads = bn_kernels::threads, lanes = 1, rows = threads, min_blocks = bn_kernels::min_blocks;

    LOCKSTEP_HD static Value accumulate(const Params& p, const Where& w) {
        const std::int64_t c = p.span.group(w);
        const ReluMask m = ReluMask::of(p.folded, p.span.C, c);
        const float hi = m.hi;
        Value total;
        float a = 0, b = 0;
        int pending = 0;
        const auto add = [&](float xv, float dy) {
            const float d = m.gate(p.relu, xv, dy);
            a += d;
            b += d * (xv - hi);
        };
        for (unsigned int j = p.span.begin(w) + static_cast<unsigned int>(w.t); j < p.span.end(w); j += threads) {
            const Window win = p.span.template window<V>(j, c);
            if (win.template whole<V>()) {
                const auto x = load_pack<V>(p.x + win.at);
                const auto g = load_pack<V>(p.dy + win.at);
                LOCKSTEP_UNROLL
                for (int e = 0; e < V; ++e) add(to_float(x.v[e]), to_float(g.v[e]));
            } else {  // a plane's first or last window: its own elements alone
                LOCKSTEP_UNROLL
                for (int e = 0; e < V; ++e)
                    if (win.has(e)) add(to_float(p.x[win.at + e]), to_float(p.dy[win.at + e]));
            }
            if (++pending == flush) {
                total = total + Value{a, b};
                a = b = 0;
                pending = 0;
            }
        }
        return total + Value{a, b};
    }
    LOCKSTEP_HD static void store_partial(const Params& p, const Where& w, int, const Value& v) {
        store(p.partials + static_cast<std::int64_t>(p.span.group(w)) * w.gx + p.span.chunk(w), v);
    }
    LOCKSTEP_HD static unsigned int* counter(const Params& p, const Where& w) { return p.counters + p.span.group(w); }
    LOCKSTEP_HD static Value gather(const Params& p, const Where& w, int, int row) {
        Value v;
        const Sums2* part = p.partials + static_cast<std::int64_t>(p.span.group(w)) * w.gx;
        for (int i = row; i < w.gx; i += rows) v = v + Value{load_other_block(&part[i].a), load_other_block(&part[i].b)};
        return v;
    }
    LOCKSTEP_HD static void finish(const Params& p, const Where& w, int, const Value& total) {
        backward_finish_channel(p, p.span.group(w), total);
    }
};

template <class T, int V>
struct BackwardSumsChannelsLast {
    using Params = BackwardSumsParams<T>;
    using Value = SumsV<V>;
    static constexpr int threads = bn_kernels::threads, lanes = tile, rows = tile_rows, min_blocks = bn_kernels::min_blocks;

    LOCKSTEP_HD static Value accumulate(const Params& p, const Where& w) {
        const std::int64_t c0 = lane_channel<V>(p.span.group(w), p.span.lane(w.t), p.span.lanes);
        Value total;
        if (c0 >= p.span.C) return total;
        ReluMask m[V];
        float a[V], b[V];
        LOCKSTEP_UNROLL
        for (int e = 0; e < V; ++e) m[e] = ReluMask::of(p.folded, p.span.C, c0 + e), a[e] = b[e] = 0;
        int pending = 0;
        for (unsigned int r = p.span.first_row(w); r < p.span.end(w); r += p.span.row_step()) {
            const std::int64_t off = static_cast<std::int64_t>(r) * p.span.C + c0;
            const auto x = load_pack<V>(p.x + off);
            const auto g = load_pack<V>(p.dy + off);
            LOCKSTEP_UNROLL
            for (int e = 0; e < V; ++e) {
                const float xv = to_float(x.v[e]);
                const float d = m[e].gate(p.relu, xv, to_float(g.v[e]));
                a[e] += d;
                b[e] += d * (xv - m[e].hi);
            }
            if (++pending == flush) {
                LOCKSTEP_UNROLL
                for (int e = 0; e < V; ++e) total.c[e] = total.c[e] + Sums2{a[e], b[e]}, a[e] = b[e] = 0;
                pending = 0;
            }
        }
        LOCKSTEP_UNROLL
        for (int e = 0; e < V; ++e) total.c[e] = total.c[e] + Sums2{a[e], b[e]};
        return total;
    }
    LOCKSTEP_HD static void store_partial(const Params& p, const Where& w, int column, const Value& v) {
        Sums2* out = column_slot<V>(p.partials, p.span, w, p.span.chunk(w), column);
        LOCKSTEP_UNROLL
        for (int e = 0; e < V; ++e) store(out + e, v.c[e]);
    }
    LOCKSTEP_HD static unsigned int* counter(const Params& p, const Where& w) { return p.counters + p.span.group(w); }
    LOCKSTEP_HD static Value gather(const Params& p, const Where& w, int lane, int row) {
        return gather_lane<V>(p.partials, p.span, w, lane, row, rows);
    }
    LOCKSTEP_HD static void finish(const Params& p, const Where& w, int lane, const Value& total) {
        if (lane >= p.span.lanes) return;
        const std::int64_t c0 = lane_channel<V>(p.span.group(w), lane, p.span.lanes);
        if (c0 >= p.span.C) return;
        LOCKSTEP_UNROLL
        for (int e = 0; e < V; ++e) backward_finish_channel(p, c0 + e, total.c[e]);
    }
};

// ---- backward dx (map), with the backward constants in its prologue --------------------------

template <class T>
struct DxParams {
    const T* x = nullptr;  // may be dx itself: every element is read before it is written
    const T* dy = nullptr;
    bool relu = false;  // fused ReLU (Note [ReLU mask from x])
    T* dx = nullptr;
    Span span;
    const double* payload = nullptr;  // all-reduced [sum dy | sum dy (x - mean)]
    const double* stats = nullptr;    // [mean | invstd | N]
    const float* folded = nullptr;    // [mean_hi | mean_lo | scale | shift]
    const float* weight = nullptr;
};

struct DxConstants {
    float a, b, c;
    ReluMask m;  // hi for dx, and the ReLU mask's constants

    //! dx of one element, in T.
    template <class T>
    LOCKSTEP_HD T dx(bool relu, float x, float dy) const {
        return from_float<T>(bn::backward(m.gate(relu, x, dy), x, m.hi, a, b, c));
    }
};

template <class T>
LOCKSTEP_HD inline DxConstants dx_constants_of(const DxParams<T>& p, std::int64_t c) {
    const std::int64_t C = p.span.C;
    const bn::BackwardPayload layout{C};
    const bn::BackwardConstants k =
        bn::backward_constants(p.stats[2 * C], p.payload[layout.sum_dy(c)], p.payload[layout.sum_dy_xmu(c)], p.stats[c],
                               p.stats[C + c], p.weight != nullptr ? p.weight[c] : 1.0);
    return {k.a, k.b, k.c, ReluMask::of(p.folded, C, c)};
}

template <class T, int V>
struct DxChannelsFirst {
    using Params = DxParams<T>;
    static constexpr int threads = bn_kernels::threads, min_blocks = bn_kernels::min_blocks;

    LOCKSTEP_HD static void run(const Params& p, const Where& w) {
        const std::int64_t c = p.span.group(w);
        const DxConstants k = dx_constants_of(p, c);
        for (unsigned int j = p.span.begin(w) + static_cast<unsigned int>(w.t); j < p.span.end(w); j += threads) {
            const Window win = p.span.template window<V>(j, c);
            const auto x = load_window<V>(p.x, win);
            const auto g = load_window<V>(p.dy, win);
            Pack<T, V> out;
            LOCKSTEP_UNROLL
            for (int e = 0; e < V; ++e) {
                out.v[e] = k.template dx<T>(p.relu, to_float(x.v[e]), to_float(g.v[e]));
            }
            store_window<V>(p.dx, win, out);
        }
    }
};

template <class T, int V>
struct DxChannelsLast {
    using Params = DxParams<T>;
    static constexpr int threads = bn_kernels::threads, min_blocks = bn_kernels::min_blocks;

    LOCKSTEP_HD static void run(const Params& p, const Where& w) {
        const std::int64_t c0 = lane_channel<V>(p.span.group(w), p.span.lane(w.t), p.span.lanes);
        if (c0 >= p.span.C) return;
        DxConstants k[V]{};  // each_channel sets all; {} for g++'s -Wmaybe-uninitialized
        each_channel(k, [&](int e) { return dx_constants_of(p, c0 + e); });
        for (unsigned int r = p.span.first_row(w); r < p.span.end(w); r += p.span.row_step()) {
            const std::int64_t off = static_cast<std::int64_t>(r) * p.span.C + c0;
            const auto x = load_pack<V>(p.x + off);
            const auto g = load_pack<V>(p.dy + off);
            Pack<T, V> out;
            LOCKSTEP_UNROLL
            for (int e = 0; e < V; ++e) {
                out.v[e] = k[e].template dx<T>(p.relu, to_float(x.v[e]), to_float(g.v[e]));
            }
            store_pack<V>(p.dx + off, out);
        }
    }
};

}  // namespace lockstep::kernels::device::bn_kernels
