// SPDX-License-Identifier: MIT
//! `nn::SyncBatchNorm`: batch normalization with statistics over the global batch of all replicas.
#pragma once

#include <cmath>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "lockstep/core/error.hpp"
#include "lockstep/core/tensor.hpp"
#include "lockstep/kernels/batch_norm_host.hpp"
#include "lockstep/kernels/batch_norm_math.hpp"
#include "lockstep/nn/context.hpp"
#include "lockstep/nn/parameter.hpp"
#include "lockstep/nn/site.hpp"

namespace lockstep::nn {

//! Options of `SyncBatchNorm`, PyTorch's defaults. `momentum = std::nullopt` gives the
//! cumulative average (factor 1 / num_batches_tracked), as PyTorch's `momentum=None`.
struct BatchNormOptions {
    double eps = 1e-5;
    std::optional<double> momentum = 0.1;
    bool affine = true;
    bool track_running_stats = true;
    //! Memory format of 4-D inputs (2-D inputs (N, C) have one layout).
    MemoryFormat format = MemoryFormat::nchw;
};

// Note [one collective per direction]
// Training forward makes exactly one all-reduce of 2C+1 fp64 values (sums and the count),
// backward exactly one of 2C values, whatever the number of replicas: counts come from the
// all-reduce, so uneven and empty shards are exact and an empty replica still joins both.
// Every replica finishes the statistics from identical bits, so each updates its own running
// statistics once per step and they stay bit-identical without a broadcast.
// NaN in the input propagates to the output and to the running statistics, as in PyTorch: no
// clamping hides it.

//! Batch norm over (N, C) or (N, C, H, W) inputs with statistics of the whole global batch.
//! Parameters and buffers as PyTorch's BatchNorm: `weight`, `bias`, `running_mean`,
//! `running_var`, `num_batches_tracked`.
template <BackendTag B = Host>
class SyncBatchNorm {
    static_assert(std::same_as<B, Host>, "SyncBatchNorm<Cuda> lives in <lockstep/cuda.cuh>");

public:
    using backend = B;

    explicit SyncBatchNorm(std::int64_t num_features, BatchNormOptions options = {})
        : options_(options), channels_(num_features), site_(detail::next_site()) {
        LOCKSTEP_CHECK(num_features > 0, "SyncBatchNorm needs num_features > 0, got ", num_features);
        LOCKSTEP_CHECK(options.eps > 0, "SyncBatchNorm eps must be positive, got ", options.eps);
        LOCKSTEP_CHECK(!options.momentum || (*options.momentum >= 0 && *options.momentum <= 1),
                       "SyncBatchNorm momentum must be in [0, 1], got ", options.momentum.value_or(0));
        if (options.affine) {
            weight = Parameter<B>(Shape{num_features});
            bias = Parameter<B>(Shape{num_features});
            for (auto& w : weight.value.span()) w = 1.0f;
        }
        if (options.track_running_stats) {
            running_mean = Tensor<float, B>(Shape{num_features});
            running_var = Tensor<float, B>(Shape{num_features});
            num_batches_tracked = Tensor<std::int64_t, B>(Shape{});
            for (auto& v : running_var.span()) v = 1.0f;
        }
    }

    Parameter<B> weight;
    Parameter<B> bias;
    Tensor<float, B> running_mean;
    Tensor<float, B> running_var;
    Tensor<std::int64_t, B> num_batches_tracked;

    std::int64_t num_features() const noexcept { return channels_; }
    const BatchNormOptions& options() const noexcept { return options_; }
    std::string describe() const { return "SyncBatchNorm(" + std::to_string(channels_) + ")"; }

    template <class V>
    void visit(V&& v) {
        if (options_.affine) {
            v.parameter("weight", weight);
            v.parameter("bias", bias);
        }
        if (options_.track_running_stats) {
            v.buffer("running_mean", running_mean);
            v.buffer("running_var", running_var);
            v.buffer("num_batches_tracked", num_batches_tracked);
        }
    }

