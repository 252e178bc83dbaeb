// SPDX-License-Identifier: MIT
//! The convolution and linear layers of the CUDA backend: im2col and col2im kernels around cuBLAS
//! SGEMMs whose arguments are planned on the host (`GemmCall`, Note [convolution on CUDA]), and the
//! operations that run them on any runner (Note [kernel runners]).
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "lockstep/core/error.hpp"
#include "lockstep/kernels/device/grid.cuh"
#include "lockstep/kernels/device/launch_config.cuh"
#include "lockstep/kernels/device/layer_kernels.cuh"
#include "lockstep/kernels/ops.hpp"

namespace lockstep::kernels::device::layer_kernels {

// ---- im2col and col2im (maps) -------------------------------------------------------------------

// Note [convolution on CUDA]
// A convolution over an NCHW shard is im2col + cuBLAS over the whole shard, with the columns of
// every sample in one buffer (in the replica's workspace: Note [one layer workspace]), K = C k k, P = OH OW:
// - forward: columns [N][K][P]; y[n] (O x P) = W (O x K) cols[n] (K x P) is one strided-batched
//   GEMM over the N samples (W shared: stride 0), then the bias is a map kernel;
// - backward: dy is transposed to dyt [O][N*P] and the columns are laid out [K][N*P], so the
//   weight gradient over the whole shard is ONE GEMM, dW (O x K) += dyt cols^T with beta = 1
//   (strided-batched GEMMs cannot sum their batch into one matrix; a GEMM per sample would be N
//   small launches), and dcols [K][N*P] = W^T dyt is one GEMM too; col2im then gathers dx. The
//   bias gradient is the per-channel sum of dy.
// cuBLAS is column-major: a row-major (r x c) matrix with leading dimension ld is its transpose,
// column-major, with the same ld, so the row-major product C = A B is computed as the
// column-major C^T = B^T A^T. The arguments of every call are a `GemmCall` made by a host
// function below; the emulation tests run those same calls through a column-major reference GEMM.
// NHWC convolutions are not implemented on CUDA (NotImplemented): the layer's user is told to use NCHW.

struct ColsParams {
    const float* x = nullptr;            // im2col: the input (unless x16 is set); col2im: -
    const __nv_bfloat16* x16 = nullptr;  // im2col of an input stored in bf16 (Note [activation precision]): read, widened
    float* cols = nullptr;               // im2col: written (unless cols16 is set)
    __nv_bfloat16* cols16 = nullptr;     // im2col of a bf16 product (Note [precision]): written, rounded, instead
    const float* dcols = nullptr;        // col2im: read
    float* dx = nullptr;                 // col2im: written (unless dx16 is set)
    __nv_bfloat16* dx16 = nullptr;       // col2im into a bf16 dx (Note [activation precision]): written, rounded, instead
    int C = 0, H = 0, W = 0, k = 1, s = 1, pad = 0, OH = 0, OW = 0;
    int N = 0, K = 0, P = 0;
    bool sample_major = true;  // columns [N][K][P] (forward), else [K][N][P] (backward)
    unsigned int items = 0;    // im2col: N K P; col2im: N C H W
    Divider d0, d1, d2, d3;    // im2col: P, K or N, k, OW; col2im: W, H, C, s
};

//! cols[(n, (c, i, j), (oh, ow))] = x[n, c, oh s - pad + i, ow s - pad + j], zero outside the image;
//! one thread per column element, in the columns' memory order; from x16 (widened exactly) when that
//! is set; into cols16, rounded to bf16, when that is set.
struct Im2col {
    using Params = ColsParams;
    static constexpr int threads = layer_kernels::threads, min_blocks = layer_kernels::min_blocks;
    LOCKSTEP_HD static void run(const Params& p, const Where& w) {
        for (unsigned int i = static_cast<unsigned int>(first_index(w)); i < p.items;
             i += static_cast<unsigned int>(grid_threads(w))) {
            const unsigned int r = p.d0.div(i);
            const unsigned int pp = i - r * p.d0.d;
            const unsigned int outer = p.d1.div(r);
            const unsigned int inner = r - outer * p.d1.d;
            const unsigned int kk = p.sample_major ? inner : outer;
            const unsigned int n = p.sample_major ? outer : inner;
            const unsigned int ci = p.d2.div(kk);
            const int j = static_cast<int>(kk - ci * p.d2.d);
            const unsigned int c = p.d2.div(ci);
            const int a = static_cast<int>(ci - c * p.d2.d);
            const unsigned int oh = p.d3.div(pp);
            const int ow = static_cast<int>(pp - oh * p.d3.d);
            const int h = static_cast<int>(oh) * p.s - p.pad + a, x = ow * p.s - p.pad + j;
            float v = 0.0f;
            if (h >= 0 && h < p.H && x >= 0 && x < p.W) {
                const std::int64_t at = ((static_cast<std::int64_t>(n) * p.C + c) * p.H + h) * p.W + x;
                v = p.x16 != nullptr ? to_float(p.x16[at]) : p.x[at];
            }
            if (p.cols16 != nullptr)
                store(p.cols16 + i, from_float<__nv_bfloat16>(v));
            else
                store(p.cols + i, v);
        }
    }
};

//! dx[n, c, h, x] = the sum of the column entries read from (h, x), added in the host's col2im
//! order ((i, j) ascending): a gather, bit for bit the host's scatter, without atomics; into dx16,
//! the sum rounded once to bf16, when that is set.
struct Col2im {
    using Params = ColsParams;
    static constexpr int threads = layer_kernels::threads, min_blocks = layer_kernels::min_blocks;
    LOCKSTEP_HD static void run(const Params& p, const Where& w) {
        for (unsigned int i = static_cast<unsigned int>(first_index(w)); i < p.items;
             i += static_cast<unsigned int>(grid_threads(w))) {
            const unsigned int q = p.d0.div(i);
            const int x = static_cast<int>(i - q * p.d0.d);
            const unsigned int q2 = p.d1.div(q);
            const int h = static_cast<int>(q - q2 * p.d1.d);
            const unsigned int n = p.d2.div(q2);
            const unsigned int c = q2 - n * p.d2.d;
            float sum = 0.0f;
            for (int a = 0; a < p.k; ++a) {
                const int hh = h + p.pad - a;
                if (hh < 0) break;  // a only grows
                const int oh = static_cast<int>(p.d3.div(static_cast<unsigned int>(hh)));
                if (oh * p.s != hh || oh >= p.OH) continue;
                for (int j = 0; j < p.k; ++j) {
                    const int xx = x + p.pad - j;
                    if (xx < 0) break;
                    const int ow = static_cast<int>(p.d3.div(static_cast<unsigned int>(xx)));
                    if (ow * p.s != xx || ow >= p.OW) continue;
                    const std::int64_t kk = (static_cast<std::int64_t>(c) * p.k + a) * p.k + j;
                    const std::int64_t col =
                        p.sample_major ? (static_cast<std::int64_t>(n) * p.K + kk) * p.P : (kk * p.N + n) * p.P;
                    sum += p.dcols[col + static_cast<std::int64_t>(oh) * p.OW + ow];
                }
            }
            if (p.dx16 != nullptr)
                store(p.dx16 + i, from_float<__nv_bfloat16>(sum));
            else
                store(p.dx + i, sum);
        }
    }
};

// ---- GEMM calls (cuBLAS, column-major) ----------------------------------------------------------

//! One cuBLAS SGEMM, column-major: C = alpha op(A) op(B) + beta C, `batch` times with A, B and C
//! advanced by their strides (cublasSgemmStridedBatched; batch 1: cublasSgemm). C is always
//! contiguous here (ldc = m, stride_c = m n).
struct GemmCall {
    bool trans_a = false, trans_b = false;
    int m = 0, n = 0, k = 0;
    float alpha = 1, beta = 0;
    const float* a = nullptr;
    int lda = 1;
    long long stride_a = 0;
    const float* b = nullptr;
    int ldb = 1;
    long long stride_b = 0;
    float* c = nullptr;
    int ldc = 1;
    long long stride_c = 0;
    int batch = 1;
    // The layer it serves, which the replica's math mode looks at (Note [math modes]).
    ProductOf of = ProductOf::linear;
};

//! A GEMM dimension as cuBLAS's int.
inline int gemm_dim(std::int64_t v, const char* what) {
    LOCKSTEP_CHECK_AS(ShapeError, v >= 0 && v <= index_limit, what, " of ", v, " is beyond cuBLAS's 32-bit dimensions");
    return static_cast<int>(v);
}
inline int ld_of(std::int64_t v) { return static_cast<int>(std::max<std::int64_t>(v, 1)); }

//! The geometry of an NCHW convolution on CUDA, checked (Note [convolution on CUDA]).
struct ConvPlan {
    std::int64_t N = 0, C = 0, H = 0, W = 0, O = 0, k = 1, s = 1, pad = 0, OH = 0, OW = 0;
    std::int64_t K = 0, P = 0;  // C k k, OH OW

