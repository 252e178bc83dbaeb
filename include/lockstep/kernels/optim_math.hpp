// SPDX-License-Identifier: MIT
//! Adam and AdamW per element, written once for both backends (`__host__ __device__` under nvcc):
//! the host loop and the CUDA kernel give the same bits.
#pragma once

#include <math.h>

#include <cmath>
#include <cstdint>

#include "lockstep/core/config.hpp"
#include "lockstep/kernels/rounding.hpp"

namespace lockstep::kernels {

//! One Adam or AdamW update, the scalars computed once per step on the host in fp64 from
//! torch.optim.Adam's formulas and rounded to fp32 as PyTorch's kernels take them.
struct AdamUpdate {
    float beta1 = 0.9f, beta2 = 0.999f;
    float one_minus_beta1 = 0.1f, one_minus_beta2 = 0.001f;
    float eps = 1e-8f;
    float weight_decay = 0.0f;  // Adam: added to the gradient (L2)
    float decay = 1.0f;         // AdamW: 1 - lr * weight_decay, multiplied into the parameter
    bool decoupled = false;     // AdamW
    float step_size = 1e-3f;    // lr / (1 - beta1^step)
    float bias_sqrt = 1.0f;     // sqrt(1 - beta2^step)

    //! The scalars of step `step` (1 for the first) for learning rate `lr`.
    static AdamUpdate at(double lr, double beta1, double beta2, double eps, double weight_decay, bool decoupled,
                         std::int64_t step) {
        AdamUpdate u;
        u.beta1 = static_cast<float>(beta1), u.beta2 = static_cast<float>(beta2);
        u.one_minus_beta1 = static_cast<float>(1.0 - beta1), u.one_minus_beta2 = static_cast<float>(1.0 - beta2);
        u.eps = static_cast<float>(eps);
        u.decoupled = decoupled;
        u.weight_decay = decoupled ? 0.0f : static_cast<float>(weight_decay);
        u.decay = decoupled ? static_cast<float>(1.0 - lr * weight_decay) : 1.0f;
        const double s = static_cast<double>(step);
        u.step_size = static_cast<float>(lr / (1.0 - std::pow(beta1, s)));
        u.bias_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(beta2, s)));
        return u;
    }
};

namespace optim {

// fp32 operations each rounded on its own (Note [rounded once]).
using rounding::add_rn;
using rounding::div_rn;
using rounding::mul_rn;
using rounding::sqrt_rn;
using rounding::sub_rn;

//! torch.optim.Adam's update of one element (its single-tensor path, in its order):
//!   AdamW: w *= 1 - lr wd;  Adam: g += wd w;
//!   m = m + (1 - beta1) (g - m);  v = v beta2 + (1 - beta2) g g;
//!   w = w - (step_size m) / (sqrt(v) / bias_sqrt + eps)   (addcdiv's order: value * t1 / t2).
LOCKSTEP_HD inline void adam_one(const AdamUpdate& u, float& w, float g, float& m, float& v) {
    if (u.decoupled)
        w = mul_rn(w, u.decay);
    else
        g = add_rn(g, mul_rn(u.weight_decay, w));
    m = add_rn(m, mul_rn(u.one_minus_beta1, sub_rn(g, m)));
    v = add_rn(mul_rn(v, u.beta2), mul_rn(mul_rn(u.one_minus_beta2, g), g));
    const float denom = add_rn(div_rn(sqrt_rn(v), u.bias_sqrt), u.eps);
    w = sub_rn(w, div_rn(mul_rn(u.step_size, m), denom));
}

}  // namespace optim

}  // namespace lockstep::kernels
