// SPDX-License-Identifier: MIT
//! `nn::Dropout`: zeroes elements with probability p in training and scales the rest by 1/(1-p).
#pragma once

#include <cmath>
#include <cstdint>
#include <string>

#include "lockstep/core/error.hpp"
#include "lockstep/core/tensor.hpp"
#include "lockstep/kernels/ops.hpp"
#include "lockstep/nn/context.hpp"
#include "lockstep/nn/init.hpp"

namespace lockstep::nn {

//! torch.nn.Dropout(p): in training, y = x * (kept ? 1/(1-p) : 0) with each element kept with
//! probability 1 - p; in evaluation, y = x. The masks are a counter-based hash of (seed, the
//! replica's rank, the number of forwards this layer has made) and the element's index (Note
//! [pooling and dropout per element]): the same on every backend, reproducible from the seed,
//! different on every replica of a DataParallel and at every call.
template <BackendTag B = Host>
class Dropout {
    using K = kernels::Ops<B>;

public:
    using backend = B;

    //! p in [0, 1]; the seed drawn from `gen` (the default generator unless given).
    explicit Dropout(double p = 0.5, Generator& gen = default_generator()) : Dropout(p, gen.engine()()) {}
    Dropout(double p, std::uint64_t seed) : p_(p), seed_(seed) {
        LOCKSTEP_CHECK(p >= 0.0 && p <= 1.0, "Dropout: p is a probability in [0, 1], got ", p);
    }

    template <class V>
    void visit(V&&) {}
    std::string describe() const { return "Dropout(p=" + std::to_string(p_) + ")"; }
    double p() const noexcept { return p_; }
    //! The seed and the number of training forwards made: a layer copied with them draws the
    //! same masks as the original.
    std::uint64_t seed() const noexcept { return seed_; }
    std::uint64_t calls() const noexcept { return calls_; }

    Tensor<float, B> forward(const Context<B>& ctx, Tensor<float, B> x) {
        use_.enter(ctx, [&] { return describe(); });
        if (!ctx.training || p_ == 0.0) {
            mask_ = Tensor<std::uint8_t, B>();
            identity_ = true;
            return x;
        }
        draw_ = draw(ctx.rank, calls_++);
        mask_ = Tensor<std::uint8_t, B>::empty_like(x);
        identity_ = false;
        K::dropout_forward(ctx.exec, x, draw_, mask_);
        return x;
    }

    Tensor<float, B> backward(const Context<B>& ctx, const Tensor<float, B>& dy) {
        if (identity_) return dy;
        LOCKSTEP_CHECK_AS(ShapeError, dy.shape() == mask_.shape(), describe(), ": dy has shape ", dy.shape(),
                          " but the forward input had ", mask_.shape(),
                          mask_.numel() == 0 && dy.numel() != 0 ? " (no training-mode forward before backward?)" : "");
        auto dx = Tensor<float, B>::empty_like(dy);
        K::dropout_backward(ctx.exec, dy, mask_, draw_, dx);
        mask_ = Tensor<std::uint8_t, B>();
        return dx;
    }

private:
    OneUse use_;  // Note [one instance, one use]
    kernels::DropoutDraw draw(int rank, std::uint64_t call) const {
        kernels::DropoutDraw d;
        d.seed = seed_;
        d.key = (static_cast<std::uint64_t>(rank) << 40) ^ call;
        d.threshold = static_cast<std::uint32_t>(std::llround(p_ * 16777216.0));  // 2^24
        d.scale = p_ < 1.0 ? static_cast<float>(1.0 / (1.0 - p_)) : 0.0f;
        return d;
    }

    double p_;
    std::uint64_t seed_;
    std::uint64_t calls_ = 0;
    kernels::DropoutDraw draw_{};
    Tensor<std::uint8_t, B> mask_;
    bool identity_ = true;
};

}  // namespace lockstep::nn