    //! Takes `x` by value: it is kept for backward, so pass an rvalue to avoid a copy.
    Tensor<float, B> forward(const Context& ctx, Tensor<float, B> x) {
        const auto g = geometry(x);
        const std::int64_t C = channels_;
        const bool batch_stats = ctx.training || !options_.track_running_stats;
        saved_x_ = Tensor<float, B>();
        mean_hi_.assign(static_cast<std::size_t>(C), 0.0f);
        mean_lo_.assign(static_cast<std::size_t>(C), 0.0f);
        mean_.assign(static_cast<std::size_t>(C), 0.0);
        invstd_.assign(static_cast<std::size_t>(C), 0.0);
        if (batch_stats) {
            const kernels::bn::ForwardPayload layout{C};
            auto& payload = payload_;  // (2C+1), filled by bn_local_stats
            payload.resize(static_cast<std::size_t>(layout.size()));
            std::vector<float> shift(static_cast<std::size_t>(C), 0.0f);
            if (options_.track_running_stats) shift.assign(running_mean.data(), running_mean.data() + C);
            kernels::host::bn_local_stats(x.data(), g, shift.data(), payload.data());
            if (ctx.comm != nullptr) ctx.comm->all_reduce_sum(std::span<double>(payload), site_);
            const double n = payload[static_cast<std::size_t>(layout.count())];
            LOCKSTEP_CHECK(!ctx.training || n > 1, describe(), ": expected more than 1 value per channel when training, got input size ",
                           x.shape(), " (", static_cast<std::int64_t>(n), " value(s) per channel over all replicas)");
            count_ = n;
            const bool update = ctx.training && options_.track_running_stats;
            double factor = options_.momentum.value_or(0.0);
            if (update) {
                num_batches_tracked[0] += 1;
                if (!options_.momentum) factor = 1.0 / static_cast<double>(num_batches_tracked[0]);
            }
            for (std::int64_t c = 0; c < C; ++c) {
                const auto uc = static_cast<std::size_t>(c);
                const auto st = kernels::bn::finish(n, payload[static_cast<std::size_t>(layout.sum(c))],
                                                    payload[static_cast<std::size_t>(layout.sum_sq(c))], shift[uc],
                                                    options_.eps);
                mean_[uc] = st.mean;
                invstd_[uc] = st.invstd;
                if (update) kernels::bn::update_running(running_mean[c], running_var[c], st, n, factor);
            }
        } else {
            for (std::int64_t c = 0; c < C; ++c) {
                const auto uc = static_cast<std::size_t>(c);
                mean_[uc] = running_mean[c];
                invstd_[uc] = 1.0 / std::sqrt(static_cast<double>(running_var[c]) + options_.eps);
            }
        }
        std::vector<float> scale(static_cast<std::size_t>(C)), shift(static_cast<std::size_t>(C));
        for (std::int64_t c = 0; c < C; ++c) {
            const auto uc = static_cast<std::size_t>(c);
            const auto split = kernels::bn::split_mean(mean_[uc]);
            mean_hi_[uc] = split.hi;
            mean_lo_[uc] = split.lo;
            const auto k = kernels::bn::normalize_constants(mean_[uc], invstd_[uc], options_.affine ? weight.value[c] : 1.0,
                                                            options_.affine ? bias.value[c] : 0.0);
            scale[uc] = k.scale;
            shift[uc] = k.shift;
        }
        auto y = Tensor<float, B>::empty_like(x);
        kernels::host::bn_normalize(x.data(), y.data(), g, mean_hi_.data(), scale.data(), shift.data());
        if (ctx.training) {
            saved_x_ = std::move(x);
            saved_batch_stats_ = batch_stats;
        }
        return y;
    }

