// SPDX-License-Identifier: MIT
//! Host convolutions through oneDNN: forward, backward-data and backward-weights primitives made
//! once per layer and input shape, run on the calling replica thread.
#pragma once

#include <oneapi/dnnl/dnnl.hpp>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "lockstep/core/error.hpp"
#include "lockstep/kernels/ops.hpp"

namespace lockstep::kernels::dnnl_conv {

// Note [oneDNN convolutions]
// oneDNN's fast convolution kernels work on blocked layouts of their own choosing; a layer's
// tensors are plain NCHW. Each primitive is made with `any` layouts, and the plain tensors are
// reordered into the primitive's layouts and back around it: for the example's conv2 the blocked
// kernel runs at about 2.5x the throughput oneDNN reaches on plain NCHW, which pays for the
// reorders many times over. Weights are reordered on every call (they change every step) and
// weight gradients reordered back and added to the layer's (oneDNN overwrites, a layer
// accumulates). The input reordered for forward is kept for backward-weights.
// Primitives are made once per layer and input shape and kept for the two most recent shapes (a
// training run has two: the batch and the epoch's last, partial batch). Each layer copy (each
// replica) makes its own: nothing mutable is shared between replica threads, and every
// primitive's scratchpad is the layer's own buffer (scratchpad_mode::user). Debian's oneDNN runs
// on OpenMP; a replica thread asks for one OpenMP thread (`single_thread`), since every replica
// already has a core. A shape for which oneDNN offers only its reference kernels is left to the
// im2col + GEMM path.

inline const dnnl::engine& engine() {
    static const dnnl::engine e(dnnl::engine::kind::cpu, 0);
    return e;
}

//! Limits oneDNN's OpenMP to the calling thread (each replica thread already has a core).
inline void single_thread() { omp_set_num_threads(1); }

using tag = dnnl::memory::format_tag;
using dt = dnnl::memory::data_type;
using dims = dnnl::memory::dims;

//! A tensor in a primitive's layout: the user's memory itself when the layouts agree, else a
//! buffer of its own with the reorders to and from the user's layout.
class Staged {
public:
    Staged() = default;
    Staged(const dnnl::memory::desc& user, const dnnl::memory::desc& wanted)
        : user_(user, engine(), DNNL_MEMORY_NONE), same_(user == wanted) {
        if (same_) return;
        mem_ = dnnl::memory(wanted, engine());
        in_ = dnnl::reorder(user_, mem_);
        out_ = dnnl::reorder(mem_, user_);
    }

    //! The primitive-layout memory holding `data` (reordered into the buffer when needed).
    dnnl::memory in(dnnl::stream& s, const float* data) {
        user_.set_data_handle(const_cast<float*>(data));
        if (same_) return user_;
        in_.execute(s, user_, mem_);
        return mem_;
    }
    //! The primitive-layout memory to write a result into; `out` then moves it to `data`.
    dnnl::memory target(float* data) {
        user_.set_data_handle(data);
        return same_ ? user_ : mem_;
    }
    void out(dnnl::stream& s) {
        if (!same_) out_.execute(s, mem_, user_);
    }
    //! The buffer as it was last staged (same_: the user's memory, rebound to `data`).
    dnnl::memory last(const float* data) {
        if (same_) user_.set_data_handle(const_cast<float*>(data));
        return same_ ? user_ : mem_;
    }

private:
    dnnl::memory user_;
    dnnl::memory mem_;
    dnnl::reorder in_, out_;
    bool same_ = true;
};

//! Every primitive and buffer of one layer for one input shape.
struct Plan {
    ConvGeometry g;
    bool bias = false;
    dnnl::stream stream{engine()};
    dnnl::convolution_forward fwd;
    dnnl::convolution_backward_data bwd_data;
    dnnl::convolution_backward_weights bwd_weights;
    Staged src, weights, dst;                         // forward
    Staged bd_diff_dst, bd_weights, bd_diff_src;      // backward data
    Staged bw_src, bw_diff_dst, bw_diff_weights;      // backward weights
    std::vector<float> diff_weights, diff_bias;       // plain results, added to the layer's gradients
    std::vector<unsigned char> scratchpad;
    dnnl::memory scratch_mem;
    bool src_reused = false;          // backward weights can read the forward's staged input...
    const float* staged_x = nullptr;  // ...when it is still this one

