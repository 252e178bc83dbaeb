// SPDX-License-Identifier: MIT
//! Host convolutions through oneDNN: forward, backward-data and backward-weights primitives made
//! once per layer and input shape, run on the calling replica thread. Including this header (the
//! nn component does, where lockstep was built with oneDNN) makes the host backend use it.
#pragma once

#include <oneapi/dnnl/dnnl.hpp>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "lockstep/core/error.hpp"
#include "lockstep/kernels/host_conv_engine.hpp"
#include "lockstep/kernels/ops.hpp"

namespace lockstep::kernels::dnnl_conv {

// Note [oneDNN convolutions]
// oneDNN's fast convolution kernels work on blocked layouts of their own choosing; a layer's
// tensors are plain NCHW or NHWC. Each primitive is made with `any` layouts, and the plain tensors
// are reordered into the primitive's layouts and back around it: the blocked kernels outrun
// oneDNN's plain-NCHW ones by far more than the reorders cost (bench_train_step measures the
// whole step). Weights are reordered on every call (they change every step) and
// weight gradients reordered back and added to the layer's (oneDNN overwrites, a layer
// accumulates). The input staged for forward is reused by backward-weights, and dy staged for
// backward-data by backward-weights, when the layouts agree.
// A layer keeps plans for its two most recent input shapes (a training run has two: the batch and
// the epoch's last, partial one); a plan's backward half is made at its first backward, so an
// evaluation shape costs only forward buffers. Each layer copy (each replica) makes its own:
// nothing mutable is shared between replica threads, and every primitive's scratchpad is the
// plan's own buffer (scratchpad_mode::user). Debian's oneDNN runs on OpenMP; a replica thread asks
// for one OpenMP thread, since every replica already has a core. (oneDNN may pick another
// algorithm, with other rounding, for another thread count: a layer's plan is made on the thread
// that runs it, so every replica of a DataParallel rounds alike.) A shape for which oneDNN offers
// only its reference kernels is left to the im2col + GEMM path.

inline const dnnl::engine& engine() {
    static const dnnl::engine e(dnnl::engine::kind::cpu, 0);
    return e;
}

//! Plans made so far in this process (tests check that oneDNN, not im2col, served a layer).
inline std::atomic<long>& plans_made() {
    static std::atomic<long> count{0};
    return count;
}

using tag = dnnl::memory::format_tag;
using dt = dnnl::memory::data_type;
using dims = dnnl::memory::dims;

//! A tensor in a primitive's layout: the user's memory itself when the layouts agree, else a
//! buffer of its own (made at first use) with the reorders to and from the user's layout.
class Staged {
public:
    Staged() = default;
    Staged(const dnnl::memory::desc& user, const dnnl::memory::desc& wanted)
        : user_(user, engine(), DNNL_MEMORY_NONE), wanted_(wanted), same_(user == wanted) {}

    //! The primitive-layout memory holding `data` (reordered into the buffer when needed).
    dnnl::memory in(dnnl::stream& s, const float* data) {
        user_.set_data_handle(const_cast<float*>(data));
        if (same_) return user_;
        make();
        in_.execute(s, user_, mem_);
        return mem_;
    }
    //! The primitive-layout memory to write a result into; `out` then moves it to `data`.
    dnnl::memory target(float* data) {
        user_.set_data_handle(data);
        if (same_) return user_;
        make();
        return mem_;
    }
    void out(dnnl::stream& s) {
        if (!same_) out_.execute(s, mem_, user_);
    }

private:
    void make() {
        if (mem_) return;
        mem_ = dnnl::memory(wanted_, engine());
        in_ = dnnl::reorder(user_, mem_);
        out_ = dnnl::reorder(mem_, user_);
    }

    dnnl::memory user_;
    dnnl::memory::desc wanted_;
    dnnl::memory mem_;
    dnnl::reorder in_, out_;
    bool same_ = true;
};

//! Every primitive and buffer of one layer for one input shape.
struct Plan {
    struct Unsupported {};  // oneDNN has only reference kernels for the shape

    ConvGeometry g;
    bool bias = false;
    dnnl::stream stream{engine()};
    dnnl::memory::desc user_src, user_wei, user_dst;
    dnnl::convolution_forward::primitive_desc fwd_pd;
    dnnl::convolution_forward fwd;
    Staged src, weights, dst;
    std::vector<unsigned char> scratchpad;
    dnnl::memory scratch_mem;
    const float* staged_x = nullptr;  // the input `src` holds, once a forward has finished
    // Made at the first backward.
    bool has_backward = false;
    dnnl::convolution_backward_data bwd_data;
    dnnl::convolution_backward_weights bwd_weights;
    Staged bd_diff_dst, bd_weights, bd_diff_src, bw_src, bw_diff_dst, bw_diff_weights;
    bool bw_reuses_src = false, bw_reuses_diff_dst = false;
    std::vector<float> diff_weights, diff_bias;  // plain results, added to the layer's gradients

