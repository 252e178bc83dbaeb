// SPDX-License-Identifier: MIT
//! `nn::SyncBatchNorm`: batch normalization with statistics over the global batch of all replicas.
#pragma once

#include <cmath>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "lockstep/comm/collective_tag.hpp"
#include "lockstep/core/activation.hpp"
#include "lockstep/core/bfloat16.hpp"
#include "lockstep/core/device_span.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/tensor.hpp"
#include "lockstep/kernels/ops.hpp"
#include "lockstep/nn/activation_precision.hpp"
#include "lockstep/nn/context.hpp"
#include "lockstep/nn/init.hpp"
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
    //! Apply ReLU to the output in the same passes (batch norm + ReLU in one layer; backward
    //! masks dy by the output's sign). See Note [fused batch norm + ReLU].
    bool fused_relu = false;
};

// Note [fixed-size collectives]
// Training forward makes exactly two all-reduces, of C+1 and 2C fp64 values (the channels'
// totals and the count, then the sums about the batch's shift: Note [shifted statistics]), and
// backward one of 2C values, whatever the number of replicas: counts come from the all-reduce,
// so uneven and empty shards are exact and an empty replica still joins all three.
// Every replica finishes the statistics from identical bits, so each updates its own running
// statistics once per step and they stay bit-identical without a broadcast.
// NaN in the input propagates to the output and to the running statistics, as in PyTorch: no
// clamping hides it.

//! Batch norm over (N, C) or (N, C, H, W) inputs with statistics of the whole global batch.
//! Parameters and buffers as PyTorch's BatchNorm: `weight`, `bias`, `running_mean`,
//! `running_var`, `num_batches_tracked`. Statistics stay on the layer's device: the payloads and
//! per-channel constants are tensors of backend B, made and read only by backend operations.
template <BackendTag B = Host>
class SyncBatchNorm {
    using K = kernels::Ops<B>;

public:
    using backend = B;

    explicit SyncBatchNorm(std::int64_t num_features, BatchNormOptions options = {})
        : options_(options), channels_(num_features), layer_id_(detail::next_layer_id()) {
        LOCKSTEP_CHECK(num_features > 0, "SyncBatchNorm needs num_features > 0, got ", num_features);
        LOCKSTEP_CHECK(options.eps > 0, "SyncBatchNorm eps must be positive, got ", options.eps);
        LOCKSTEP_CHECK(!options.momentum || (*options.momentum >= 0 && *options.momentum <= 1),
                       "SyncBatchNorm momentum must be in [0, 1], got ", options.momentum.value_or(0));
        if (options.affine) {
            weight = Parameter<B>(Shape{num_features});
            bias = Parameter<B>(Shape{num_features}, weight.value.device());
            fill_value(weight.value, 1.0f);
        }
        if (options.track_running_stats) {
            running_mean = Tensor<float, B>(Shape{num_features});
            running_var = Tensor<float, B>(Shape{num_features}, MemoryFormat::nchw, running_mean.device());
            num_batches_tracked = Tensor<std::int64_t, B>(Shape{}, MemoryFormat::nchw, running_mean.device());
            fill_value(running_var, 1.0f);
        }
    }

    Parameter<B> weight;
    Parameter<B> bias;
    Tensor<float, B> running_mean;
    Tensor<float, B> running_var;
    Tensor<std::int64_t, B> num_batches_tracked;

    std::int64_t num_features() const noexcept { return channels_; }
    const BatchNormOptions& options() const noexcept { return options_; }
    std::string describe() const {
        return "SyncBatchNorm(" + std::to_string(channels_) + (options_.fused_relu ? ", fused_relu" : "") + ")";
    }

    //! The id this layer's collectives carry (Note [layer ids]): drawn at construction, given by
    //! its place in the module where DataParallel numbers its replicas' layers.
    void set_layer_id(std::uint64_t id) noexcept { layer_id_ = id; }
    std::uint64_t layer_id() const noexcept { return layer_id_; }

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