    static bool same_shape(const ConvGeometry& a, const ConvGeometry& b) {
        return a.batch == b.batch && a.in_channels == b.in_channels && a.height == b.height && a.width == b.width &&
               a.out_channels == b.out_channels && a.kernel == b.kernel && a.stride == b.stride && a.padding == b.padding;
    }

    // Made for `g`; throws Unsupported when oneDNN has only reference kernels for it.
    struct Unsupported {};
    Plan(const ConvGeometry& geometry, bool with_bias) : g(geometry), bias(with_bias) {
        const dims src_d{g.batch, g.in_channels, g.height, g.width};
        const dims wei_d{g.out_channels, g.in_channels, g.kernel, g.kernel};
        const dims dst_d{g.batch, g.out_channels, g.out_height(), g.out_width()};
        const dims stride{g.stride, g.stride}, pad{g.padding, g.padding};
        const dnnl::memory::desc any_src(src_d, dt::f32, tag::any), any_wei(wei_d, dt::f32, tag::any),
            any_dst(dst_d, dt::f32, tag::any), bias_d({g.out_channels}, dt::f32, tag::x);
        const dnnl::memory::desc user_src(src_d, dt::f32, tag::nchw), user_wei(wei_d, dt::f32, tag::oihw),
            user_dst(dst_d, dt::f32, tag::nchw);
        dnnl::primitive_attr attr;
        attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
        const auto alg = dnnl::algorithm::convolution_direct;
        const auto fwd_pd = dnnl::convolution_forward::primitive_desc(
            bias ? dnnl::convolution_forward::desc(dnnl::prop_kind::forward_training, alg, any_src, any_wei, bias_d, any_dst,
                                                   stride, pad, pad)
                 : dnnl::convolution_forward::desc(dnnl::prop_kind::forward_training, alg, any_src, any_wei, any_dst, stride,
                                                   pad, pad),
            attr, engine());
        const auto bd_pd = dnnl::convolution_backward_data::primitive_desc(
            dnnl::convolution_backward_data::desc(alg, any_src, any_wei, any_dst, stride, pad, pad), attr, engine(), fwd_pd);
        const auto bw_pd = dnnl::convolution_backward_weights::primitive_desc(
            bias ? dnnl::convolution_backward_weights::desc(alg, any_src, any_wei, bias_d, any_dst, stride, pad, pad)
                 : dnnl::convolution_backward_weights::desc(alg, any_src, any_wei, any_dst, stride, pad, pad),
            attr, engine(), fwd_pd);
        for (const char* impl : {fwd_pd.impl_info_str(), bd_pd.impl_info_str(), bw_pd.impl_info_str()})
            if (std::string(impl).rfind("ref", 0) == 0) throw Unsupported{};
        fwd = dnnl::convolution_forward(fwd_pd);
        bwd_data = dnnl::convolution_backward_data(bd_pd);
        bwd_weights = dnnl::convolution_backward_weights(bw_pd);
        src = Staged(user_src, fwd_pd.src_desc());
        weights = Staged(user_wei, fwd_pd.weights_desc());
        dst = Staged(user_dst, fwd_pd.dst_desc());
        bd_diff_dst = Staged(user_dst, bd_pd.diff_dst_desc());
        bd_weights = Staged(user_wei, bd_pd.weights_desc());
        bd_diff_src = Staged(user_src, bd_pd.diff_src_desc());
        src_reused = bw_pd.src_desc() == fwd_pd.src_desc();
        bw_src = Staged(user_src, bw_pd.src_desc());
        bw_diff_dst = Staged(user_dst, bw_pd.diff_dst_desc());
        bw_diff_weights = Staged(user_wei, bw_pd.diff_weights_desc());
        diff_weights.resize(static_cast<std::size_t>(g.out_channels * g.in_channels * g.kernel * g.kernel));
        diff_bias.resize(static_cast<std::size_t>(g.out_channels));
        std::size_t scratch = 0;
        for (const auto& d : {fwd_pd.scratchpad_desc(), bd_pd.scratchpad_desc(), bw_pd.scratchpad_desc()})
            scratch = std::max(scratch, d.get_size());
        scratchpad.resize(std::max<std::size_t>(scratch, 1));
        scratch_mem = dnnl::memory(dnnl::memory::desc({static_cast<dnnl::memory::dim>(scratchpad.size())}, dt::u8, tag::x),
                                   engine(), scratchpad.data());
    }
};

//! A layer's plans for its most recent input shapes (a layer's copies start without them:
//! `detail::FreshOnCopy` in host_ops.hpp).
class Cache {
public:
    //! The plan for `g`, made on first use; null when oneDNN cannot run `g` well (use im2col).
    Plan* plan(const ConvGeometry& g, bool bias) {
        for (std::size_t i = 0; i < plans_.size(); ++i)
            if (plans_[i].plan && Plan::same_shape(plans_[i].g, g) && plans_[i].bias == bias) {
                if (i != 0) std::swap(plans_[0], plans_[i]);  // most recent first
                return plans_[0].plan.get();
            }
        Entry e{g, bias, nullptr};
        try {
            e.plan = std::make_unique<Plan>(g, bias);
        } catch (const Plan::Unsupported&) {
        } catch (const dnnl::error& err) {
            throw Error(std::string("oneDNN could not make a convolution for input (") + std::to_string(g.batch) + ", " +
                        std::to_string(g.in_channels) + ", " + std::to_string(g.height) + ", " + std::to_string(g.width) +
                        "), kernel " + std::to_string(g.kernel) + ": " + err.what());
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

//! y = conv(x, weight) + bias (bias may be null) through `p`.
inline void forward(Plan& p, const float* x, const float* weight, const float* bias, float* y) {
    auto& s = p.stream;
    p.staged_x = x;
    std::unordered_map<int, dnnl::memory> args{{DNNL_ARG_SRC, p.src.in(s, x)},
                                               {DNNL_ARG_WEIGHTS, p.weights.in(s, weight)},
                                               {DNNL_ARG_DST, p.dst.target(y)},
                                               {DNNL_ARG_SCRATCHPAD, p.scratch_mem}};
    dnnl::memory b;
    if (p.bias) {
        b = dnnl::memory({{p.g.out_channels}, dt::f32, tag::x}, engine(), const_cast<float*>(bias));
        args.emplace(DNNL_ARG_BIAS, b);
    }
    p.fwd.execute(s, args);
    p.dst.out(s);
    s.wait();
}

//! dx = dL/dx; weight_grad += dL/dweight; bias_grad += dL/dbias (may be null), through `p`; `x`
//! is the input of the last forward through `p`.
inline void backward(Plan& p, const float* x, const float* dy, const float* weight, float* weight_grad, float* bias_grad,
                     float* dx) {
    auto& s = p.stream;
    p.bwd_data.execute(s, {{DNNL_ARG_DIFF_DST, p.bd_diff_dst.in(s, dy)},
                           {DNNL_ARG_WEIGHTS, p.bd_weights.in(s, weight)},
                           {DNNL_ARG_DIFF_SRC, p.bd_diff_src.target(dx)},
                           {DNNL_ARG_SCRATCHPAD, p.scratch_mem}});
    p.bd_diff_src.out(s);
    std::unordered_map<int, dnnl::memory> args{
        {DNNL_ARG_SRC, p.src_reused && p.staged_x == x ? p.src.last(x) : p.bw_src.in(s, x)},
        {DNNL_ARG_DIFF_DST, p.bw_diff_dst.in(s, dy)},
        {DNNL_ARG_DIFF_WEIGHTS, p.bw_diff_weights.target(p.diff_weights.data())},
        {DNNL_ARG_SCRATCHPAD, p.scratch_mem}};
    dnnl::memory db;
    if (p.bias) {
        db = dnnl::memory({{p.g.out_channels}, dt::f32, tag::x}, engine(), p.diff_bias.data());
        args.emplace(DNNL_ARG_DIFF_BIAS, db);
    }
    p.bwd_weights.execute(s, args);
    p.bw_diff_weights.out(s);
    s.wait();
    for (std::size_t i = 0; i < p.diff_weights.size(); ++i) weight_grad[i] += p.diff_weights[i];
    if (bias_grad != nullptr)
        for (std::size_t i = 0; i < p.diff_bias.size(); ++i) bias_grad[i] += p.diff_bias[i];
}

}  // namespace lockstep::kernels::dnnl_conv