    Plan(const ConvGeometry& geometry, bool with_bias) : g(geometry), bias(with_bias) {
        const auto act = g.channels_last ? tag::nhwc : tag::nchw;
        user_src = {{g.batch, g.in_channels, g.height, g.width}, dt::f32, act};
        user_wei = {{g.out_channels, g.in_channels, g.kernel, g.kernel}, dt::f32, tag::oihw};
        user_dst = {{g.batch, g.out_channels, g.out_height(), g.out_width()}, dt::f32, act};
        const auto fd =
            bias ? dnnl::convolution_forward::desc(dnnl::prop_kind::forward_training, alg(), any(user_src), any(user_wei),
                                                   bias_desc(), any(user_dst), strides(), pads(), pads())
                 : dnnl::convolution_forward::desc(dnnl::prop_kind::forward_training, alg(), any(user_src), any(user_wei),
                                                   any(user_dst), strides(), pads(), pads());
        fwd_pd = dnnl::convolution_forward::primitive_desc(fd, attr(), engine());
        check(fwd_pd.impl_info_str());
        fwd = dnnl::convolution_forward(fwd_pd);
        src = Staged(user_src, fwd_pd.src_desc());
        weights = Staged(user_wei, fwd_pd.weights_desc());
        dst = Staged(user_dst, fwd_pd.dst_desc());
        grow_scratchpad(fwd_pd.scratchpad_desc());
        ++plans_made();
    }

