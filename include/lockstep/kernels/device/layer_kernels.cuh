// SPDX-License-Identifier: MIT
//! The layer kernels of the CUDA backend (fills and elementwise arithmetic, ReLU, max pooling,
//! im2col/col2im, per-channel sums, losses, SGD, sums of squares), written once for the device and
//! the host emulator (Note [kernels proven on the host]), their launch configurations, and the
//! operations that run them and the cuBLAS calls between them on any runner.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <type_traits>

#include "lockstep/core/error.hpp"
#include "lockstep/kernels/device/grid.cuh"
#include "lockstep/kernels/ops.hpp"

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

inline constexpr int threads = 256;
//! Blocks each multiprocessor must hold at once: the register budget is 65536 / (256 x 4) = 64.
inline constexpr int min_blocks = 4;
inline constexpr int blocks_per_sm = 4;
inline constexpr int tile = 32;  // channel lanes of the (N, C) per-channel sums
inline constexpr int tile_rows = threads / tile;
//! Index spaces decomposed with `Divider` stay below this.
inline constexpr std::int64_t index_limit = 2147483647;

// ---- launch configurations --------------------------------------------------------------------

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
    const std::int64_t by_work = std::max<std::int64_t>(1, (items + std::int64_t{rows} * per_thread - 1) / (std::int64_t{rows} * per_thread));
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

// ---- shared per-thread helpers ----------------------------------------------------------------

//! A map thread's first item, and the items between its iterations (the grid's threads).
LOCKSTEP_HD inline std::int64_t first_index(const Where& w) { return static_cast<std::int64_t>(w.bx) * threads + w.t; }
LOCKSTEP_HD inline std::int64_t grid_threads(const Where& w) { return static_cast<std::int64_t>(w.gx) * threads; }

//! max(v, 0) with NaN kept, as the host's ReLU (`host::relu`).
LOCKSTEP_HD inline float relu(float v) { return v > 0.0f ? v : (v == v ? 0.0f : v); }

//! fp32 a * b, a + b, a - b, each rounded on its own: on the device never contracted into an FMA.
LOCKSTEP_HD inline float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
}
LOCKSTEP_HD inline float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fadd_rn(a, b);
#else
    return a + b;
#endif
}
LOCKSTEP_HD inline float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fsub_rn(a, b);
#else
    return a - b;
#endif
}

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

// ---- fill, scale, add, clip (maps) ---------------------------------------------------------------

template <class T>
struct FillParams {
    T* p = nullptr;
    std::int64_t n = 0;
    T value{};
};

//! p[0, n) = value.
template <class T, int V>
struct Fill {
    using Params = FillParams<T>;
    static constexpr int threads = layer_kernels::threads, min_blocks = layer_kernels::min_blocks;
    LOCKSTEP_HD static void run(const Params& p, const Where& w) {
        const std::int64_t vectors = p.n / V;
        Pack<T, V> v;
LOCKSTEP_UNROLL
        for (int e = 0; e < V; ++e) v.v[e] = p.value;
        for (std::int64_t i = first_index(w); i < vectors; i += grid_threads(w)) store_pack<V>(p.p + i * V, v);
        const std::int64_t tail = vectors * V + first_index(w);
        if (V > 1 && tail < p.n) p.p[tail] = p.value;
    }
};

struct ScaleParams {
    float* p = nullptr;
    std::int64_t n = 0;
    float factor = 1;
    //! Clipping: the factor is min(1, max_norm / (sqrt(sum_squares[0]) + 1e-6)), computed here.
    const double* sum_squares = nullptr;
    double max_norm = 0;
};

//! p *= factor in fp32; or, with `sum_squares`, clipping to `max_norm` as the host's clip_to_norm
//! (the coefficient in fp64 from the device's sum of squares, applied only when below 1).
template <int V>
struct Scale {
    using Params = ScaleParams;
    static constexpr int threads = layer_kernels::threads, min_blocks = layer_kernels::min_blocks;
    LOCKSTEP_HD static void run(const Params& p, const Where& w) {
        float f = p.factor;
        if (p.sum_squares != nullptr) {
            const double coef = p.max_norm / (::sqrt(*p.sum_squares) + 1e-6);
            if (!(coef < 1.0)) return;
            f = static_cast<float>(coef);
        }
        const std::int64_t vectors = p.n / V;
        for (std::int64_t i = first_index(w); i < vectors; i += grid_threads(w)) {
            auto v = load_pack<V>(p.p + i * V);
LOCKSTEP_UNROLL
            for (int e = 0; e < V; ++e) v.v[e] *= f;
            store_pack<V>(p.p + i * V, v);
        }
        const std::int64_t tail = vectors * V + first_index(w);
        if (V > 1 && tail < p.n) p.p[tail] *= f;
    }
};

template <class T>
struct AddParams {
    T* acc = nullptr;
    const T* x = nullptr;
    std::int64_t n = 0;
};

//! acc += x, element by element.
template <class T, int V>
struct Add {
    using Params = AddParams<T>;
    static constexpr int threads = layer_kernels::threads, min_blocks = layer_kernels::min_blocks;
    LOCKSTEP_HD static void run(const Params& p, const Where& w) {
        const std::int64_t vectors = p.n / V;
        for (std::int64_t i = first_index(w); i < vectors; i += grid_threads(w)) {
            auto a = load_pack<V>(p.acc + i * V);
            const auto b = load_pack<V>(p.x + i * V);
LOCKSTEP_UNROLL
            for (int e = 0; e < V; ++e) a.v[e] += b.v[e];
            store_pack<V>(p.acc + i * V, a);
        }
        const std::int64_t tail = vectors * V + first_index(w);
        if (V > 1 && tail < p.n) p.acc[tail] += p.x[tail];
    }
};

// ---- ReLU (maps) -------------------------------------------------------------------------------

struct ReluParams {
    float* x = nullptr;           // forward: in place
    const float* dy = nullptr;    // backward
    float* dx = nullptr;          // backward
    std::uint8_t* mask = nullptr;        // forward: where x > 0 (may be null)
    const std::uint8_t* kept = nullptr;  // backward: the forward's mask
    std::int64_t n = 0;
};

//! x = max(x, 0) in place (NaN stays NaN), mask = x > 0 where the mask is not null.
template <int V>
struct ReluForward {
    using Params = ReluParams;
    static constexpr int threads = layer_kernels::threads, min_blocks = layer_kernels::min_blocks;
    LOCKSTEP_HD static void run(const Params& p, const Where& w) {
        const std::int64_t vectors = p.n / V;
        for (std::int64_t i = first_index(w); i < vectors; i += grid_threads(w)) {
            auto v = load_pack<V>(p.x + i * V);
            Pack<std::uint8_t, V> m;
LOCKSTEP_UNROLL
            for (int e = 0; e < V; ++e) {
                m.v[e] = v.v[e] > 0.0f;
                v.v[e] = relu(v.v[e]);
            }
            store_pack<V>(p.x + i * V, v);
            if (p.mask != nullptr) store_pack<V>(p.mask + i * V, m);
        }
        const std::int64_t tail = vectors * V + first_index(w);
        if (V > 1 && tail < p.n) {
            const float v = p.x[tail];
            if (p.mask != nullptr) p.mask[tail] = v > 0.0f;
            p.x[tail] = relu(v);
        }
    }
};

//! dx = mask ? dy : 0.
template <int V>
struct ReluBackward {
    using Params = ReluParams;
    static constexpr int threads = layer_kernels::threads, min_blocks = layer_kernels::min_blocks;
    LOCKSTEP_HD static void run(const Params& p, const Where& w) {
        const std::int64_t vectors = p.n / V;
        for (std::int64_t i = first_index(w); i < vectors; i += grid_threads(w)) {
            auto v = load_pack<V>(p.dy + i * V);
            const auto m = load_pack<V>(p.kept + i * V);
LOCKSTEP_UNROLL
            for (int e = 0; e < V; ++e) v.v[e] = m.v[e] != 0 ? v.v[e] : 0.0f;
            store_pack<V>(p.dx + i * V, v);
        }
        const std::int64_t tail = vectors * V + first_index(w);
        if (V > 1 && tail < p.n) p.dx[tail] = p.kept[tail] != 0 ? p.dy[tail] : 0.0f;
    }
};

// ---- bias and activation, transposition (maps over (N, C, P)) -----------------------------------

//! An (N, C, P) batch in vectors of V along P (P % V == 0): item j is the V values at j * V.
struct Planes {
    unsigned int items = 0;  // N * C * P / V
    Divider per_plane;       // P / V items a (n, c) plane
    Divider channels;        // C
    Divider batch;           // N
};

struct BiasActParams {
    float* y = nullptr;
    const float* bias = nullptr;   // per channel (may be null)
    std::uint8_t* mask = nullptr;  // v > 0 (may be null)
    bool relu = false;
    Planes s;
};