    //! Takes `x` by value: it is kept for backward, so pass an rvalue to avoid a copy. fp32 on
    //! every backend; on CUDA also fp16 and bf16 storage (`Tensor<__half, Cuda>`,
    //! `Tensor<__nv_bfloat16, Cuda>`, `Tensor<BFloat16, Cuda>`), with fp32 math, statistics and
    //! parameters.
    template <class T = float>
    requires kernels::bn_storage<B, T> Tensor<T, B> forward(const Context<B>& ctx, Tensor<T, B> x) {
        use_.enter(ctx, [&] { return describe(); });
        const auto g = geometry(x);
        const bool batch_stats = ctx.training || !options_.track_running_stats;
        LOCKSTEP_CHECK_AS(UsageError, !batch_stats || ctx.world <= 1 || ctx.comm != nullptr, describe(),
                          ": the context says world ", ctx.world,
                          " but has no communicator; give each replica's context "
                          "its replica group (ctx.comm), or use world 1 for a replica alone");
        if (options_.affine) check_device(weight.value.device(), x.device(), describe() + ": the input");
        if (options_.track_running_stats) check_device(running_mean.device(), x.device(), describe() + ": the input");
        drop_saved();
        prepare(x.device());
        if (batch_stats) {
            const kernels::bn::ForwardPayload layout{channels_};
            K::bn_local_stats(ctx.exec, x, g, constants_, forward_payload_);
            if (ctx.comm != nullptr)
                ctx.comm->all_reduce_sum(payload_part(layout.first_offset(), layout.first_size()),
                                         comm::CollectiveSite::layer(layer_id_, 0));
            check_count(ctx, x, g);
            K::bn_centre(ctx.exec, g, constants_, forward_payload_);
            if (ctx.comm != nullptr)
                ctx.comm->all_reduce_sum(payload_part(0, layout.second_size()), comm::CollectiveSite::layer(layer_id_, 2));
            const kernels::BnFinishOptions finish{options_.eps, options_.momentum, ctx.training && options_.track_running_stats};
            const bool track = options_.track_running_stats;
            K::bn_forward_finish(ctx.exec, forward_payload_, finish, track ? &running_mean : nullptr,
                                 track ? &running_var : nullptr, track ? &num_batches_tracked : nullptr, affine_weight(),
                                 options_.affine ? &bias.value : nullptr, constants_);
        } else {
            K::bn_eval_constants(ctx.exec, running_mean, running_var, options_.eps, affine_weight(),
                                 options_.affine ? &bias.value : nullptr, constants_);
        }
        auto y = Tensor<T, B>::empty_like(x);
        // A backend that keeps the fused ReLU's mask gets one (the host); CUDA finds it again from
        // x in backward (Note [ReLU mask from x]).
        const bool keep_mask = options_.fused_relu && ctx.training && K::bn_keeps_relu_mask;
        if (keep_mask) relu_mask_ = Tensor<std::uint8_t, B>::empty_like(x);
        K::bn_normalize(ctx.exec, x, y, g, constants_, options_.fused_relu, keep_mask ? &relu_mask_ : nullptr);
        if (ctx.training) {
            save(std::move(x));
            saved_batch_stats_ = batch_stats;
        }
        return y;
    }

