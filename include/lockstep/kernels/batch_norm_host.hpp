// SPDX-License-Identifier: MIT
//! Host loops of batch norm over whole tensors (NCHW and NHWC), built on `batch_norm_math.hpp`.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "lockstep/core/config.hpp"
#include "lockstep/kernels/batch_norm_math.hpp"
#include "lockstep/kernels/ops.hpp"
#include "lockstep/kernels/simd.hpp"

// Vectors wider than the baseline cross no function boundary (every helper is always-inline into a
// wrapper compiled for their ISA), so GCC's note that such a call would change the ABI is moot.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"

namespace lockstep::kernels::host {

using kernels::BnGeometry;

// Note [host batch-norm kernels]
// Every kernel is one template over the vector width W (floats), instantiated for the baseline
// ISA and, on x86-64, inside wrappers compiled for AVX2+FMA and AVX-512 that `simd::active()`
// picks at run time (see simd.hpp). The bodies are always-inline so the whole loop nest is
// compiled for the wrapper's ISA.
// - Channels-first (NCHW) sums run over each contiguous (n, c) plane with four independent vector
//   accumulators per quantity, so the adds' latency overlaps; fp32 over at most `per_lane` values
//   per lane, fp64 beyond: no long sum is ever formed in fp32.
// - Channels-last (NHWC, 2-D) sums walk the rows in order into per-channel fp32 partials that are
//   flushed into fp64 every `block_rows` rows.
// - Element-wise passes read every tensor front to back and apply the per-channel constants of
//   batch_norm_math.hpp: two or three arithmetic operations per element.
// A step whose tensors exceed the cache is bound by memory traffic: eight tensor-sized streams
// (x read four times, dy twice, y and dx written).

namespace detail {

#define LOCKSTEP_KERNEL_INLINE [[gnu::always_inline]] inline

template <int W>
struct Vec {
    typedef float type __attribute__((vector_size(W * sizeof(float))));
    // The same vector at float alignment, for loads and stores anywhere in a tensor.
    typedef float unaligned __attribute__((vector_size(W * sizeof(float)), aligned(alignof(float)), may_alias));
};
template <int W>
using vec = typename Vec<W>::type;

// Loads and stores are expressions, not calls: no function passes a wide vector by value, where
// GCC would warn that the calling convention depends on the ISA (-Wpsabi).
#define LOCKSTEP_VLOAD(p) (*reinterpret_cast<const typename Vec<W>::unaligned*>(p))
#define LOCKSTEP_VSTORE(p, v) (*reinterpret_cast<typename Vec<W>::unaligned*>(p) = (v))

// Sum of the lanes: halves added in fp32 down to one lane.
template <int W>
LOCKSTEP_KERNEL_INLINE float hsum(const vec<W>& v) {
    if constexpr (W == 4) {
        return (v[0] + v[2]) + (v[1] + v[3]);
    } else {
        vec<W / 2> lo, hi;
        __builtin_memcpy(&lo, &v, sizeof lo);
        __builtin_memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof lo, sizeof hi);
        const vec<W / 2> sum = lo + hi;
        return hsum<W / 2>(sum);
    }
}

constexpr int chains = 4;                // independent accumulators per quantity
constexpr std::int64_t per_lane = 32;    // values an fp32 accumulator lane sums before an fp64 flush
constexpr std::int64_t block_rows = 32;  // channels-last rows per fp64 flush

// ---- channels-first: one contiguous run of one channel ----

// s += sum(p - k), q += sum((p - k)^2) over p[0, len).
template <int W>
LOCKSTEP_KERNEL_INLINE void stats_run(const float* LOCKSTEP_RESTRICT p, std::int64_t len, float k, double& s, double& q) {
    using V = vec<W>;
    constexpr std::int64_t step = chains * W;
    const V kv = V{} + k;
    std::int64_t i = 0;
    while (i < len) {
        const std::int64_t end = std::min(len, i + per_lane * step);
        V s0{}, s1{}, s2{}, s3{}, q0{}, q1{}, q2{}, q3{};
        for (; i + step <= end; i += step) {
            const V d0 = LOCKSTEP_VLOAD(p + i) - kv, d1 = LOCKSTEP_VLOAD(p + i + W) - kv;
            const V d2 = LOCKSTEP_VLOAD(p + i + 2 * W) - kv, d3 = LOCKSTEP_VLOAD(p + i + 3 * W) - kv;
            s0 += d0, s1 += d1, s2 += d2, s3 += d3;
            q0 += d0 * d0, q1 += d1 * d1, q2 += d2 * d2, q3 += d3 * d3;
        }
        for (; i + W <= end; i += W) {
            const V d = LOCKSTEP_VLOAD(p + i) - kv;
            s0 += d;
            q0 += d * d;
        }
        double bs = 0, bq = 0;
        for (; i < end; ++i) {
            const double d = static_cast<double>(p[i] - k);
            bs += d;
            bq += d * d;
        }
        s += bs + static_cast<double>(hsum<W>((s0 + s1) + (s2 + s3)));
        q += bq + static_cast<double>(hsum<W>((q0 + q1) + (q2 + q3)));
    }
}

// sdy += sum(dy), sdyx += sum(dy * (x - m)) over [0, len).
template <int W>
LOCKSTEP_KERNEL_INLINE void grad_run(const float* LOCKSTEP_RESTRICT x, const float* LOCKSTEP_RESTRICT dy, std::int64_t len,
                                     float m, double& sdy, double& sdyx) {
    using V = vec<W>;
    constexpr std::int64_t step = chains * W;
    const V mv = V{} + m;
    std::int64_t i = 0;
    while (i < len) {
        const std::int64_t end = std::min(len, i + per_lane * step);
        V a0{}, a1{}, a2{}, a3{}, b0{}, b1{}, b2{}, b3{};
        for (; i + step <= end; i += step) {
            const V g0 = LOCKSTEP_VLOAD(dy + i), g1 = LOCKSTEP_VLOAD(dy + i + W);
            const V g2 = LOCKSTEP_VLOAD(dy + i + 2 * W), g3 = LOCKSTEP_VLOAD(dy + i + 3 * W);
            a0 += g0, a1 += g1, a2 += g2, a3 += g3;
            b0 += g0 * (LOCKSTEP_VLOAD(x + i) - mv);
            b1 += g1 * (LOCKSTEP_VLOAD(x + i + W) - mv);
            b2 += g2 * (LOCKSTEP_VLOAD(x + i + 2 * W) - mv);
            b3 += g3 * (LOCKSTEP_VLOAD(x + i + 3 * W) - mv);
        }
        for (; i + W <= end; i += W) {
            const V g = LOCKSTEP_VLOAD(dy + i);
            a0 += g;
            b0 += g * (LOCKSTEP_VLOAD(x + i) - mv);
        }
        double ba = 0, bb = 0;
        for (; i < end; ++i) {
            ba += static_cast<double>(dy[i]);
            bb += static_cast<double>(dy[i] * (x[i] - m));
        }
        sdy += ba + static_cast<double>(hsum<W>((a0 + a1) + (a2 + a3)));
        sdyx += bb + static_cast<double>(hsum<W>((b0 + b1) + (b2 + b3)));
    }
}

// ---- channels-last: whole rows of C contiguous channels ----

// Adds rows [r0, r1) into per-channel fp32 partials `a`, `b` (2C floats, in L1), row after row and
// front to back: a tensor too big for the cache streams from memory at full speed only when read
// in order.
//   Stats: a += sum(x - k), b += sum((x - k)^2).   Grad: a += sum(dy), b += sum(dy * (x - m)).
template <int W>
LOCKSTEP_KERNEL_INLINE void stats_rows(const float* LOCKSTEP_RESTRICT x, std::int64_t C, std::int64_t r0, std::int64_t r1,
                                       const float* LOCKSTEP_RESTRICT k, float* LOCKSTEP_RESTRICT a, float* LOCKSTEP_RESTRICT b) {
    using V = vec<W>;
    const std::int64_t cv = C - C % W;  // channels covered by whole vectors
    for (std::int64_t r = r0; r < r1; ++r) {
        const float* LOCKSTEP_RESTRICT xr = x + r * C;
        for (std::int64_t c = 0; c < cv; c += W) {
            const V d = LOCKSTEP_VLOAD(xr + c) - LOCKSTEP_VLOAD(k + c);
            LOCKSTEP_VSTORE(a + c, LOCKSTEP_VLOAD(a + c) + d);
            LOCKSTEP_VSTORE(b + c, LOCKSTEP_VLOAD(b + c) + d * d);
        }
        for (std::int64_t c = cv; c < C; ++c) {
            const float d = xr[c] - k[c];
            a[c] += d;
            b[c] += d * d;
        }
    }
}

template <int W>
LOCKSTEP_KERNEL_INLINE void grad_rows(const float* LOCKSTEP_RESTRICT x, const float* LOCKSTEP_RESTRICT dy, std::int64_t C,
                                      std::int64_t r0, std::int64_t r1, const float* LOCKSTEP_RESTRICT m,
                                      float* LOCKSTEP_RESTRICT a, float* LOCKSTEP_RESTRICT b) {
    using V = vec<W>;
    const std::int64_t cv = C - C % W;
    for (std::int64_t r = r0; r < r1; ++r) {
        const float* LOCKSTEP_RESTRICT xr = x + r * C;
        const float* LOCKSTEP_RESTRICT gr = dy + r * C;
        for (std::int64_t c = 0; c < cv; c += W) {
            const V g = LOCKSTEP_VLOAD(gr + c);
            LOCKSTEP_VSTORE(a + c, LOCKSTEP_VLOAD(a + c) + g);
            LOCKSTEP_VSTORE(b + c, LOCKSTEP_VLOAD(b + c) + g * (LOCKSTEP_VLOAD(xr + c) - LOCKSTEP_VLOAD(m + c)));
        }
        for (std::int64_t c = cv; c < C; ++c) {
            a[c] += gr[c];
            b[c] += gr[c] * (xr[c] - m[c]);
        }
    }
}

// ---- whole-tensor kernels, one template per ISA ----

template <int W>
LOCKSTEP_KERNEL_INLINE void local_sums(const float* LOCKSTEP_RESTRICT x, const BnGeometry& g, const float* LOCKSTEP_RESTRICT k,
                                       double* S, double* Q, float* scratch) {
    const std::int64_t C = g.channels;
    if (!g.channels_last) {
        for (std::int64_t n = 0; n < g.batch; ++n)
            for (std::int64_t c = 0; c < C; ++c) stats_run<W>(x + (n * C + c) * g.inner, g.inner, k[c], S[c], Q[c]);
        return;
    }
    // fp32 partials per block of rows (scratch: 2C floats), flushed into the fp64 totals.
    float* a = scratch;
    float* b = scratch + C;
    for (std::int64_t r0 = 0; r0 < g.rows(); r0 += block_rows) {
        std::fill(a, a + 2 * C, 0.0f);
        stats_rows<W>(x, C, r0, std::min(g.rows(), r0 + block_rows), k, a, b);
        for (std::int64_t c = 0; c < C; ++c) {
            S[c] += static_cast<double>(a[c]);
            Q[c] += static_cast<double>(b[c]);
        }
    }
}

template <int W>
LOCKSTEP_KERNEL_INLINE void normalize_all(const float* LOCKSTEP_RESTRICT x, float* LOCKSTEP_RESTRICT y, const BnGeometry& g,
                                          const float* LOCKSTEP_RESTRICT hi, const float* LOCKSTEP_RESTRICT scale,
                                          const float* LOCKSTEP_RESTRICT shift) {
    const std::int64_t C = g.channels;
    if (g.channels_last) {
        // Row after row, front to back; the constants are re-read from L1.
        for (std::int64_t r = 0; r < g.rows(); ++r) {
            const float* LOCKSTEP_RESTRICT xr = x + r * C;
            float* LOCKSTEP_RESTRICT yr = y + r * C;
            for (std::int64_t c = 0; c < C; ++c) yr[c] = bn::normalize(xr[c], hi[c], scale[c], shift[c]);
        }
        return;
    }
    for (std::int64_t n = 0; n < g.batch; ++n)
        for (std::int64_t c = 0; c < C; ++c) {
            const float h = hi[c], s = scale[c], t = shift[c];
            const float* LOCKSTEP_RESTRICT xr = x + (n * C + c) * g.inner;
            float* LOCKSTEP_RESTRICT yr = y + (n * C + c) * g.inner;
            for (std::int64_t i = 0; i < g.inner; ++i) yr[i] = bn::normalize(xr[i], h, s, t);
        }
}

template <int W>
LOCKSTEP_KERNEL_INLINE void grad_sums(const float* LOCKSTEP_RESTRICT x, const float* LOCKSTEP_RESTRICT dy, const BnGeometry& g,
                                      const float* LOCKSTEP_RESTRICT hi, double* A, double* B, float* scratch) {
    const std::int64_t C = g.channels;
    if (!g.channels_last) {
        for (std::int64_t n = 0; n < g.batch; ++n)
            for (std::int64_t c = 0; c < C; ++c) {
                const std::int64_t off = (n * C + c) * g.inner;
                grad_run<W>(x + off, dy + off, g.inner, hi[c], A[c], B[c]);
            }
        return;
    }
    float* a = scratch;
    float* b = scratch + C;
    for (std::int64_t r0 = 0; r0 < g.rows(); r0 += block_rows) {
        std::fill(a, a + 2 * C, 0.0f);
        grad_rows<W>(x, dy, C, r0, std::min(g.rows(), r0 + block_rows), hi, a, b);
        for (std::int64_t c = 0; c < C; ++c) {
            A[c] += static_cast<double>(a[c]);
            B[c] += static_cast<double>(b[c]);
        }
    }
}

// `dx` may be `x` itself (the layer writes dx over the input it saved): every element is read
// before it is written, at the same index, so x and dx are not restrict-qualified and the loops
// use explicit vectors rather than rely on the compiler's alias checks.
template <int W>
LOCKSTEP_KERNEL_INLINE void grad_input(const float* x, const float* LOCKSTEP_RESTRICT dy, float* dx, const BnGeometry& g,
                                       const float* LOCKSTEP_RESTRICT hi, const float* LOCKSTEP_RESTRICT a,
                                       const float* LOCKSTEP_RESTRICT b, const float* LOCKSTEP_RESTRICT c3) {
    using V = vec<W>;
    const std::int64_t C = g.channels;
    if (g.channels_last) {
        const std::int64_t cv = C - C % W;
        for (std::int64_t r = 0; r < g.rows(); ++r) {
            const std::int64_t off = r * C;
            for (std::int64_t c = 0; c < cv; c += W) {
                const V v =
                    LOCKSTEP_VLOAD(a + c) * LOCKSTEP_VLOAD(dy + off + c) +
                    ((LOCKSTEP_VLOAD(x + off + c) - LOCKSTEP_VLOAD(hi + c)) * LOCKSTEP_VLOAD(b + c) + LOCKSTEP_VLOAD(c3 + c));
                LOCKSTEP_VSTORE(dx + off + c, v);
            }
            for (std::int64_t c = cv; c < C; ++c) dx[off + c] = bn::backward(dy[off + c], x[off + c], hi[c], a[c], b[c], c3[c]);
        }
        return;
    }
    const std::int64_t P = g.inner, pv = P - P % W;
    for (std::int64_t n = 0; n < g.batch; ++n)
        for (std::int64_t c = 0; c < C; ++c) {
            const std::int64_t off = (n * C + c) * P;
            const V h = V{} + hi[c], ka = V{} + a[c], kb = V{} + b[c], kc = V{} + c3[c];
            for (std::int64_t i = 0; i < pv; i += W)
                LOCKSTEP_VSTORE(dx + off + i, ka * LOCKSTEP_VLOAD(dy + off + i) + ((LOCKSTEP_VLOAD(x + off + i) - h) * kb + kc));
            for (std::int64_t i = pv; i < P; ++i) dx[off + i] = bn::backward(dy[off + i], x[off + i], hi[c], a[c], b[c], c3[c]);
        }
}

// One entry point per kernel and ISA: `LOCKSTEP_SIMD_VARIANTS(name)` defines name_avx2 and
// name_avx512 (x86-64) around name<W>; `LOCKSTEP_SIMD_CALL(name, ...)` calls the one that
// simd::active() names.
#if LOCKSTEP_SIMD_X86
#define LOCKSTEP_SIMD_VARIANTS(name)                                                                      \
    template <class... A>                                                                                 \
    [[gnu::target("avx2,fma")]] inline void name##_avx2(A... args) {                                      \
        name<8>(args...);                                                                                 \
    }                                                                                                     \
    template <class... A>                                                                                 \
    [[gnu::target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma")]] inline void name##_avx512(A... args) { \
        name<16>(args...);                                                                                \
    }
#define LOCKSTEP_SIMD_CALL(name, ...)                                        \
    switch (simd::active()) {                                                \
        case simd::Level::avx512: return detail::name##_avx512(__VA_ARGS__); \
        case simd::Level::avx2: return detail::name##_avx2(__VA_ARGS__);     \
        default: return detail::name<4>(__VA_ARGS__);                        \
    }
#else
#define LOCKSTEP_SIMD_VARIANTS(name)
#define LOCKSTEP_SIMD_CALL(name, ...) return detail::name<4>(__VA_ARGS__);
#endif

LOCKSTEP_SIMD_VARIANTS(local_sums)
LOCKSTEP_SIMD_VARIANTS(normalize_all)
LOCKSTEP_SIMD_VARIANTS(grad_sums)
LOCKSTEP_SIMD_VARIANTS(grad_input)

}  // namespace detail

//! Forward payload [S | Q | M | n] (3C+1 doubles) of the local batch (Note [shifted
//! statistics]): S, Q the sums about the local shift k_c (left in `shift`), M = n k_c + S.
inline void bn_local_stats(const float* LOCKSTEP_RESTRICT x, const BnGeometry& g, float* shift, double* payload) {
    const std::int64_t C = g.channels;
    const bn::ForwardPayload layout{C};
    double* S = payload + layout.sum(0);
    double* Q = payload + layout.sum_sq(0);
    std::fill(payload, payload + layout.size(), 0.0);
    // Local shift k: this replica's first value of each channel (close to its values, so the fp32
    // partial sums stay small); 0 for an empty shard.
    std::fill(shift, shift + C, 0.0f);
    if (g.per_channel() > 0)
        for (std::int64_t c = 0; c < C; ++c) shift[c] = g.channels_last ? x[c] : x[c * g.inner];
    std::vector<float> scratch(g.channels_last ? static_cast<std::size_t>(2 * C) : 0);
    [&] { LOCKSTEP_SIMD_CALL(local_sums, x, g, shift, S, Q, scratch.data()) }();
    const double count = static_cast<double>(g.per_channel());
    for (std::int64_t c = 0; c < C; ++c) payload[layout.total(c)] = count * static_cast<double>(shift[c]) + S[c];
    payload[layout.count()] = count;
}

//! After the first all-reduce ([M | n] global): re-centres the shard's local sums [S | Q] about
//! `shift` (g.per_channel() values per channel) on mu = M/N (Note [shifted statistics]).
inline void bn_centre(const BnGeometry& g, const float* shift, double* payload) {
    const std::int64_t C = g.channels;
    const bn::ForwardPayload layout{C};
    const double n = static_cast<double>(g.per_channel());
    for (std::int64_t c = 0; c < C; ++c) {
        const bn::ShiftedSums r = bn::centred(payload, layout, c, n, shift[c]);
        payload[layout.sum(c)] = r.s;
        payload[layout.sum_sq(c)] = r.q;
    }
}

//! y = (x - hi_c) * scale_c + shift_c over the whole batch (see `bn::normalize_constants`).
inline void bn_normalize(const float* LOCKSTEP_RESTRICT x, float* LOCKSTEP_RESTRICT y, const BnGeometry& g,
                         const float* LOCKSTEP_RESTRICT mean_hi, const float* LOCKSTEP_RESTRICT scale,
                         const float* LOCKSTEP_RESTRICT shift) {
    LOCKSTEP_SIMD_CALL(normalize_all, x, y, g, mean_hi, scale, shift)
}

//! Backward payload [sum(dy) | sum(dy * (x - mean))] (2C doubles) of the local batch.
inline void bn_backward_sums(const float* LOCKSTEP_RESTRICT x, const float* LOCKSTEP_RESTRICT dy, const BnGeometry& g,
                             const float* LOCKSTEP_RESTRICT mean_hi, const float* LOCKSTEP_RESTRICT mean_lo, double* payload) {
    const std::int64_t C = g.channels;
    const bn::BackwardPayload layout{C};
    double* A = payload + layout.sum_dy(0);
    double* B = payload + layout.sum_dy_xmu(0);
    std::fill(payload, payload + layout.size(), 0.0);
    std::vector<float> scratch(g.channels_last ? static_cast<std::size_t>(2 * C) : 0);
    [&] { LOCKSTEP_SIMD_CALL(grad_sums, x, dy, g, mean_hi, A, B, scratch.data()) }();
    for (std::int64_t c = 0; c < C; ++c) B[c] = bn::centred_sum(B[c], A[c], mean_lo[c]);
}

//! dx = a_c * dy + b_c * (x - hi_c) + c_c over the whole batch (see `bn::backward_constants`).
//! `dx` may be `x` (in place); otherwise the two must not overlap.
inline void bn_backward_dx(const float* x, const float* LOCKSTEP_RESTRICT dy, float* dx, const BnGeometry& g,
                           const float* LOCKSTEP_RESTRICT mean_hi, const float* LOCKSTEP_RESTRICT a,
                           const float* LOCKSTEP_RESTRICT b, const float* LOCKSTEP_RESTRICT c) {
    LOCKSTEP_SIMD_CALL(grad_input, x, dy, dx, g, mean_hi, a, b, c)
}

// Note [fused batch norm + ReLU]
// With ReLU fused (BatchNormOptions::fused_relu) the layer's output is max(0, y) and backward
// sees dy only where y > 0 (on the host a mask of one byte per element, saved by forward; the
// CUDA backend keeps none and finds it from x: Note [ReLU mask from x]). The fused passes
// run one sample at a time: the sample's y (or its masked dy, in a per-thread buffer) is still
// in cache when the ReLU (or the passes that read it) touch it, so fusing adds no tensor-sized
// memory stream and removes the three of a separate ReLU layer (forward: read y, write y and the
// mask; backward: read dy and the mask, write dx). NaN stays NaN, as in ReLU.

//! max(v, 0) with NaN kept (as PyTorch's ReLU): the one definition the host's ReLU, fused or not, uses.
inline float relu(float v) { return v > 0.0f ? v : (v == v ? 0.0f : v); }

//! A buffer of the calling thread's own of at least `floats` floats (replica threads each have
//! theirs), for a sample's masked gradient. Valid until the thread's next call: a caller holds it
//! only across calls that do not take it themselves.
inline float* thread_buffer(std::size_t floats) {
    thread_local std::vector<float> buffer;
    if (buffer.size() < floats) buffer.resize(floats);
    return buffer.data();
}
//! out = dy where the mask is set, else 0, for `n` elements (dy loaded unconditionally: the select vectorizes).
inline void mask_into(const float* LOCKSTEP_RESTRICT dy, const std::uint8_t* LOCKSTEP_RESTRICT mask, float* LOCKSTEP_RESTRICT out,
                      std::int64_t n) {
    for (std::int64_t i = 0; i < n; ++i) {
        const float v = dy[i];
        out[i] = mask[i] != 0 ? v : 0.0f;
    }
}
namespace detail {
inline BnGeometry one_sample(BnGeometry g) {
    g.batch = 1;
    return g;
}
}  // namespace detail

//! bn_normalize followed by y = max(0, y) and mask = (y > 0), a sample at a time (Note [fused
//! batch norm + ReLU]); `mask` may be null (evaluation).
inline void bn_normalize_relu(const float* LOCKSTEP_RESTRICT x, float* LOCKSTEP_RESTRICT y, const BnGeometry& g,
                              const float* LOCKSTEP_RESTRICT mean_hi, const float* LOCKSTEP_RESTRICT scale,
                              const float* LOCKSTEP_RESTRICT shift, std::uint8_t* LOCKSTEP_RESTRICT mask) {
    const std::int64_t per_sample = g.channels * g.inner;
    for (std::int64_t n = 0; n < g.batch; ++n) {
        float* LOCKSTEP_RESTRICT ys = y + n * per_sample;
        bn_normalize(x + n * per_sample, ys, detail::one_sample(g), mean_hi, scale, shift);
        std::uint8_t* LOCKSTEP_RESTRICT ms = mask != nullptr ? mask + n * per_sample : nullptr;
        for (std::int64_t i = 0; i < per_sample; ++i) {
            const float v = ys[i];
            if (ms != nullptr) ms[i] = v > 0.0f;
            ys[i] = relu(v);
        }
    }
}

//! bn_backward_sums of dy masked by `mask` (Note [fused batch norm + ReLU]).
inline void bn_backward_sums_masked(const float* LOCKSTEP_RESTRICT x, const float* LOCKSTEP_RESTRICT dy,
                                    const std::uint8_t* LOCKSTEP_RESTRICT mask, const BnGeometry& g,
                                    const float* LOCKSTEP_RESTRICT mean_hi, const float* LOCKSTEP_RESTRICT mean_lo,
                                    double* payload) {
    const std::int64_t C = g.channels, per_sample = C * g.inner;
    const bn::BackwardPayload layout{C};
    double* A = payload + layout.sum_dy(0);
    double* B = payload + layout.sum_dy_xmu(0);
    std::fill(payload, payload + layout.size(), 0.0);
    std::vector<float> scratch(g.channels_last ? static_cast<std::size_t>(2 * C) : 0);
    float* masked = thread_buffer(static_cast<std::size_t>(per_sample));
    const BnGeometry one = detail::one_sample(g);
    for (std::int64_t n = 0; n < g.batch; ++n) {
        mask_into(dy + n * per_sample, mask + n * per_sample, masked, per_sample);
        const float* xs = x + n * per_sample;
        [&] { LOCKSTEP_SIMD_CALL(grad_sums, xs, static_cast<const float*>(masked), one, mean_hi, A, B, scratch.data()) }();
    }
    for (std::int64_t c = 0; c < C; ++c) B[c] = bn::centred_sum(B[c], A[c], mean_lo[c]);
}

//! bn_backward_dx of dy masked by `mask`; `dx` may be `x`.
inline void bn_backward_dx_masked(const float* x, const float* LOCKSTEP_RESTRICT dy, const std::uint8_t* LOCKSTEP_RESTRICT mask,
                                  float* dx, const BnGeometry& g, const float* LOCKSTEP_RESTRICT mean_hi,
                                  const float* LOCKSTEP_RESTRICT a, const float* LOCKSTEP_RESTRICT b,
                                  const float* LOCKSTEP_RESTRICT c) {
    const std::int64_t per_sample = g.channels * g.inner;
    float* masked = thread_buffer(static_cast<std::size_t>(per_sample));
    const BnGeometry one = detail::one_sample(g);
    for (std::int64_t n = 0; n < g.batch; ++n) {
        mask_into(dy + n * per_sample, mask + n * per_sample, masked, per_sample);
        bn_backward_dx(x + n * per_sample, masked, dx + n * per_sample, one, mean_hi, a, b, c);
    }
}

}  // namespace lockstep::kernels::host

#undef LOCKSTEP_SIMD_CALL
#undef LOCKSTEP_SIMD_VARIANTS
#undef LOCKSTEP_KERNEL_INLINE
#undef LOCKSTEP_VLOAD
#undef LOCKSTEP_VSTORE
#pragma GCC diagnostic pop
