// SPDX-License-Identifier: MIT
//! Layer normalization per row and per column, written once for both backends
//! (`__host__ __device__` under nvcc): the host loops and the CUDA kernels give the same bits.
#pragma once

#include <math.h>

#include <cmath>
#include <cstdint>

#include "lockstep/core/config.hpp"

namespace lockstep::kernels::layer_norm {

// Note [layer norm per row]
// An (R, M) input is normalized over each row of M values (torch.nn.LayerNorm over the trailing
// dimensions whose sizes multiply to M). A row's mean and variance are summed in fp64 in two
// passes (no cancellation), kept as fp32 mean and 1/sqrt(var + eps) for backward, as PyTorch
// keeps them. Backward per row: dx = rstd (w dy - mean(w dy) - xhat mean(w dy xhat)), the two
// means in fp64; the parameters' gradients per column, summed over the rows in fp64 in row order.
// Every fp64 product and sum is rounded on its own (never contracted into an FMA), so a GPU gives
// the host's bits.

LOCKSTEP_HD inline double mul(double a, double b) {
#if defined(__CUDA_ARCH__)
    return __dmul_rn(a, b);
#else
    return a * b;
#endif
}
LOCKSTEP_HD inline double add(double a, double b) {
#if defined(__CUDA_ARCH__)
    return __dadd_rn(a, b);
#else
    return a + b;
#endif
}
LOCKSTEP_HD inline double sub(double a, double b) {
#if defined(__CUDA_ARCH__)
    return __dsub_rn(a, b);
#else
    return a - b;
#endif
}
LOCKSTEP_HD inline double div(double a, double b) {
#if defined(__CUDA_ARCH__)
    return __ddiv_rn(a, b);
#else
    return a / b;
#endif
}

//! Row `x` (M values): its mean and 1/sqrt(var + eps), var the biased variance.
LOCKSTEP_HD inline void row_stats(const float* x, std::int64_t M, double eps, float& mean, float& rstd) {
    double s = 0;
    for (std::int64_t j = 0; j < M; ++j) s = add(s, static_cast<double>(x[j]));
    const double mu = div(s, static_cast<double>(M));
    double q = 0;
    for (std::int64_t j = 0; j < M; ++j) {
        const double d = sub(static_cast<double>(x[j]), mu);
        q = add(q, mul(d, d));
    }
    const double var = div(q, static_cast<double>(M));
    mean = static_cast<float>(mu);
    rstd = static_cast<float>(div(1.0, ::sqrt(add(var, eps))));
}

//! y[j] = (x[j] - mean) rstd w[j] + b[j] (w, b may be null: 1 and 0), in fp64, rounded once.
LOCKSTEP_HD inline float forward_at(float x, float mean, float rstd, const float* w, const float* b, std::int64_t j) {
    double v = mul(sub(static_cast<double>(x), static_cast<double>(mean)), static_cast<double>(rstd));
    if (w != nullptr) v = mul(v, static_cast<double>(w[j]));
    if (b != nullptr) v = add(v, static_cast<double>(b[j]));
    return static_cast<float>(v);
}

//! Row dx from the row's x, dy and statistics.
LOCKSTEP_HD inline void backward_row(const float* x, const float* dy, std::int64_t M, const float* w, float mean, float rstd,
                                     float* dx) {
    double a = 0, c = 0;
    const double mu = mean, r = rstd;
    for (std::int64_t j = 0; j < M; ++j) {
        const double g = w != nullptr ? mul(static_cast<double>(dy[j]), static_cast<double>(w[j])) : static_cast<double>(dy[j]);
        const double xhat = mul(sub(static_cast<double>(x[j]), mu), r);
        a = add(a, g);
        c = add(c, mul(g, xhat));
    }
    a = div(a, static_cast<double>(M));
    c = div(c, static_cast<double>(M));
    for (std::int64_t j = 0; j < M; ++j) {
        const double g = w != nullptr ? mul(static_cast<double>(dy[j]), static_cast<double>(w[j])) : static_cast<double>(dy[j]);
        const double xhat = mul(sub(static_cast<double>(x[j]), mu), r);
        dx[j] = static_cast<float>(mul(r, sub(sub(g, a), mul(xhat, c))));
    }
}

//! Column j's parameter gradients over R rows: dw += sum dy xhat, db += sum dy (either may be null).
LOCKSTEP_HD inline void param_grads_at(const float* x, const float* dy, std::int64_t R, std::int64_t M, const float* mean,
                                       const float* rstd, std::int64_t j, float* dw, float* db) {
    double sw = 0, sb = 0;
    for (std::int64_t i = 0; i < R; ++i) {
        const double g = dy[i * M + j];
        const double xhat =
            mul(sub(static_cast<double>(x[i * M + j]), static_cast<double>(mean[i])), static_cast<double>(rstd[i]));
        sw = add(sw, mul(g, xhat));
        sb = add(sb, g);
    }
    if (dw != nullptr) dw[j] = static_cast<float>(add(static_cast<double>(dw[j]), sw));
    if (db != nullptr) db[j] = static_cast<float>(add(static_cast<double>(db[j]), sb));
}

}  // namespace lockstep::kernels::layer_norm
