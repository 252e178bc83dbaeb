// SPDX-License-Identifier: MIT
//! `nn::SoftmaxCrossEntropy`: mean cross-entropy over the global batch and its gradient.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>

#include "lockstep/core/error.hpp"
#include "lockstep/core/tensor.hpp"
#include "lockstep/nn/context.hpp"

namespace lockstep::nn {

//! What a loss gives back for one replica's shard.
template <BackendTag B = Host>
struct LossOutput {
    double sum = 0;             // sum of per-sample losses over this shard (fp64)
    std::int64_t correct = 0;   // samples whose arg-max logit is the label
    std::int64_t count = 0;     // samples in this shard
    Tensor<float, B> grad;      // d(global mean loss) / d(logits) for this shard
};

// Note [loss over the global batch]
// The loss is the mean over the GLOBAL batch, so each replica scales its gradient by
// 1/N_global, not by 1/world: the SUM all-reduce of gradients is then the gradient of the
// global mean for uneven shards too. The value is returned as this shard's sum in fp64;
// DataParallel adds the sums in rank order and divides by N_global (a count-weighted mean).

//! Softmax followed by negative log-likelihood of integer class labels.
class SoftmaxCrossEntropy {
public:
    template <BackendTag B>
    LossOutput<B> operator()(const Context& ctx, const Tensor<float, B>& logits, std::span<const std::int64_t> labels) const {
        LOCKSTEP_CHECK_AS(ShapeError, logits.rank() == 2, "SoftmaxCrossEntropy: expected logits (N, classes), got shape ",
                          logits.shape());
        const std::int64_t N = logits.dim(0), K = logits.dim(1);
        LOCKSTEP_CHECK_AS(ShapeError, static_cast<std::int64_t>(labels.size()) == N, "SoftmaxCrossEntropy: ", labels.size(),
                          " labels for a batch of ", N, "; pass one label per sample");
        const std::int64_t global = ctx.global_batch >= 0 ? ctx.global_batch : N;
        LossOutput<B> out;
        out.count = N;
        out.grad = Tensor<float, B>(logits.shape(), MemoryFormat::nchw, logits.device(), uninitialized);
        const double inv = global > 0 ? 1.0 / static_cast<double>(global) : 0.0;
        for (std::int64_t n = 0; n < N; ++n) {
            const std::int64_t label = labels[static_cast<std::size_t>(n)];
            LOCKSTEP_CHECK(label >= 0 && label < K, "SoftmaxCrossEntropy: label ", label, " of sample ", n,
                           " is out of range for ", K, " classes; labels must be in [0, ", K, ")");
            const float* z = logits.data() + n * K;
            float* g = out.grad.data() + n * K;
            const std::int64_t best = std::max_element(z, z + K) - z;
            const double zmax = z[best];
            double denom = 0;
            for (std::int64_t k = 0; k < K; ++k) denom += std::exp(static_cast<double>(z[k]) - zmax);
            const double log_denom = std::log(denom);
            out.sum += log_denom - (static_cast<double>(z[label]) - zmax);
            out.correct += best == label;
            for (std::int64_t k = 0; k < K; ++k) {
                const double p = std::exp(static_cast<double>(z[k]) - zmax - log_denom);
                g[k] = static_cast<float>((p - (k == label ? 1.0 : 0.0)) * inv);
            }
        }
        return out;
    }
};

}  // namespace lockstep::nn