//! y = bias[c] + y, then mask = y > 0 and, with `relu`, y = max(0, y): the host's linear epilogue
//! and convolution bias, in the same fp32 operations.
template <int V>
struct BiasAct {
    using Params = BiasActParams;
    static constexpr int threads = layer_kernels::threads, min_blocks = layer_kernels::min_blocks;
    LOCKSTEP_HD static void run(const Params& p, const Where& w) {
        for (unsigned int j = static_cast<unsigned int>(first_index(w)); j < p.s.items; j += static_cast<unsigned int>(grid_threads(w))) {
            const unsigned int plane = p.s.per_plane.div(j);
            const unsigned int c = plane - p.s.channels.div(plane) * p.s.channels.d;
            const float b = p.bias != nullptr ? p.bias[c] : 0.0f;
            const std::int64_t off = static_cast<std::int64_t>(j) * V;
            auto v = load_pack<V>(p.y + off);
            Pack<std::uint8_t, V> m;
LOCKSTEP_UNROLL
            for (int e = 0; e < V; ++e) {
                const float x = p.bias != nullptr ? v.v[e] + b : v.v[e];
                m.v[e] = x > 0.0f;
                v.v[e] = p.relu ? relu(x) : x;
            }
            store_pack<V>(p.y + off, v);
            if (p.mask != nullptr) store_pack<V>(p.mask + off, m);
        }
    }
};

struct ChannelMajorParams {
    const float* src = nullptr;  // (N, C, P)
    float* dst = nullptr;        // (C, N, P)
    Planes s;
};

//! dst (C, N, P) = src (N, C, P): the convolution's dy laid out for one GEMM over the shard.
template <int V>
struct ChannelMajor {
    using Params = ChannelMajorParams;
    static constexpr int threads = layer_kernels::threads, min_blocks = layer_kernels::min_blocks;
    LOCKSTEP_HD static void run(const Params& p, const Where& w) {
        for (unsigned int j = static_cast<unsigned int>(first_index(w)); j < p.s.items; j += static_cast<unsigned int>(grid_threads(w))) {
            const unsigned int plane = p.s.per_plane.div(j);  // (c, n) of dst
            const unsigned int q = j - plane * p.s.per_plane.d;
            const unsigned int c = p.s.batch.div(plane);
            const unsigned int n = plane - c * p.s.batch.d;
            const std::int64_t src = (static_cast<std::int64_t>(n) * p.s.channels.d + c) * p.s.per_plane.d + q;
            store_pack<V>(p.dst + static_cast<std::int64_t>(j) * V, load_pack<V>(p.src + src * V));
        }
    }
};

// ---- max pooling (maps) ------------------------------------------------------------------------

struct PoolParams {
    const float* x = nullptr;
    float* y = nullptr;
    std::int32_t* argmax = nullptr;
    const float* dy = nullptr;        // backward
    const std::int32_t* at = nullptr; // backward: the forward's argmax
    float* dx = nullptr;              // backward
    int H = 0, W = 0, OH = 0, OW = 0, k = 1, s = 1;
    unsigned int items = 0;  // forward: planes * OH * OW; backward: planes * H * W
    Divider cols, rows;      // forward: OW, OH; backward: W, H
    Divider stride;          // backward: s
};

//! y = the maximum of each window, argmax = its index in the plane, with the host's rules: the
//! window is read in row order from its top-left value, a value wins when greater or NaN (so the
//! last NaN of the window wins, and of equal values the first).
struct MaxPoolForward {
    using Params = PoolParams;
    static constexpr int threads = layer_kernels::threads, min_blocks = layer_kernels::min_blocks;
    LOCKSTEP_HD static void run(const Params& p, const Where& w) {
        for (unsigned int i = static_cast<unsigned int>(first_index(w)); i < p.items; i += static_cast<unsigned int>(grid_threads(w))) {
            const unsigned int q = p.cols.div(i);
            const unsigned int ow = i - q * p.cols.d;
            const unsigned int plane = p.rows.div(q);
            const unsigned int oh = q - plane * p.rows.d;
            const float* src = p.x + static_cast<std::int64_t>(plane) * p.H * p.W;
            const int top = static_cast<int>(oh) * p.s * p.W, left = static_cast<int>(ow) * p.s;
            float best = src[top + left];
            int at = top + left;
            for (int a = 0; a < p.k; ++a)
                for (int b = 0; b < p.k; ++b) {
                    if (a == 0 && b == 0) continue;
                    const int idx = top + a * p.W + b + left;
                    const float v = src[idx];
                    const bool take = v > best || v != v;
                    best = take ? v : best;
                    at = take ? idx : at;
                }
            p.y[i] = best;
            p.argmax[i] = at;
        }
    }
};

//! dx = the sum of dy over the windows whose argmax is this element, added in the order of the
//! windows (the host's scatter order): a gather, bit for bit the host's result, without atomics.
//! `at` must be the forward's argmax (an index inside each window).
struct MaxPoolBackward {
    using Params = PoolParams;
    static constexpr int threads = layer_kernels::threads, min_blocks = layer_kernels::min_blocks;
    LOCKSTEP_HD static void run(const Params& p, const Where& w) {
        for (unsigned int i = static_cast<unsigned int>(first_index(w)); i < p.items; i += static_cast<unsigned int>(grid_threads(w))) {
            const unsigned int q = p.cols.div(i);
            const int x = static_cast<int>(i - q * p.cols.d);
            const unsigned int plane = p.rows.div(q);
            const int h = static_cast<int>(q - plane * p.rows.d);
            // The windows holding (h, x): oh in [ceil((h - k + 1) / s), floor(h / s)], within [0, OH).
            const int oh_lo = h - p.k + 1 > 0 ? static_cast<int>(p.stride.div(static_cast<unsigned int>(h - p.k + p.s))) : 0;
            const int oh_top = static_cast<int>(p.stride.div(static_cast<unsigned int>(h)));
            const int oh_hi = oh_top < p.OH - 1 ? oh_top : p.OH - 1;
            const int ow_lo = x - p.k + 1 > 0 ? static_cast<int>(p.stride.div(static_cast<unsigned int>(x - p.k + p.s))) : 0;
            const int ow_top = static_cast<int>(p.stride.div(static_cast<unsigned int>(x)));
            const int ow_hi = ow_top < p.OW - 1 ? ow_top : p.OW - 1;
            const int self = h * p.W + x;
            const std::int64_t base = static_cast<std::int64_t>(plane) * p.OH * p.OW;
            float sum = 0.0f;
            for (int oh = oh_lo; oh <= oh_hi; ++oh)
                for (int ow = ow_lo; ow <= ow_hi; ++ow) {
                    const std::int64_t o = base + static_cast<std::int64_t>(oh) * p.OW + ow;
                    if (p.at[o] == self) sum += p.dy[o];
                }
            p.dx[i] = sum;
        }
    }
};

// ---- im2col and col2im (maps) --------------------------------------------------------------------

// Note [convolution on CUDA]
// A convolution over an NCHW shard is im2col + cuBLAS over the whole shard, with the columns of
// every sample in one buffer (kept in the layer's ConvScratch), K = C k k, P = OH OW:
// - forward: columns [N][K][P]; y[n] (O x P) = W (O x K) cols[n] (K x P) is one strided-batched
//   GEMM over the N samples (W shared: stride 0), then the bias is a map kernel;
// - backward: dy is transposed to dyt [O][N*P] and the columns are laid out [K][N*P], so the
//   weight gradient over the whole shard is ONE GEMM, dW (O x K) += dyt cols^T with beta = 1
//   (strided-batched GEMMs cannot sum their batch into one matrix; a GEMM per sample would be N
//   small launches), and dcols [K][N*P] = W^T dyt is one GEMM too; col2im then gathers dx. The
//   bias gradient is the per-channel sum of dy.
// cuBLAS is column-major: a row-major (r x c) matrix with leading dimension ld is its transpose,
// column-major, with the same ld, so the row-major product C = A B is computed as the
// column-major C^T = B^T A^T. The arguments of every call are a `GemmCall` made by a host
// function below; the emulation tests run those same calls through a column-major reference GEMM.
// NHWC convolutions are not implemented on CUDA (NotImplemented): the layer's user is told to use NCHW.

struct ColsParams {
    const float* x = nullptr;  // im2col: the input; col2im: -
    float* cols = nullptr;     // im2col: written
    const float* dcols = nullptr;  // col2im: read
    float* dx = nullptr;       // col2im: written
    int C = 0, H = 0, W = 0, k = 1, s = 1, pad = 0, OH = 0, OW = 0;
    int N = 0, K = 0, P = 0;
    bool sample_major = true;  // columns [N][K][P] (forward), else [K][N][P] (backward)
    unsigned int items = 0;    // im2col: N K P; col2im: N C H W
    Divider d0, d1, d2, d3;    // im2col: P, K or N, k, OW; col2im: W, H, C, s
};

