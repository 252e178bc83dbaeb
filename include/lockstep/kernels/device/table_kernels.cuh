// SPDX-License-Identifier: MIT
//! The kernels that take many tensors per launch (Note [tensor tables]): the SGD step over a
//! model's parameters and the gradient buckets' pack and unpack, and the operations that launch
//! them on any runner (Note [kernel runners]).
#pragma once

#include <cstdint>
#include <span>

#include "lockstep/kernels/device/grid.cuh"
#include "lockstep/kernels/device/launch_config.cuh"
#include "lockstep/kernels/ops.hpp"
#include "lockstep/kernels/rounding.hpp"

namespace lockstep::kernels::device::layer_kernels {

// ---- many tensors in one launch (maps) ----------------------------------------------------------

// Note [tensor tables]
// An optimizer step and a gradient bucket's pack and unpack touch many small tensors (the MNIST
// network's biases have 4 to 128 elements): a launch per tensor would cost more than the work. So
// these kernels take a table of up to `table_max` tensors in their parameters (about 1.4 KB, well
// inside the 4 KB a launch may pass) and one grid-stride loop covers the concatenation of the
// tensors' items; a thread finds its tensor by binary search over the items' prefix sums. Each
// tensor is cut into 16-byte vectors and a scalar tail by itself (`vec`: 4 where every pointer of
// the tensor is aligned for it, else 1), so an unaligned offset into a bucket costs only that
// tensor its vectors. An operation over more tensors launches once per `table_max`.

inline constexpr int table_max = 32;

// fp32 a * b, a + b, a - b, each rounded on its own (Note [rounded once] in kernels/rounding.hpp).
using rounding::add_rn;
using rounding::mul_rn;
using rounding::sub_rn;

//! Where item i of a table's concatenated items lies: the largest t with begin[t] <= i (empty
//! tensors share their begin with the next one, so a non-empty tensor is found).
LOCKSTEP_HD inline int table_find(const long long* begin, int count, long long i) {
    int lo = 0, hi = count - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (begin[mid] <= i)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

//! Element `e` of a tensor cut into vectors of `vec` and a tail: item j is either the vector at
//! j * vec (`is_vector`) or the tail element at `element`.
struct TableItem {
    bool is_vector;
    long long element;
};
LOCKSTEP_HD inline TableItem table_item(long long j, long long n, int vec) {
    const long long vectors = n / vec;
    if (vec > 1 && j < vectors) return {true, j * vec};
    return {false, vec > 1 ? vectors * vec + (j - vectors) : j};
}

//! One torch.optim.SGD update of one element (the same operations as `Sgd::one`).
LOCKSTEP_HD inline void sgd_one(float lr, float mu, float damp, float wd, bool first, bool nesterov, bool momentum, float& w,
                                float gr, float& v) {
    if (!momentum) {
        w = sub_rn(w, mul_rn(lr, add_rn(gr, mul_rn(wd, w))));
    } else {
        const float g = add_rn(gr, mul_rn(wd, w));
        v = first ? g : add_rn(mul_rn(mu, v), mul_rn(damp, g));
        w = sub_rn(w, mul_rn(lr, nesterov ? add_rn(g, mul_rn(mu, v)) : v));
    }
}

struct SgdTableParams {
    float* w[table_max];
    const float* g[table_max];
    float* v[table_max];  // momentum buffers (momentum only)
    long long n[table_max];
    long long begin[table_max + 1];  // prefix sums of the tensors' items
    unsigned char vec[table_max], first[table_max];
    int count = 0;
    float lr = 0, mu = 0, damp = 1, wd = 0;
    bool nesterov = false;
};

//! One torch.optim.SGD update of every tensor of the table (Note [tensor tables]).
template <bool Momentum>
struct SgdTable {
    using Params = SgdTableParams;
    static constexpr int threads = layer_kernels::threads, min_blocks = layer_kernels::min_blocks;
    LOCKSTEP_HD static void run(const Params& p, const Where& w) {
        const long long items = p.begin[p.count];
        for (long long i = first_index(w); i < items; i += grid_threads(w)) {
            const int t = table_find(p.begin, p.count, i);
            const TableItem it = table_item(i - p.begin[t], p.n[t], p.vec[t]);
            float* wp = p.w[t] + it.element;
            const float* gp = p.g[t] + it.element;
            float* vp = Momentum ? p.v[t] + it.element : nullptr;
            const bool first = p.first[t] != 0;
            if (it.is_vector) {
                auto wv = load_pack<4>(wp);
                const auto gv = load_pack<4>(gp);
                Pack<float, 4> vv{};
                if constexpr (Momentum) vv = load_pack<4>(vp);
                LOCKSTEP_UNROLL
                for (int e = 0; e < 4; ++e)
                    sgd_one(p.lr, p.mu, p.damp, p.wd, first, p.nesterov, Momentum, wv.v[e], gv.v[e], vv.v[e]);
                store_pack<4>(wp, wv);
                if constexpr (Momentum) store_pack<4>(vp, vv);
            } else {
                float wv = *wp, vv = Momentum ? *vp : 0.0f;
                sgd_one(p.lr, p.mu, p.damp, p.wd, first, p.nesterov, Momentum, wv, *gp, vv);
                store(wp, wv);
                if constexpr (Momentum) store(vp, vv);
            }
        }
    }
};

struct AdamTableParams {
    float* w[table_max];
    const float* g[table_max];
    float* m[table_max];
    float* v[table_max];
    long long n[table_max];
    long long begin[table_max + 1];  // prefix sums of the tensors' items
    unsigned char vec[table_max];
    int count = 0;
    AdamUpdate u;
};

//! One torch.optim.Adam update of every tensor of the table (optim::adam_one, as the host).
struct AdamTable {
    using Params = AdamTableParams;
    static constexpr int threads = layer_kernels::threads, min_blocks = layer_kernels::min_blocks;
    LOCKSTEP_HD static void run(const Params& p, const Where& w) {
        const long long items = p.begin[p.count];
        for (long long i = first_index(w); i < items; i += grid_threads(w)) {
            const int t = table_find(p.begin, p.count, i);
            const TableItem it = table_item(i - p.begin[t], p.n[t], p.vec[t]);
            float* wp = p.w[t] + it.element;
            const float* gp = p.g[t] + it.element;
            float* mp = p.m[t] + it.element;
            float* vp = p.v[t] + it.element;
            if (it.is_vector) {
                auto wv = load_pack<4>(wp);
                const auto gv = load_pack<4>(gp);
                auto mv = load_pack<4>(mp);
                auto vv = load_pack<4>(vp);
                LOCKSTEP_UNROLL
                for (int e = 0; e < 4; ++e) optim::adam_one(p.u, wv.v[e], gv.v[e], mv.v[e], vv.v[e]);
                store_pack<4>(wp, wv);
                store_pack<4>(mp, mv);
                store_pack<4>(vp, vv);
            } else {
                float wv = *wp, mv = *mp, vv = *vp;
                optim::adam_one(p.u, wv, *gp, mv, vv);
                store(wp, wv);
                store(mp, mv);
                store(vp, vv);
            }
        }
    }
};

struct CopyTableParams {
    float* dst[table_max];
    const float* src[table_max];
    long long n[table_max];
    long long begin[table_max + 1];
    unsigned char vec[table_max];
    int count = 0;
};

//! dst[t][0, n[t]) = src[t][0, n[t]) for every tensor of the table: a gradient bucket's pack or
//! unpack in one launch (Note [tensor tables]). The ranges do not overlap.
struct CopyTable {
    using Params = CopyTableParams;
    static constexpr int threads = layer_kernels::threads, min_blocks = layer_kernels::min_blocks;
    LOCKSTEP_HD static void run(const Params& p, const Where& w) {
        const long long items = p.begin[p.count];
        for (long long i = first_index(w); i < items; i += grid_threads(w)) {
            const int t = table_find(p.begin, p.count, i);
            const TableItem it = table_item(i - p.begin[t], p.n[t], p.vec[t]);
            if (it.is_vector)
                store_pack<4>(p.dst[t] + it.element, load_pack<4>(p.src[t] + it.element));
            else
                store(p.dst[t] + it.element, p.src[t][it.element]);
        }
    }
};

// ---- the operations, for any runner (Note [kernel runners]) -------------------------------------

//! One entry of sgd_step_many: a parameter, its gradient, its momentum buffer (momentum only)
//! and whether that buffer is made from the gradient at this step.
struct SgdEntry {
    float* value = nullptr;
    const float* grad = nullptr;
    float* momentum = nullptr;
    std::int64_t n = 0;
    bool first = false;
};

//! One torch.optim.SGD update of every entry, a launch per `table_max` entries (Note [tensor tables]).
template <class Run>
void sgd_step_many(Run& run, std::span<const SgdEntry> entries, const SgdUpdate& u) {
    SgdTableParams p;
    p.lr = static_cast<float>(u.lr), p.mu = static_cast<float>(u.momentum), p.damp = static_cast<float>(1.0 - u.dampening);
    p.wd = static_cast<float>(u.weight_decay), p.nesterov = u.nesterov;
    const bool momentum = p.mu != 0.0f;
    const auto launch = [&] {
        if (p.count == 0) return;
        const Grid g = map_grid(p.begin[p.count], run.info());
        if (momentum)
            run.template map<SgdTable<true>>(p, g);
        else
            run.template map<SgdTable<false>>(p, g);
        p.count = 0;
    };
    p.begin[0] = 0;
    for (const SgdEntry& e : entries) {
        if (e.n <= 0) continue;
        const int t = p.count;
        const int vec = all_aligned(16, {e.value, e.grad, momentum ? e.momentum : nullptr}) ? 4 : 1;
        p.w[t] = e.value, p.g[t] = e.grad, p.v[t] = momentum ? e.momentum : nullptr, p.n[t] = e.n;
        p.vec[t] = static_cast<unsigned char>(vec), p.first[t] = e.first ? 1 : 0;
        p.begin[t + 1] = p.begin[t] + vector_items(e.n, vec);
        ++p.count;
        if (p.count == table_max) launch();
    }
    launch();
}

//! One torch.optim.SGD update of one tensor (`momentum` ignored without momentum, initialized
//! from the gradient when `first`): a table of one.
template <class Run>
void sgd_step(Run& run, float* value, const float* grad, float* momentum, std::int64_t n, bool first, const SgdUpdate& u) {
    const SgdEntry e{value, grad, momentum, n, first};
    sgd_step_many(run, std::span<const SgdEntry>(&e, 1), u);
}

//! One entry of adam_step_many: a parameter, its gradient and its two moment estimates.
struct AdamEntry {
    float* value = nullptr;
    const float* grad = nullptr;
    float* exp_avg = nullptr;
    float* exp_avg_sq = nullptr;
    std::int64_t n = 0;
};

//! One torch.optim.Adam update of every entry, a launch per `table_max` entries (Note [tensor tables]).
template <class Run>
void adam_step_many(Run& run, std::span<const AdamEntry> entries, const AdamUpdate& u) {
    AdamTableParams p;
    p.u = u;
    const auto launch = [&] {
        if (p.count == 0) return;
        run.template map<AdamTable>(p, map_grid(p.begin[p.count], run.info()));
        p.count = 0;
    };
    p.begin[0] = 0;
    for (const AdamEntry& e : entries) {
        if (e.n <= 0) continue;
        const int t = p.count;
        const int vec = all_aligned(16, {e.value, e.grad, e.exp_avg, e.exp_avg_sq}) ? 4 : 1;
        p.w[t] = e.value, p.g[t] = e.grad, p.m[t] = e.exp_avg, p.v[t] = e.exp_avg_sq, p.n[t] = e.n;
        p.vec[t] = static_cast<unsigned char>(vec);
        p.begin[t + 1] = p.begin[t] + vector_items(e.n, vec);
        ++p.count;
        if (p.count == table_max) launch();
    }
    launch();
}

//! One entry of copy_many: n floats from src to dst (not overlapping).
struct CopyEntry {
    float* dst = nullptr;
    const float* src = nullptr;
    std::int64_t n = 0;
};

//! Every entry's copy, a launch per `table_max` entries (Note [tensor tables]).
template <class Run>
void copy_many(Run& run, std::span<const CopyEntry> entries) {
    CopyTableParams p;
    const auto launch = [&] {
        if (p.count == 0) return;
        run.template map<CopyTable>(p, map_grid(p.begin[p.count], run.info()));
        p.count = 0;
    };
    p.begin[0] = 0;
    for (const CopyEntry& e : entries) {
        if (e.n <= 0) continue;
        const int t = p.count;
        const int vec = all_aligned(16, {e.dst, e.src}) ? 4 : 1;
        p.dst[t] = e.dst, p.src[t] = e.src, p.n[t] = e.n, p.vec[t] = static_cast<unsigned char>(vec);
        p.begin[t + 1] = p.begin[t] + vector_items(e.n, vec);
        ++p.count;
        if (p.count == table_max) launch();
    }
    launch();
}

}  // namespace lockstep::kernels::device::layer_kernels
