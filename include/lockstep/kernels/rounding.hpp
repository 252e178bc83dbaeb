// SPDX-License-Identifier: MIT
//! fp32 and fp64 arithmetic rounded once per operation on both backends (`__host__ __device__`):
//! what the per-element math shared by the host loops and the CUDA kernels is written with.
#pragma once

#include <math.h>

#include <cmath>

#include "lockstep/core/config.hpp"

namespace lockstep::kernels::rounding {

// Note [rounded once]
// nvcc contracts a * b + c into one fused multiply-add by default, which rounds once where the
// host rounds twice: the two backends would then differ in the last bit. The per-element math
// that both run (the SGD and Adam updates, layer norm) is written with these instead, each a
// single IEEE operation rounded to nearest: on the device the intrinsic that is never
// contracted, on the host the plain operator (the host build enables no FMA contraction).

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
LOCKSTEP_HD inline float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fdiv_rn(a, b);
#else
    return a / b;
#endif
}
LOCKSTEP_HD inline float sqrt_rn(float a) {
#if defined(__CUDA_ARCH__)
    return __fsqrt_rn(a);
#else
    return std::sqrt(a);
#endif
}

LOCKSTEP_HD inline double mul_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
    return __dmul_rn(a, b);
#else
    return a * b;
#endif
}
LOCKSTEP_HD inline double add_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
    return __dadd_rn(a, b);
#else
    return a + b;
#endif
}
LOCKSTEP_HD inline double sub_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
    return __dsub_rn(a, b);
#else
    return a - b;
#endif
}
LOCKSTEP_HD inline double div_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
    return __ddiv_rn(a, b);
#else
    return a / b;
#endif
}
LOCKSTEP_HD inline double sqrt_rn(double a) {
#if defined(__CUDA_ARCH__)
    return __dsqrt_rn(a);
#else
    return std::sqrt(a);
#endif
}

}  // namespace lockstep::kernels::rounding