//! cols[(n, (c, i, j), (oh, ow))] = x[n, c, oh s - pad + i, ow s - pad + j], zero outside the image;
//! one thread per column element, in the columns' memory order.
struct Im2col {
    using Params = ColsParams;
    static constexpr int threads = layer_kernels::threads, min_blocks = layer_kernels::min_blocks;
    LOCKSTEP_HD static void run(const Params& p, const Where& w) {
        for (unsigned int i = static_cast<unsigned int>(first_index(w)); i < p.items; i += static_cast<unsigned int>(grid_threads(w))) {
            const unsigned int r = p.d0.div(i);
            const unsigned int pp = i - r * p.d0.d;
            const unsigned int outer = p.d1.div(r);
            const unsigned int inner = r - outer * p.d1.d;
            const unsigned int kk = p.sample_major ? inner : outer;
            const unsigned int n = p.sample_major ? outer : inner;
            const unsigned int ci = p.d2.div(kk);
            const int j = static_cast<int>(kk - ci * p.d2.d);
            const unsigned int c = p.d2.div(ci);
            const int a = static_cast<int>(ci - c * p.d2.d);
            const unsigned int oh = p.d3.div(pp);
            const int ow = static_cast<int>(pp - oh * p.d3.d);
            const int h = static_cast<int>(oh) * p.s - p.pad + a, x = ow * p.s - p.pad + j;
            float v = 0.0f;
            if (h >= 0 && h < p.H && x >= 0 && x < p.W)
                v = p.x[((static_cast<std::int64_t>(n) * p.C + c) * p.H + h) * p.W + x];
            p.cols[i] = v;
        }
    }
};

//! dx[n, c, h, x] = the sum of the column entries read from (h, x), added in the host's col2im
//! order ((i, j) ascending): a gather, bit for bit the host's scatter, without atomics.
struct Col2im {
    using Params = ColsParams;
    static constexpr int threads = layer_kernels::threads, min_blocks = layer_kernels::min_blocks;
    LOCKSTEP_HD static void run(const Params& p, const Where& w) {
        for (unsigned int i = static_cast<unsigned int>(first_index(w)); i < p.items; i += static_cast<unsigned int>(grid_threads(w))) {
            const unsigned int q = p.d0.div(i);
            const int x = static_cast<int>(i - q * p.d0.d);
            const unsigned int q2 = p.d1.div(q);
            const int h = static_cast<int>(q - q2 * p.d1.d);
            const unsigned int n = p.d2.div(q2);
            const unsigned int c = q2 - n * p.d2.d;
            float sum = 0.0f;
            for (int a = 0; a < p.k; ++a) {
                const int hh = h + p.pad - a;
                if (hh < 0) break;  // a only grows
                const int oh = static_cast<int>(p.d3.div(static_cast<unsigned int>(hh)));
                if (oh * p.s != hh || oh >= p.OH) continue;
                for (int j = 0; j < p.k; ++j) {
                    const int xx = x + p.pad - j;
                    if (xx < 0) break;
                    const int ow = static_cast<int>(p.d3.div(static_cast<unsigned int>(xx)));
                    if (ow * p.s != xx || ow >= p.OW) continue;
                    const std::int64_t kk = (static_cast<std::int64_t>(c) * p.k + a) * p.k + j;
                    const std::int64_t col = p.sample_major ? (static_cast<std::int64_t>(n) * p.K + kk) * p.P
                                                            : (kk * p.N + n) * p.P;
                    sum += p.dcols[col + static_cast<std::int64_t>(oh) * p.OW + ow];
                }
            }
            p.dx[i] = sum;
        }
    }
};

// ---- per-channel sums (reducing) -----------------------------------------------------------------

struct ChannelSumParams {
    const float* dy = nullptr;  // (N, C, P)
    float* out = nullptr;       // += per channel
    unsigned int items = 0;     // N P per channel (P > 1) or N rows (P = 1)
    int C = 0;
    Divider per_plane;          // P
    Sum1* partials = nullptr;
    unsigned int* counters = nullptr;
};

//! out[c] += the fp64 sum of dy over N and P, a group per channel (the convolution's bias gradient).
struct ChannelSumPlanes {
    using Params = ChannelSumParams;
    using Value = Sum1;
    static constexpr int threads = layer_kernels::threads, lanes = 1, rows = threads, min_blocks = layer_kernels::min_blocks;
    LOCKSTEP_HD static Value accumulate(const Params& p, const Where& w) {
        double s = 0;
        const std::int64_t c = w.by;
        for (unsigned int j = static_cast<unsigned int>(first_index(w)); j < p.items; j += static_cast<unsigned int>(grid_threads(w))) {
            const unsigned int n = p.per_plane.div(j);
            const unsigned int q = j - n * p.per_plane.d;
            s += static_cast<double>(p.dy[(static_cast<std::int64_t>(n) * p.C + c) * p.per_plane.d + q]);
        }
        return {s};
    }
    LOCKSTEP_HD static void store_partial(const Params& p, const Where& w, int, const Value& v) {
        p.partials[static_cast<std::int64_t>(w.by) * w.gx + w.bx] = v;
    }
    LOCKSTEP_HD static unsigned int* counter(const Params& p, const Where& w) { return p.counters + w.by; }
    LOCKSTEP_HD static Value gather(const Params& p, const Where& w, int, int row) {
        double s = 0;
        const Sum1* part = p.partials + static_cast<std::int64_t>(w.by) * w.gx;
        for (int i = row; i < w.gx; i += rows) s += load_other_block(&part[i].v);
        return {s};
    }
    LOCKSTEP_HD static void finish(const Params& p, const Where& w, int, const Value& total) {
        p.out[w.by] += static_cast<float>(total.v);
    }
};

//! out[c] += the fp64 sum of dy's column c over its N rows (the linear layer's bias gradient):
//! 32 channels a group, a warp reading 32 consecutive values.
struct ChannelSumRows {
    using Params = ChannelSumParams;
    using Value = Sum1;
    static constexpr int threads = layer_kernels::threads, lanes = tile, rows = tile_rows, min_blocks = layer_kernels::min_blocks;
    LOCKSTEP_HD static Value accumulate(const Params& p, const Where& w) {
        const std::int64_t c = static_cast<std::int64_t>(w.by) * tile + w.t % tile;
        if (c >= p.C) return {};
        double s = 0;
        for (unsigned int r = static_cast<unsigned int>(w.bx * rows + w.t / tile); r < p.items; r += static_cast<unsigned int>(w.gx * rows))
            s += static_cast<double>(p.dy[static_cast<std::int64_t>(r) * p.C + c]);
        return {s};
    }
    LOCKSTEP_HD static void store_partial(const Params& p, const Where& w, int lane, const Value& v) {
        p.partials[(static_cast<std::int64_t>(w.by) * w.gx + w.bx) * tile + lane] = v;
    }
    LOCKSTEP_HD static unsigned int* counter(const Params& p, const Where& w) { return p.counters + w.by; }
    LOCKSTEP_HD static Value gather(const Params& p, const Where& w, int lane, int row) {
        double s = 0;
        const Sum1* part = p.partials + static_cast<std::int64_t>(w.by) * w.gx * tile;
        for (int i = row; i < w.gx; i += rows) s += load_other_block(&part[i * tile + lane].v);
        return {s};
    }
    LOCKSTEP_HD static void finish(const Params& p, const Where& w, int lane, const Value& total) {
        const std::int64_t c = static_cast<std::int64_t>(w.by) * tile + lane;
        if (c < p.C) p.out[c] += static_cast<float>(total.v);
    }
};

// ---- sums of squares (reducing) ----------------------------------------------------------------------

struct SumSquaresParams {
    const float* x = nullptr;
    std::int64_t n = 0;
    double* acc = nullptr;  // += the sum
    Sum1* partials = nullptr;
    unsigned int* counters = nullptr;
};

//! *acc += the fp64 sum of x^2 (NaN or infinity anywhere makes it non-finite).
template <int V>
struct SumSquares {
    using Params = SumSquaresParams;
    using Value = Sum1;
    static constexpr int threads = layer_kernels::threads, lanes = 1, rows = threads, min_blocks = layer_kernels::min_blocks;
    LOCKSTEP_HD static Value accumulate(const Params& p, const Where& w) {
        double s = 0;
        const std::int64_t vectors = p.n / V;
        for (std::int64_t i = first_index(w); i < vectors; i += grid_threads(w)) {
            const auto v = load_pack<V>(p.x + i * V);
LOCKSTEP_UNROLL
            for (int e = 0; e < V; ++e) s += static_cast<double>(v.v[e]) * v.v[e];
        }
        const std::int64_t tail = vectors * V + first_index(w);
        if (V > 1 && tail < p.n) s += static_cast<double>(p.x[tail]) * p.x[tail];
        return {s};
    }
    LOCKSTEP_HD static void store_partial(const Params& p, const Where& w, int, const Value& v) { p.partials[w.bx] = v; }
    LOCKSTEP_HD static unsigned int* counter(const Params& p, const Where&) { return p.counters; }
    LOCKSTEP_HD static Value gather(const Params& p, const Where& w, int, int row) {
        double s = 0;
        for (int i = row; i < w.gx; i += rows) s += load_other_block(&p.partials[i].v);
        return {s};
    }
    LOCKSTEP_HD static void finish(const Params& p, const Where&, int, const Value& total) { *p.acc += total.v; }
};

