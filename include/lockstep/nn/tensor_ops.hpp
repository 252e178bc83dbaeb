// SPDX-License-Identifier: MIT
//! The tensor operations a custom module is written with, the same on `Host` and `Cuda`:
//! elementwise arithmetic, sums and means over dimensions, softmax, argmax, concatenation, and the
//! backward of each that has one (Note [tensor operations]).
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "lockstep/core/backend.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/shape.hpp"
#include "lockstep/core/tensor.hpp"
#include "lockstep/kernels/ops.hpp"
#include "lockstep/nn/context.hpp"

namespace lockstep::ops {

// Note [tensor operations]
// lockstep has no autograd: a module's backward is written by hand (Note [module protocol]). These
// operations are what it is written with. Each takes the replica's Context first (its stream on
// CUDA), returns a new tensor on the input's device and never waits for the device; each that has
// a backward offers it beside it, taking what the forward returned or was given (softmax_backward
// takes y, mul_backward takes a and b), so a custom backward is a mirror of its forward:
//     forward:  s = mean(ctx, x, {2, 3});  a = softmax(ctx, s, 1);
//     backward: ds = softmax_backward(ctx, a, da, 1);  dx = mean_backward(ctx, ds, x.shape(), {2, 3});
// Dimensions count from 0 and may be negative (from the end), as in PyTorch. Reductions, softmax,
// argmax and concatenation read NCHW and NHWC tensors by their logical (N, C, H, W) dimensions;
// elementwise operations need their operands in one memory format. The arithmetic is written once
// for both backends (Note [tensor operations per element]): a GPU gives the host's bits (softmax
// within its last fp32 place: CUDA's fp64 exp may differ from the host's), sums and softmax in fp64.
// One thread computes each output element: fine for a module's per-channel or per-sample tensors,
// a serial loop on a GPU for a sum over a whole large tensor.

template <BackendTag B>
using FloatTensor = Tensor<float, B>;

//! Dimensions of an operation: `{2, 3}`; empty for every dimension.
using Dims = std::vector<int>;

namespace detail {

//! Logical dimension d's stride in memory, and the logical dimensions in memory order.
struct Layout {
    std::int64_t stride[Shape::max_rank] = {};
    int order[Shape::max_rank] = {};
};

inline Layout layout(const Shape& s, MemoryFormat f) {
    Layout l;
    const int r = s.rank();
    if (f == MemoryFormat::nhwc && r == 4) {
        const int order[4] = {0, 2, 3, 1};
        for (int i = 0; i < 4; ++i) l.order[i] = order[i];
    } else {
        for (int i = 0; i < r; ++i) l.order[i] = i;
    }
    std::int64_t step = 1;
    for (int i = r - 1; i >= 0; --i) {
        l.stride[l.order[i]] = step;
        step *= s[l.order[i]];
    }
    return l;
}

inline int normalize_dim(int dim, int rank, const char* op) {
    LOCKSTEP_CHECK_AS(ShapeError, dim >= -rank && dim < rank && rank > 0, "ops::", op, ": dimension ", dim,
                      " is out of range for a tensor of rank ", rank, " (give 0 to ", rank - 1, ", or -", rank, " to -1)");
    return dim < 0 ? dim + rank : dim;
}

//! Which dimensions `dims` names (all of them when empty); each named once.
inline std::vector<bool> dim_set(const Dims& dims, int rank, const char* op) {
    std::vector<bool> in(static_cast<std::size_t>(rank), dims.empty());
    for (int d : dims) {
        const int n = normalize_dim(d, rank, op);
        LOCKSTEP_CHECK_AS(ShapeError, !in[static_cast<std::size_t>(n)], "ops::", op, ": dimension ", d,
                          " is named twice; name each dimension once");
        in[static_cast<std::size_t>(n)] = true;
    }
    return in;
}

template <BackendTag B, class T, class U>
void check_same(const Tensor<T, B>& a, const Tensor<U, B>& b, const char* op, const char* what) {
    LOCKSTEP_CHECK_AS(ShapeError, a.shape() == b.shape(), "ops::", op, ": ", what, " has shape ", b.shape(),
                      " but the first operand ", a.shape(), "; give both the same shape");
    LOCKSTEP_CHECK_AS(ShapeError, a.format() == b.format() || a.rank() != 4, "ops::", op, ": ", what, " is ",
                      to_string(b.format()), " but the first operand ", to_string(a.format()),
                      "; give both the same memory format");
    LOCKSTEP_CHECK_AS(UsageError, a.device() == b.device(), "ops::", op, ": ", what, " is on ", b.device().str(),
                      " but the first operand on ", a.device().str(), "; move both to one device");
}

//! The shape left when `reduced` dimensions are summed away (kept as 1 with keepdim).
inline Shape reduced_shape(const Shape& s, const std::vector<bool>& reduced, bool keepdim) {
    int rank = 0;
    std::int64_t dims[Shape::max_rank] = {};
    for (int d = 0; d < s.rank(); ++d) {
        if (!reduced[static_cast<std::size_t>(d)])
            dims[rank++] = s[d];
        else if (keepdim)
            dims[rank++] = 1;
    }
    switch (rank) {
        case 0: return Shape{};
        case 1: return Shape{dims[0]};
        case 2: return Shape{dims[0], dims[1]};
        case 3: return Shape{dims[0], dims[1], dims[2]};
        case 4: return Shape{dims[0], dims[1], dims[2], dims[3]};
        default: return Shape{dims[0], dims[1], dims[2], dims[3], dims[4]};
    }
}

inline kernels::ReduceGeometry reduce_geometry(const Shape& s, MemoryFormat f, const std::vector<bool>& reduced) {
    const Layout l = layout(s, f);
    kernels::ReduceGeometry g;
    for (int d = 0; d < s.rank(); ++d) {
        if (reduced[static_cast<std::size_t>(d)])
            g.reduced.push(s[d], l.stride[d]);
        else
            g.kept.push(s[d], l.stride[d]);
    }
    return g;
}

//! The walk of an input in its memory order with a reduction's output strides (0 where reduced).
inline kernels::BroadcastGeometry broadcast_geometry(const Shape& s, MemoryFormat f, const std::vector<bool>& reduced) {
    const Layout l = layout(s, f);
    std::int64_t out_stride[Shape::max_rank] = {};
    std::int64_t step = 1;
    for (int d = s.rank() - 1; d >= 0; --d) {
        if (reduced[static_cast<std::size_t>(d)]) continue;
        out_stride[d] = step;
        step *= s[d];
    }
    kernels::BroadcastGeometry g;
    for (int i = 0; i < s.rank(); ++i) g.input.push(s[l.order[i]], out_stride[l.order[i]]);
    return g;
}

inline kernels::LineGeometry line_geometry(const Shape& s, MemoryFormat f, int dim) {
    const Layout l = layout(s, f);
    kernels::LineGeometry g;
    for (int d = 0; d < s.rank(); ++d)
        if (d != dim) g.lines.push(s[d], l.stride[d]);
    g.length = s[dim];
    g.step = l.stride[dim];
    return g;
}

inline std::int64_t reduced_count(const Shape& s, const std::vector<bool>& reduced) {
    std::int64_t n = 1;
    for (int d = 0; d < s.rank(); ++d)
        if (reduced[static_cast<std::size_t>(d)]) n *= s[d];
    return n;
}

//! Slice j of a concatenation: where its elements (in its memory order) lie in the output.
inline kernels::PlaceGeometry place_geometry(const Shape& part, const Shape& whole, MemoryFormat f, int dim,
                                             std::int64_t offset) {
    const Layout lp = layout(part, f), lw = layout(whole, f);
    kernels::PlaceGeometry g;
    for (int i = 0; i < part.rank(); ++i) g.walk.push(part[lp.order[i]], lw.stride[lp.order[i]]);
    g.base = offset * lw.stride[dim];
    return g;
}

}  // namespace detail

// ---- elementwise ------------------------------------------------------------------------------

//! alpha a + beta b, element by element (same shape, format and device).
template <BackendTag B>
FloatTensor<B> axpby(const nn::Context<B>& ctx, float alpha, const FloatTensor<B>& a, float beta, const FloatTensor<B>& b) {
    detail::check_same(a, b, "axpby", "b");
    FloatTensor<B> out(a.shape(), a.format(), a.device(), uninitialized);
    kernels::Ops<B>::axpby(ctx.exec, alpha, a, beta, b, out);
    return out;
}

//! a + b. Its backward passes dy to both.
template <BackendTag B>
FloatTensor<B> add(const nn::Context<B>& ctx, const FloatTensor<B>& a, const FloatTensor<B>& b) {
    detail::check_same(a, b, "add", "b");
    FloatTensor<B> out(a.shape(), a.format(), a.device(), uninitialized);
    kernels::Ops<B>::axpby(ctx.exec, 1.0f, a, 1.0f, b, out);
    return out;
}

//! a - b. Its backward: dy and -dy.
template <BackendTag B>
FloatTensor<B> sub(const nn::Context<B>& ctx, const FloatTensor<B>& a, const FloatTensor<B>& b) {
    detail::check_same(a, b, "sub", "b");
    FloatTensor<B> out(a.shape(), a.format(), a.device(), uninitialized);
    kernels::Ops<B>::axpby(ctx.exec, 1.0f, a, -1.0f, b, out);
    return out;
}

//! y += alpha x in place (how a backward adds a gradient into another: axpy(ctx, 1, dx_skip, dx)).
template <BackendTag B>
void axpy(const nn::Context<B>& ctx, float alpha, const FloatTensor<B>& x, FloatTensor<B>& y) {
    detail::check_same(y, x, "axpy", "x");
    kernels::Ops<B>::axpby(ctx.exec, alpha, x, 1.0f, y, y);
}

//! x * alpha (x taken by value and scaled in place: move it in to spend no copy). Its backward is
//! scale(dy, alpha).
template <BackendTag B>
FloatTensor<B> scale(const nn::Context<B>& ctx, FloatTensor<B> x, float alpha) {
    kernels::Ops<B>::scale(ctx.exec, x, alpha);
    return x;
}

//! a * b, element by element.
template <BackendTag B>
FloatTensor<B> mul(const nn::Context<B>& ctx, const FloatTensor<B>& a, const FloatTensor<B>& b) {
    detail::check_same(a, b, "mul", "b");
    FloatTensor<B> out(a.shape(), a.format(), a.device(), uninitialized);
    kernels::Ops<B>::multiply(ctx.exec, a, b, out);
    return out;
}

//! The gradients of mul(a, b): da = dy b, db = dy a.
template <BackendTag B>
struct MulGrads {
    FloatTensor<B> da, db;
};

template <BackendTag B>
MulGrads<B> mul_backward(const nn::Context<B>& ctx, const FloatTensor<B>& a, const FloatTensor<B>& b, const FloatTensor<B>& dy) {
    detail::check_same(a, b, "mul_backward", "b");
    detail::check_same(a, dy, "mul_backward", "dy");
    return {mul(ctx, dy, b), mul(ctx, dy, a)};
}

// ---- reductions -------------------------------------------------------------------------------

//! The sum over `dims` (every dimension when empty), in fp64; the summed dimensions dropped, or
//! kept with extent 1 (`keepdim`). The result is contiguous (NCHW where it has rank 4).
template <BackendTag B>
FloatTensor<B> sum(const nn::Context<B>& ctx, const FloatTensor<B>& x, const Dims& dims = {}, bool keepdim = false) {
    const auto reduced = detail::dim_set(dims, x.rank(), "sum");
    FloatTensor<B> y(detail::reduced_shape(x.shape(), reduced, keepdim), MemoryFormat::nchw, x.device(), uninitialized);
    kernels::Ops<B>::reduce(ctx.exec, detail::reduce_geometry(x.shape(), x.format(), reduced), x, y);
    return y;
}

//! The mean over `dims` (every dimension when empty): the sum divided by the count, in fp64.
template <BackendTag B>
FloatTensor<B> mean(const nn::Context<B>& ctx, const FloatTensor<B>& x, const Dims& dims = {}, bool keepdim = false) {
    const auto reduced = detail::dim_set(dims, x.rank(), "mean");
    const std::int64_t count = detail::reduced_count(x.shape(), reduced);
    LOCKSTEP_CHECK_AS(ShapeError, count > 0, "ops::mean: the reduced dimensions of ", x.shape(),
                      " hold no elements; a mean of none is undefined");
    FloatTensor<B> y(detail::reduced_shape(x.shape(), reduced, keepdim), MemoryFormat::nchw, x.device(), uninitialized);
    auto g = detail::reduce_geometry(x.shape(), x.format(), reduced);
    g.scale = 1.0 / static_cast<double>(count);
    kernels::Ops<B>::reduce(ctx.exec, g, x, y);
    return y;
}

//! `t` repeated along `dims` of `shape` (t holds `shape` without those dimensions, or with them as
//! 1, in NCHW order as sums and means give it), in memory format `format`: what sum's backward is, and how a per-channel value
//! meets a batch (expand(ctx, gate, x.shape(), {2, 3}, x.format()) gives gate[n, c] at every pixel).
template <BackendTag B>
FloatTensor<B> expand(const nn::Context<B>& ctx, const FloatTensor<B>& t, const Shape& shape, const Dims& dims,
                      MemoryFormat format = MemoryFormat::nchw, double factor = 1.0) {
    const auto reduced = detail::dim_set(dims, shape.rank(), "expand");
    const Shape kept = detail::reduced_shape(shape, reduced, false);
    LOCKSTEP_CHECK_AS(
        ShapeError, t.numel() == kept.numel() && (t.shape() == kept || t.shape() == detail::reduced_shape(shape, reduced, true)),
        "ops::expand: a tensor of shape ", t.shape(), " does not repeat into ", shape,
        " along the named dimensions; it should have shape ", kept, " or ", detail::reduced_shape(shape, reduced, true));
    LOCKSTEP_CHECK_AS(ShapeError, t.rank() != 4 || t.format() == MemoryFormat::nchw,
                      "ops::expand reads the repeated tensor in NCHW order, but it is NHWC; pass a sum's or mean's "
                      "output (always NCHW) or a tensor without the repeated dimensions");
    const MemoryFormat f = shape.rank() == 4 ? format : MemoryFormat::nchw;
    FloatTensor<B> out(shape, f, t.device(), uninitialized);
    auto g = detail::broadcast_geometry(shape, f, reduced);
    g.scale = factor;
    kernels::Ops<B>::broadcast(ctx.exec, g, t, out);
    return out;
}

//! The backward of sum(x, dims): dy repeated over the summed dimensions, shaped as x (`input`,
//! `format`).
template <BackendTag B>
FloatTensor<B> sum_backward(const nn::Context<B>& ctx, const FloatTensor<B>& dy, const Shape& input, const Dims& dims = {},
                            MemoryFormat format = MemoryFormat::nchw) {
    return expand(ctx, dy, input, dims, format);
}

//! The backward of mean(x, dims): dy / count repeated over the averaged dimensions.
template <BackendTag B>
FloatTensor<B> mean_backward(const nn::Context<B>& ctx, const FloatTensor<B>& dy, const Shape& input, const Dims& dims = {},
                             MemoryFormat format = MemoryFormat::nchw) {
    const auto reduced = detail::dim_set(dims, input.rank(), "mean_backward");
    const std::int64_t count = detail::reduced_count(input, reduced);
    LOCKSTEP_CHECK_AS(ShapeError, count > 0, "ops::mean_backward: the reduced dimensions of ", input, " hold no elements");
    return expand(ctx, dy, input, dims, format, 1.0 / static_cast<double>(count));
}

// ---- softmax and argmax -----------------------------------------------------------------------

//! softmax along `dim`: exp(x - max) / sum exp(x - max) per line, in fp64; shaped as x.
template <BackendTag B>
FloatTensor<B> softmax(const nn::Context<B>& ctx, const FloatTensor<B>& x, int dim) {
    dim = detail::normalize_dim(dim, x.rank(), "softmax");
    FloatTensor<B> y(x.shape(), x.format(), x.device(), uninitialized);
    kernels::Ops<B>::softmax_forward(ctx.exec, detail::line_geometry(x.shape(), x.format(), dim), x, y);
    return y;
}

//! The backward of y = softmax(x, dim): dx = y (dy - sum(dy y)) along dim.
template <BackendTag B>
FloatTensor<B> softmax_backward(const nn::Context<B>& ctx, const FloatTensor<B>& y, const FloatTensor<B>& dy, int dim) {
    detail::check_same(y, dy, "softmax_backward", "dy");
    dim = detail::normalize_dim(dim, y.rank(), "softmax_backward");
    FloatTensor<B> dx(y.shape(), y.format(), y.device(), uninitialized);
    kernels::Ops<B>::softmax_backward(ctx.exec, detail::line_geometry(y.shape(), y.format(), dim), y, dy, dx);
    return dx;
}

//! The index of the largest element along `dim` (the first of equals; a NaN counts as largest),
//! as torch.argmax: shaped as x without `dim`, int64, on x's device. No backward.
template <BackendTag B>
Tensor<std::int64_t, B> argmax(const nn::Context<B>& ctx, const FloatTensor<B>& x, int dim) {
    dim = detail::normalize_dim(dim, x.rank(), "argmax");
    LOCKSTEP_CHECK_AS(ShapeError, x.dim(dim) > 0, "ops::argmax: dimension ", dim, " of ", x.shape(),
                      " is empty; an argmax over no elements is undefined");
    std::vector<bool> reduced(static_cast<std::size_t>(x.rank()), false);
    reduced[static_cast<std::size_t>(dim)] = true;
    Tensor<std::int64_t, B> index(detail::reduced_shape(x.shape(), reduced, false), MemoryFormat::nchw, x.device(),
                                  uninitialized);
    kernels::Ops<B>::argmax(ctx.exec, detail::line_geometry(x.shape(), x.format(), dim), x, index);
    return index;
}

// ---- concatenation ----------------------------------------------------------------------------

//! The tensors joined along `dim` (1: channels), as torch.cat: the same rank, memory format and
//! device, the same extents but along dim.
template <BackendTag B>
FloatTensor<B> concat(const nn::Context<B>& ctx, const std::vector<std::reference_wrapper<const FloatTensor<B>>>& parts,
                      int dim = 1) {
    LOCKSTEP_CHECK_AS(ShapeError, !parts.empty(), "ops::concat: nothing to join; give at least one tensor");
    const FloatTensor<B>& first = parts.front().get();
    dim = detail::normalize_dim(dim, first.rank(), "concat");
    std::int64_t total = 0;
    for (std::size_t j = 0; j < parts.size(); ++j) {
        const FloatTensor<B>& t = parts[j].get();
        LOCKSTEP_CHECK_AS(ShapeError, t.rank() == first.rank() && t.format() == first.format(), "ops::concat: tensor ", j,
                          " has shape ", t.shape(), " ", to_string(t.format()), " but tensor 0 ", first.shape(), " ",
                          to_string(first.format()), "; give them one rank and memory format");
        for (int d = 0; d < first.rank(); ++d)
            LOCKSTEP_CHECK_AS(ShapeError, d == dim || t.dim(d) == first.dim(d), "ops::concat: tensor ", j, " has shape ",
                              t.shape(), " but tensor 0 ", first.shape(), "; they may differ only along dimension ", dim);
        LOCKSTEP_CHECK_AS(UsageError, t.device() == first.device(), "ops::concat: tensor ", j, " is on ", t.device().str(),
                          " but tensor 0 on ", first.device().str(), "; move them to one device");
        total += t.dim(dim);
    }
    const Shape whole = first.shape().with(dim, total);
    FloatTensor<B> out(whole, first.format(), first.device(), uninitialized);
    std::int64_t offset = 0;
    for (const auto& part : parts) {
        const FloatTensor<B>& t = part.get();
        if (t.numel() > 0)
            kernels::Ops<B>::place(ctx.exec, detail::place_geometry(t.shape(), whole, t.format(), dim, offset), t, out);
        offset += t.dim(dim);
    }
    return out;
}

//! `x` cut along `dim` into pieces of the given extents (which add up to x's): concat's backward
//! (split(ctx, dy, {a.dim(1), b.dim(1)}) gives da and db).
template <BackendTag B>
std::vector<FloatTensor<B>> split(const nn::Context<B>& ctx, const FloatTensor<B>& x, const std::vector<std::int64_t>& sizes,
                                  int dim = 1) {
    dim = detail::normalize_dim(dim, x.rank(), "split");
    std::int64_t total = 0;
    for (std::int64_t s : sizes) {
        LOCKSTEP_CHECK_AS(ShapeError, s >= 0, "ops::split: a piece of extent ", s, "; give non-negative extents");
        total += s;
    }
    LOCKSTEP_CHECK_AS(ShapeError, total == x.dim(dim), "ops::split: the pieces' extents add up to ", total, " but dimension ",
                      dim, " of ", x.shape(), " is ", x.dim(dim), "; give extents that add up to it");
    std::vector<FloatTensor<B>> out;
    out.reserve(sizes.size());
    std::int64_t offset = 0;
    for (std::int64_t s : sizes) {
        const Shape part = x.shape().with(dim, s);
        out.emplace_back(part, x.format(), x.device(), uninitialized);
        if (out.back().numel() > 0)
            kernels::Ops<B>::take(ctx.exec, detail::place_geometry(part, x.shape(), x.format(), dim, offset), x, out.back());
        offset += s;
    }
    return out;
}

}  // namespace lockstep::ops
