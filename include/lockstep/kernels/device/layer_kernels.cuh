// SPDX-License-Identifier: MIT
//! The elementwise and layer kernels of the CUDA backend (fills and arithmetic, clipping, ReLU,
//! bias and activation, transposition, max pooling, per-channel sums, sums of squares), written
//! once for the device and the host emulator (Note [kernels proven on the host]), and the
//! operations that launch them on any runner (Note [kernel runners]).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "lockstep/core/error.hpp"
#include "lockstep/kernels/device/grid.cuh"
#include "lockstep/kernels/device/launch_config.cuh"
#include "lockstep/kernels/ops.hpp"

namespace lockstep::kernels::device::layer_kernels {

//! max(v, 0) with NaN kept, as the host's ReLU (`host::relu`).
LOCKSTEP_HD inline float relu(float v) { return v > 0.0f ? v : (v == v ? 0.0f : v); }

// ---- fill, scale, add, clip (maps) --------------------------------------------------------------

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
        if (V > 1 && tail < p.n) store(p.p + tail, p.value);
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

template <class T, class S = T>
struct AddParams {
    T* acc = nullptr;
    const S* x = nullptr;
    std::int64_t n = 0;
};

//! acc += x, element by element; x of acc's type, or bfloat16 widened exactly into fp32 (S: a bf16
//! weight gradient added to the fp32 one, Note [cuDNN convolutions]).
template <class T, int V, class S = T>
struct Add {
    using Params = AddParams<T, S>;
    static constexpr int threads = layer_kernels::threads, min_blocks = layer_kernels::min_blocks;
    LOCKSTEP_HD static T widened(S v) {
        if constexpr (std::is_same_v<S, T>)
            return v;
        else
            return to_float(v);
    }
    LOCKSTEP_HD static void run(const Params& p, const Where& w) {
        const std::int64_t vectors = p.n / V;
        for (std::int64_t i = first_index(w); i < vectors; i += grid_threads(w)) {
            auto a = load_pack<V>(p.acc + i * V);
            const auto b = load_pack<V>(p.x + i * V);
            LOCKSTEP_UNROLL
            for (int e = 0; e < V; ++e) a.v[e] += widened(b.v[e]);
            store_pack<V>(p.acc + i * V, a);
        }
        const std::int64_t tail = vectors * V + first_index(w);
        if (V > 1 && tail < p.n) store(p.acc + tail, p.acc[tail] + widened(p.x[tail]));
    }
};

template <class From, class To>
struct ConvertParams {
    const From* x = nullptr;
    To* y = nullptr;
    std::int64_t n = 0;
};

//! y = x in the other storage type (Note [precision]): fp32 to bfloat16 rounds to nearest with
//! ties to even (NaN stays NaN, infinities stay, a value beyond bf16's range becomes an infinity);
//! bfloat16 to fp32 is exact.
template <class From, class To, int V>
struct Convert {
    using Params = ConvertParams<From, To>;
    static constexpr int threads = layer_kernels::threads, min_blocks = layer_kernels::min_blocks;
    LOCKSTEP_HD static void run(const Params& p, const Where& w) {
        const std::int64_t vectors = p.n / V;
        for (std::int64_t i = first_index(w); i < vectors; i += grid_threads(w)) {
            const auto v = load_pack<V>(p.x + i * V);
            Pack<To, V> o;
            LOCKSTEP_UNROLL
            for (int e = 0; e < V; ++e) o.v[e] = from_float<To>(to_float(v.v[e]));
            store_pack<V>(p.y + i * V, o);
        }
        const std::int64_t tail = vectors * V + first_index(w);
        if (V > 1 && tail < p.n) store(p.y + tail, from_float<To>(to_float(p.x[tail])));
    }
};

// ---- ReLU (maps) --------------------------------------------------------------------------------

// Note [activation storage]
// ReLU and max pooling take fp32 or bfloat16 storage (T). Each compares in fp32 (the exact
// widening of T) and writes one of its inputs or +0 unchanged, so a bf16 result is the fp32
// result of the widened input, and no rounding happens; max pooling's backward sums dy in fp32
// in the host's order and rounds the sum once into T. fp32 storage gives the host's bits.

template <class T = float>
struct ReluParams {
    T* x = nullptr;                      // forward: in place
    const T* dy = nullptr;               // backward
    T* dx = nullptr;                     // backward
    std::uint8_t* mask = nullptr;        // forward: where x > 0 (may be null)
    const std::uint8_t* kept = nullptr;  // backward: the forward's mask
    std::int64_t n = 0;
};

//! Whether ReLU keeps the value v (positive or NaN; anything else becomes +0).
LOCKSTEP_HD inline bool relu_keeps(float v) { return v > 0.0f || v != v; }

//! x = max(x, 0) in place (NaN stays NaN, with its bits), mask = x > 0 where the mask is not null.
template <int V, class T = float>
struct ReluForward {
    using Params = ReluParams<T>;
    static constexpr int threads = layer_kernels::threads, min_blocks = layer_kernels::min_blocks;
    LOCKSTEP_HD static void run(const Params& p, const Where& w) {
        const std::int64_t vectors = p.n / V;
        for (std::int64_t i = first_index(w); i < vectors; i += grid_threads(w)) {
            auto v = load_pack<V>(p.x + i * V);
            Pack<std::uint8_t, V> m;
            LOCKSTEP_UNROLL
            for (int e = 0; e < V; ++e) {
                const float f = to_float(v.v[e]);
                m.v[e] = f > 0.0f;
                if (!relu_keeps(f)) v.v[e] = from_float<T>(0.0f);
            }
            store_pack<V>(p.x + i * V, v);
            if (p.mask != nullptr) store_pack<V>(p.mask + i * V, m);
        }
        const std::int64_t tail = vectors * V + first_index(w);
        if (V > 1 && tail < p.n) {
            const float f = to_float(p.x[tail]);
            if (p.mask != nullptr) store(p.mask + tail, static_cast<std::uint8_t>(f > 0.0f));
            if (!relu_keeps(f)) store(p.x + tail, from_float<T>(0.0f));
        }
    }
};

//! dx = mask ? dy : 0.
template <int V, class T = float>
struct ReluBackward {
    using Params = ReluParams<T>;
    static constexpr int threads = layer_kernels::threads, min_blocks = layer_kernels::min_blocks;
    LOCKSTEP_HD static void run(const Params& p, const Where& w) {
        const std::int64_t vectors = p.n / V;
        for (std::int64_t i = first_index(w); i < vectors; i += grid_threads(w)) {
            auto v = load_pack<V>(p.dy + i * V);
            const auto m = load_pack<V>(p.kept + i * V);
            LOCKSTEP_UNROLL
            for (int e = 0; e < V; ++e)
                if (m.v[e] == 0) v.v[e] = from_float<T>(0.0f);
            store_pack<V>(p.dx + i * V, v);
        }
        const std::int64_t tail = vectors * V + first_index(w);
        if (V > 1 && tail < p.n) store(p.dx + tail, p.kept[tail] != 0 ? p.dy[tail] : from_float<T>(0.0f));
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

template <class T = float>
struct BiasActParams {
    T* y = nullptr;
    const float* src = nullptr;    // where set, the values (fp32) read instead of y's: y is written only
    const float* bias = nullptr;   // per channel (may be null)
    std::uint8_t* mask = nullptr;  // v > 0 (may be null)
    bool relu = false;
    Planes s;
};

//! y = bias[c] + y (or + src, where set), then mask = y > 0 and, with `relu`, y = max(0, y): the
//! host's linear epilogue and convolution bias, in the same fp32 operations. T: fp32, or bfloat16
//! storage (the sum in fp32 on the widened value, or on src's fp32 value, rounded once: Note
//! [precision]); with src, a bf16 output's epilogue and rounding are one pass.
template <int V, class T = float>
struct BiasAct {
    using Params = BiasActParams<T>;
    static constexpr int threads = layer_kernels::threads, min_blocks = layer_kernels::min_blocks;
    LOCKSTEP_HD static void run(const Params& p, const Where& w) {
        for (unsigned int j = static_cast<unsigned int>(first_index(w)); j < p.s.items;
             j += static_cast<unsigned int>(grid_threads(w))) {
            const unsigned int plane = p.s.per_plane.div(j);
            const unsigned int c = plane - p.s.channels.div(plane) * p.s.channels.d;
            const float b = p.bias != nullptr ? p.bias[c] : 0.0f;
            const std::int64_t off = static_cast<std::int64_t>(j) * V;
            Pack<float, V> in;
            if (p.src != nullptr) {
                in = load_pack<V>(p.src + off);
            } else {
                const auto t = load_pack<V>(p.y + off);
                LOCKSTEP_UNROLL
                for (int e = 0; e < V; ++e) in.v[e] = to_float(t.v[e]);
            }
            Pack<T, V> v;
            Pack<std::uint8_t, V> m;
            LOCKSTEP_UNROLL
            for (int e = 0; e < V; ++e) {
                const float x = p.bias != nullptr ? in.v[e] + b : in.v[e];
                m.v[e] = x > 0.0f;
                v.v[e] = from_float<T>(p.relu ? relu(x) : x);
            }
            store_pack<V>(p.y + off, v);
            if (p.mask != nullptr) store_pack<V>(p.mask + off, m);
        }
    }
};

template <class From = float, class To = float>
struct ChannelMajorParams {
    const From* src = nullptr;  // (N, C, P)
    To* dst = nullptr;          // (C, N, P)
    Planes s;
};

//! dst (C, N, P) = src (N, C, P): the convolution's dy laid out for one GEMM over the shard; from
//! fp32 into bf16 rounded to nearest even on the way (a bf16 product's operand, Note
//! [precision]); a bf16 source copied bit for bit.
template <int V, class From = float, class To = float>
struct ChannelMajor {
    using Params = ChannelMajorParams<From, To>;
    static constexpr int threads = layer_kernels::threads, min_blocks = layer_kernels::min_blocks;
    LOCKSTEP_HD static void run(const Params& p, const Where& w) {
        for (unsigned int j = static_cast<unsigned int>(first_index(w)); j < p.s.items;
             j += static_cast<unsigned int>(grid_threads(w))) {
            const unsigned int plane = p.s.per_plane.div(j);  // (c, n) of dst
            const unsigned int q = j - plane * p.s.per_plane.d;
            const unsigned int c = p.s.batch.div(plane);
            const unsigned int n = plane - c * p.s.batch.d;
            const std::int64_t src = (static_cast<std::int64_t>(n) * p.s.channels.d + c) * p.s.per_plane.d + q;
            if constexpr (std::is_same_v<From, To>) {
                store_pack<V>(p.dst + static_cast<std::int64_t>(j) * V, load_pack<V>(p.src + src * V));
            } else {
                const auto v = load_pack<V>(p.src + src * V);
                Pack<To, V> o;
                LOCKSTEP_UNROLL
                for (int e = 0; e < V; ++e) o.v[e] = from_float<To>(to_float(v.v[e]));
                store_pack<V>(p.dst + static_cast<std::int64_t>(j) * V, o);
            }
        }
    }
};

// ---- max pooling (maps) -------------------------------------------------------------------------

template <class T = float>
struct PoolParams {
    const T* x = nullptr;
    T* y = nullptr;
    std::int32_t* argmax = nullptr;
    const T* dy = nullptr;             // backward
    const std::int32_t* at = nullptr;  // backward: the forward's argmax
    T* dx = nullptr;                   // backward
    int H = 0, W = 0, OH = 0, OW = 0, k = 1, s = 1;
    unsigned int items = 0;  // forward: planes * OH * OW; backward: planes * H * W
    Divider cols, rows;      // forward: OW, OH; backward: W, H
    Divider stride;          // backward: s
};

//! y = the maximum of each window, argmax = its index in the plane, with the host's rules: the
//! window is read in row order from its top-left value, a value wins when greater or NaN (so the
//! last NaN of the window wins, and of equal values the first); y is the winning element itself
//! (Note [activation storage]).
template <class T = float>
struct MaxPoolForward {
    using Params = PoolParams<T>;
    static constexpr int threads = layer_kernels::threads, min_blocks = layer_kernels::min_blocks;
    LOCKSTEP_HD static void run(const Params& p, const Where& w) {
        for (unsigned int i = static_cast<unsigned int>(first_index(w)); i < p.items;
             i += static_cast<unsigned int>(grid_threads(w))) {
            const unsigned int q = p.cols.div(i);
            const unsigned int ow = i - q * p.cols.d;
            const unsigned int plane = p.rows.div(q);
            const unsigned int oh = q - plane * p.rows.d;
            const T* src = p.x + static_cast<std::int64_t>(plane) * p.H * p.W;
            const int top = static_cast<int>(oh) * p.s * p.W, left = static_cast<int>(ow) * p.s;
            T winner = src[top + left];
            float best = to_float(winner);
            int at = top + left;
            for (int a = 0; a < p.k; ++a)
                for (int b = 0; b < p.k; ++b) {
                    if (a == 0 && b == 0) continue;
                    const int idx = top + a * p.W + b + left;
                    const T raw = src[idx];
                    const float v = to_float(raw);
                    const bool take = v > best || v != v;
                    winner = take ? raw : winner;
                    best = take ? v : best;
                    at = take ? idx : at;
                }
            store(p.y + i, winner);
            store(p.argmax + i, at);
        }
    }
};

//! dx = the sum of dy over the windows whose argmax is this element, added in the order of the
//! windows (the host's scatter order): a gather, bit for bit the host's result, without atomics.
//! `at` must be the forward's argmax (an index inside each window). The sum is fp32, rounded once
//! into T.
template <class T = float>
struct MaxPoolBackward {
    using Params = PoolParams<T>;
    static constexpr int threads = layer_kernels::threads, min_blocks = layer_kernels::min_blocks;
    LOCKSTEP_HD static void run(const Params& p, const Where& w) {
        for (unsigned int i = static_cast<unsigned int>(first_index(w)); i < p.items;
             i += static_cast<unsigned int>(grid_threads(w))) {
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
                    if (p.at[o] == self) sum += to_float(p.dy[o]);
                }
            store(p.dx + i, from_float<T>(sum));
        }
    }
};

// ---- the public tensor operations (maps, Note [tensor operations per element]) ------------------

struct TensorOpParams {
    const float* a = nullptr;
    const float* b = nullptr;
    float* out = nullptr;
    std::int64_t* index = nullptr;
    float alpha = 1.0f, beta = 1.0f;
    std::int64_t n = 0;  // threads' items: elements, outputs or lines
    ReduceGeometry reduce;
    BroadcastGeometry broadcast;
    LineGeometry line;
    PlaceGeometry place;
};

//! out = alpha a + beta b.
struct Axpby {
    using Params = TensorOpParams;
    static constexpr int threads = layer_kernels::threads, min_blocks = layer_kernels::min_blocks;
    LOCKSTEP_HD static void run(const Params& p, const Where& w) {
        for (std::int64_t i = first_index(w); i < p.n; i += grid_threads(w))
            store(p.out + i, tensor_math::axpby(p.alpha, p.a[i], p.beta, p.b[i]));
    }
};

//! out = a * b.
struct Multiply {
    using Params = TensorOpParams;
    static constexpr int threads = layer_kernels::threads, min_blocks = layer_kernels::min_blocks;
    LOCKSTEP_HD static void run(const Params& p, const Where& w) {
        for (std::int64_t i = first_index(w); i < p.n; i += grid_threads(w)) store(p.out + i, p.a[i] * p.b[i]);
    }
};

//! One thread per output: its scaled fp64 sum (tensor_math::reduce_at).
struct Reduce {
    using Params = TensorOpParams;
    static constexpr int threads = layer_kernels::threads, min_blocks = layer_kernels::min_blocks;
    LOCKSTEP_HD static void run(const Params& p, const Where& w) {
        for (std::int64_t o = first_index(w); o < p.n; o += grid_threads(w))
            store(p.out + o, tensor_math::reduce_at(p.reduce, p.a, o));
    }
};

//! One thread per input element: dy broadcast back (tensor_math::broadcast_at).
struct Broadcast {
    using Params = TensorOpParams;
    static constexpr int threads = layer_kernels::threads, min_blocks = layer_kernels::min_blocks;
    LOCKSTEP_HD static void run(const Params& p, const Where& w) {
        for (std::int64_t i = first_index(w); i < p.n; i += grid_threads(w))
            store(p.out + i, tensor_math::broadcast_at(p.broadcast, p.a, i));
    }
};

//! One thread per line: softmax (a: x, out: y).
struct SoftmaxForward {
    using Params = TensorOpParams;
    static constexpr int threads = layer_kernels::threads, min_blocks = layer_kernels::min_blocks;
    LOCKSTEP_HD static void run(const Params& p, const Where& w) {
        const std::int64_t length = p.line.length, step = p.line.step;
        for (std::int64_t l = first_index(w); l < p.n; l += grid_threads(w)) {
            const std::int64_t start = p.line.lines.offset(l);
            const float* x = p.a + start;
            float* y = p.out + start;
            const auto line = tensor_math::softmax_stats(x, length, step);
            for (std::int64_t k = 0; k < length; ++k) store(y + k * step, tensor_math::softmax_value(x[k * step], line));
        }
    }
};

//! One thread per line: softmax backward (a: y, b: dy, out: dx).
struct SoftmaxBackward {
    using Params = TensorOpParams;
    static constexpr int threads = layer_kernels::threads, min_blocks = layer_kernels::min_blocks;
    LOCKSTEP_HD static void run(const Params& p, const Where& w) {
        const std::int64_t length = p.line.length, step = p.line.step;
        for (std::int64_t l = first_index(w); l < p.n; l += grid_threads(w)) {
            const std::int64_t start = p.line.lines.offset(l);
            const float* y = p.a + start;
            const float* dy = p.b + start;
            float* dx = p.out + start;
            const double dot = tensor_math::softmax_dot(y, dy, length, step);
            for (std::int64_t k = 0; k < length; ++k)
                store(dx + k * step, tensor_math::softmax_grad_value(y[k * step], dy[k * step], dot));
        }
    }
};

//! One thread per line: the index of its largest element.
struct Argmax {
    using Params = TensorOpParams;
    static constexpr int threads = layer_kernels::threads, min_blocks = layer_kernels::min_blocks;
    LOCKSTEP_HD static void run(const Params& p, const Where& w) {
        for (std::int64_t l = first_index(w); l < p.n; l += grid_threads(w))
            store(p.index + l, tensor_math::argmax_line(p.line, p.a, l));
    }
};

//! out[base + walk.offset(i)] = a[i] (a slice put in its place).
struct Place {
    using Params = TensorOpParams;
    static constexpr int threads = layer_kernels::threads, min_blocks = layer_kernels::min_blocks;
    LOCKSTEP_HD static void run(const Params& p, const Where& w) {
        for (std::int64_t i = first_index(w); i < p.n; i += grid_threads(w))
            store(p.out + p.place.base + p.place.walk.offset(i), p.a[i]);
    }
};

//! out[i] = a[base + walk.offset(i)] (a slice taken out).
struct Take {
    using Params = TensorOpParams;
    static constexpr int threads = layer_kernels::threads, min_blocks = layer_kernels::min_blocks;
    LOCKSTEP_HD static void run(const Params& p, const Where& w) {
        for (std::int64_t i = first_index(w); i < p.n; i += grid_threads(w))
            store(p.out + i, p.a[p.place.base + p.place.walk.offset(i)]);
    }
};

// ---- average pooling and dropout (maps, Note [pooling and dropout per element]) -------------------

struct AvgPoolParams {
    AvgPoolGeometry g;
    const float* src = nullptr;  // forward: x; backward: dy
    float* dst = nullptr;        // forward: y; backward: dx
    std::int64_t n = 0;          // elements of dst
};

//! y = the mean of each window (pool::forward_at, as the host computes it).
struct AvgPoolForward {
    using Params = AvgPoolParams;
    static constexpr int threads = layer_kernels::threads, min_blocks = layer_kernels::min_blocks;
    LOCKSTEP_HD static void run(const Params& p, const Where& w) {
        for (std::int64_t i = first_index(w); i < p.n; i += grid_threads(w)) store(p.dst + i, pool::forward_at(p.g, p.src, i));
    }
};

//! dx = the windows' shares of dy gathered per input element (pool::backward_at): no atomics.
struct AvgPoolBackward {
    using Params = AvgPoolParams;
    static constexpr int threads = layer_kernels::threads, min_blocks = layer_kernels::min_blocks;
    LOCKSTEP_HD static void run(const Params& p, const Where& w) {
        for (std::int64_t i = first_index(w); i < p.n; i += grid_threads(w)) store(p.dst + i, pool::backward_at(p.g, p.src, i));
    }
};

struct DropoutParams {
    DropoutDraw draw;
    float* x = nullptr;                  // forward: in place
    std::uint8_t* mask = nullptr;        // forward: written
    const float* dy = nullptr;           // backward
    const std::uint8_t* kept = nullptr;  // backward: the forward's mask
    float* dx = nullptr;                 // backward
    std::int64_t n = 0;
};

//! x *= (keep ? scale : 0) in place, mask = keep, keep drawn per element (dropout::keep).
struct DropoutForward {
    using Params = DropoutParams;
    static constexpr int threads = layer_kernels::threads, min_blocks = layer_kernels::min_blocks;
    LOCKSTEP_HD static void run(const Params& p, const Where& w) {
        for (std::int64_t i = first_index(w); i < p.n; i += grid_threads(w)) {
            const bool k = dropout::keep(p.draw, static_cast<std::uint64_t>(i));
            store(p.mask + i, static_cast<std::uint8_t>(k ? 1 : 0));
            store(p.x + i, p.x[i] * (k ? p.draw.scale : 0.0f));
        }
    }
};

//! dx = dy * (kept ? scale : 0).
struct DropoutBackward {
    using Params = DropoutParams;
    static constexpr int threads = layer_kernels::threads, min_blocks = layer_kernels::min_blocks;
    LOCKSTEP_HD static void run(const Params& p, const Where& w) {
        for (std::int64_t i = first_index(w); i < p.n; i += grid_threads(w))
            store(p.dx + i, p.dy[i] * (p.kept[i] != 0 ? p.draw.scale : 0.0f));
    }
};

// ---- layer norm (maps over rows and columns, Note [layer norm per row]) --------------------------

struct LayerNormParams {
    const float* x = nullptr;
    const float* dy = nullptr;  // backward
    const float* w = nullptr;   // may be null
    const float* b = nullptr;   // forward; may be null
    float* y = nullptr;         // forward: y; backward: dx
    float* mean = nullptr;
    float* rstd = nullptr;
    float* dw = nullptr;  // parameter gradients (may be null)
    float* db = nullptr;
    std::int64_t rows = 0, M = 0;
    double eps = 1e-5;
};

//! One thread per row: its statistics, then the row normalized.
struct LayerNormForward {
    using Params = LayerNormParams;
    static constexpr int threads = layer_kernels::threads, min_blocks = layer_kernels::min_blocks;
    LOCKSTEP_HD static void run(const Params& p, const Where& w) {
        for (std::int64_t i = first_index(w); i < p.rows; i += grid_threads(w)) {
            const float* row = p.x + i * p.M;
            float mu = 0, r = 0;
            layer_norm::row_stats(row, p.M, p.eps, mu, r);
            store(p.mean + i, mu);
            store(p.rstd + i, r);
            for (std::int64_t j = 0; j < p.M; ++j) store(p.y + i * p.M + j, layer_norm::forward_at(row[j], mu, r, p.w, p.b, j));
        }
    }
};

//! One thread per row: the row's dx.
struct LayerNormDx {
    using Params = LayerNormParams;
    static constexpr int threads = layer_kernels::threads, min_blocks = layer_kernels::min_blocks;
    LOCKSTEP_HD static void run(const Params& p, const Where& w) {
        for (std::int64_t i = first_index(w); i < p.rows; i += grid_threads(w))
            layer_norm::backward_row(p.x + i * p.M, p.dy + i * p.M, p.M, p.w, p.mean[i], p.rstd[i], p.y + i * p.M);
    }
};

//! One thread per column: its parameters' gradients, summed over the rows in row order.
struct LayerNormParamGrads {
    using Params = LayerNormParams;
    static constexpr int threads = layer_kernels::threads, min_blocks = layer_kernels::min_blocks;
    LOCKSTEP_HD static void run(const Params& p, const Where& w) {
        for (std::int64_t j = first_index(w); j < p.M; j += grid_threads(w))
            layer_norm::param_grads_at(p.x, p.dy, p.rows, p.M, p.mean, p.rstd, j, p.dw, p.db);
    }
};

// ---- per-channel sums (reducing) ----------------------------------------------------------------

template <class T = float>
struct ChannelSumParams {
    const T* dy = nullptr;   // (N, C, P), fp32 or bfloat16 storage (summed widened)
    float* out = nullptr;    // += per channel
    unsigned int items = 0;  // N P per channel (P > 1) or N rows (P = 1)
    int C = 0;
    Divider per_plane;  // P
    Sum1* partials = nullptr;
    unsigned int* counters = nullptr;
};

//! out[c] += the fp64 sum of dy over N and P, a group per channel (the convolution's bias gradient).
template <class T = float>
struct ChannelSumPlanes {
    using Params = ChannelSumParams<T>;
    using Value = Sum1;
    static constexpr int threads = layer_kernels::threads, lanes = 1, rows = threads, min_blocks = layer_kernels::min_blocks;
    LOCKSTEP_HD static Value accumulate(const Params& p, const Where& w) {
        double s = 0;
        const std::int64_t c = w.by;
        for (unsigned int j = static_cast<unsigned int>(first_index(w)); j < p.items;
             j += static_cast<unsigned int>(grid_threads(w))) {
            const unsigned int n = p.per_plane.div(j);
            const unsigned int q = j - n * p.per_plane.d;
            s += static_cast<double>(to_float(p.dy[(static_cast<std::int64_t>(n) * p.C + c) * p.per_plane.d + q]));
        }
        return {s};
    }
    LOCKSTEP_HD static void store_partial(const Params& p, const Where& w, int, const Value& v) {
        store(p.partials + static_cast<std::int64_t>(w.by) * w.gx + w.bx, v);
    }
    LOCKSTEP_HD static unsigned int* counter(const Params& p, const Where& w) { return p.counters + w.by; }
    LOCKSTEP_HD static Value gather(const Params& p, const Where& w, int, int row) {
        double s = 0;
        const Sum1* part = p.partials + static_cast<std::int64_t>(w.by) * w.gx;
        for (int i = row; i < w.gx; i += rows) s += load_other_block(&part[i].v);
        return {s};
    }
    LOCKSTEP_HD static void finish(const Params& p, const Where& w, int, const Value& total) {
        store(p.out + w.by, p.out[w.by] + static_cast<float>(total.v));
    }
};

//! out[c] += the fp64 sum of dy's column c over its N rows (the linear layer's bias gradient):
//! 32 channels a group, a warp reading 32 consecutive values.
template <class T = float>
struct ChannelSumRows {
    using Params = ChannelSumParams<T>;
    using Value = Sum1;
    static constexpr int threads = layer_kernels::threads, lanes = tile, rows = tile_rows, min_blocks = layer_kernels::min_blocks;
    LOCKSTEP_HD static Value accumulate(const Params& p, const Where& w) {
        const std::int64_t c = static_cast<std::int64_t>(w.by) * tile + w.t % tile;
        if (c >= p.C) return {};
        double s = 0;
        for (unsigned int r = static_cast<unsigned int>(w.bx * rows + w.t / tile); r < p.items;
             r += static_cast<unsigned int>(w.gx * rows))
            s += static_cast<double>(to_float(p.dy[static_cast<std::int64_t>(r) * p.C + c]));
        return {s};
    }
    LOCKSTEP_HD static void store_partial(const Params& p, const Where& w, int lane, const Value& v) {
        store(p.partials + (static_cast<std::int64_t>(w.by) * w.gx + w.bx) * tile + lane, v);
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
        if (c < p.C) store(p.out + c, p.out[c] + static_cast<float>(total.v));
    }
};

// ---- sums of squares (reducing) -----------------------------------------------------------------

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
    LOCKSTEP_HD static void store_partial(const Params& p, const Where& w, int, const Value& v) { store(p.partials + w.bx, v); }
    LOCKSTEP_HD static unsigned int* counter(const Params& p, const Where&) { return p.counters; }
    LOCKSTEP_HD static Value gather(const Params& p, const Where& w, int, int row) {
        double s = 0;
        for (int i = row; i < w.gx; i += rows) s += load_other_block(&p.partials[i].v);
        return {s};
    }
    LOCKSTEP_HD static void finish(const Params& p, const Where&, int, const Value& total) { store(p.acc, *p.acc + total.v); }
};

// ---- the operations, for any runner (Note [kernel runners]) -------------------------------------

//! p[0, n) = value.
template <class Run, class T>
void fill(Run& run, T* p, std::int64_t n, T value) {
    static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 16 && (sizeof(T) & (sizeof(T) - 1)) == 0,
                  "fill takes trivially copyable elements of 1, 2, 4, 8 or 16 bytes");
    constexpr int V = vec16<T>;
    FillParams<T> f{p, n, value};
    if (all_aligned(16, {p}))
        run.template map<Fill<T, V>>(f, map_grid(vector_items(n, V), run.info()));
    else
        run.template map<Fill<T, 1>>(f, map_grid(n, run.info()));
}