// ---- losses (reducing) ---------------------------------------------------------------------------

struct LossParams {
    const float* out = nullptr;    // logits (N, K) or outputs (N, D)
    const float* target = nullptr; // mse
    const std::int64_t* labels = nullptr;  // cross-entropy, on the device
    float* grad = nullptr;
    std::int64_t N = 0, K = 0;     // samples, values per sample
    std::int64_t n = 0;            // mse: N K values
    double inv_count = 1;
    double* totals = nullptr;      // [2] = the sums
    Sum2* partials2 = nullptr;
    Sum1* partials1 = nullptr;
    unsigned int* counters = nullptr;
};

//! Softmax cross-entropy, a thread per sample, in fp64 as the host: grad = (softmax - onehot) *
//! inv_count; totals = [sum of the losses, samples whose first maximum is the label]. A label
//! outside [0, K) (the caller checks them) gives a NaN loss, never a read out of the row.
struct SoftmaxCrossEntropy {
    using Params = LossParams;
    using Value = Sum2;
    static constexpr int threads = layer_kernels::threads, lanes = 1, rows = threads, min_blocks = layer_kernels::min_blocks;
    LOCKSTEP_HD static Value accumulate(const Params& p, const Where& w) {
        Value total;
        for (std::int64_t n = first_index(w); n < p.N; n += grid_threads(w)) {
            const float* z = p.out + n * p.K;
            float* gr = p.grad + n * p.K;
            std::int64_t best = 0;  // the first maximum, as std::max_element
            for (std::int64_t k = 1; k < p.K; ++k)
                if (z[best] < z[k]) best = k;
            const double zmax = z[best];
            double denom = 0;
            for (std::int64_t k = 0; k < p.K; ++k) denom += ::exp(static_cast<double>(z[k]) - zmax);
            const double log_denom = ::log(denom);
            const std::int64_t label = p.labels[n];
            const bool valid = label >= 0 && label < p.K;
            total.a += valid ? log_denom - (static_cast<double>(z[valid ? label : 0]) - zmax) : ::nan("");
            total.b += valid && best == label ? 1.0 : 0.0;
            for (std::int64_t k = 0; k < p.K; ++k) {
                const double q = ::exp(static_cast<double>(z[k]) - zmax - log_denom);
                gr[k] = static_cast<float>((q - (k == label ? 1.0 : 0.0)) * p.inv_count);
            }
        }
        return total;
    }
    LOCKSTEP_HD static void store_partial(const Params& p, const Where& w, int, const Value& v) { p.partials2[w.bx] = v; }
    LOCKSTEP_HD static unsigned int* counter(const Params& p, const Where&) { return p.counters; }
    LOCKSTEP_HD static Value gather(const Params& p, const Where& w, int, int row) {
        Value v;
        for (int i = row; i < w.gx; i += rows) v = v + Value{load_other_block(&p.partials2[i].a), load_other_block(&p.partials2[i].b)};
        return v;
    }
    LOCKSTEP_HD static void finish(const Params& p, const Where&, int, const Value& total) {
        p.totals[0] = total.a;
        p.totals[1] = total.b;
    }
};

//! Mean squared error per sample: grad = 2 (out - target) / D * inv_count element by element (the
//! host's fp64 expression), totals = [sum over samples of the sample's mean square, 0], summed
//! over all N D values and divided by D once.
template <int V>
struct MeanSquaredError {
    using Params = LossParams;
    using Value = Sum1;
    static constexpr int threads = layer_kernels::threads, lanes = 1, rows = threads, min_blocks = layer_kernels::min_blocks;
    LOCKSTEP_HD static double one(const Params& p, float out, float target, float& grad) {
        const double diff = static_cast<double>(out) - static_cast<double>(target);
        grad = static_cast<float>(2.0 * diff / static_cast<double>(p.K) * p.inv_count);
        return diff * diff;
    }
    LOCKSTEP_HD static Value accumulate(const Params& p, const Where& w) {
        double s = 0;
        const std::int64_t vectors = p.n / V;
        for (std::int64_t i = first_index(w); i < vectors; i += grid_threads(w)) {
            const auto o = load_pack<V>(p.out + i * V);
            const auto t = load_pack<V>(p.target + i * V);
            Pack<float, V> g;
LOCKSTEP_UNROLL
            for (int e = 0; e < V; ++e) s += one(p, o.v[e], t.v[e], g.v[e]);
            store_pack<V>(p.grad + i * V, g);
        }
        const std::int64_t tail = vectors * V + first_index(w);
        if (V > 1 && tail < p.n) s += one(p, p.out[tail], p.target[tail], p.grad[tail]);
        return {s};
    }
    LOCKSTEP_HD static void store_partial(const Params& p, const Where& w, int, const Value& v) { p.partials1[w.bx] = v; }
    LOCKSTEP_HD static unsigned int* counter(const Params& p, const Where&) { return p.counters; }
    LOCKSTEP_HD static Value gather(const Params& p, const Where& w, int, int row) {
        double s = 0;
        for (int i = row; i < w.gx; i += rows) s += load_other_block(&p.partials1[i].v);
        return {s};
    }
    LOCKSTEP_HD static void finish(const Params& p, const Where&, int, const Value& total) {
        p.totals[0] = total.v / static_cast<double>(p.K);
        p.totals[1] = 0;
    }
};

struct StoreParams {
    double* p = nullptr;
    double a = 0, b = 0;
};

//! p[0] = a, p[1] = b: the totals of a loss over an empty shard.
struct Store2 {
    using Params = StoreParams;
    static constexpr int threads = 32;
    LOCKSTEP_HD static void run(const Params& p, const Where& w) {
        if (w.bx == 0 && w.t == 0) {
            p.p[0] = p.a;
            p.p[1] = p.b;
        }
    }
};

// ---- many tensors in one launch (maps) -------------------------------------------------------------

// Note [tensor tables]
// An optimizer step and a gradient bucket's pack and unpack touch many small tensors (the MNIST
// network's biases have 4 to 128 elements): a launch per tensor would cost more than the work. So
// these kernels take a table of up to `table_max` tensors in their parameters (about 1.4 KB, well
// inside the 4 KB a launch may pass) and one grid-stride loop covers the concatenation of the
// tensors' items; a thread finds its tensor by binary search over the items' prefix sums. Each
// tensor is cut into 16-byte vectors and a scalar tail by itself (`vec`: 4 where every pointer of
// the tensor is aligned for it, else 1), so an unaligned offset into a bucket costs only that
// tensor its vectors. An operation over more tensors launches once per `table_max`.

inline constexpr int table_max = 32;

