// SPDX-License-Identifier: MIT
//! Losses over the global batch: `nn::SoftmaxCrossEntropy` (class labels) and `nn::MseLoss`
//! (regression targets), and the `LossLike` concept DataParallel checks a loss against.
#pragma once

#include <concepts>
#include <cstdint>
#include <span>
#include <type_traits>

#include "lockstep/core/error.hpp"
#include "lockstep/core/tensor.hpp"
#include "lockstep/kernels/ops.hpp"
#include "lockstep/nn/context.hpp"

namespace lockstep::nn {

//! What a loss gives back for one replica's shard. `totals` stays on the shard's device until the
//! step ends; `sum()` and `correct()` read it (a device read on CUDA: not inside a step).
template <BackendTag B = Host>
struct LossOutput {
    Tensor<double, B> totals;  // (2): [sum of per-sample losses over this shard, samples classified correctly]
    std::int64_t count = 0;    // samples in this shard
    Tensor<float, B> grad;     // d(global mean loss) / d(output) for this shard

    //! Sum of the shard's per-sample losses (fp64).
    double sum() const { return totals.empty() ? 0.0 : totals.to_host()[0]; }
    //! Samples whose arg-max output is the label (classification losses; 0 for regression).
    std::int64_t correct() const { return totals.empty() ? 0 : static_cast<std::int64_t>(totals.to_host()[1]); }
};

// Note [loss over the global batch]
// The loss is the mean over the GLOBAL batch, so each replica scales its gradient by
// 1/N_global, not by 1/world: the SUM all-reduce of gradients is then the gradient of the
// global mean for uneven shards too. The value is returned as this shard's sum in fp64;
// DataParallel adds the sums in rank order and divides by N_global (a count-weighted mean).

//! A loss DataParallel can train with on backend `B` and a replica's shard of targets `Targets`.
template <class L, class B, class Targets>
concept LossLike = BackendTag<B> &&
    requires(const L& loss, const Context<B>& ctx, const Tensor<float, B>& out, const Targets& targets) {
    { loss(ctx, out, targets) } -> std::same_as<LossOutput<B>>;
};

namespace detail {
// Throws UsageError when the context's global batch cannot hold this replica's samples (a
// context reused from another call, say with global_batch 0, would silently zero the gradient).
inline double inverse_count(std::int64_t global, std::int64_t local) {
    LOCKSTEP_CHECK_AS(UsageError, global < 0 || global >= local, "the context's global_batch is ", global,
                      " but this replica's shard holds ", local,
                      " samples; set Context::global_batch to the samples over all replicas (-1 for a replica that "
                      "holds the whole batch)");
    const std::int64_t n = global >= 0 ? global : local;
    return n > 0 ? 1.0 / static_cast<double>(n) : 0.0;
}
}  // namespace detail

//! Softmax followed by negative log-likelihood of integer class labels; `correct` counts the
//! samples whose arg-max logit is the label.
class SoftmaxCrossEntropy {
public:
    template <BackendTag B>
    LossOutput<B> operator()(const Context<B>& ctx, const Tensor<float, B>& logits, std::span<const std::int64_t> labels) const {
        LOCKSTEP_CHECK_AS(ShapeError, logits.rank() == 2, "SoftmaxCrossEntropy: expected logits (N, classes), got shape ",
                          logits.shape());
        const std::int64_t N = logits.dim(0), K = logits.dim(1);
        check_labels(labels, N, K);  // labels are host values, whatever the backend
        LossOutput<B> out = make_output(logits);
        kernels::Ops<B>::softmax_cross_entropy(ctx.exec, logits, labels, detail::inverse_count(ctx.global_batch, N), out.grad,
                                               out.totals);
        return out;
    }