//! p *= factor (fp32).
template <class Run>
void scale(Run& run, float* p, std::int64_t n, float factor) {
    ScaleParams s;
    s.p = p, s.n = n, s.factor = factor;
    if (all_aligned(16, {p}))
        run.template map<Scale<4>>(s, map_grid(vector_items(n, 4), run.info()));
    else
        run.template map<Scale<1>>(s, map_grid(n, run.info()));
}

//! p *= min(1, max_norm / (sqrt(sum_squares[0]) + 1e-6)), the coefficient computed on the device.
template <class Run>
void clip_to_norm(Run& run, float* p, std::int64_t n, const double* sum_squares, double max_norm) {
    ScaleParams s;
    s.p = p, s.n = n, s.sum_squares = sum_squares, s.max_norm = max_norm;
    if (all_aligned(16, {p}))
        run.template map<Scale<4>>(s, map_grid(vector_items(n, 4), run.info()));
    else
        run.template map<Scale<1>>(s, map_grid(n, run.info()));
}

//! acc += x.
template <class Run, class T>
void add(Run& run, T* acc, const T* x, std::int64_t n) {
    static_assert(std::is_arithmetic_v<T>, "add takes arithmetic elements");
    constexpr int V = vec16<T>;
    AddParams<T> a{acc, x, n};
    if (all_aligned(16, {acc, x}))
        run.template map<Add<T, V>>(a, map_grid(vector_items(n, V), run.info()));
    else
        run.template map<Add<T, 1>>(a, map_grid(n, run.info()));
}