//! Where item i of a table's concatenated items lies: the largest t with begin[t] <= i (empty
//! tensors share their begin with the next one, so a non-empty tensor is found).
LOCKSTEP_HD inline int table_find(const long long* begin, int count, long long i) {
    int lo = 0, hi = count - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (begin[mid] <= i) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

//! Element `e` of a tensor cut into vectors of `vec` and a tail: item j is either the vector at
//! j * vec (`is_vector`) or the tail element at `element`.
struct TableItem {
    bool is_vector;
    long long element;
};
LOCKSTEP_HD inline TableItem table_item(long long j, long long n, int vec) {
    const long long vectors = n / vec;
    if (vec > 1 && j < vectors) return {true, j * vec};
    return {false, vec > 1 ? vectors * vec + (j - vectors) : j};
}

//! One torch.optim.SGD update of one element (the same operations as `Sgd::one`).
LOCKSTEP_HD inline void sgd_one(float lr, float mu, float damp, float wd, bool first, bool nesterov, bool momentum, float& w,
                                float gr, float& v) {
    if (!momentum) {
        w = sub_rn(w, mul_rn(lr, add_rn(gr, mul_rn(wd, w))));
    } else {
        const float g = add_rn(gr, mul_rn(wd, w));
        v = first ? g : add_rn(mul_rn(mu, v), mul_rn(damp, g));
        w = sub_rn(w, mul_rn(lr, nesterov ? add_rn(g, mul_rn(mu, v)) : v));
    }
}

struct SgdTableParams {
    float* w[table_max];
    const float* g[table_max];
    float* v[table_max];  // momentum buffers (momentum only)
    long long n[table_max];
    long long begin[table_max + 1];  // prefix sums of the tensors' items
    unsigned char vec[table_max], first[table_max];
    int count = 0;
    float lr = 0, mu = 0, damp = 1, wd = 0;
    bool nesterov = false;
};

//! One torch.optim.SGD update of every tensor of the table (Note [tensor tables]).
template <bool Momentum>
struct SgdTable {
    using Params = SgdTableParams;
    static constexpr int threads = layer_kernels::threads, min_blocks = layer_kernels::min_blocks;
    LOCKSTEP_HD static void run(const Params& p, const Where& w) {
        const long long items = p.begin[p.count];
        for (long long i = first_index(w); i < items; i += grid_threads(w)) {
            const int t = table_find(p.begin, p.count, i);
            const TableItem it = table_item(i - p.begin[t], p.n[t], p.vec[t]);
            float* wp = p.w[t] + it.element;
            const float* gp = p.g[t] + it.element;
            float* vp = Momentum ? p.v[t] + it.element : nullptr;
            const bool first = p.first[t] != 0;
            if (it.is_vector) {
                auto wv = load_pack<4>(wp);
                const auto gv = load_pack<4>(gp);
                Pack<float, 4> vv{};
                if constexpr (Momentum) vv = load_pack<4>(vp);
LOCKSTEP_UNROLL
                for (int e = 0; e < 4; ++e) sgd_one(p.lr, p.mu, p.damp, p.wd, first, p.nesterov, Momentum, wv.v[e], gv.v[e], vv.v[e]);
                store_pack<4>(wp, wv);
                if constexpr (Momentum) store_pack<4>(vp, vv);
            } else {
                float dummy = 0;
                sgd_one(p.lr, p.mu, p.damp, p.wd, first, p.nesterov, Momentum, *wp, *gp, Momentum ? *vp : dummy);
            }
        }
    }
};

struct CopyTableParams {
    float* dst[table_max];
    const float* src[table_max];
    long long n[table_max];
    long long begin[table_max + 1];
    unsigned char vec[table_max];
    int count = 0;
};

//! dst[t][0, n[t]) = src[t][0, n[t]) for every tensor of the table: a gradient bucket's pack or
//! unpack in one launch (Note [tensor tables]). The ranges do not overlap.
struct CopyTable {
    using Params = CopyTableParams;
    static constexpr int threads = layer_kernels::threads, min_blocks = layer_kernels::min_blocks;
    LOCKSTEP_HD static void run(const Params& p, const Where& w) {
        const long long items = p.begin[p.count];
        for (long long i = first_index(w); i < items; i += grid_threads(w)) {
            const int t = table_find(p.begin, p.count, i);
            const TableItem it = table_item(i - p.begin[t], p.n[t], p.vec[t]);
            if (it.is_vector) store_pack<4>(p.dst[t] + it.element, load_pack<4>(p.src[t] + it.element));
            else p.dst[t][it.element] = p.src[t][it.element];
        }
    }
};

// ---- the device-local all-reduce ------------------------------------------------------------------

// Note [rank-order sum]
// Replicas that share one GPU all-reduce through one kernel (comm/stream_group.hpp, the `local`
// mode): element i of every rank's buffer becomes b0[i] + b1[i] + ... + b{n-1}[i], summed in rank
// order as the host group sums (Note [deterministic host all-reduce]), so the result has the same
// bits on both backends and in every buffer. Each thread reads all ranks' element before writing
// any, so the buffers are read and written in place. 16-bit floats (__half, __nv_bfloat16) are
// summed in fp32 in the same order and rounded once.

//! The most ranks one device-local all-reduce takes (their pointers travel in the parameters).
inline constexpr int rank_max = 16;

template <class T>
struct RankSumParams {
    T* buf[rank_max];
    int ranks = 0;
    long long n = 0;
};

//! buf[r][i] = sum over ranks in rank order of buf[r][i], for every r (Note [rank-order sum]).
template <class T>
struct RankSum {
    using Params = RankSumParams<T>;
    static constexpr int threads = layer_kernels::threads, min_blocks = layer_kernels::min_blocks;
    LOCKSTEP_HD static void run(const Params& p, const Where& w) {
        for (long long i = first_index(w); i < p.n; i += grid_threads(w)) {
            if constexpr (sizeof(T) == 2) {  // __half, __nv_bfloat16: summed in fp32, rounded once
                float acc = to_float(p.buf[0][i]);
                for (int r = 1; r < p.ranks; ++r) acc = acc + to_float(p.buf[r][i]);
                const T out = from_float<T>(acc);
                for (int r = 0; r < p.ranks; ++r) p.buf[r][i] = out;
            } else {
                T acc = p.buf[0][i];
                for (int r = 1; r < p.ranks; ++r) acc = acc + p.buf[r][i];
                for (int r = 0; r < p.ranks; ++r) p.buf[r][i] = acc;
            }
        }
    }
};

//! The device-local all-reduce of `ranks` buffers of `n` elements each, in one launch.
template <class T, class Run>
void rank_sum(Run& run, std::span<T* const> bufs, std::int64_t n) {
    LOCKSTEP_CHECK_AS(UsageError, !bufs.empty() && bufs.size() <= static_cast<std::size_t>(rank_max),
                      "a device-local all-reduce takes 1 to ", rank_max, " replicas on one GPU, got ", bufs.size(),
                      "; put fewer replicas on each GPU");
    if (n <= 0) return;
    RankSumParams<T> p;
    p.ranks = static_cast<int>(bufs.size());
    p.n = n;
    for (std::size_t r = 0; r < bufs.size(); ++r) p.buf[r] = bufs[r];
    run.template map<RankSum<T>>(p, map_grid(n, run.info()));
}

// ---- GEMM calls (cuBLAS, column-major) ---------------------------------------------------------------

//! One cuBLAS SGEMM, column-major: C = alpha op(A) op(B) + beta C, `batch` times with A, B and C
//! advanced by their strides (cublasSgemmStridedBatched; batch 1: cublasSgemm). C is always
//! contiguous here (ldc = m, stride_c = m n).
struct GemmCall {
    bool trans_a = false, trans_b = false;
    int m = 0, n = 0, k = 0;
    float alpha = 1, beta = 0;
    const float* a = nullptr;
    int lda = 1;
    long long stride_a = 0;
    const float* b = nullptr;
    int ldb = 1;
    long long stride_b = 0;
    float* c = nullptr;
    int ldc = 1;
    long long stride_c = 0;
    int batch = 1;
};

//! A GEMM dimension as cuBLAS's int.
inline int gemm_dim(std::int64_t v, const char* what) {
    LOCKSTEP_CHECK_AS(ShapeError, v >= 0 && v <= index_limit, what, " of ", v, " is beyond cuBLAS's 32-bit dimensions");
    return static_cast<int>(v);
}
inline int ld_of(std::int64_t v) { return static_cast<int>(std::max<std::int64_t>(v, 1)); }

//! The geometry of an NCHW convolution on CUDA, checked (Note [convolution on CUDA]).
struct ConvPlan {
    std::int64_t N = 0, C = 0, H = 0, W = 0, O = 0, k = 1, s = 1, pad = 0, OH = 0, OW = 0;
    std::int64_t K = 0, P = 0;  // C k k, OH OW

    explicit ConvPlan(const ConvGeometry& g)
        : N(g.batch), C(g.in_channels), H(g.height), W(g.width), O(g.out_channels), k(g.kernel), s(g.stride), pad(g.padding) {
        LOCKSTEP_CHECK_AS(NotImplemented, !g.channels_last, "NHWC convolutions on CUDA are not implemented; use NCHW");
        LOCKSTEP_CHECK_AS(ShapeError, N >= 0 && C >= 0 && H >= 0 && W >= 0 && O >= 0 && k >= 1 && s >= 1 && pad >= 0,
                          "a convolution needs non-negative sizes, kernel >= 1, stride >= 1 and padding >= 0; got N=", N,
                          " C=", C, " H=", H, " W=", W, " O=", O, " kernel=", k, " stride=", s, " padding=", pad);
        LOCKSTEP_CHECK_AS(ShapeError, H + 2 * pad >= k && W + 2 * pad >= k, "a convolution's kernel ", k,
                          " is larger than its padded input ", H + 2 * pad, "x", W + 2 * pad);
        OH = g.out_height();
        OW = g.out_width();
        K = C * k * k;
        P = OH * OW;
        check_index_space(N * C * H * W, "a convolution's input");
        check_index_space(N * O * P, "a convolution's output");
        check_index_space(N * K * P, "a convolution's im2col buffer");
    }
    std::int64_t cols() const { return N * K * P; }
};

//! y[n] (O x P) = W (O x K) cols[n] (K x P), cols [N][K][P]: column-major y[n]^T = cols[n]^T W^T.
inline GemmCall conv_forward_gemm(const ConvPlan& c, const float* cols, const float* weight, float* y) {
    GemmCall g;
    g.m = gemm_dim(c.P, "a convolution's output plane");
    g.n = gemm_dim(c.O, "a convolution's output channels");
    g.k = gemm_dim(c.K, "a convolution's C k k");
    g.a = cols, g.lda = ld_of(c.P), g.stride_a = c.K * c.P;
    g.b = weight, g.ldb = ld_of(c.K), g.stride_b = 0;
    g.c = y, g.ldc = ld_of(c.P), g.stride_c = c.O * c.P;
    g.batch = gemm_dim(c.N, "a convolution's batch");
    return g;
}

//! dW (O x K) += dyt (O x NP) cols^T, cols [K][NP]: column-major dW^T += cols^T(op T) dyt^T.
inline GemmCall conv_weight_grad_gemm(const ConvPlan& c, const float* cols, const float* dyt, float* weight_grad) {
    GemmCall g;
    g.trans_a = true;
    g.m = gemm_dim(c.K, "a convolution's C k k");
    g.n = gemm_dim(c.O, "a convolution's output channels");
    g.k = gemm_dim(c.N * c.P, "a convolution's N OH OW");
    g.a = cols, g.lda = ld_of(c.N * c.P);
    g.b = dyt, g.ldb = ld_of(c.N * c.P);
    g.c = weight_grad, g.ldc = ld_of(c.K), g.stride_c = c.K * c.O;
    g.beta = 1;
    return g;
}

//! dcols (K x NP) = W^T (K x O) dyt (O x NP): column-major dcols^T = dyt^T W(op T).
inline GemmCall conv_input_grad_gemm(const ConvPlan& c, const float* weight, const float* dyt, float* dcols) {
    GemmCall g;
    g.trans_b = true;
    g.m = gemm_dim(c.N * c.P, "a convolution's N OH OW");
    g.n = gemm_dim(c.K, "a convolution's C k k");
    g.k = gemm_dim(c.O, "a convolution's output channels");
    g.a = dyt, g.lda = ld_of(c.N * c.P);
    g.b = weight, g.ldb = ld_of(c.K);
    g.c = dcols, g.ldc = ld_of(c.N * c.P), g.stride_c = c.N * c.P * c.K;
    return g;
}

//! y (N x out) = x (N x in) W^T (W: out x in): column-major y^T = W(op T) x^T.
inline GemmCall linear_forward_gemm(std::int64_t N, std::int64_t in, std::int64_t out, const float* x, const float* weight,
                                    float* y) {
    GemmCall g;
    g.trans_a = true;
    g.m = gemm_dim(out, "a linear layer's outputs");
    g.n = gemm_dim(N, "a linear layer's batch");
    g.k = gemm_dim(in, "a linear layer's inputs");
    g.a = weight, g.lda = ld_of(in);
    g.b = x, g.ldb = ld_of(in);
    g.c = y, g.ldc = ld_of(out), g.stride_c = out * N;
    return g;
}

//! dW (out x in) += dy^T (out x N) x (N x in): column-major dW^T += x^T dy(op T).
inline GemmCall linear_weight_grad_gemm(std::int64_t N, std::int64_t in, std::int64_t out, const float* x, const float* dy,
                                        float* weight_grad) {
    GemmCall g;
    g.trans_b = true;
    g.m = gemm_dim(in, "a linear layer's inputs");
    g.n = gemm_dim(out, "a linear layer's outputs");
    g.k = gemm_dim(N, "a linear layer's batch");
    g.a = x, g.lda = ld_of(in);
    g.b = dy, g.ldb = ld_of(out);
    g.c = weight_grad, g.ldc = ld_of(in), g.stride_c = in * out;
    g.beta = 1;
    return g;
}

//! dx (N x in) = dy (N x out) W (out x in): column-major dx^T = W^T dy^T, both as stored.
inline GemmCall linear_input_grad_gemm(std::int64_t N, std::int64_t in, std::int64_t out, const float* weight, const float* dy,
                                       float* dx) {
    GemmCall g;
    g.m = gemm_dim(in, "a linear layer's inputs");
    g.n = gemm_dim(N, "a linear layer's batch");
    g.k = gemm_dim(out, "a linear layer's outputs");
    g.a = weight, g.lda = ld_of(in);
    g.b = dy, g.ldb = ld_of(out);
    g.c = dx, g.ldc = ld_of(in), g.stride_c = in * N;
    return g;
}

// ---- the operations, for any runner (the device, or the host emulator) ---------------------------

// A runner launches kernels and GEMMs: `run.template map<K>(params, grid)`, `run.template
// reduce<K>(params, grid)`, `run.gemm(call)`, and says `run.info()` (the device's DeviceInfo) and
// `run.scratch()`. The CUDA operations (cuda_layer_ops.cuh) use the device runner, the emulation
// tests a host one whose GEMM is a column-major reference, so both go through the same kernels,
// vector widths, grids and GEMM arguments.

//! p[0, n) = value.
template <class Run, class T>
void fill(Run& run, T* p, std::int64_t n, T value) {
    static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 16 && (sizeof(T) & (sizeof(T) - 1)) == 0,
                  "fill takes trivially copyable elements of 1, 2, 4, 8 or 16 bytes");
    constexpr int V = vec16<T>;
    FillParams<T> f{p, n, value};
    if (all_aligned(16, {p})) run.template map<Fill<T, V>>(f, map_grid(vector_items(n, V), run.info()));
    else run.template map<Fill<T, 1>>(f, map_grid(n, run.info()));
}

