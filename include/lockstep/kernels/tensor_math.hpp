// SPDX-License-Identifier: MIT
//! The public tensor operations' arithmetic (nn/tensor_ops.hpp), written once for both backends
//! (`__host__ __device__` under nvcc): the host loops and the CUDA kernels call these per element
//! or per line, so the two backends give the same bits (Note [tensor operations per element]).
#pragma once

#include <math.h>

#include <cmath>
#include <cstdint>

#include "lockstep/core/config.hpp"
#include "lockstep/kernels/rounding.hpp"

namespace lockstep::kernels {

// Note [tensor operations per element]
// The tensor operations a custom module calls (add, axpy, multiply, sums and means over dims,
// softmax, argmax, concatenation) address their tensors through a `DimWalk`: the sizes of some
// dimensions, outermost first, each with the stride it moves by in some tensor. Walking index i
// over those dimensions gives an offset, so one walk reads a reduction's input in any memory
// format (NHWC included: the strides are the physical ones) and another writes a concatenation's
// slice into its place in the output. Every output element is computed by one thread from its
// inputs in a fixed order: elementwise in fp32 with each operation rounded on its own (no fused
// multiply-add), sums and softmax in fp64 rounded once per operation (Note [rounded once]), so a
// reduction or a softmax has the host's bits on a GPU (exp aside: CUDA's fp64 exp and the host's
// may differ in the last fp64 place, which the rounding to fp32 almost always hides) and no
// atomics make it nondeterministic.

//! Dimensions walked in row-major order: index i -> sum over d of (i's coordinate d) * stride[d].
struct DimWalk {
    static constexpr int max_rank = 5;
    int rank = 0;
    std::int64_t size[max_rank] = {};
    std::int64_t stride[max_rank] = {};