//! y[0, n) = x[0, n) converted between fp32 and bfloat16 (Convert), 4 elements at a time (a
//! 16-byte vector of fp32, an 8-byte one of bf16) where the pointers allow.
template <class Run, class From, class To>
void convert(Run& run, const From* x, To* y, std::int64_t n) {
    ConvertParams<From, To> a{x, y, n};
    if (all_aligned(4 * sizeof(From), {x}) && all_aligned(4 * sizeof(To), {y}))
        run.template map<Convert<From, To, 4>>(a, map_grid(vector_items(n, 4), run.info()));
    else
        run.template map<Convert<From, To, 1>>(a, map_grid(n, run.info()));
}

//! y[0, n) = x[0, n) rounded to bfloat16 (Note [precision]).
template <class Run>
void to_bf16(Run& run, const float* x, __nv_bfloat16* y, std::int64_t n) {
    convert(run, x, y, n);
}

//! y[0, n) = x[0, n) widened to fp32 (exact).
template <class Run>
void from_bf16(Run& run, const __nv_bfloat16* x, float* y, std::int64_t n) {
    convert(run, x, y, n);
}

//! x = max(x, 0) in place (NaN kept); mask (may be null) = x > 0. T: float or __nv_bfloat16 (Note
//! [activation storage]), 16 bytes a vector where aligned.
template <class Run, class T>
void relu_forward(Run& run, T* x, std::uint8_t* mask, std::int64_t n) {
    constexpr int V = vec16<T>;
    ReluParams<T> r;
    r.x = x, r.mask = mask, r.n = n;
    if (all_aligned(16, {x}) && all_aligned(static_cast<std::size_t>(V), {mask}))
        run.template map<ReluForward<V, T>>(r, map_grid(vector_items(n, V), run.info()));
    else
        run.template map<ReluForward<1, T>>(r, map_grid(n, run.info()));
}