//! p *= factor (fp32).
template <class Run>
void scale(Run& run, float* p, std::int64_t n, float factor) {
    ScaleParams s;
    s.p = p, s.n = n, s.factor = factor;
    if (all_aligned(16, {p})) run.template map<Scale<4>>(s, map_grid(vector_items(n, 4), run.info()));
    else run.template map<Scale<1>>(s, map_grid(n, run.info()));
}

//! p *= min(1, max_norm / (sqrt(sum_squares[0]) + 1e-6)), the coefficient computed on the device.
template <class Run>
void clip_to_norm(Run& run, float* p, std::int64_t n, const double* sum_squares, double max_norm) {
    ScaleParams s;
    s.p = p, s.n = n, s.sum_squares = sum_squares, s.max_norm = max_norm;
    if (all_aligned(16, {p})) run.template map<Scale<4>>(s, map_grid(vector_items(n, 4), run.info()));
    else run.template map<Scale<1>>(s, map_grid(n, run.info()));
}

//! acc += x.
template <class Run, class T>
void add(Run& run, T* acc, const T* x, std::int64_t n) {
    static_assert(std::is_arithmetic_v<T>, "add takes arithmetic elements");
    constexpr int V = vec16<T>;
    AddParams<T> a{acc, x, n};
    if (all_aligned(16, {acc, x})) run.template map<Add<T, V>>(a, map_grid(vector_items(n, V), run.info()));
    else run.template map<Add<T, 1>>(a, map_grid(n, run.info()));
}

//! x = max(x, 0) in place (NaN kept); mask (may be null) = x > 0.
template <class Run>
void relu_forward(Run& run, float* x, std::uint8_t* mask, std::int64_t n) {
    ReluParams r;
    r.x = x, r.mask = mask, r.n = n;
    if (all_aligned(16, {x}) && all_aligned(4, {mask})) run.template map<ReluForward<4>>(r, map_grid(vector_items(n, 4), run.info()));
    else run.template map<ReluForward<1>>(r, map_grid(n, run.info()));
}

//! dx = mask ? dy : 0.
template <class Run>
void relu_backward(Run& run, const float* dy, const std::uint8_t* mask, float* dx, std::int64_t n) {
    ReluParams r;
    r.dy = dy, r.kept = mask, r.dx = dx, r.n = n;
    if (all_aligned(16, {dy, dx}) && all_aligned(4, {mask})) run.template map<ReluBackward<4>>(r, map_grid(vector_items(n, 4), run.info()));
    else run.template map<ReluBackward<1>>(r, map_grid(n, run.info()));
}

//! The (N, C, P) items of a map in vectors of V.
inline Planes planes_of(std::int64_t N, std::int64_t C, std::int64_t P, int V) {
    check_index_space(N * C * P, "a per-channel map");
    Planes s;
    s.items = static_cast<unsigned int>(N * C * P / V);
    s.per_plane = divider(P / V);
    s.channels = divider(C);
    s.batch = divider(N);
    return s;
}