    Tensor<float, B> backward(const Context& ctx, const Tensor<float, B>& dy) {
        LOCKSTEP_CHECK_AS(UsageError, saved_x_.rank() >= 2, describe(),
                          ": backward called without a training-mode forward before it");
        LOCKSTEP_CHECK_AS(ShapeError, dy.shape() == saved_x_.shape() && dy.format() == saved_x_.format(), describe(),
                          ": dy has shape ", dy.shape(), " ", to_string(dy.format()), " but the forward input had ",
                          saved_x_.shape(), " ", to_string(saved_x_.format()));
        LOCKSTEP_CHECK_AS(UsageError, saved_batch_stats_, describe(),
                          ": backward through running statistics (eval mode) is not supported; call train() first");
        const auto g = geometry(saved_x_);
        const std::int64_t C = channels_;
        const kernels::bn::BackwardPayload layout{C};
        auto& payload = payload_;  // (2C), filled by bn_backward_sums
        payload.resize(static_cast<std::size_t>(layout.size()));
        kernels::host::bn_backward_sums(saved_x_.data(), dy.data(), g, mean_hi_.data(), mean_lo_.data(), payload.data());
        if (options_.affine) {  // local sums: the gradient all-reduce adds them over replicas
            for (std::int64_t c = 0; c < C; ++c) {
                weight.grad[c] += static_cast<float>(payload[static_cast<std::size_t>(layout.sum_dy_xmu(c))] *
                                                     invstd_[static_cast<std::size_t>(c)]);
                bias.grad[c] += static_cast<float>(payload[static_cast<std::size_t>(layout.sum_dy(c))]);
            }
            ctx.mark_grad_ready(&weight);
            ctx.mark_grad_ready(&bias);
        }
        if (ctx.comm != nullptr) ctx.comm->all_reduce_sum(std::span<double>(payload), site_ + 1);
        std::vector<float> ka(static_cast<std::size_t>(C)), kb(static_cast<std::size_t>(C)), kc(static_cast<std::size_t>(C));
        for (std::int64_t c = 0; c < C; ++c) {
            const auto uc = static_cast<std::size_t>(c);
            const auto k = kernels::bn::backward_constants(count_, payload[static_cast<std::size_t>(layout.sum_dy(c))],
                                                           payload[static_cast<std::size_t>(layout.sum_dy_xmu(c))], mean_[uc],
                                                           invstd_[uc], options_.affine ? weight.value[c] : 1.0);
            ka[uc] = k.a;
            kb[uc] = k.b;
            kc[uc] = k.c;
        }
        // dx overwrites the saved input, which nothing needs after this: a step holds one tensor
        // less, and dx is written to cache lines the same pass has just read.
        auto dx = std::move(saved_x_);
        kernels::host::bn_backward_dx(dx.data(), dy.data(), dx.data(), g, mean_hi_.data(), ka.data(), kb.data(),
                                      kc.data());
        saved_x_ = Tensor<float, B>();
        return dx;
    }

private:
    kernels::host::BnGeometry geometry(const Tensor<float, B>& x) const {
        LOCKSTEP_CHECK_AS(ShapeError, x.rank() == 2 || x.rank() == 4, describe(),
                          ": expected a 2-D (N, C) or 4-D (N, C, H, W) input, got shape ", x.shape());
        LOCKSTEP_CHECK_AS(ShapeError, x.dim(1) == channels_, describe(), ": expected ", channels_,
                          " channels, got input of shape ", x.shape());
        if (x.rank() == 4)
            LOCKSTEP_CHECK_AS(ShapeError, x.format() == options_.format, describe(), " was built for ",
                              to_string(options_.format), " input but got an ", to_string(x.format()),
                              " tensor of shape ", x.shape(), "; set BatchNormOptions::format or convert the input");
        kernels::host::BnGeometry g;
        g.batch = x.dim(0);
        g.channels = channels_;
        g.inner = x.rank() == 4 ? x.dim(2) * x.dim(3) : 1;
        g.channels_last = x.rank() == 2 || g.inner == 1 || x.format() == MemoryFormat::nhwc;
        return g;
    }

    BatchNormOptions options_;
    std::int64_t channels_;
    std::uint64_t site_;
    // What backward needs from forward.
    Tensor<float, B> saved_x_;
    bool saved_batch_stats_ = false;
    std::vector<double> mean_, invstd_;
    std::vector<float> mean_hi_, mean_lo_;  // the mean as hi + lo: see Note [split mean]
    // The all-reduce buffer outlives each call: a peer that is still reading it when this replica
    // leaves an aborted collective reads memory that is still ours.
    std::vector<double> payload_;
    double count_ = 0;
};

}  // namespace lockstep::nn
