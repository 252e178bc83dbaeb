// SPDX-License-Identifier: MIT
//! `nn::LayerNorm`: torch.nn.LayerNorm over an input's trailing dimensions.
#pragma once

#include <cstdint>
#include <string>

#include "lockstep/core/error.hpp"
#include "lockstep/core/tensor.hpp"
#include "lockstep/kernels/ops.hpp"
#include "lockstep/nn/context.hpp"
#include "lockstep/nn/init.hpp"
#include "lockstep/nn/parameter.hpp"

namespace lockstep::nn {

struct LayerNormOptions {
    double eps = 1e-5;
    //! A weight (ones) and a bias (zeros) of the normalized shape, as PyTorch's elementwise_affine.
    bool elementwise_affine = true;
};

//! torch.nn.LayerNorm(normalized_shape): each sample's trailing dimensions, whose shape is
//! `normalized_shape`, normalized to zero mean and unit variance (biased), then scaled and
//! shifted per element. Statistics per sample, so replicas need no communication. State-dict
//! names "weight" and "bias". (Note [layer norm per row] in kernels/norm_math.hpp.)
template <BackendTag B = Host>
class LayerNorm {
    using K = kernels::Ops<B>;

public:
    using backend = B;

    explicit LayerNorm(Shape normalized_shape, LayerNormOptions options = {}) : shape_(normalized_shape), options_(options) {
        LOCKSTEP_CHECK(normalized_shape.rank() > 0 && normalized_shape.numel() > 0,
                       "LayerNorm needs a normalized shape of at least one element, got ", normalized_shape);
        LOCKSTEP_CHECK(options.eps > 0, "LayerNorm: eps must be > 0, got ", options.eps);
        if (options.elementwise_affine) {
            weight = Parameter<B>(normalized_shape);
            bias = Parameter<B>(normalized_shape);
            fill_value(weight.value, 1.0f);
        }
    }
    //! LayerNorm over the last dimension of `features` values.
    explicit LayerNorm(std::int64_t features, LayerNormOptions options = {}) : LayerNorm(Shape{features}, options) {}

    Parameter<B> weight;
    Parameter<B> bias;

    template <class V>
    void visit(V&& v) {
        if (!options_.elementwise_affine) return;
        v.parameter("weight", weight);
        v.parameter("bias", bias);
    }
    std::string describe() const { return "LayerNorm(" + dims() + ")"; }

    Tensor<float, B> forward(const Context<B>& ctx, Tensor<float, B> x) {
        use_.enter(ctx, [&] { return describe(); });
        check_input(x);
        const std::int64_t rows = x.numel() / shape_.numel();
        Tensor<float, B> y(x.shape(), x.format(), x.device(), uninitialized);
        Tensor<float, B> mean(Shape{rows}, MemoryFormat::nchw, x.device(), uninitialized);
        Tensor<float, B> rstd(Shape{rows}, MemoryFormat::nchw, x.device(), uninitialized);
        K::layer_norm_forward(ctx.exec, x, shape_.numel(), affine(weight), affine(bias), options_.eps, y, mean, rstd);
        if (ctx.training) {
            x_ = std::move(x);
            mean_ = std::move(mean);
            rstd_ = std::move(rstd);
        }
        return y;
    }

    Tensor<float, B> backward(const Context<B>& ctx, const Tensor<float, B>& dy) {
        LOCKSTEP_CHECK_AS(UsageError, x_.numel() > 0 || dy.numel() == 0, describe(),
                          ": backward without a training-mode forward before it");
        LOCKSTEP_CHECK_AS(ShapeError, dy.shape() == x_.shape(), describe(), ": dy has shape ", dy.shape(),
                          " but the forward input had ", x_.shape());
        Tensor<float, B> dx(dy.shape(), dy.format(), dy.device(), uninitialized);
        K::layer_norm_backward(ctx.exec, x_, dy, shape_.numel(), affine(weight), mean_, rstd_, dx, affine_grad(weight),
                               affine_grad(bias));
        if (options_.elementwise_affine) {
            ctx.mark_grad_ready(&weight);
            ctx.mark_grad_ready(&bias);
        }
        x_ = Tensor<float, B>();
        return dx;
    }

private:
    OneUse use_;  // Note [one instance, one use]
    void check_input(const Tensor<float, B>& x) const {
        const int k = shape_.rank();
        bool fits = x.rank() > k && x.format() == MemoryFormat::nchw;
        for (int d = 0; fits && d < k; ++d) fits = x.dim(x.rank() - k + d) == shape_[d];
        LOCKSTEP_CHECK_AS(ShapeError, fits, describe(), ": expected an input (N, ..., ", dims(),
                          ") with the normalized shape last (row-major), got ", x.shape(), " ", to_string(x.format()));
    }
    // The normalized shape's sizes, "2, 5".
    std::string dims() const {
        const std::string s = shape_.str();  // "(2, 5)"
        return s.substr(1, s.size() - 2);
    }
    const Tensor<float, B>* affine(const Parameter<B>& p) const { return options_.elementwise_affine ? &p.value : nullptr; }
    Tensor<float, B>* affine_grad(Parameter<B>& p) { return options_.elementwise_affine ? &p.grad : nullptr; }

    Shape shape_;
    LayerNormOptions options_;
    Tensor<float, B> x_, mean_, rstd_;
};

}  // namespace lockstep::nn