//! y (N, C, P) = bias[c] + y (bias may be null), mask (may be null) = y > 0, with `relu` y = max(0, y).
template <class Run>
void bias_act(Run& run, float* y, std::int64_t N, std::int64_t C, std::int64_t P, const float* bias, bool relu,
              std::uint8_t* mask) {
    const int V = P % 4 == 0 && all_aligned(16, {y}) && all_aligned(4, {mask}) ? 4 : 1;
    BiasActParams b;
    b.y = y, b.bias = bias, b.mask = mask, b.relu = relu;
    b.s = planes_of(N, C, P, V);
    if (V == 4) run.template map<BiasAct<4>>(b, map_grid(b.s.items, run.info()));
    else run.template map<BiasAct<1>>(b, map_grid(b.s.items, run.info()));
}

//! out[c] += the sum of dy (N, C, P) over N and P.
template <class Run>
void channel_sums(Run& run, const float* dy, std::int64_t N, std::int64_t C, std::int64_t P, float* out) {
    check_index_space(N * P, "a per-channel sum");
    const Scratch scratch = run.scratch();
    ChannelSumParams s;
    s.dy = dy, s.out = out, s.C = static_cast<int>(std::min<std::int64_t>(C, index_limit));
    s.items = static_cast<unsigned int>(P == 1 ? N : N * P);
    s.per_plane = divider(P);
    s.counters = scratch.counters;
    if (P == 1) {
        const Grid g = reduce_grid(N, (C + tile - 1) / tile, tile_rows, tile, 4, sizeof(Sum1), run.info());
        s.partials = scratch.template partials_as<Sum1>(std::int64_t{g.x} * g.y * tile);
        run.template reduce<ChannelSumRows>(s, g);
    } else {
        const Grid g = reduce_grid(N * P, C, threads, 1, 4, sizeof(Sum1), run.info());
        s.partials = scratch.template partials_as<Sum1>(std::int64_t{g.x} * g.y);
        run.template reduce<ChannelSumPlanes>(s, g);
    }
}

//! acc[0] += the fp64 sum of x^2.
template <class Run>
void add_sum_squares(Run& run, const float* x, std::int64_t n, double* acc) {
    const Scratch scratch = run.scratch();
    SumSquaresParams s;
    s.x = x, s.n = n, s.acc = acc, s.counters = scratch.counters;
    const int V = all_aligned(16, {x}) ? 4 : 1;
    const Grid g = reduce_grid(vector_items(n, V), 1, threads, 1, 4, sizeof(Sum1), run.info());
    s.partials = scratch.template partials_as<Sum1>(g.x);
    if (V == 4) run.template reduce<SumSquares<4>>(s, g);
    else run.template reduce<SumSquares<1>>(s, g);
}

//! Max pooling forward over an NCHW shard (y, argmax: (N, C, OH, OW)).
template <class Run>
void maxpool_forward(Run& run, const PoolGeometry& g, const float* x, float* y, std::int32_t* argmax) {
    LOCKSTEP_CHECK_AS(ShapeError, g.kernel >= 1 && g.stride >= 1 && g.height >= g.kernel && g.width >= g.kernel,
                      "max pooling needs kernel >= 1, stride >= 1 and a kernel no larger than the input; got kernel ",
                      g.kernel, ", stride ", g.stride, " on ", g.height, "x", g.width);
    const std::int64_t planes = g.batch * g.channels, OH = g.out_height(), OW = g.out_width();
    check_index_space(planes * g.height * g.width, "max pooling");
    PoolParams p;
    p.x = x, p.y = y, p.argmax = argmax;
    p.H = static_cast<int>(g.height), p.W = static_cast<int>(g.width), p.OH = static_cast<int>(OH), p.OW = static_cast<int>(OW);
    p.k = static_cast<int>(g.kernel), p.s = static_cast<int>(g.stride);
    p.items = static_cast<unsigned int>(planes * OH * OW);
    p.cols = divider(OW), p.rows = divider(OH);
    run.template map<MaxPoolForward>(p, map_grid(p.items, run.info()));
}

//! Max pooling backward: dx (N, C, H, W) from dy and the forward's argmax (a gather).
template <class Run>
void maxpool_backward(Run& run, const PoolGeometry& g, const float* dy, const std::int32_t* argmax, float* dx) {
    LOCKSTEP_CHECK_AS(ShapeError, g.kernel >= 1 && g.stride >= 1 && g.height >= g.kernel && g.width >= g.kernel,
                      "max pooling needs kernel >= 1, stride >= 1 and a kernel no larger than the input; got kernel ",
                      g.kernel, ", stride ", g.stride, " on ", g.height, "x", g.width);
    const std::int64_t planes = g.batch * g.channels;
    check_index_space(planes * g.height * g.width, "max pooling");
    PoolParams p;
    p.dy = dy, p.at = argmax, p.dx = dx;
    p.H = static_cast<int>(g.height), p.W = static_cast<int>(g.width);
    p.OH = static_cast<int>(g.out_height()), p.OW = static_cast<int>(g.out_width());
    p.k = static_cast<int>(g.kernel), p.s = static_cast<int>(g.stride);
    p.items = static_cast<unsigned int>(planes * g.height * g.width);
    p.cols = divider(g.width), p.rows = divider(g.height), p.stride = divider(g.stride);
    run.template map<MaxPoolBackward>(p, map_grid(p.items, run.info()));
}

//! The columns of an NCHW shard: [N][K][P] (`sample_major`) or [K][N][P].
template <class Run>
void im2col(Run& run, const ConvPlan& c, const float* x, float* cols, bool sample_major) {
    ColsParams p;
    p.x = x, p.cols = cols;
    p.C = static_cast<int>(c.C), p.H = static_cast<int>(c.H), p.W = static_cast<int>(c.W), p.k = static_cast<int>(c.k);
    p.s = static_cast<int>(c.s), p.pad = static_cast<int>(c.pad), p.OH = static_cast<int>(c.OH), p.OW = static_cast<int>(c.OW);
    p.N = static_cast<int>(c.N), p.K = static_cast<int>(c.K), p.P = static_cast<int>(c.P);
    p.sample_major = sample_major;
    p.items = static_cast<unsigned int>(c.cols());
    p.d0 = divider(c.P), p.d1 = divider(sample_major ? c.K : c.N), p.d2 = divider(c.k), p.d3 = divider(c.OW);
    run.template map<Im2col>(p, map_grid(p.items, run.info()));
}

//! dx (N, C, H, W) = the adjoint of im2col of `dcols` ([N][K][P] when `sample_major`, else [K][N][P]).
template <class Run>
void col2im(Run& run, const ConvPlan& c, const float* dcols, float* dx, bool sample_major) {
    ColsParams p;
    p.dcols = dcols, p.dx = dx;
    p.C = static_cast<int>(c.C), p.H = static_cast<int>(c.H), p.W = static_cast<int>(c.W), p.k = static_cast<int>(c.k);
    p.s = static_cast<int>(c.s), p.pad = static_cast<int>(c.pad), p.OH = static_cast<int>(c.OH), p.OW = static_cast<int>(c.OW);
    p.N = static_cast<int>(c.N), p.K = static_cast<int>(c.K), p.P = static_cast<int>(c.P);
    p.sample_major = sample_major;
    p.items = static_cast<unsigned int>(c.N * c.C * c.H * c.W);
    p.d0 = divider(c.W), p.d1 = divider(c.H), p.d2 = divider(c.C), p.d3 = divider(c.s);
    run.template map<Col2im>(p, map_grid(p.items, run.info()));
}

//! dst (C, N, P) = src (N, C, P).
template <class Run>
void channel_major(Run& run, const float* src, float* dst, std::int64_t N, std::int64_t C, std::int64_t P) {
    const int V = P % 4 == 0 && all_aligned(16, {src, dst}) ? 4 : 1;
    ChannelMajorParams t;
    t.src = src, t.dst = dst;
    t.s = planes_of(N, C, P, V);
    if (V == 4) run.template map<ChannelMajor<4>>(t, map_grid(t.s.items, run.info()));
    else run.template map<ChannelMajor<1>>(t, map_grid(t.s.items, run.info()));
}

//! Runs `call`, or what it amounts to when a dimension is empty: nothing, or C = 0 when the inner
//! dimension k is empty and beta is 0 (cuBLAS is never handed an empty product).
template <class Run>
void gemm(Run& run, const GemmCall& call) {
    if (call.m == 0 || call.n == 0 || call.batch == 0) return;
    if (call.k == 0) {
        if (call.beta == 0.0f) fill(run, call.c, std::int64_t{call.m} * call.n * call.batch, 0.0f);
        return;  // beta = 1: C unchanged
    }
    run.gemm(call);
}