    LOCKSTEP_HD std::int64_t count() const {
        std::int64_t n = 1;
        for (int d = 0; d < rank; ++d) n *= size[d];
        return n;
    }
    LOCKSTEP_HD std::int64_t offset(std::int64_t i) const {
        std::int64_t off = 0;
        for (int d = rank - 1; d >= 0; --d) {
            off += (i % size[d]) * stride[d];
            i /= size[d];
        }
        return off;
    }
    //! Appends a dimension (innermost so far).
    LOCKSTEP_HD void push(std::int64_t extent, std::int64_t step) {
        size[rank] = extent;
        stride[rank] = step;
        ++rank;
    }
};

//! A sum over some dimensions: output element o (contiguous, the kept dimensions in order) sums
//! the input at kept.offset(o) + reduced.offset(r) for r in [0, reduced.count()), then multiplies
//! by `scale` (1 for a sum, 1 / count for a mean).
struct ReduceGeometry {
    DimWalk kept, reduced;
    double scale = 1.0;
};

//! The backward of a sum or mean: dx element i (the input's physical order, walked by `input`,
//! whose strides are the output's, 0 along reduced dimensions) = dy[input.offset(i)] * scale.
struct BroadcastGeometry {
    DimWalk input;
    double scale = 1.0;
};

//! Lines along one dimension: line l starts at lines.offset(l) and holds `length` elements
//! `step` apart (softmax and argmax along `dim`).
struct LineGeometry {
    DimWalk lines;
    std::int64_t length = 0, step = 1;
};

//! A strided copy: element i of a contiguous `count`-element source goes to
//! base + walk.offset(i) of the destination (concatenation), or the other way (its backward).
struct PlaceGeometry {
    DimWalk walk;
    std::int64_t base = 0;
};

namespace tensor_math {

using rounding::add_rn;
using rounding::div_rn;
using rounding::mul_rn;
using rounding::sub_rn;

//! Calls f(i, walk.offset(i)) for every i in order, the innermost dimension in a tight loop (how
//! the host walks: the same offsets as `DimWalk::offset` without a division per element).
template <class F>
inline void for_each_offset(const DimWalk& walk, F&& f) {
    if (walk.rank == 0) {
        f(std::int64_t{0}, std::int64_t{0});
        return;
    }
    DimWalk outer = walk;
    outer.rank = walk.rank - 1;
    const std::int64_t inner = walk.size[outer.rank], step = walk.stride[outer.rank], lines = outer.count();
    for (std::int64_t o = 0; o < lines; ++o) {
        const std::int64_t base = outer.offset(o);
        for (std::int64_t k = 0; k < inner; ++k) f(o * inner + k, base + k * step);
    }
}

//! alpha a + beta b, each product and the sum rounded on its own (the same bits with or without FMA).
LOCKSTEP_HD inline float axpby(float alpha, float a, float beta, float b) { return add_rn(mul_rn(alpha, a), mul_rn(beta, b)); }

//! Output element o of a sum or mean: fp64 in the reduced dimensions' row-major order.
LOCKSTEP_HD inline float reduce_at(const ReduceGeometry& g, const float* x, std::int64_t o) {
    const float* base = x + g.kept.offset(o);
    const std::int64_t n = g.reduced.count();
    double s = 0;
    for (std::int64_t r = 0; r < n; ++r) s = add_rn(s, static_cast<double>(base[g.reduced.offset(r)]));
    return static_cast<float>(mul_rn(s, g.scale));
}

//! dx element i of a sum's or mean's backward.
LOCKSTEP_HD inline float broadcast_at(const BroadcastGeometry& g, const float* dy, std::int64_t i) {
    return static_cast<float>(mul_rn(static_cast<double>(dy[g.input.offset(i)]), g.scale));
}

//! What a softmax line's elements need: its maximum and sum of exp(x - max), in fp64; NaN
//! maximum when the line holds a NaN (every output NaN then, as PyTorch's).
struct SoftmaxLine {
    double max = 0, sum = 0;
};

//! The line of `length` elements `step` apart from x.
LOCKSTEP_HD inline SoftmaxLine softmax_stats(const float* x, std::int64_t length, std::int64_t step) {
    double m = -HUGE_VAL;
    for (std::int64_t k = 0; k < length; ++k) {
        const double v = x[k * step];
        if (v != v) return {v, 1.0};
        if (v > m) m = v;
    }
    double s = 0;
    for (std::int64_t k = 0; k < length; ++k) s = add_rn(s, exp(sub_rn(static_cast<double>(x[k * step]), m)));
    return {m, s};
}

//! One softmax output: exp(x - max) / sum.
LOCKSTEP_HD inline float softmax_value(float x, const SoftmaxLine& line) {
    return static_cast<float>(div_rn(exp(sub_rn(static_cast<double>(x), line.max)), line.sum));
}

//! Softmax backward's sum(dy y) over a line of `length` elements `step` apart, in fp64.
LOCKSTEP_HD inline double softmax_dot(const float* y, const float* dy, std::int64_t length, std::int64_t step) {
    double dot = 0;
    for (std::int64_t k = 0; k < length; ++k)
        dot = add_rn(dot, mul_rn(static_cast<double>(dy[k * step]), static_cast<double>(y[k * step])));
    return dot;
}

//! One softmax backward output: y (dy - dot).
LOCKSTEP_HD inline float softmax_grad_value(float y, float dy, double dot) {
    return static_cast<float>(mul_rn(static_cast<double>(y), sub_rn(static_cast<double>(dy), dot)));
}

//! The index of line l's largest element, the first of equals; a NaN counts as the largest (the
//! first NaN wins), as torch.argmax.
LOCKSTEP_HD inline std::int64_t argmax_line(const LineGeometry& g, const float* x, std::int64_t l) {
    const std::int64_t start = g.lines.offset(l);
    std::int64_t best = 0;
    float m = x[start];
    if (m != m) return 0;
    for (std::int64_t k = 1; k < g.length; ++k) {
        const float v = x[start + k * g.step];
        if (v != v) return k;
        if (v > m) {
            m = v;
            best = k;
        }
    }
    return best;
}

}  // namespace tensor_math
}  // namespace lockstep::kernels