    //! dx for dy of the forward's storage type.
    template <class T = float>
    requires kernels::bn_storage<B, T> Tensor<T, B> backward(const Context<B>& ctx, const Tensor<T, B>& dy) {
        LOCKSTEP_CHECK_AS(UsageError, saved_rank() >= 2, describe(),
                          ": backward called without a training-mode forward before it");
        LOCKSTEP_CHECK_AS(UsageError, saved_size_ == sizeof(T), describe(), ": dy has ", sizeof(T) * 8,
                          "-bit elements but the forward input had ", saved_size_ * 8, "; pass dy in the input's type");
        Tensor<T, B> saved = take_saved<T>();
        LOCKSTEP_CHECK_AS(ShapeError, dy.shape() == saved.shape() && dy.format() == saved.format(), describe(), ": dy has shape ",
                          dy.shape(), " ", to_string(dy.format()), " but the forward input had ", saved.shape(), " ",
                          to_string(saved.format()));
        LOCKSTEP_CHECK_AS(UsageError, saved_batch_stats_, describe(),
                          ": backward through running statistics (eval mode) is not supported; call train() first");
        check_device(saved.device(), dy.device(), describe() + ": dy");
        const auto g = geometry(saved);
        const bool relu = options_.fused_relu;
        const Tensor<std::uint8_t, B>* mask = relu && K::bn_keeps_relu_mask ? &relu_mask_ : nullptr;
        K::bn_backward_sums(ctx.exec, saved, dy, relu, mask, g, constants_, backward_payload_);
        if (options_.affine) {  // local sums: the gradient all-reduce adds them over replicas
            K::bn_param_grads(ctx.exec, backward_payload_, constants_, weight.grad, bias.grad);
            ctx.mark_grad_ready(&weight);
            ctx.mark_grad_ready(&bias);
        }
        if (ctx.comm != nullptr)
            ctx.comm->all_reduce_sum(DeviceSpan(backward_payload_), comm::CollectiveSite::layer(layer_id_, 1));
        // dx overwrites the saved input, which nothing needs after this: a step holds one tensor
        // less, and dx is written to cache lines the same pass has just read.
        auto dx = std::move(saved);
        K::bn_backward_dx(ctx.exec, backward_payload_, constants_, affine_weight(), dx, dy, relu, mask, g);
        relu_mask_ = Tensor<std::uint8_t, B>();
        return dx;
    }

    //! The activation protocol where the backend normalizes bf16 storage (Note [activation
    //! precision]): y and dx in the type of x and dy; statistics and parameters in fp32/fp64.
    Activation<B> forward(const Context<B>& ctx, Activation<B> x) requires kernels::bn_storage<B, BFloat16> {
        return x.visit([&](auto& t) { return Activation<B>(forward(ctx, std::move(t))); });
    }
    Activation<B> backward(const Context<B>& ctx, const Activation<B>& dy) requires kernels::bn_storage<B, BFloat16> {
        const Precision gave = saved_size_ == 2 ? Precision::bf16 : Precision::fp32;  // the forward's output type
        if (saved_size_ != 0 && dy.precision() != gave) return backward(ctx, converted(ctx, dy, gave));
        return dy.visit([&](const auto& t) { return Activation<B>(backward(ctx, t)); });
    }

private:
    OneUse use_;  // Note [one instance, one use]
    // Training needs more than one value per channel over all replicas. A replica that holds more
    // than one itself knows that without asking; only one that holds at most one reads the global
    // count (a device read on CUDA). The global count is the same everywhere, so every replica
    // decides alike: where it is 1 or less, each replica holds at most one value and all read.
    template <class T>
    void check_count(const Context<B>& ctx, const Tensor<T, B>& x, const kernels::BnGeometry& g) const {
        if (!ctx.training || g.per_channel() > 1) return;
        const double n = K::read(ctx.exec, forward_payload_, kernels::bn::ForwardPayload{channels_}.count());
        LOCKSTEP_CHECK(n > 1, describe(), ": expected more than 1 value per channel when training, got input size ", x.shape(),
                       " (", static_cast<std::int64_t>(n), " value(s) per channel over all replicas)");
    }

    //! `count` values of the forward payload from `offset`: what one of its all-reduces covers.
    DeviceSpan<double> payload_part(std::int64_t offset, std::int64_t count) {
        return DeviceSpan(forward_payload_).subspan(static_cast<std::size_t>(offset), static_cast<std::size_t>(count));
    }