//! Floats of each buffer a convolution's ConvScratch holds (Note [convolution on CUDA]).
struct ConvBuffers {
    std::int64_t cols = 0, dcols = 0, dyt = 0;
};
inline ConvBuffers conv_forward_buffers(const ConvPlan& c) { return {c.cols(), 0, 0}; }
inline ConvBuffers conv_backward_buffers(const ConvPlan& c) { return {c.cols(), c.cols(), c.N * c.O * c.P}; }

//! y = conv(x, weight) + bias (bias may be null); `cols` holds conv_forward_buffers(c).cols floats.
template <class Run>
void conv2d_forward(Run& run, const ConvPlan& c, const float* x, const float* weight, const float* bias, float* y, float* cols) {
    if (c.N == 0 || c.O == 0) return;
    im2col(run, c, x, cols, /*sample_major=*/true);
    gemm(run, conv_forward_gemm(c, cols, weight, y));
    if (bias != nullptr) bias_act(run, y, c.N, c.O, c.P, bias, false, nullptr);
}

//! weight_grad += dL/dW, bias_grad += dL/db (may be null), dx = dL/dx; the buffers hold
//! conv_backward_buffers(c) floats.
template <class Run>
void conv2d_backward(Run& run, const ConvPlan& c, const float* x, const float* dy, const float* weight, float* weight_grad,
                     float* bias_grad, float* dx, float* cols, float* dcols, float* dyt) {
    if (c.N == 0) return;
    channel_major(run, dy, dyt, c.N, c.O, c.P);
    im2col(run, c, x, cols, /*sample_major=*/false);
    gemm(run, conv_weight_grad_gemm(c, cols, dyt, weight_grad));
    if (bias_grad != nullptr) channel_sums(run, dy, c.N, c.O, c.P, bias_grad);
    gemm(run, conv_input_grad_gemm(c, weight, dyt, dcols));
    col2im(run, c, dcols, dx, /*sample_major=*/false);
}

//! y (N, out) = x (N, in) W^T + bias (may be null); with `relu` y = max(0, y), mask (may be null) = y > 0.
template <class Run>
void linear_forward(Run& run, std::int64_t N, std::int64_t in, std::int64_t out, const float* x, const float* weight,
                    const float* bias, float* y, bool relu, std::uint8_t* mask) {
    gemm(run, linear_forward_gemm(N, in, out, x, weight, y));
    if (bias != nullptr || relu) bias_act(run, y, N, out, 1, bias, relu, mask);
}

//! weight_grad += g^T x, bias_grad += column sums of g (may be null), dx = g W, where g = dy, or
//! with `mask` dy where the mask is set, written into `masked` (N out floats).
template <class Run>
void linear_backward(Run& run, std::int64_t N, std::int64_t in, std::int64_t out, const float* x, const float* dy,
                     const std::uint8_t* mask, float* masked, const float* weight, float* weight_grad, float* bias_grad,
                     float* dx) {
    const float* g = dy;
    if (mask != nullptr) {
        relu_backward(run, dy, mask, masked, N * out);
        g = masked;
    }
    gemm(run, linear_weight_grad_gemm(N, in, out, x, g, weight_grad));
    if (bias_grad != nullptr) channel_sums(run, g, N, out, 1, bias_grad);
    gemm(run, linear_input_grad_gemm(N, in, out, weight, g, dx));
}

//! Softmax cross-entropy of logits (N, K) against device `labels` (N): grad and totals (=).
template <class Run>
void softmax_cross_entropy(Run& run, const float* logits, std::int64_t N, std::int64_t K, const std::int64_t* labels,
                           double inv_count, float* grad, double* totals) {
    LOCKSTEP_CHECK_AS(ShapeError, N == 0 || K > 0, "softmax cross-entropy needs at least one class, got logits of ", N, "x", K);
    if (N == 0) {
        run.template map<Store2>(StoreParams{totals, 0.0, 0.0}, Grid{1, 1, Store2::threads});
        return;
    }
    const Scratch scratch = run.scratch();
    LossParams p;
    p.out = logits, p.labels = labels, p.grad = grad, p.N = N, p.K = K, p.inv_count = inv_count, p.totals = totals;
    p.counters = scratch.counters;
    const Grid g = reduce_grid(N, 1, threads, 1, 1, sizeof(Sum2), run.info());
    p.partials2 = scratch.template partials_as<Sum2>(g.x);
    run.template reduce<SoftmaxCrossEntropy>(p, g);
}

//! Mean squared error of out against target, both (N, D): grad and totals (=).
template <class Run>
void mse(Run& run, const float* out, const float* target, std::int64_t N, std::int64_t D, double inv_count, float* grad,
         double* totals) {
    if (N == 0 || D == 0) {  // the host's sum of N means of nothing: 0 for no samples, else NaN
        run.template map<Store2>(StoreParams{totals, N == 0 ? 0.0 : ::nan(""), 0.0}, Grid{1, 1, Store2::threads});
        return;
    }
    const Scratch scratch = run.scratch();
    LossParams p;
    p.out = out, p.target = target, p.grad = grad, p.N = N, p.K = D, p.n = N * D, p.inv_count = inv_count, p.totals = totals;
    p.counters = scratch.counters;
    const int V = all_aligned(16, {out, target, grad}) ? 4 : 1;
    const Grid g = reduce_grid(vector_items(p.n, V), 1, threads, 1, 4, sizeof(Sum1), run.info());
    p.partials1 = scratch.template partials_as<Sum1>(g.x);
    if (V == 4) run.template reduce<MeanSquaredError<4>>(p, g);
    else run.template reduce<MeanSquaredError<1>>(p, g);
}

//! One entry of sgd_step_many: a parameter, its gradient, its momentum buffer (momentum only)
//! and whether that buffer is made from the gradient at this step.
struct SgdEntry {
    float* value = nullptr;
    const float* grad = nullptr;
    float* momentum = nullptr;
    std::int64_t n = 0;
    bool first = false;
};

//! One torch.optim.SGD update of every entry, a launch per `table_max` entries (Note [tensor tables]).
template <class Run>
void sgd_step_many(Run& run, std::span<const SgdEntry> entries, const SgdUpdate& u) {
    SgdTableParams p;
    p.lr = static_cast<float>(u.lr), p.mu = static_cast<float>(u.momentum), p.damp = static_cast<float>(1.0 - u.dampening);
    p.wd = static_cast<float>(u.weight_decay), p.nesterov = u.nesterov;
    const bool momentum = p.mu != 0.0f;
    const auto launch = [&] {
        if (p.count == 0) return;
        const Grid g = map_grid(p.begin[p.count], run.info());
        if (momentum) run.template map<SgdTable<true>>(p, g);
        else run.template map<SgdTable<false>>(p, g);
        p.count = 0;
    };
    p.begin[0] = 0;
    for (const SgdEntry& e : entries) {
        if (e.n <= 0) continue;
        const int t = p.count;
        const int vec = all_aligned(16, {e.value, e.grad, momentum ? e.momentum : nullptr}) ? 4 : 1;
        p.w[t] = e.value, p.g[t] = e.grad, p.v[t] = momentum ? e.momentum : nullptr, p.n[t] = e.n;
        p.vec[t] = static_cast<unsigned char>(vec), p.first[t] = e.first ? 1 : 0;
        p.begin[t + 1] = p.begin[t] + vector_items(e.n, vec);
        ++p.count;
        if (p.count == table_max) launch();
    }
    launch();
}

//! One torch.optim.SGD update of one tensor (`momentum` ignored without momentum, initialized
//! from the gradient when `first`): a table of one.
template <class Run>
void sgd_step(Run& run, float* value, const float* grad, float* momentum, std::int64_t n, bool first, const SgdUpdate& u) {
    const SgdEntry e{value, grad, momentum, n, first};
    sgd_step_many(run, std::span<const SgdEntry>(&e, 1), u);
}

//! One entry of copy_many: n floats from src to dst (not overlapping).
struct CopyEntry {
    float* dst = nullptr;
    const float* src = nullptr;
    std::int64_t n = 0;
};

//! Every entry's copy, a launch per `table_max` entries (Note [tensor tables]).
template <class Run>
void copy_many(Run& run, std::span<const CopyEntry> entries) {
    CopyTableParams p;
    const auto launch = [&] {
        if (p.count == 0) return;
        run.template map<CopyTable>(p, map_grid(p.begin[p.count], run.info()));
        p.count = 0;
    };
    p.begin[0] = 0;
    for (const CopyEntry& e : entries) {
        if (e.n <= 0) continue;
        const int t = p.count;
        const int vec = all_aligned(16, {e.dst, e.src}) ? 4 : 1;
        p.dst[t] = e.dst, p.src[t] = e.src, p.n[t] = e.n, p.vec[t] = static_cast<unsigned char>(vec);
        p.begin[t + 1] = p.begin[t] + vector_items(e.n, vec);
        ++p.count;
        if (p.count == table_max) launch();
    }
    launch();
}

}  // namespace lockstep::kernels::device::layer_kernels