    void make_backward() {
        if (has_backward) return;
        const auto bd_pd = dnnl::convolution_backward_data::primitive_desc(
            dnnl::convolution_backward_data::desc(alg(), any(user_src), any(user_wei), any(user_dst), strides(), pads(), pads()),
            attr(), engine(), fwd_pd);
        const auto bw_pd = dnnl::convolution_backward_weights::primitive_desc(
            bias ? dnnl::convolution_backward_weights::desc(alg(), any(user_src), any(user_wei), bias_desc(), any(user_dst),
                                                            strides(), pads(), pads())
                 : dnnl::convolution_backward_weights::desc(alg(), any(user_src), any(user_wei), any(user_dst), strides(), pads(),
                                                            pads()),
            attr(), engine(), fwd_pd);
        check(bd_pd.impl_info_str());
        check(bw_pd.impl_info_str());
        bwd_data = dnnl::convolution_backward_data(bd_pd);
        bwd_weights = dnnl::convolution_backward_weights(bw_pd);
        bd_diff_dst = Staged(user_dst, bd_pd.diff_dst_desc());
        bd_weights = Staged(user_wei, bd_pd.weights_desc());
        bd_diff_src = Staged(user_src, bd_pd.diff_src_desc());
        bw_reuses_src = bw_pd.src_desc() == fwd_pd.src_desc();
        bw_reuses_diff_dst = bw_pd.diff_dst_desc() == bd_pd.diff_dst_desc();
        bw_src = Staged(user_src, bw_pd.src_desc());
        bw_diff_dst = Staged(user_dst, bw_pd.diff_dst_desc());
        bw_diff_weights = Staged(user_wei, bw_pd.diff_weights_desc());
        diff_weights.resize(static_cast<std::size_t>(g.out_channels * g.in_channels * g.kernel * g.kernel));
        diff_bias.resize(static_cast<std::size_t>(g.out_channels));
        grow_scratchpad(bd_pd.scratchpad_desc());
        grow_scratchpad(bw_pd.scratchpad_desc());
        has_backward = true;
    }

private:
    static dnnl::algorithm alg() { return dnnl::algorithm::convolution_direct; }
    static dnnl::primitive_attr attr() {
        dnnl::primitive_attr a;
        a.set_scratchpad_mode(dnnl::scratchpad_mode::user);
        return a;
    }
    static dnnl::memory::desc any(const dnnl::memory::desc& d) { return {d.dims(), dt::f32, tag::any}; }
    dnnl::memory::desc bias_desc() const { return {{g.out_channels}, dt::f32, tag::x}; }
    dims strides() const { return {g.stride, g.stride}; }
    dims pads() const { return {g.padding, g.padding}; }
    static void check(const char* impl) {
        if (std::string(impl).rfind("ref", 0) == 0) throw Unsupported{};
    }
    // One scratchpad, as large as the largest primitive's: they run one after another.
    void grow_scratchpad(const dnnl::memory::desc& d) {
        if (d.get_size() <= scratchpad.size() && scratch_mem) return;
        scratchpad.resize(std::max<std::size_t>({d.get_size(), scratchpad.size(), 1}));
        scratch_mem = dnnl::memory(dnnl::memory::desc({static_cast<dnnl::memory::dim>(scratchpad.size())}, dt::u8, tag::x),
                                   engine(), scratchpad.data());
    }
};

//! A layer's plans for its most recent input shapes (a layer's copies start without them:
//! `detail::FreshOnCopy`). A shape oneDNN declined is remembered too.
class Cache {
public:
    //! The plan for `g`, made on first use; null when oneDNN cannot run `g` well (use im2col).
    Plan* plan(const ConvGeometry& g, bool bias) {
        for (std::size_t i = 0; i < plans_.size(); ++i)
            if (plans_[i].g == g && plans_[i].bias == bias) {
                if (i != 0) std::swap(plans_[0], plans_[i]);  // most recent first
                return plans_[0].plan.get();
            }
        Entry e{g, bias, nullptr};
        try {
            e.plan = std::make_unique<Plan>(g, bias);
        } catch (const Plan::Unsupported&) {
        }
        plans_.insert(plans_.begin(), std::move(e));
        if (plans_.size() > 2) plans_.pop_back();
        return plans_[0].plan.get();
    }

private:
    struct Entry {
        ConvGeometry g;
        bool bias = false;
        std::unique_ptr<Plan> plan;  // null: oneDNN declined this shape
    };
    std::vector<Entry> plans_;
};

inline void forward(Plan& p, const float* x, const float* weight, const float* bias, float* y) {
    auto& s = p.stream;
    p.staged_x = nullptr;
    std::unordered_map<int, dnnl::memory> args{{DNNL_ARG_SRC, p.src.in(s, x)},
                                               {DNNL_ARG_WEIGHTS, p.weights.in(s, weight)},
                                               {DNNL_ARG_DST, p.dst.target(y)},
                                               {DNNL_ARG_SCRATCHPAD, p.scratch_mem}};
    if (p.bias)
        args.emplace(DNNL_ARG_BIAS, dnnl::memory({{p.g.out_channels}, dt::f32, tag::x}, engine(), const_cast<float*>(bias)));
    p.fwd.execute(s, args);
    p.dst.out(s);
    s.wait();
    p.staged_x = x;
}

inline void backward(Plan& p, const float* x, const float* dy, const float* weight, float* weight_grad, float* bias_grad,
                     float* dx) {
    p.make_backward();
    auto& s = p.stream;
    const dnnl::memory staged_dy = p.bd_diff_dst.in(s, dy);
    p.bwd_data.execute(s, {{DNNL_ARG_DIFF_DST, staged_dy},
                           {DNNL_ARG_WEIGHTS, p.bd_weights.in(s, weight)},
                           {DNNL_ARG_DIFF_SRC, p.bd_diff_src.target(dx)},
                           {DNNL_ARG_SCRATCHPAD, p.scratch_mem}});
    p.bd_diff_src.out(s);
    // The forward's staged input is this x only if no other forward ran through the plan since.
    const bool input_staged = p.bw_reuses_src && p.staged_x == x;
    std::unordered_map<int, dnnl::memory> args{
        {DNNL_ARG_SRC, input_staged ? p.src.target(const_cast<float*>(x)) : p.bw_src.in(s, x)},
        {DNNL_ARG_DIFF_DST, p.bw_reuses_diff_dst ? staged_dy : p.bw_diff_dst.in(s, dy)},
        {DNNL_ARG_DIFF_WEIGHTS, p.bw_diff_weights.target(p.diff_weights.data())},
        {DNNL_ARG_SCRATCHPAD, p.scratch_mem}};
    if (p.bias)
        args.emplace(DNNL_ARG_DIFF_BIAS, dnnl::memory({{p.g.out_channels}, dt::f32, tag::x}, engine(), p.diff_bias.data()));
    p.bwd_weights.execute(s, args);
    p.bw_diff_weights.out(s);
    s.wait();
    for (std::size_t i = 0; i < p.diff_weights.size(); ++i) weight_grad[i] += p.diff_weights[i];
    if (bias_grad != nullptr)
        for (std::size_t i = 0; i < p.diff_bias.size(); ++i) bias_grad[i] += p.diff_bias[i];
}

// ---- the hook (Note [convolution engine hook]) ----

[[noreturn]] inline void rethrow(const dnnl::error& e, const ConvGeometry& g) {
    throw Error(std::string("oneDNN convolution of input (") + std::to_string(g.batch) + ", " + std::to_string(g.in_channels) +
                ", " + std::to_string(g.height) + ", " + std::to_string(g.width) + ") " + (g.channels_last ? "NHWC" : "NCHW") +
                ", kernel " + std::to_string(g.kernel) + ", stride " + std::to_string(g.stride) + ", padding " +
                std::to_string(g.padding) + " failed: " + e.what());
}

inline bool forward_hook(detail::FreshOnCopy& state, const ConvGeometry& g, const float* x, const float* weight,
                         const float* bias, float* y) {
    try {
        Plan* p = state.get<Cache>().plan(g, bias != nullptr);
        if (p == nullptr) return false;
        forward(*p, x, weight, bias, y);
        return true;
    } catch (const dnnl::error& e) {
        rethrow(e, g);
    }
}

inline bool backward_hook(detail::FreshOnCopy& state, const ConvGeometry& g, const float* x, const float* dy, const float* weight,
                          float* weight_grad, float* bias_grad, float* dx) {
    try {
        Plan* p = state.get<Cache>().plan(g, bias_grad != nullptr);
        if (p == nullptr) return false;
        backward(*p, x, dy, weight, weight_grad, bias_grad, dx);
        return true;
    } catch (const dnnl::error& e) {
        rethrow(e, g);
    }
}

//! Limits oneDNN's OpenMP to the calling thread (each replica thread already has a core).
inline void single_thread() { omp_set_num_threads(1); }

// Note [oneDNN matmul for linear layers]
// bench_linear_gemm times OpenBLAS's sgemm and oneDNN's matmul alternately, one thread each, on
// the example's fc1 (12544 -> 128) at 32 and 64 rows, for the three products of a linear layer:
// oneDNN's matmul is the faster of the two on all three (the ratios are the benchmark's output).
// So the linear layers' three products go through matmul primitives (the accumulation as a sum
// post-op).
// Primitives are made once per shape on each thread that runs them (a replica's thread), kept
// in a thread-local cache of the 16 most recently used (a network's linear layers need 3 per
// batch shape, and an epoch has two shapes), and run on a thread-local stream: nothing is
// shared between replicas. The transposes are strides of plain row-major memory, so nothing is
// reordered.

//! Matmul primitives made so far in this process (tests check that oneDNN served a linear layer).
inline std::atomic<long>& matmuls_made() {
    static std::atomic<long> count{0};
    return count;
}

struct MatmulKey {
    bool trans_a, trans_b;
    std::int64_t m, n, k, lda, ldb, ldc;
    float beta;
    friend bool operator==(const MatmulKey&, const MatmulKey&) = default;
};

inline bool gemm_hook(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, const float* a,
                      std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c, std::int64_t ldc) {
    if (m == 0 || n == 0) return true;
    if (k == 0) return false;  // OpenBLAS's path scales C
    const MatmulKey key{trans_a, trans_b, m, n, k, lda, ldb, ldc, beta};
    struct Entry {
        MatmulKey key;
        dnnl::memory::desc a, b, c;
        dnnl::matmul prim;
    };
    thread_local std::vector<Entry> cache;  // most recently used last
    try {
        thread_local dnnl::stream stream(engine());
        auto it = std::find_if(cache.begin(), cache.end(), [&](const Entry& e) { return e.key == key; });
        if (it != cache.end() && it + 1 != cache.end()) {  // a hit: now the most recent
            std::rotate(it, it + 1, cache.end());
            it = cache.end() - 1;
        }
        if (it == cache.end()) {
            using dims = dnnl::memory::dims;
            Entry e{key,
                    dnnl::memory::desc(dims{m, k}, dt::f32, trans_a ? dims{1, lda} : dims{lda, 1}),
                    dnnl::memory::desc(dims{k, n}, dt::f32, trans_b ? dims{1, ldb} : dims{ldb, 1}),
                    dnnl::memory::desc(dims{m, n}, dt::f32, dims{ldc, 1}),
                    {}};
            dnnl::primitive_attr attr;
            if (beta != 0.0f) {
                dnnl::post_ops ops;
                ops.append_sum(beta);
                attr.set_post_ops(ops);
            }
            e.prim = dnnl::matmul(dnnl::matmul::primitive_desc(dnnl::matmul::desc(e.a, e.b, e.c), attr, engine()));
            ++matmuls_made();
            if (cache.size() >= 16) cache.erase(cache.begin());  // the least recently used
            cache.push_back(std::move(e));
            it = cache.end() - 1;
        }
        dnnl::memory am(it->a, engine(), const_cast<float*>(a)), bm(it->b, engine(), const_cast<float*>(b)),
            cm(it->c, engine(), c);
        it->prim.execute(stream, {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}});
        stream.wait();
        return true;
    } catch (const dnnl::error& e) {
        throw Error("oneDNN matmul of " + std::to_string(m) + " x " + std::to_string(k) + (trans_a ? " (transposed)" : "") +
                    " by " + std::to_string(k) + " x " + std::to_string(n) + (trans_b ? " (transposed)" : "") +
                    " failed: " + e.what());
    }
}

inline const bool registered = [] {
    auto& e = detail::host_conv_engine();
    e.forward = &forward_hook;
    e.backward = &backward_hook;
    e.enter_thread = &single_thread;
    e.gemm = &gemm_hook;
    return true;
}();

}  // namespace lockstep::kernels::dnnl_conv
