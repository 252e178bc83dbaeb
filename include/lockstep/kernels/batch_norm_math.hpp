// SPDX-License-Identifier: MIT
//! Batch-norm math written once for both backends (`__host__ __device__` under nvcc).
#pragma once

#include <math.h>

#include <cmath>
#include <cstdint>

#include "lockstep/core/config.hpp"

namespace lockstep::kernels::bn {

// Note [shifted statistics]
// A replica sums d = x - k_r per channel, with k_r a local shift (its first value of the
// channel): fp32 over short blocks, fp64 across blocks, so no large sum is ever formed in fp32.
// The batch statistics then take two all-reduces of fixed size, whatever the world size, and
// depend on nothing but the batch (not on the running statistics, as PyTorch's do not):
// 1. [M_c = n_r k_r + s_r, n] (C+1 doubles): the global sum of x, so mu = M/N, the shift every
//    replica then shares, within rounding of the batch mean;
// 2. the local sums re-centred on mu, [S_c = sum(x - mu), Q_c = sum((x - mu)^2)] (2C doubles),
//    from the local ones about k_r (`recentre`: delta = k_r - mu is a few standard deviations, as
//    k_r is one of the values), so no pass over x is repeated. A first value far out in its
//    batch (an outlier 1e3 standard deviations away) costs digits through the fp32 partial sums
//    about it, as it did before the re-centring.
// mean = mu + S/N and var = Q/N - (S/N)^2 then cancel almost nothing in fp64: S/N is the rounding
// of mu. A shift known before the batch (the running mean, as lockstep once used) leaves
// var = Q/N - (S/N)^2 with (S/N)^2 ~ (mean - K)^2, which loses every digit of the variance when
// |mean - K| >> std (a running mean far from the data, or a first batch whose mean is far from
// zero), E[x^2] - E[x]^2 in fp32 being the extreme case. The second all-reduce is the price: one
// more collective's latency per layer forward (bench_sync_batch_norm measures it).

//! Offsets into the forward payload of `channels` channels: [S | Q | M | n], 3C+1 doubles; the
//! first all-reduce covers [M | n] (`first_offset`, `first_size`), the second [S | Q].
struct ForwardPayload {
    std::int64_t channels;
    LOCKSTEP_HD constexpr std::int64_t size() const { return 3 * channels + 1; }
    LOCKSTEP_HD constexpr std::int64_t sum(std::int64_t c) const { return c; }
    LOCKSTEP_HD constexpr std::int64_t sum_sq(std::int64_t c) const { return channels + c; }
    LOCKSTEP_HD constexpr std::int64_t total(std::int64_t c) const { return 2 * channels + c; }
    LOCKSTEP_HD constexpr std::int64_t count() const { return 3 * channels; }
    LOCKSTEP_HD constexpr std::int64_t first_offset() const { return 2 * channels; }
    LOCKSTEP_HD constexpr std::int64_t first_size() const { return channels + 1; }
    LOCKSTEP_HD constexpr std::int64_t second_size() const { return 2 * channels; }
};

//! Offsets into the backward payload: [sum(dy) | sum(dy * (x - mean))], 2C doubles.
struct BackwardPayload {
    std::int64_t channels;
    LOCKSTEP_HD constexpr std::int64_t size() const { return 2 * channels; }
    LOCKSTEP_HD constexpr std::int64_t sum_dy(std::int64_t c) const { return c; }
    LOCKSTEP_HD constexpr std::int64_t sum_dy_xmu(std::int64_t c) const { return channels + c; }
};

//! Local sums about a local shift k: n values, s = sum(x - k), q = sum((x - k)^2).
struct ShiftedSums {
    double n = 0, s = 0, q = 0;
    double shift = 0;
};

//! Adds the sums of another part with the same shift (sums about a common shift are additive).
LOCKSTEP_HD inline void merge_same_shift(ShiftedSums& a, const ShiftedSums& b) {
    a.n += b.n;
    a.s += b.s;
    a.q += b.q;
}

//! The same sums re-centred on `shift`: sum(x - K) and sum((x - K)^2) from those about k.
LOCKSTEP_HD inline ShiftedSums recentre(const ShiftedSums& a, double shift) {
    const double delta = a.shift - shift;  // x - K = (x - k) + delta
    ShiftedSums r;
    r.n = a.n;
    r.s = a.s + a.n * delta;
    r.q = a.q + 2.0 * delta * a.s + a.n * delta * delta;
    r.shift = shift;
    return r;
}

//! Global statistics of one channel from the all-reduced payload.
struct ChannelStats {
    double mean;
    double var;     // biased (divides by N), the one that normalizes
    double invstd;  // 1 / sqrt(var + eps)
};

//! The shared shift mu of channel c after the first all-reduce: M/N (Note [shifted statistics]).
LOCKSTEP_HD inline double batch_shift(const double* payload, const ForwardPayload& layout, std::int64_t c) {
    return payload[layout.total(c)] / payload[layout.count()];
}

//! A replica's part of the second all-reduce for channel c: its sums in `payload` about its local
//! shift k (n values) re-centred on mu.
LOCKSTEP_HD inline ShiftedSums centred(const double* payload, const ForwardPayload& layout, std::int64_t c, double n,
                                       double k) {
    return recentre(ShiftedSums{n, payload[layout.sum(c)], payload[layout.sum_sq(c)], k}, batch_shift(payload, layout, c));
}

//! mean = K + S/N, var = Q/N - (S/N)^2 (a tiny negative from rounding becomes 0; NaN stays NaN).
LOCKSTEP_HD inline ChannelStats finish(double n, double s, double q, double shift, double eps) {
    const double m = s / n;
    double var = q / n - m * m;
    if (var < 0.0) var = 0.0;
    return {shift + m, var, 1.0 / ::sqrt(var + eps)};
}

//! Channel c's statistics from the all-reduced forward payload (its count is the global one).
LOCKSTEP_HD inline ChannelStats channel_stats(const double* payload, const ForwardPayload& layout, std::int64_t c, double eps) {
    return finish(payload[layout.count()], payload[layout.sum(c)], payload[layout.sum_sq(c)], batch_shift(payload, layout, c),
                  eps);
}

// Note [split mean]
// The fp64 mean is kept as two floats, hi = fp32(mean) and lo = mean - hi. x - hi is exact when x
// is near the mean (Sterbenz), so every per-element formula subtracts hi from x first and folds lo
// into a per-channel constant computed in fp64: x - mean is then exact to fp32 precision even when
// |mean| >> std, where fp32(x - fp32(mean)) alone would be off by the mean's rounding (at mean 1e4
// that is 5e-4, i.e. 5% of a std of 1e-2). Folding lo away leaves each element two or three
// arithmetic operations, which keeps the kernels at memory speed.

//! The fp64 mean as hi + lo floats.
struct SplitMean {
    float hi, lo;
};
LOCKSTEP_HD inline SplitMean split_mean(double mean) {
    const float hi = static_cast<float>(mean);
    return {hi, static_cast<float>(mean - static_cast<double>(hi))};
}

//! Per-channel constants of the normalize: y = (x - mean_hi) * scale + shift, where
//! scale = invstd * gamma and shift = beta - (mean - mean_hi) * scale carries the mean's low part
//! (mean_hi = split_mean(mean).hi).
struct NormalizeConstants {
    float scale, shift;
};
LOCKSTEP_HD inline NormalizeConstants normalize_constants(double mean, double invstd, double gamma, double beta) {
    const float hi = static_cast<float>(mean);
    const float scale = static_cast<float>(invstd * gamma);
    return {scale, static_cast<float>(beta - (mean - static_cast<double>(hi)) * static_cast<double>(scale))};
}

//! y of one element. The difference comes first so a large mean cancels exactly before scaling.
//! One correctly rounded fma, whatever the compiler contracts elsewhere, so every kernel that
//! calls it gets the same bits (Note [ReLU mask from x] in device/bn_kernels.cuh), and the host
//! (the emulator, the host backend) gets the device's bits: std::fma is __fmaf_rn's rounding (one
//! instruction where the host kernels run with FMA, a library call in the baseline build).
LOCKSTEP_HD inline float normalize(float x, float mean_hi, float scale, float shift) {
#if defined(__CUDA_ARCH__)
    return __fmaf_rn(x - mean_hi, scale, shift);
#else
    return std::fma(x - mean_hi, scale, shift);
#endif
}

//! sum(dy * (x - mean)) from sum(dy * (x - mean_hi)) and sum(dy), in fp64.
LOCKSTEP_HD inline double centred_sum(double sum_dy_xhi, double sum_dy, float mean_lo) {
    return sum_dy_xhi - static_cast<double>(mean_lo) * sum_dy;
}

//! Per-channel constants of `backward`: dx = a * dy + b * (x - mean_hi) + c, where
//! mean_hi = split_mean(mean).hi.
struct BackwardConstants {
    float a, b, c;
};

//! dx = gamma * invstd * (dy - sum(dy)/N - (x - mean) * invstd^2 * sum(dy * (x - mean))/N),
//! expanded about mean_hi: a = gamma * invstd, b = -a * k2, c = a * (k2 * mean_lo - sum(dy)/N)
//! with k2 = invstd^2 * sum(dy * (x - mean))/N, all in fp64.
LOCKSTEP_HD inline BackwardConstants backward_constants(double n, double sum_dy, double sum_dy_xmu, double mean, double invstd,
                                                        double gamma) {
    const float hi = static_cast<float>(mean);
    const double lo = mean - static_cast<double>(hi);
    const double a = gamma * invstd;
    const double k2 = invstd * invstd * sum_dy_xmu / n;
    return {static_cast<float>(a), static_cast<float>(-a * k2), static_cast<float>(a * (k2 * lo - sum_dy / n))};
}

//! dx of one element (see `backward_constants`).
LOCKSTEP_HD inline float backward(float dy, float x, float mean_hi, float a, float b, float c) {
    return a * dy + ((x - mean_hi) * b + c);
}

//! PyTorch's running-statistics update with the global mean and the unbiased global variance:
//! r_mean = (1 - m) r_mean + m mean, r_var = (1 - m) r_var + m var N / (N - 1).
LOCKSTEP_HD inline void update_running(float& running_mean, float& running_var, const ChannelStats& st, double n,
                                       double momentum) {
    const double unbiased = st.var * n / (n - 1.0);
    running_mean = static_cast<float>((1.0 - momentum) * running_mean + momentum * st.mean);
    running_var = static_cast<float>((1.0 - momentum) * running_var + momentum * unbiased);
}

}  // namespace lockstep::kernels::bn
