// SPDX-License-Identifier: MIT
//! Host loops of batch norm over whole tensors (NCHW and NHWC), built on `batch_norm_math.hpp`.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "lockstep/core/config.hpp"
#include "lockstep/core/shape.hpp"
#include "lockstep/kernels/batch_norm_math.hpp"

namespace lockstep::kernels::host {

//! Where element (n, c, p) of an (N, C, P) batch lives; P = H*W (1 for 2-D input). A batch is
//! channels-last when it is NHWC, 2-D, or has P = 1: then every row of C channels is contiguous.
struct BnGeometry {
    std::int64_t batch = 0;     // N
    std::int64_t channels = 0;  // C
    std::int64_t inner = 1;     // P = H * W
    bool channels_last = false;

    std::int64_t rows() const { return batch * inner; }
    std::int64_t per_channel() const { return batch * inner; }
};

namespace detail {

constexpr int lanes = 4;  // floats per vector: the SIMD width every x86-64 and AArch64 CPU has
// A vector of `lanes` floats (GCC/Clang vector extension): keeps the partial sums in registers,
// where a float array would round-trip through memory on every add.
typedef float vfloat __attribute__((vector_size(lanes * sizeof(float))));
inline vfloat splat(float v) { return vfloat{} + v; }
inline vfloat load(const float* p) {
    vfloat v;
    __builtin_memcpy(&v, p, sizeof v);  // unaligned load
    return v;
}
constexpr std::int64_t block = 256;  // fp32 partial sums never cover more than this many values

// Adds sum(a - k) and sum((a - k)^2) over a contiguous run into the fp64 totals.
inline void sum_run(const float* LOCKSTEP_RESTRICT p, std::int64_t len, float k, double& s, double& q) {
    for (std::int64_t i = 0; i < len;) {
        const std::int64_t end = std::min(len, i + block);
        vfloat ls{}, lq{}, ls2{}, lq2{};  // two chains each: the adds' latency overlaps
        const vfloat kv = splat(k);
        for (; i + 2 * lanes <= end; i += 2 * lanes) {
            const vfloat d = load(p + i) - kv, d2 = load(p + i + lanes) - kv;
            ls += d;
            lq += d * d;
            ls2 += d2;
            lq2 += d2 * d2;
        }
        ls += ls2;
        lq += lq2;
        double bs = 0, bq = 0;
        for (; i < end; ++i) {
            const float d = p[i] - k;
            bs += d;
            bq += static_cast<double>(d) * d;
        }
        for (int j = 0; j < lanes; ++j) {
            bs += ls[j];
            bq += lq[j];
        }
        s += bs;
        q += bq;
    }
}

// Adds sum(dy) and sum(dy * (x - m)) over a contiguous run into the fp64 totals.
inline void sum_grad_run(const float* LOCKSTEP_RESTRICT x, const float* LOCKSTEP_RESTRICT dy, std::int64_t len,
                         float m, float m_lo, double& sdy, double& sdyx) {
    const vfloat mv = splat(m), lov = splat(m_lo);
    for (std::int64_t i = 0; i < len;) {
        const std::int64_t end = std::min(len, i + block);
        vfloat a{}, b{}, a2{}, b2{};  // two chains each: the adds' latency overlaps
        for (; i + 2 * lanes <= end; i += 2 * lanes) {
            const vfloat g = load(dy + i), g2 = load(dy + i + lanes);
            a += g;
            b += g * ((load(x + i) - mv) - lov);
            a2 += g2;
            b2 += g2 * ((load(x + i + lanes) - mv) - lov);
        }
        a += a2;
        b += b2;
        double ba = 0, bb = 0;
        for (; i < end; ++i) {
            ba += dy[i];
            bb += static_cast<double>(dy[i] * bn::centre(x[i], m, m_lo));
        }
        for (int j = 0; j < lanes; ++j) {
            ba += a[j];
            bb += b[j];
        }
        sdy += ba;
        sdyx += bb;
    }
}

// Channels-last: per-channel fp32 partials over blocks of rows, flushed into fp64 totals.
// `term(r, a, b)` adds row r into the partials a and b; used for both directions.
template <class Term>
void sum_rows(std::int64_t rows, std::int64_t channels, double* tot_a, double* tot_b, Term term) {
    std::vector<float> a(static_cast<std::size_t>(channels)), b(static_cast<std::size_t>(channels));
    constexpr std::int64_t rows_per_block = 32;
    for (std::int64_t r0 = 0; r0 < rows; r0 += rows_per_block) {
        std::fill(a.begin(), a.end(), 0.0f);
        std::fill(b.begin(), b.end(), 0.0f);
        const std::int64_t r1 = std::min(rows, r0 + rows_per_block);
        for (std::int64_t r = r0; r < r1; ++r) term(r, a.data(), b.data());
        for (std::int64_t c = 0; c < channels; ++c) {
            tot_a[c] += a[static_cast<std::size_t>(c)];
            tot_b[c] += b[static_cast<std::size_t>(c)];
        }
    }
}

}  // namespace detail

//! Forward payload [S | Q | n] (2C+1 doubles) of the local batch, re-centred on `shift` (K).
inline void bn_local_stats(const float* LOCKSTEP_RESTRICT x, const BnGeometry& g, const float* shift, double* payload) {
    const std::int64_t C = g.channels;
    const bn::ForwardPayload layout{C};
    std::vector<double> s(static_cast<std::size_t>(C), 0.0), q(static_cast<std::size_t>(C), 0.0);
    std::vector<float> k(static_cast<std::size_t>(C), 0.0f);  // local shift: this replica's first value
    if (g.per_channel() > 0) {
        for (std::int64_t c = 0; c < C; ++c) k[static_cast<std::size_t>(c)] = g.channels_last ? x[c] : x[c * g.inner];
    }
    if (g.channels_last) {
        const float* kk = k.data();
        detail::sum_rows(g.rows(), C, s.data(), q.data(), [&](std::int64_t r, float* a, float* b) {
            const float* LOCKSTEP_RESTRICT row = x + r * C;
            for (std::int64_t c = 0; c < C; ++c) {
                const float d = row[c] - kk[c];
                a[c] += d;
                b[c] += d * d;
            }
        });
    } else {
        for (std::int64_t n = 0; n < g.batch; ++n)
            for (std::int64_t c = 0; c < C; ++c)
                detail::sum_run(x + (n * C + c) * g.inner, g.inner, k[static_cast<std::size_t>(c)],
                                s[static_cast<std::size_t>(c)], q[static_cast<std::size_t>(c)]);
    }
    const double count = static_cast<double>(g.per_channel());
    for (std::int64_t c = 0; c < C; ++c) {
        const auto uc = static_cast<std::size_t>(c);
        const bn::ShiftedSums local{count, s[uc], q[uc], static_cast<double>(k[uc])};
        const bn::ShiftedSums shared = bn::recentre(local, static_cast<double>(shift[c]));
        payload[layout.sum(c)] = shared.s;
        payload[layout.sum_sq(c)] = shared.q;
    }
    payload[layout.count()] = count;
}

//! y = (x - mean_c) * scale_c + beta_c over the whole batch.
inline void bn_normalize(const float* LOCKSTEP_RESTRICT x, float* LOCKSTEP_RESTRICT y, const BnGeometry& g,
                         const float* LOCKSTEP_RESTRICT mean, const float* LOCKSTEP_RESTRICT mean_lo,
                         const float* LOCKSTEP_RESTRICT scale, const float* LOCKSTEP_RESTRICT beta) {
    const std::int64_t C = g.channels;
    if (g.channels_last) {
        for (std::int64_t r = 0; r < g.rows(); ++r) {
            const float* LOCKSTEP_RESTRICT xr = x + r * C;
            float* LOCKSTEP_RESTRICT yr = y + r * C;
            for (std::int64_t c = 0; c < C; ++c) yr[c] = bn::normalize(xr[c], mean[c], mean_lo[c], scale[c], beta[c]);
        }
        return;
    }
    for (std::int64_t n = 0; n < g.batch; ++n)
        for (std::int64_t c = 0; c < C; ++c) {
            const float m = mean[c], lo = mean_lo[c], s = scale[c], b = beta[c];
            const float* LOCKSTEP_RESTRICT xr = x + (n * C + c) * g.inner;
            float* LOCKSTEP_RESTRICT yr = y + (n * C + c) * g.inner;
            for (std::int64_t i = 0; i < g.inner; ++i) yr[i] = bn::normalize(xr[i], m, lo, s, b);
        }
}

//! Backward payload [sum(dy) | sum(dy * (x - mean))] (2C doubles) of the local batch.
inline void bn_backward_sums(const float* LOCKSTEP_RESTRICT x, const float* LOCKSTEP_RESTRICT dy, const BnGeometry& g,
                             const float* LOCKSTEP_RESTRICT mean, const float* LOCKSTEP_RESTRICT mean_lo, double* payload) {
    const std::int64_t C = g.channels;
    const bn::BackwardPayload layout{C};
    double* sdy = payload + layout.sum_dy(0);
    double* sdyx = payload + layout.sum_dy_xmu(0);
    std::fill(payload, payload + layout.size(), 0.0);
    if (g.channels_last) {
        detail::sum_rows(g.rows(), C, sdy, sdyx, [&](std::int64_t r, float* a, float* b) {
            const float* LOCKSTEP_RESTRICT xr = x + r * C;
            const float* LOCKSTEP_RESTRICT dr = dy + r * C;
            for (std::int64_t c = 0; c < C; ++c) {
                a[c] += dr[c];
                b[c] += dr[c] * bn::centre(xr[c], mean[c], mean_lo[c]);
            }
        });
        return;
    }
    for (std::int64_t n = 0; n < g.batch; ++n)
        for (std::int64_t c = 0; c < C; ++c) {
            const std::int64_t off = (n * C + c) * g.inner;
            detail::sum_grad_run(x + off, dy + off, g.inner, mean[c], mean_lo[c], sdy[c], sdyx[c]);
        }
}

//! dx over the whole batch from per-channel constants (see `bn::backward`).
inline void bn_backward_dx(const float* LOCKSTEP_RESTRICT x, const float* LOCKSTEP_RESTRICT dy, float* LOCKSTEP_RESTRICT dx,
                           const BnGeometry& g, const float* LOCKSTEP_RESTRICT mean, const float* LOCKSTEP_RESTRICT mean_lo,
                           const float* LOCKSTEP_RESTRICT k1,
                           const float* LOCKSTEP_RESTRICT mean_dy, const float* LOCKSTEP_RESTRICT k2) {
    const std::int64_t C = g.channels;
    if (g.channels_last) {
        for (std::int64_t r = 0; r < g.rows(); ++r) {
            const std::int64_t off = r * C;
            for (std::int64_t c = 0; c < C; ++c)
                dx[off + c] = bn::backward(dy[off + c], x[off + c], mean[c], mean_lo[c], k1[c], mean_dy[c], k2[c]);
        }
        return;
    }
    for (std::int64_t n = 0; n < g.batch; ++n)
        for (std::int64_t c = 0; c < C; ++c) {
            const std::int64_t off = (n * C + c) * g.inner;
            const float m = mean[c], lo = mean_lo[c], a = k1[c], b = mean_dy[c], d = k2[c];
            for (std::int64_t i = 0; i < g.inner; ++i) dx[off + i] = bn::backward(dy[off + i], x[off + i], m, lo, a, b, d);
        }
}

}  // namespace lockstep::kernels::host