    explicit ConvPlan(const ConvGeometry& g)
        : N(g.batch), C(g.in_channels), H(g.height), W(g.width), O(g.out_channels), k(g.kernel), s(g.stride), pad(g.padding) {
        LOCKSTEP_CHECK_AS(NotImplemented, !g.channels_last, "NHWC convolutions on CUDA are not implemented; use NCHW");
        LOCKSTEP_CHECK_AS(ShapeError, N >= 0 && C >= 0 && H >= 0 && W >= 0 && O >= 0 && k >= 1 && s >= 1 && pad >= 0,
                          "a convolution needs non-negative sizes, kernel >= 1, stride >= 1 and padding >= 0; got N=", N,
                          " C=", C, " H=", H, " W=", W, " O=", O, " kernel=", k, " stride=", s, " padding=", pad);
        LOCKSTEP_CHECK_AS(ShapeError, H + 2 * pad >= k && W + 2 * pad >= k, "a convolution's kernel ", k,
                          " is larger than its padded input ", H + 2 * pad, "x", W + 2 * pad);
        OH = g.out_height();
        OW = g.out_width();
        K = C * k * k;
        P = OH * OW;
        check_index_space(N * C * H * W, "a convolution's input");
        check_index_space(N * O * P, "a convolution's output");
        check_index_space(N * K * P, "a convolution's im2col buffer");
    }
    std::int64_t cols() const { return N * K * P; }
};

//! y[n] (O x P) = W (O x K) cols[n] (K x P), cols [N][K][P]: column-major y[n]^T = cols[n]^T W^T.
inline GemmCall conv_forward_gemm(const ConvPlan& c, const float* cols, const float* weight, float* y) {
    GemmCall g;
    g.of = ProductOf::convolution;
    g.m = gemm_dim(c.P, "a convolution's output plane");
    g.n = gemm_dim(c.O, "a convolution's output channels");
    g.k = gemm_dim(c.K, "a convolution's C k k");
    g.a = cols, g.lda = ld_of(c.P), g.stride_a = c.K * c.P;
    g.b = weight, g.ldb = ld_of(c.K), g.stride_b = 0;
    g.c = y, g.ldc = ld_of(c.P), g.stride_c = c.O * c.P;
    g.batch = gemm_dim(c.N, "a convolution's batch");
    return g;
}

//! dW (O x K) += dyt (O x NP) cols^T, cols [K][NP]: column-major dW^T += cols^T(op T) dyt^T.
inline GemmCall conv_weight_grad_gemm(const ConvPlan& c, const float* cols, const float* dyt, float* weight_grad) {
    GemmCall g;
    g.of = ProductOf::convolution;
    g.trans_a = true;
    g.m = gemm_dim(c.K, "a convolution's C k k");
    g.n = gemm_dim(c.O, "a convolution's output channels");
    g.k = gemm_dim(c.N * c.P, "a convolution's N OH OW");
    g.a = cols, g.lda = ld_of(c.N * c.P);
    g.b = dyt, g.ldb = ld_of(c.N * c.P);
    g.c = weight_grad, g.ldc = ld_of(c.K), g.stride_c = c.K * c.O;
    g.beta = 1;
    return g;
}

//! dcols (K x NP) = W^T (K x O) dyt (O x NP): column-major dcols^T = dyt^T W(op T).
inline GemmCall conv_input_grad_gemm(const ConvPlan& c, const float* weight, const float* dyt, float* dcols) {
    GemmCall g;
    g.of = ProductOf::convolution;
    g.trans_b = true;
    g.m = gemm_dim(c.N * c.P, "a convolution's N OH OW");
    g.n = gemm_dim(c.K, "a convolution's C k k");
    g.k = gemm_dim(c.O, "a convolution's output channels");
    g.a = dyt, g.lda = ld_of(c.N * c.P);
    g.b = weight, g.ldb = ld_of(c.K);
    g.c = dcols, g.ldc = ld_of(c.N * c.P), g.stride_c = c.N * c.P * c.K;
    return g;
}

//! y (N x out) = x (N x in) W^T (W: out x in): column-major y^T = W(op T) x^T.
inline GemmCall linear_forward_gemm(std::int64_t N, std::int64_t in, std::int64_t out, const float* x, const float* weight,
                                    float* y) {
    GemmCall g;
    g.trans_a = true;
    g.m = gemm_dim(out, "a linear layer's outputs");
    g.n = gemm_dim(N, "a linear layer's batch");
    g.k = gemm_dim(in, "a linear layer's inputs");
    g.a = weight, g.lda = ld_of(in);
    g.b = x, g.ldb = ld_of(in);
    g.c = y, g.ldc = ld_of(out), g.stride_c = out * N;
    return g;
}

//! dW (out x in) += dy^T (out x N) x (N x in): column-major dW^T += x^T dy(op T).
inline GemmCall linear_weight_grad_gemm(std::int64_t N, std::int64_t in, std::int64_t out, const float* x, const float* dy,
                                        float* weight_grad) {
    GemmCall g;
    g.trans_b = true;
    g.m = gemm_dim(in, "a linear layer's inputs");
    g.n = gemm_dim(out, "a linear layer's outputs");
    g.k = gemm_dim(N, "a linear layer's batch");
    g.a = x, g.lda = ld_of(in);
    g.b = dy, g.ldb = ld_of(out);
    g.c = weight_grad, g.ldc = ld_of(in), g.stride_c = in * out;
    g.beta = 1;
    return g;
}

//! dx (N x in) = dy (N x out) W (out x in): column-major dx^T = W^T dy^T, both as stored.
inline GemmCall linear_input_grad_gemm(std::int64_t N, std::int64_t in, std::int64_t out, const float* weight, const float* dy,
                                       float* dx) {
    GemmCall g;
    g.m = gemm_dim(in, "a linear layer's inputs");
    g.n = gemm_dim(N, "a linear layer's batch");
    g.k = gemm_dim(out, "a linear layer's outputs");
    g.a = weight, g.lda = ld_of(in);
    g.b = dy, g.ldb = ld_of(out);
    g.c = dx, g.ldc = ld_of(in), g.stride_c = in * N;
    return g;
}

// ---- the operations, for any runner (Note [kernel runners]) -------------------------------------

//! The geometry of im2col's parameters (every field but the source and the output).
inline void fill_im2col_params(const ConvPlan& c, bool sample_major, ColsParams& p) {
    p.C = static_cast<int>(c.C), p.H = static_cast<int>(c.H), p.W = static_cast<int>(c.W), p.k = static_cast<int>(c.k);
    p.s = static_cast<int>(c.s), p.pad = static_cast<int>(c.pad), p.OH = static_cast<int>(c.OH), p.OW = static_cast<int>(c.OW);
    p.N = static_cast<int>(c.N), p.K = static_cast<int>(c.K), p.P = static_cast<int>(c.P);
    p.sample_major = sample_major;
    p.items = static_cast<unsigned int>(c.cols());
    p.d0 = divider(c.P), p.d1 = divider(sample_major ? c.K : c.N), p.d2 = divider(c.k), p.d3 = divider(c.OW);
}

//! im2col's parameters for an NCHW shard, its output not yet set.
inline ColsParams im2col_params(const ConvPlan& c, const float* x, bool sample_major) {
    ColsParams p;
    p.x = x;
    fill_im2col_params(c, sample_major, p);
    return p;
}
inline ColsParams im2col_params(const ConvPlan& c, const __nv_bfloat16* x, bool sample_major) {
    ColsParams p;
    p.x16 = x;
    fill_im2col_params(c, sample_major, p);
    return p;
}

//! The columns of an NCHW shard: [N][K][P] (`sample_major`) or [K][N][P].
template <class Run>
void im2col(Run& run, const ConvPlan& c, const float* x, float* cols, bool sample_major) {
    ColsParams p = im2col_params(c, x, sample_major);
    p.cols = cols;
    run.template map<Im2col>(p, map_grid(p.items, run.info()));
}

//! The same columns rounded to bfloat16 (a bf16 product's operand, Note [precision]): im2col then
//! to_bf16 in one pass; from an input in fp32 or stored in bf16 (S).
template <class Run, class S>
void im2col_bf16(Run& run, const ConvPlan& c, const S* x, __nv_bfloat16* cols16, bool sample_major) {
    ColsParams p = im2col_params(c, x, sample_major);
    p.cols16 = cols16;
    run.template map<Im2col>(p, map_grid(p.items, run.info()));
}

//! dx (N, C, H, W) = the adjoint of im2col of `dcols` ([N][K][P] when `sample_major`, else [K][N][P]);
//! T: float, or __nv_bfloat16 (each sum rounded once).
template <class Run, class T>
void col2im(Run& run, const ConvPlan& c, const float* dcols, T* dx, bool sample_major) {
    static_assert(std::is_same_v<T, float> || std::is_same_v<T, __nv_bfloat16>, "col2im writes fp32 or bf16");
    ColsParams p;
    p.dcols = dcols;
    if constexpr (std::is_same_v<T, float>)
        p.dx = dx;
    else
        p.dx16 = dx;
    p.C = static_cast<int>(c.C), p.H = static_cast<int>(c.H), p.W = static_cast<int>(c.W), p.k = static_cast<int>(c.k);
    p.s = static_cast<int>(c.s), p.pad = static_cast<int>(c.pad), p.OH = static_cast<int>(c.OH), p.OW = static_cast<int>(c.OW);
    p.N = static_cast<int>(c.N), p.K = static_cast<int>(c.K), p.P = static_cast<int>(c.P);
    p.sample_major = sample_major;
    p.items = static_cast<unsigned int>(c.N * c.C * c.H * c.W);
    p.d0 = divider(c.W), p.d1 = divider(c.H), p.d2 = divider(c.C), p.d3 = divider(c.s);
    run.template map<Col2im>(p, map_grid(p.items, run.info()));
}

//! Runs `call`, or what it amounts to when a dimension is empty: nothing, or C = 0 when the inner
//! dimension k is empty and beta is 0 (cuBLAS is never handed an empty product).
template <class Run>
void gemm(Run& run, const GemmCall& call) {
    if (call.m == 0 || call.n == 0 || call.batch == 0) return;
    if (call.k == 0) {
        if (call.beta == 0.0f) fill(run, call.c, std::int64_t{call.m} * call.n * call.batch, 0.0f);
        return;  // beta = 1: C unchanged
    }
    run.gemm(call);
}

//! Floats of each buffer a convolution needs in the replica's workspace (Note [one layer workspace]).
struct ConvBuffers {
    std::int64_t cols = 0, dcols = 0, dyt = 0;
};
inline ConvBuffers conv_forward_buffers(const ConvPlan& c) { return {c.cols(), 0, 0}; }
inline ConvBuffers conv_backward_buffers(const ConvPlan& c) { return {c.cols(), c.cols(), c.N * c.O * c.P}; }

//! y = conv(x, weight) + bias (bias may be null); `cols` holds conv_forward_buffers(c).cols floats.
template <class Run>
void conv2d_forward(Run& run, const ConvPlan& c, const float* x, const float* weight, const float* bias, float* y, float* cols) {
    if (c.N == 0 || c.O == 0) return;
    im2col(run, c, x, cols, /*sample_major=*/true);
    gemm(run, conv_forward_gemm(c, cols, weight, y));
    if (bias != nullptr) bias_act(run, y, c.N, c.O, c.P, bias, false, nullptr);
}

//! weight_grad += dL/dW, bias_grad += dL/db (may be null), dx = dL/dx; the buffers hold
//! conv_backward_buffers(c) floats.
template <class Run>
void conv2d_backward(Run& run, const ConvPlan& c, const float* x, const float* dy, const float* weight, float* weight_grad,
                     float* bias_grad, float* dx, float* cols, float* dcols, float* dyt) {
    if (c.N == 0) return;
    channel_major(run, dy, dyt, c.N, c.O, c.P);
    im2col(run, c, x, cols, /*sample_major=*/false);
    gemm(run, conv_weight_grad_gemm(c, cols, dyt, weight_grad));
    if (bias_grad != nullptr) channel_sums(run, dy, c.N, c.O, c.P, bias_grad);
    gemm(run, conv_input_grad_gemm(c, weight, dyt, dcols));
    col2im(run, c, dcols, dx, /*sample_major=*/false);
}

//! y (N, out) = x (N, in) W^T + bias (may be null); with `relu` y = max(0, y), mask (may be null) = y > 0.
template <class Run>
void linear_forward(Run& run, std::int64_t N, std::int64_t in, std::int64_t out, const float* x, const float* weight,
                    const float* bias, float* y, bool relu, std::uint8_t* mask) {
    gemm(run, linear_forward_gemm(N, in, out, x, weight, y));
    if (bias != nullptr || relu) bias_act(run, y, N, out, 1, bias, relu, mask);
}

//! weight_grad += g^T x, bias_grad += column sums of g (may be null), dx = g W, where g = dy, or
//! with `mask` dy where the mask is set, written into `masked` (N out floats).
template <class Run>
void linear_backward(Run& run, std::int64_t N, std::int64_t in, std::int64_t out, const float* x, const float* dy,
                     const std::uint8_t* mask, float* masked, const float* weight, float* weight_grad, float* bias_grad,
                     float* dx) {
    const float* g = dy;
    if (mask != nullptr) {
        relu_backward(run, dy, mask, masked, N * out);
        g = masked;
    }
    gemm(run, linear_weight_grad_gemm(N, in, out, x, g, weight_grad));
    if (bias_grad != nullptr) channel_sums(run, g, N, out, 1, bias_grad);
    gemm(run, linear_input_grad_gemm(N, in, out, weight, g, dx));
}

}  // namespace lockstep::kernels::device::layer_kernels