//! dx = mask ? dy : 0.
template <class Run, class T>
void relu_backward(Run& run, const T* dy, const std::uint8_t* mask, T* dx, std::int64_t n) {
    constexpr int V = vec16<T>;
    ReluParams<T> r;
    r.dy = dy, r.kept = mask, r.dx = dx, r.n = n;
    if (all_aligned(16, {dy, dx}) && all_aligned(static_cast<std::size_t>(V), {mask}))
        run.template map<ReluBackward<V, T>>(r, map_grid(vector_items(n, V), run.info()));
    else
        run.template map<ReluBackward<1, T>>(r, map_grid(n, run.info()));
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

//! y (N, C, P) = bias[c] + y (bias may be null), mask (may be null) = y > 0, with `relu` y = max(0, y);
//! with `src`, bias[c] + src instead of + y, y written only. T: float, or __nv_bfloat16 storage
//! (computed in fp32, rounded once).
template <class Run, class T>
void bias_act(Run& run, T* y, std::int64_t N, std::int64_t C, std::int64_t P, const float* bias, bool relu, std::uint8_t* mask,
              const float* src = nullptr) {
    const int V = P % 4 == 0 && all_aligned(4 * sizeof(T), {y}) && all_aligned(16, {src}) && all_aligned(4, {mask}) ? 4 : 1;
    BiasActParams<T> b;
    b.y = y, b.src = src, b.bias = bias, b.mask = mask, b.relu = relu;
    b.s = planes_of(N, C, P, V);
    if (V == 4)
        run.template map<BiasAct<4, T>>(b, map_grid(b.s.items, run.info()));
    else
        run.template map<BiasAct<1, T>>(b, map_grid(b.s.items, run.info()));
}

//! acc[0, n) += x[0, n) widened to fp32.
template <class Run>
void add_widened(Run& run, float* acc, const __nv_bfloat16* x, std::int64_t n) {
    AddParams<float, __nv_bfloat16> a{acc, x, n};
    if (all_aligned(16, {acc}) && all_aligned(8, {x}))
        run.template map<Add<float, 4, __nv_bfloat16>>(a, map_grid(vector_items(n, 4), run.info()));
    else
        run.template map<Add<float, 1, __nv_bfloat16>>(a, map_grid(n, run.info()));
}

//! out[c] += the sum of dy (N, C, P) over N and P, in fp64, rounded once into out's fp32 sum. dy:
//! fp32, or bfloat16 storage read widened (the sums of a bf16 dy and of its widened copy are the same).
template <class Run, class T>
void channel_sums(Run& run, const T* dy, std::int64_t N, std::int64_t C, std::int64_t P, float* out) {
    check_index_space(N * P, "a per-channel sum");
    const Scratch scratch = run.scratch();
    ChannelSumParams<T> s;
    s.dy = dy, s.out = out, s.C = static_cast<int>(std::min<std::int64_t>(C, index_limit));
    s.items = static_cast<unsigned int>(P == 1 ? N : N * P);
    s.per_plane = divider(P);
    s.counters = scratch.counters;
    if (P == 1) {
        const Grid g = reduce_grid(N, (C + tile - 1) / tile, tile_rows, tile, 4, sizeof(Sum1), run.info());
        s.partials = scratch.template partials_as<Sum1>(std::int64_t{g.x} * g.y * tile);
        run.template reduce<ChannelSumRows<T>>(s, g);
    } else {
        const Grid g = reduce_grid(N * P, C, threads, 1, 4, sizeof(Sum1), run.info());
        s.partials = scratch.template partials_as<Sum1>(std::int64_t{g.x} * g.y);
        run.template reduce<ChannelSumPlanes<T>>(s, g);
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
    if (V == 4)
        run.template reduce<SumSquares<4>>(s, g);
    else
        run.template reduce<SumSquares<1>>(s, g);
}

//! Max pooling forward over an NCHW shard (y, argmax: (N, C, OH, OW)).
template <class Run, class T>
void maxpool_forward(Run& run, const PoolGeometry& g, const T* x, T* y, std::int32_t* argmax) {
    LOCKSTEP_CHECK_AS(ShapeError, g.kernel >= 1 && g.stride >= 1 && g.height >= g.kernel && g.width >= g.kernel,
                      "max pooling needs kernel >= 1, stride >= 1 and a kernel no larger than the input; got kernel ", g.kernel,
                      ", stride ", g.stride, " on ", g.height, "x", g.width);
    const std::int64_t planes = g.batch * g.channels, OH = g.out_height(), OW = g.out_width();
    check_index_space(planes * g.height * g.width, "max pooling");
    PoolParams<T> p;
    p.x = x, p.y = y, p.argmax = argmax;
    p.H = static_cast<int>(g.height), p.W = static_cast<int>(g.width), p.OH = static_cast<int>(OH), p.OW = static_cast<int>(OW);
    p.k = static_cast<int>(g.kernel), p.s = static_cast<int>(g.stride);
    p.items = static_cast<unsigned int>(planes * OH * OW);
    p.cols = divider(OW), p.rows = divider(OH);
    run.template map<MaxPoolForward<T>>(p, map_grid(p.items, run.info()));
}

//! Max pooling backward: dx (N, C, H, W) from dy and the forward's argmax (a gather).
template <class Run, class T>
void maxpool_backward(Run& run, const PoolGeometry& g, const T* dy, const std::int32_t* argmax, T* dx) {
    LOCKSTEP_CHECK_AS(ShapeError, g.kernel >= 1 && g.stride >= 1 && g.height >= g.kernel && g.width >= g.kernel,
                      "max pooling needs kernel >= 1, stride >= 1 and a kernel no larger than the input; got kernel ", g.kernel,
                      ", stride ", g.stride, " on ", g.height, "x", g.width);
    const std::int64_t planes = g.batch * g.channels;
    check_index_space(planes * g.height * g.width, "max pooling");
    PoolParams<T> p;
    p.dy = dy, p.at = argmax, p.dx = dx;
    p.H = static_cast<int>(g.height), p.W = static_cast<int>(g.width);
    p.OH = static_cast<int>(g.out_height()), p.OW = static_cast<int>(g.out_width());
    p.k = static_cast<int>(g.kernel), p.s = static_cast<int>(g.stride);
    p.items = static_cast<unsigned int>(planes * g.height * g.width);
    p.cols = divider(g.width), p.rows = divider(g.height), p.stride = divider(g.stride);
    run.template map<MaxPoolBackward<T>>(p, map_grid(p.items, run.info()));
}

//! Average pooling forward (y: g.out_numel() elements) or backward (dx: g.in_numel()), one thread
//! per element written.
template <class Run>
void avgpool(Run& run, const AvgPoolGeometry& g, const float* src, float* dst, bool backward) {
    AvgPoolParams p;
    p.g = g, p.src = src, p.dst = dst, p.n = backward ? g.in_numel() : g.out_numel();
    if (p.n == 0) return;
    if (backward)
        run.template map<AvgPoolBackward>(p, map_grid(p.n, run.info()));
    else
        run.template map<AvgPoolForward>(p, map_grid(p.n, run.info()));
}

//! Launches tensor operation K over p.n items (elements, outputs or lines); nothing for none.
template <class K, class Run>
void tensor_op(Run& run, const TensorOpParams& p) {
    if (p.n == 0) return;
    run.template map<K>(p, map_grid(p.n, run.info()));
}

//! Layer norm forward over `rows` rows of M values (Note [layer norm per row]).
template <class Run>
void layer_norm_forward(Run& run, LayerNormParams p) {
    if (p.rows == 0 || p.M == 0) return;
    run.template map<LayerNormForward>(p, map_grid(p.rows, run.info()));
}

//! Layer norm backward: dx (p.y) per row, then the parameters' gradients per column.
template <class Run>
void layer_norm_backward(Run& run, LayerNormParams p) {
    if (p.rows == 0 || p.M == 0) return;
    run.template map<LayerNormDx>(p, map_grid(p.rows, run.info()));
    if (p.dw != nullptr || p.db != nullptr) run.template map<LayerNormParamGrads>(p, map_grid(p.M, run.info()));
}

//! Dropout forward in place on x[0, n), its mask written.
template <class Run>
void dropout_forward(Run& run, const DropoutDraw& d, float* x, std::uint8_t* mask, std::int64_t n) {
    if (n == 0) return;
    DropoutParams p;
    p.draw = d, p.x = x, p.mask = mask, p.n = n;
    run.template map<DropoutForward>(p, map_grid(n, run.info()));
}

//! Dropout backward: dx[0, n) = dy * (mask ? scale : 0).
template <class Run>
void dropout_backward(Run& run, const DropoutDraw& d, const float* dy, const std::uint8_t* mask, float* dx, std::int64_t n) {
    if (n == 0) return;
    DropoutParams p;
    p.draw = d, p.dy = dy, p.kept = mask, p.dx = dx, p.n = n;
    run.template map<DropoutBackward>(p, map_grid(n, run.info()));
}

//! dst (C, N, P) = src (N, C, P); From, To: float, or __nv_bfloat16 (fp32 to bf16 rounds; bf16 to
//! bf16 copies).
template <class Run, class From, class To>
void channel_major(Run& run, const From* src, To* dst, std::int64_t N, std::int64_t C, std::int64_t P) {
    static_assert(!(std::is_same_v<From, __nv_bfloat16> && std::is_same_v<To, float>), "channel_major does not widen");
    const int V = P % 4 == 0 && all_aligned(4 * sizeof(From), {src}) && all_aligned(4 * sizeof(To), {dst}) ? 4 : 1;
    ChannelMajorParams<From, To> t;
    t.src = src, t.dst = dst;
    t.s = planes_of(N, C, P, V);
    if (V == 4)
        run.template map<ChannelMajor<4, From, To>>(t, map_grid(t.s.items, run.info()));
    else
        run.template map<ChannelMajor<1, From, To>>(t, map_grid(t.s.items, run.info()));
}

}  // namespace lockstep::kernels::device::layer_kernels
