// SPDX-License-Identifier: MIT
//! The per-channel kernels of SyncBatchNorm on CUDA (the centring between the forward's
//! all-reduces, evaluation constants, parameter gradients, the cumulative batch count): maps over
//! C, written once for the device and the host emulator (Note [kernels proven on the host]), and
//! the operations that launch them (Note [batch-norm kernels]).
#pragma once

#include <cmath>
#include <cstdint>

#include "lockstep/kernels/batch_norm_math.hpp"
#include "lockstep/kernels/ops.hpp"
#include "lockstep/kernels/device/grid.cuh"

namespace lockstep::kernels::device::bn_kernels {

// ---- per-channel kernels (map over C) --------------------------------------------------------

struct ChannelParams {
    std::int64_t C = 0;
    // eval constants
    const float* running_mean = nullptr;
    const float* running_var = nullptr;
    double eps = 1e-5;
    const float* weight = nullptr;
    const float* bias = nullptr;
    double* stats = nullptr;
    float* folded = nullptr;
    // parameter gradients
    const double* payload = nullptr;
    const double* stats_in = nullptr;
    float* weight_grad = nullptr;
    float* bias_grad = nullptr;
    // the cumulative-average count
    std::int64_t* num_batches_tracked = nullptr;
    // the centring: the forward payload (read and written), the local shifts, the shard's count
    double* forward_payload = nullptr;
    const float* shift = nullptr;
    double local_count = 0;
};

inline constexpr int channel_threads = 128;

//! Between the forward's all-reduces: [S | Q] about the local shift re-centred on the batch's
//! shift mu = M/N (Note [shifted statistics]).
struct Centre {
    using Params = ChannelParams;
    static constexpr int threads = channel_threads;
    LOCKSTEP_HD static void run(const Params& p, const Where& w) {
        const std::int64_t c = static_cast<std::int64_t>(w.bx) * threads + w.t;
        if (c >= p.C) return;
        const bn::ForwardPayload layout{p.C};
        const bn::ShiftedSums r = bn::centred(p.forward_payload, layout, c, p.local_count, p.shift[c]);
        store(p.forward_payload + layout.sum(c), r.s);
        store(p.forward_payload + layout.sum_sq(c), r.q);
    }
};

//! Evaluation: constants from the running statistics.
struct EvalConstants {
    using Params = ChannelParams;
    static constexpr int threads = channel_threads;
    LOCKSTEP_HD static void run(const Params& p, const Where& w) {
        const std::int64_t c = static_cast<std::int64_t>(w.bx) * threads + w.t;
        if (c > p.C) return;
        const std::int64_t C = p.C;
        if (c == C) {
            store(p.stats + 2 * C, 0.0);  // no batch was counted
            return;
        }
        const double mean = p.running_mean[c];
        const double invstd = 1.0 / ::sqrt(static_cast<double>(p.running_var[c]) + p.eps);
        const bn::SplitMean split = bn::split_mean(mean);
        const bn::NormalizeConstants k =
            bn::normalize_constants(mean, invstd, p.weight != nullptr ? p.weight[c] : 1.0, p.bias != nullptr ? p.bias[c] : 0.0);
        store(p.stats + c, mean);
        store(p.stats + C + c, invstd);
        store(p.folded + c, split.hi);
        store(p.folded + C + c, split.lo);
        store(p.folded + 2 * C + c, k.scale);
        store(p.folded + 3 * C + c, k.shift);
    }
};

//! dgamma += sum(dy * xhat), dbeta += sum(dy) from the local backward payload.
struct ParamGrads {
    using Params = ChannelParams;
    static constexpr int threads = channel_threads;
    LOCKSTEP_HD static void run(const Params& p, const Where& w) {
        const std::int64_t c = static_cast<std::int64_t>(w.bx) * threads + w.t;
        if (c >= p.C) return;
        const bn::BackwardPayload layout{p.C};
        store(p.weight_grad + c, p.weight_grad[c] + static_cast<float>(p.payload[layout.sum_dy_xmu(c)] * p.stats_in[p.C + c]));
        store(p.bias_grad + c, p.bias_grad[c] + static_cast<float>(p.payload[layout.sum_dy(c)]));
    }
};

//! num_batches_tracked += 1, after a normalize kernel whose running update read it (cumulative mode).
struct CountBatch {
    using Params = ChannelParams;
    static constexpr int threads = 32;
    LOCKSTEP_HD static void run(const Params& p, const Where& w) {
        if (w.bx == 0 && w.t == 0) store(p.num_batches_tracked, *p.num_batches_tracked + 1);
    }
};

// ---- the operations, for any runner (bn_passes.cuh) --------------------------------------------

//! [S | Q] re-centred on mu = M/N, after the forward's first all-reduce.
template <class Run>
void centre(Run& run, const BnGeometry& g, const float* shift, double* payload) {
    ChannelParams p;
    p.C = g.channels;
    p.forward_payload = payload;
    p.shift = shift;
    p.local_count = static_cast<double>(g.per_channel());
    run.template map<Centre>(p, Grid{static_cast<int>((g.channels + channel_threads - 1) / channel_threads), 1, channel_threads});
}

//! Evaluation constants from the running statistics.
template <class Run>
void eval_constants(Run& run, std::int64_t C, const float* running_mean, const float* running_var, double eps,
                    const float* weight, const float* bias, double* stats, float* folded) {
    ChannelParams p;
    p.C = C;
    p.running_mean = running_mean;
    p.running_var = running_var;
    p.eps = eps;
    p.weight = weight;
    p.bias = bias;
    p.stats = stats;
    p.folded = folded;
    run.template map<EvalConstants>(p, Grid{static_cast<int>(C / channel_threads + 1), 1, channel_threads});
}

//! weight_grad += sum(dy * xhat), bias_grad += sum(dy), from the local backward payload.
template <class Run>
void param_grads(Run& run, std::int64_t C, const double* payload, const double* stats, float* weight_grad, float* bias_grad) {
    ChannelParams p;
    p.C = C;
    p.payload = payload;
    p.stats_in = stats;
    p.weight_grad = weight_grad;
    p.bias_grad = bias_grad;
    run.template map<ParamGrads>(p, Grid{static_cast<int>((C + channel_threads - 1) / channel_threads), 1, channel_threads});
}

}  // namespace lockstep::kernels::device::bn_kernels
