// SPDX-License-Identifier: MIT
//! Layer normalization per row and per column, written once for both backends
//! (`__host__ __device__` under nvcc): the host loops and the CUDA kernels give the same bits.
#pragma once

#include <math.h>

#include <cmath>
#include <cstdint>

#include "lockstep/core/config.hpp"
#include "lockstep/kernels/rounding.hpp"

namespace lockstep::kernels::layer_norm {

// Note [layer norm per row]
// An (R, M) input is normalized over each row of M values (torch.nn.LayerNorm over the trailing
// dimensions whose sizes multiply to M). A row's mean and variance are summed in fp64 in two
// passes (no cancellation), kept as fp32 mean and 1/sqrt(var + eps) for backward, as PyTorch
// keeps them. Backward per row: dx = rstd (w dy - mean(w dy) - xhat mean(w dy xhat)), the two
// means in fp64; the parameters' gradients per column, summed over the rows in fp64 in row order.
// Every fp64 operation is rounded on its own (Note [rounded once] in kernels/rounding.hpp), so a
// GPU gives the host's bits.

using rounding::add_rn;
using rounding::div_rn;
using rounding::mul_rn;
using rounding::sqrt_rn;
using rounding::sub_rn;

//! Row `x` (M values): its mean and 1/sqrt(var + eps), var the biased variance.
LOCKSTEP_HD inline void row_stats(const float* x, std::int64_t M, double eps, float& mean, float& rstd) {
    double s = 0;
    for (std::int64_t j = 0; j < M; ++j) s = add_rn(s, static_cast<double>(x[j]));
    const double mu = div_rn(s, static_cast<double>(M));
    double q = 0;
    for (std::int64_t j = 0; j < M; ++j) {
        const double d = sub_rn(static_cast<double>(x[j]), mu);
        q = add_rn(q, mul_rn(d, d));
    }
    const double var = div_rn(q, static_cast<double>(M));
    mean = static_cast<float>(mu);
    rstd = static_cast<float>(div_rn(1.0, sqrt_rn(add_rn(var, eps))));
}

//! y[j] = (x[j] - mean) rstd w[j] + b[j] (w, b may be null: 1 and 0), in fp64, rounded once.
LOCKSTEP_HD inline float forward_at(float x, float mean, float rstd, const float* w, const float* b, std::int64_t j) {
    double v = mul_rn(sub_rn(static_cast<double>(x), static_cast<double>(mean)), static_cast<double>(rstd));
    if (w != nullptr) v = mul_rn(v, static_cast<double>(w[j]));
    if (b != nullptr) v = add_rn(v, static_cast<double>(b[j]));
    return static_cast<float>(v);
}

//! Row dx from the row's x, dy and statistics.
LOCKSTEP_HD inline void backward_row(const float* x, const float* dy, std::int64_t M, const float* w, float mean, float rstd,
                                     float* dx) {
    double a = 0, c = 0;
    const double mu = mean, r = rstd;
    for (std::int64_t j = 0; j < M; ++j) {
        const double g =
            w != nullptr ? mul_rn(static_cast<double>(dy[j]), static_cast<double>(w[j])) : static_cast<double>(dy[j]);
        const double xhat = mul_rn(sub_rn(static_cast<double>(x[j]), mu), r);
        a = add_rn(a, g);
        c = add_rn(c, mul_rn(g, xhat));
    }
    a = div_rn(a, static_cast<double>(M));
    c = div_rn(c, static_cast<double>(M));
    for (std::int64_t j = 0; j < M; ++j) {
        const double g =
            w != nullptr ? mul_rn(static_cast<double>(dy[j]), static_cast<double>(w[j])) : static_cast<double>(dy[j]);
        const double xhat = mul_rn(sub_rn(static_cast<double>(x[j]), mu), r);
        dx[j] = static_cast<float>(mul_rn(r, sub_rn(sub_rn(g, a), mul_rn(xhat, c))));
    }
}

//! Column j's parameter gradients over R rows: dw += sum dy xhat, db += sum dy (either may be null).
LOCKSTEP_HD inline void param_grads_at(const float* x, const float* dy, std::int64_t R, std::int64_t M, const float* mean,
                                       const float* rstd, std::int64_t j, float* dw, float* db) {
    double sw = 0, sb = 0;
    for (std::int64_t i = 0; i < R; ++i) {
        const double g = dy[i * M + j];
        const double xhat =
            mul_rn(sub_rn(static_cast<double>(x[i * M + j]), static_cast<double>(mean[i])), static_cast<double>(rstd[i]));
        sw = add_rn(sw, mul_rn(g, xhat));
        sb = add_rn(sb, g);
    }
    if (dw != nullptr) dw[j] = static_cast<float>(add_rn(static_cast<double>(dw[j]), sw));
    if (db != nullptr) db[j] = static_cast<float>(add_rn(static_cast<double>(db[j]), sb));
}

}  // namespace lockstep::kernels::layer_norm
