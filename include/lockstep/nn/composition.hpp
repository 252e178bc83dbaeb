// SPDX-License-Identifier: MIT
//! Composition: `nn::Identity`, `nn::Add` (two branches on one input, summed) and
//! `nn::Residual` (y = act(branch(x) + shortcut(x))), with their backward written once.
#pragma once

#include <string>
#include <type_traits>
#include <utility>

#include "lockstep/core/error.hpp"
#include "lockstep/core/tensor.hpp"
#include "lockstep/kernels/ops.hpp"
#include "lockstep/nn/activation.hpp"
#include "lockstep/nn/context.hpp"
#include "lockstep/nn/module.hpp"

namespace lockstep::nn {

// Note [branches]
// A module of two branches on one input (Add, Residual) gives each branch its own copy of x (a
// branch may work in place on what it is given, as ReLU does), sums the outputs into the first,
// and in backward hands the same dy to both branches and sums their dx: the gradient of the skip
// is the second term, the one a hand-written residual backward forgets. Backward runs the
// second branch first: it is listed last by visit(), so its parameters' buckets come first
// (Note [gradient buckets]). One instance runs once per forward: a layer keeps what its backward
// needs from its last forward, so a layer reused twice in one forward would give the first use's
// backward the second use's state; make two instances (they may share nothing).

//! y = x; dy passes through. The shortcut of a Residual without a projection.
template <BackendTag B = Host>
class Identity {
public:
    using backend = B;
    template <class V>
    void visit(V&&) {}
    Tensor<float, B> forward(const Context<B>&, Tensor<float, B> x) { return x; }
    Tensor<float, B> backward(const Context<B>&, const Tensor<float, B>& dy) { return dy; }
};

namespace detail {

template <class B>
void check_sum_shapes(const Tensor<float, B>& a, const Tensor<float, B>& b, const char* who, const char* what) {
    LOCKSTEP_CHECK_AS(ShapeError, a.shape() == b.shape() && a.format() == b.format(), who, ": the branches' ", what,
                      " have shapes ", a.shape(), " ", to_string(a.format()), " and ", b.shape(), " ", to_string(b.format()),
                      "; both branches must give the same shape and layout (a projection on the shortcut makes them agree)");
}

// left(x) + right(x), each on its own copy of x (Note [branches]).
template <class L, class R, class B>
Tensor<float, B> branches_forward(L& left, R& right, const Context<B>& ctx, Tensor<float, B> x, const char* who) {
    Tensor<float, B> copy = x;
    auto a = left.forward(ctx, std::move(x));
    auto b = right.forward(ctx, std::move(copy));
    check_sum_shapes(a, b, who, "outputs");
    kernels::Ops<B>::add(ctx.exec, a, b);
    return a;
}

// left.backward(dy) + right.backward(dy), the right branch first (Note [branches]).
template <class L, class R, class B>
Tensor<float, B> branches_backward(L& left, R& right, const Context<B>& ctx, const Tensor<float, B>& dy, const char* who) {
    auto db = right.backward(ctx, dy);
    auto da = left.backward(ctx, dy);
    check_sum_shapes(da, db, who, "input gradients");
    if (da.is_view()) da = Tensor<float, B>(da);  // an Identity branch hands dy itself back
    kernels::Ops<B>::add(ctx.exec, da, db);
    return da;
}

}  // namespace detail

//! y = left(x) + right(x): two branches on the same input, summed (same shape and layout).
//! Its children are named "0" and "1", as in a torch.nn.ModuleList.
template <class Left, class Right>
class Add {
public:
    using backend = typename Left::backend;
    static_assert(std::is_same_v<backend, typename Right::backend>, "lockstep: nn::Add's branches must run on one backend");

    Add(Left left, Right right) : left_(std::move(left)), right_(std::move(right)) {}

    Tensor<float, backend> forward(const Context<backend>& ctx, Tensor<float, backend> x) {
        return detail::branches_forward(left_, right_, ctx, std::move(x), "Add");
    }
    Tensor<float, backend> backward(const Context<backend>& ctx, const Tensor<float, backend>& dy) {
        return detail::branches_backward(left_, right_, ctx, dy, "Add");
    }
    template <class V>
    void visit(V&& v) {
        v.module("0", left_);
        v.module("1", right_);
    }
    Left& left() noexcept { return left_; }
    Right& right() noexcept { return right_; }

private:
    Left left_;
    Right right_;
};

struct ResidualOptions {
    //! y = relu(branch(x) + shortcut(x)), as ResNet's blocks; false: the sum alone.
    bool relu = true;
};

//! A residual block: y = relu(branch(x) + shortcut(x)), the shortcut the identity unless a
//! projection (a strided 1x1 Conv2d and its batch norm, say) is given. Children are named
//! "branch" and "shortcut".
template <class Branch, class Shortcut = Identity<typename Branch::backend>>
class Residual {
public:
    using backend = typename Branch::backend;
    static_assert(std::is_same_v<backend, typename Shortcut::backend>,
                  "lockstep: nn::Residual's branch and shortcut must run on one backend");

    explicit Residual(Branch branch, ResidualOptions options = {}) requires std::is_same_v<Shortcut, Identity<backend>>
        : branch_(std::move(branch)), options_(options) {}
    Residual(Branch branch, Shortcut shortcut, ResidualOptions options = {})
        : branch_(std::move(branch)), shortcut_(std::move(shortcut)), options_(options) {}

    Tensor<float, backend> forward(const Context<backend>& ctx, Tensor<float, backend> x) {
        auto y = detail::branches_forward(branch_, shortcut_, ctx, std::move(x), "Residual");
        return options_.relu ? relu_.forward(ctx, std::move(y)) : y;
    }
    Tensor<float, backend> backward(const Context<backend>& ctx, const Tensor<float, backend>& dy) {
        if (!options_.relu) return detail::branches_backward(branch_, shortcut_, ctx, dy, "Residual");
        return detail::branches_backward(branch_, shortcut_, ctx, relu_.backward(ctx, dy), "Residual");
    }
    template <class V>
    void visit(V&& v) {
        v.module("branch", branch_);
        v.module("shortcut", shortcut_);
    }
    Branch& branch() noexcept { return branch_; }
    Shortcut& shortcut() noexcept { return shortcut_; }

private:
    Branch branch_;
    Shortcut shortcut_{};
    ReLU<backend> relu_;
    ResidualOptions options_;
};

}  // namespace lockstep::nn
