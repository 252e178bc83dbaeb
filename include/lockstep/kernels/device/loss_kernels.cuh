// SPDX-License-Identifier: MIT
//! The loss kernels of the CUDA backend (softmax cross-entropy, mean squared error): a thread per
//! sample, gradients written and totals reduced in fp64 in one launch (Note [layer kernels]), and
//! the operations that launch them on any runner (Note [kernel runners]).
#pragma once

#include <cmath>
#include <cstdint>

#include "lockstep/core/error.hpp"
#include "lockstep/kernels/device/grid.cuh"
#include "lockstep/kernels/device/launch_config.cuh"

namespace lockstep::kernels::device::layer_kernels {

// ---- losses (reducing) --------------------------------------------------------------------------

struct LossParams {
    const float* out = nullptr;            // logits (N, K) or outputs (N, D)
    const float* target = nullptr;         // mse
    const std::int64_t* labels = nullptr;  // cross-entropy, on the device
    float* grad = nullptr;
    std::int64_t N = 0, K = 0;  // samples, values per sample
    std::int64_t n = 0;         // mse: N K values
    double inv_count = 1;
    double* totals = nullptr;  // [2] = the sums
    Sum2* partials2 = nullptr;
    Sum1* partials1 = nullptr;
    unsigned int* counters = nullptr;
};

//! Softmax cross-entropy, a thread per sample, in fp64 as the host: grad = (softmax - onehot) *
//! inv_count; totals = [sum of the losses, samples whose first maximum is the label]. A label
//! outside [0, K) (the caller checks them) gives a NaN loss, never a read out of the row.
struct SoftmaxCrossEntropy {
    using Params = LossParams;
    using Value = Sum2;
    static constexpr int threads = layer_kernels::threads, lanes = 1, rows = threads, min_blocks = layer_kernels::min_blocks;
    LOCKSTEP_HD static Value accumulate(const Params& p, const Where& w) {
        Value total;
        for (std::int64_t n = first_index(w); n < p.N; n += grid_threads(w)) {
            const float* z = p.out + n * p.K;
            float* gr = p.grad + n * p.K;
            std::int64_t best = 0;  // the first maximum, as std::max_element
            for (std::int64_t k = 1; k < p.K; ++k)
                if (z[best] < z[k]) best = k;
            const double zmax = z[best];
            double denom = 0;
            // Rolled, as the gradients' loop below: unrolled copies of the fp64 exp spill on sm_100 and sm_120.
            LOCKSTEP_NO_UNROLL
            for (std::int64_t k = 0; k < p.K; ++k) denom += ::exp(static_cast<double>(z[k]) - zmax);
            const double log_denom = ::log(denom);
            const std::int64_t label = p.labels[n];
            const bool valid = label >= 0 && label < p.K;
            total.a += valid ? log_denom - (static_cast<double>(z[valid ? label : 0]) - zmax) : ::nan("");
            total.b += valid && best == label ? 1.0 : 0.0;
            LOCKSTEP_NO_UNROLL
            for (std::int64_t k = 0; k < p.K; ++k) {
                const double q = ::exp(static_cast<double>(z[k]) - zmax - log_denom);
                store(gr + k, static_cast<float>((q - (k == label ? 1.0 : 0.0)) * p.inv_count));
            }
        }
        return total;
    }
    LOCKSTEP_HD static void store_partial(const Params& p, const Where& w, int, const Value& v) { store(p.partials2 + w.bx, v); }
    LOCKSTEP_HD static unsigned int* counter(const Params& p, const Where&) { return p.counters; }
    LOCKSTEP_HD static Value gather(const Params& p, const Where& w, int, int row) {
        Value v;
        for (int i = row; i < w.gx; i += rows)
            v = v + Value{load_other_block(&p.partials2[i].a), load_other_block(&p.partials2[i].b)};
        return v;
    }
    LOCKSTEP_HD static void finish(const Params& p, const Where&, int, const Value& total) {
        store(p.totals, total.a);
        store(p.totals + 1, total.b);
    }
};

//! Mean squared error per sample: grad = 2 (out - target) / D * inv_count element by element (the
//! host's fp64 expression), totals = [sum over samples of the sample's mean square, 0], summed
//! over all N D values and divided by D once.
template <int V>
struct MeanSquaredError {
    using Params = LossParams;
    using Value = Sum1;
    static constexpr int threads = layer_kernels::threads, lanes = 1, rows = threads, min_blocks = layer_kernels::min_blocks;
    LOCKSTEP_HD static double one(const Params& p, float out, float target, float& grad) {
        const double diff = static_cast<double>(out) - static_cast<double>(target);
        grad = static_cast<float>(2.0 * diff / static_cast<double>(p.K) * p.inv_count);
        return diff * diff;
    }
    LOCKSTEP_HD static Value accumulate(const Params& p, const Where& w) {
        double s = 0;
        const std::int64_t vectors = p.n / V;
        for (std::int64_t i = first_index(w); i < vectors; i += grid_threads(w)) {
            const auto o = load_pack<V>(p.out + i * V);
            const auto t = load_pack<V>(p.target + i * V);
            Pack<float, V> g;
            LOCKSTEP_UNROLL
            for (int e = 0; e < V; ++e) s += one(p, o.v[e], t.v[e], g.v[e]);
            store_pack<V>(p.grad + i * V, g);
        }
        const std::int64_t tail = vectors * V + first_index(w);
        if (V > 1 && tail < p.n) {
            float g = 0.0f;
            s += one(p, p.out[tail], p.target[tail], g);
            store(p.grad + tail, g);
        }
        return {s};
    }
    LOCKSTEP_HD static void store_partial(const Params& p, const Where& w, int, const Value& v) { store(p.partials1 + w.bx, v); }
    LOCKSTEP_HD static unsigned int* counter(const Params& p, const Where&) { return p.counters; }
    LOCKSTEP_HD static Value gather(const Params& p, const Where& w, int, int row) {
        double s = 0;
        for (int i = row; i < w.gx; i += rows) s += load_other_block(&p.partials1[i].v);
        return {s};
    }
    LOCKSTEP_HD static void finish(const Params& p, const Where&, int, const Value& total) {
        store(p.totals, total.v / static_cast<double>(p.K));
        store(p.totals + 1, 0.0);
    }
};

struct StoreParams {
    double* p = nullptr;
    double a = 0, b = 0;
};

//! p[0] = a, p[1] = b: the totals of a loss over an empty shard.
struct Store2 {
    using Params = StoreParams;
    static constexpr int threads = 32;
    LOCKSTEP_HD static void run(const Params& p, const Where& w) {
        if (w.bx == 0 && w.t == 0) {
            store(p.p, p.a);
            store(p.p + 1, p.b);
        }
    }
};

// ---- the operations, for any runner (Note [kernel runners]) -------------------------------------

//! Softmax cross-entropy of logits (N, K) against device `labels` (N): grad and totals (=).
template <class Run>
void softmax_cross_entropy(Run& run, const float* logits, std::int64_t N, std::int64_t K, const std::int64_t* labels,
                           double inv_count, float* grad, double* totals) {
    LOCKSTEP_CHECK_AS(ShapeError, N == 0 || K > 0, "softmax cross-entropy needs at least one class, got logits of ", N, "x", K);
    if (N == 0) {
        run.template map<Store2>(StoreParams{totals, 0.0, 0.0}, Grid{1, 1, Store2::threads});
        return;
    }
    const Scratch scratch = run.scratch();
    LossParams p;
    p.out = logits, p.labels = labels, p.grad = grad, p.N = N, p.K = K, p.inv_count = inv_count, p.totals = totals;
    p.counters = scratch.counters;
    const Grid g = reduce_grid(N, 1, threads, 1, 1, sizeof(Sum2), run.info());
    p.partials2 = scratch.template partials_as<Sum2>(g.x);
    run.template reduce<SoftmaxCrossEntropy>(p, g);
}

//! Mean squared error of out against target, both (N, D): grad and totals (=).
template <class Run>
void mse(Run& run, const float* out, const float* target, std::int64_t N, std::int64_t D, double inv_count, float* grad,
         double* totals) {
    if (N == 0 || D == 0) {  // the host's sum of N means of nothing: 0 for no samples, else NaN
        run.template map<Store2>(StoreParams{totals, N == 0 ? 0.0 : ::nan(""), 0.0}, Grid{1, 1, Store2::threads});
        return;
    }
    const Scratch scratch = run.scratch();
    LossParams p;
    p.out = out, p.target = target, p.grad = grad, p.N = N, p.K = D, p.n = N * D, p.inv_count = inv_count, p.totals = totals;
    p.counters = scratch.counters;
    const int V = all_aligned(16, {out, target, grad}) ? 4 : 1;
    const Grid g = reduce_grid(vector_items(p.n, V), 1, threads, 1, 4, sizeof(Sum1), run.info());
    p.partials1 = scratch.template partials_as<Sum1>(g.x);
    if (V == 4)
        run.template reduce<MeanSquaredError<4>>(p, g);
    else
        run.template reduce<MeanSquaredError<1>>(p, g);
}

}  // namespace lockstep::kernels::device::layer_kernels