    const Tensor<float, B>* affine_weight() const { return options_.affine ? &weight.value : nullptr; }

    // Sizes the payloads and constants for the layer's channels on `device` (once; again only if
    // the input moves to another device).
    void prepare(const Device& device) {
        const kernels::bn::ForwardPayload layout{channels_};
        if (forward_payload_.numel() == layout.size() && forward_payload_.device() == device) return;
        forward_payload_ = Tensor<double, B>(Shape{layout.size()}, MemoryFormat::nchw, device);
        backward_payload_ = Tensor<double, B>(Shape{2 * channels_}, MemoryFormat::nchw, device);
        constants_.stats = Tensor<double, B>(Shape{2 * channels_ + 1}, MemoryFormat::nchw, device);
        constants_.folded = Tensor<float, B>(Shape{4 * channels_}, MemoryFormat::nchw, device);
    }

    // The training forward's input, kept for backward: fp32 as is, 16-bit types as their bits
    // (their types are CUDA's, not nameable here).
    template <class T>
    void save(Tensor<T, B>&& x) {
        if constexpr (std::same_as<T, float>)
            saved_x_ = std::move(x);
        else
            saved_x16_ = std::move(x).template bitcast<std::uint16_t>();
        saved_size_ = sizeof(T);
    }
    template <class T>
    Tensor<T, B> take_saved() {
        saved_size_ = 0;
        if constexpr (std::same_as<T, float>)
            return std::move(saved_x_);
        else
            return std::move(saved_x16_).template bitcast<T>();
    }
    int saved_rank() const { return saved_size_ == 4 ? saved_x_.rank() : saved_size_ == 2 ? saved_x16_.rank() : 0; }
    void drop_saved() {
        saved_x_ = Tensor<float, B>();
        saved_x16_ = Tensor<std::uint16_t, B>();
        saved_size_ = 0;
    }

    template <class T>
    kernels::BnGeometry geometry(const Tensor<T, B>& x) const {
        LOCKSTEP_CHECK_AS(ShapeError, x.rank() == 2 || x.rank() == 4, describe(),
                          ": expected a 2-D (N, C) or 4-D (N, C, H, W) input, got shape ", x.shape());
        LOCKSTEP_CHECK_AS(ShapeError, x.dim(1) == channels_, describe(), ": expected ", channels_,
                          " channels, got input of shape ", x.shape());
        if (x.rank() == 4)
            LOCKSTEP_CHECK_AS(ShapeError, x.format() == options_.format, describe(), " was built for ",
                              to_string(options_.format), " input but got an ", to_string(x.format()), " tensor of shape ",
                              x.shape(), "; set BatchNormOptions::format or convert the input");
        kernels::BnGeometry g;
        g.batch = x.dim(0);
        g.channels = channels_;
        g.inner = x.rank() == 4 ? x.dim(2) * x.dim(3) : 1;
        g.channels_last = x.rank() == 2 || g.inner == 1 || x.format() == MemoryFormat::nhwc;
        return g;
    }

    BatchNormOptions options_;
    std::int64_t channels_;
    std::uint64_t layer_id_;
    // What backward needs from forward.
    Tensor<float, B> saved_x_;
    Tensor<std::uint16_t, B> saved_x16_;
    std::size_t saved_size_ = 0;         // bytes per element of the saved input; 0: none
    Tensor<std::uint8_t, B> relu_mask_;  // with fused_relu, where the backend keeps it: where the output was positive
    bool saved_batch_stats_ = false;
    kernels::BnConstants<B> constants_;  // mean, invstd, count; mean as hi + lo, scale, shift: see Note [split mean]
    // The all-reduce buffers outlive each call: a peer that is still reading one when this replica
    // leaves an aborted collective reads memory that is still ours.
    Tensor<double, B> forward_payload_;   // (3C+1): [S | Q | M | n]
    Tensor<double, B> backward_payload_;  // (2C)
};

}  // namespace lockstep::nn