    //! The same against labels already on the logits' device: what a captured step reads
    //! (Note [captured steps] in parallel/step.hpp), whose host labels DataParallel checks with
    //! `check_targets` before it copies them there. Unchecked here on CUDA (that would wait for the
    //! device): a label outside [0, classes) gives a NaN loss, never a read outside its row.
    template <BackendTag B>
    LossOutput<B> operator()(const Context<B>& ctx, const Tensor<float, B>& logits, const Tensor<std::int64_t, B>& labels) const {
        LOCKSTEP_CHECK_AS(ShapeError, logits.rank() == 2, "SoftmaxCrossEntropy: expected logits (N, classes), got shape ",
                          logits.shape());
        const std::int64_t N = logits.dim(0);
        LOCKSTEP_CHECK_AS(ShapeError, labels.numel() == N, "SoftmaxCrossEntropy: ", labels.numel(), " labels for a batch of ", N,
                          "; pass one label per sample");
        check_device(logits.device(), labels.device(), "SoftmaxCrossEntropy: the labels");
        if (const auto host = kernels::Ops<B>::host_values(labels)) check_labels(*host, N, logits.dim(1));
        LossOutput<B> out = make_output(logits);
        kernels::Ops<B>::softmax_cross_entropy(ctx.exec, logits, labels, detail::inverse_count(ctx.global_batch, N), out.grad,
                                               out.totals);
        return out;
    }

    //! Throws unless `labels` holds one class in [0, classes) for each of `samples` samples.
    static void check_labels(std::span<const std::int64_t> labels, std::int64_t samples, std::int64_t classes) {
        LOCKSTEP_CHECK_AS(ShapeError, static_cast<std::int64_t>(labels.size()) == samples, "SoftmaxCrossEntropy: ", labels.size(),
                          " labels for a batch of ", samples, "; pass one label per sample");
        for (std::int64_t n = 0; n < samples; ++n) {
            const std::int64_t label = labels[static_cast<std::size_t>(n)];
            LOCKSTEP_CHECK(label >= 0 && label < classes, "SoftmaxCrossEntropy: label ", label, " of sample ", n,
                           " is out of range for ", classes, " classes; labels must be in [0, ", classes, ")");
        }
    }
    //! What DataParallel checks of a captured step's labels before each launch, the output's
    //! shape being the one its capture saw (Note [captured steps] in parallel/step.hpp).
    static void check_targets(std::span<const std::int64_t> labels, const Shape& output) {
        check_labels(labels, output[0], output.rank() == 2 ? output[1] : 0);
    }

private:
    template <BackendTag B>
    static LossOutput<B> make_output(const Tensor<float, B>& logits) {
        LossOutput<B> out;
        out.count = logits.dim(0);
        out.grad = Tensor<float, B>::empty_like(logits);
        out.totals = Tensor<double, B>(Shape{2}, MemoryFormat::nchw, logits.device(), uninitialized);
        return out;
    }
};

//! Mean squared error, as torch.nn.MSELoss(reduction="mean") on the whole global batch: the
//! mean over samples of each sample's mean squared difference. Targets are a tensor of the
//! output's shape.
class MseLoss {
public:
    template <BackendTag B>
    LossOutput<B> operator()(const Context<B>& ctx, const Tensor<float, B>& out, const Tensor<float, B>& target) const {
        LOCKSTEP_CHECK_AS(ShapeError, out.rank() >= 1, "MseLoss: expected a batched output (N, ...), got a scalar");
        LOCKSTEP_CHECK_AS(ShapeError, target.shape() == out.shape() && target.format() == out.format(),
                          "MseLoss: targets of shape ", target.shape(), " ", to_string(target.format()),
                          " for an output of shape ", out.shape(), " ", to_string(out.format()),
                          "; pass one target per output element");
        check_device(out.device(), target.device(), "MseLoss: the targets");
        LossOutput<B> res;
        res.count = out.dim(0);
        res.grad = Tensor<float, B>::empty_like(out);
        res.totals = Tensor<double, B>(Shape{2}, MemoryFormat::nchw, out.device(), uninitialized);
        kernels::Ops<B>::mse(ctx.exec, out, target, detail::inverse_count(ctx.global_batch, res.count), res.grad, res.totals);
        return res;
    }
};

}  // namespace lockstep::nn
