// SPDX-License-Identifier: MIT
//! `kernels::Ops<Host>`: the backend operations on the host (OpenBLAS and the host loops).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "lockstep/core/bfloat16.hpp"
#include "lockstep/core/config.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/tensor.hpp"
#include "lockstep/kernels/batch_norm_host.hpp"
#include "lockstep/kernels/batch_norm_math.hpp"
#include "lockstep/kernels/host_blas.hpp"
#include "lockstep/kernels/ops.hpp"
#include "lockstep/kernels/host_conv_engine.hpp"
// Where lockstep was built with oneDNN, it serves host convolutions (Note [convolution engine
// hook]); nvcc's front end does not take oneDNN's headers, and does not need to.
#if LOCKSTEP_WITH_DNNL && !defined(__CUDACC__)
#include "lockstep/kernels/host_dnnl.hpp"
#endif

namespace lockstep::kernels {
//! The host backend's operations (see Note [backend operations]). Every operation runs on the
//! calling replica thread; nothing here synchronizes with another thread.
template <>
struct Ops<Host> {
    using Ex = Execution<Host>;
    template <class T>
    using T_ = Tensor<T, Host>;

    // ---- replicas ----------------------------------------------------------------------------

    //! Held by DataParallel for its lifetime: OpenBLAS single-threaded (Note [one BLAS thread per replica]).
    using Runtime = blas::SingleThreadScope;

    //! What a replica owns on the backend besides its tensors (on the host: which replica it is).
    //! Made on the replica's thread. A thread works for the replica through `enter()` (a guard)
    //! or, for the replica's own persistent threads, `bind_thread()`.
    struct ReplicaResources {
        explicit ReplicaResources(const Device& device) : index(device.index) {}
        Ex execution() const { return {}; }
        //! While the guard lives, new tensors of the calling thread go on the replica's device.
        class Entered {
        public:
            explicit Entered(int index) noexcept : previous_(current_host_device().index) { set_current_host_device(index); }
            Entered(const Entered&) = delete;
            Entered& operator=(const Entered&) = delete;
            ~Entered() { set_current_host_device(previous_); }

        private:
            int previous_;
        };
        [[nodiscard]] Entered enter() const { return Entered(index); }
        //! New tensors of the calling thread go on the replica's device for the rest of the
        //! thread's life; oneDNN runs on it alone.
        void bind_thread() const {
            set_current_host_device(index);
            if (const auto init = detail::host_conv_engine().enter_thread) init();
        }
        int index;
    };

    //! A named range of a step for profilers (NVTX on CUDA); nothing on the host.
    struct Range {
        explicit Range(const char*) noexcept {}
    };

    //! The host runs every step eagerly: no graphs (DataParallel refuses
    //! DataParallelOptions::graphs on it; Note [captured steps] in parallel/step.hpp).
    static constexpr bool graphs = false;
    //! No bf16 products on the host (Note [precision]): DataParallel refuses Precision::bf16.
    static constexpr bool bf16_products = false;
    //! No layer runs on activations stored in bf16 on the host: nn::Sequential widens them for it
    //! (Note [activation precision]).
    static constexpr bool bf16_activations = false;
    struct GraphCache {
        using Key = std::vector<std::int64_t>;
        explicit GraphCache(std::size_t = 8) noexcept {}
        void clear() noexcept {}
        std::size_t size() const noexcept { return 0; }
    };

    //! The devices of `replicas` host replicas: host:0, host:1, ...
    static std::vector<Device> default_devices(int replicas) {
        LOCKSTEP_CHECK(replicas > 0, "DataParallel needs at least one replica, got ", replicas);
        std::vector<Device> d;
        for (int r = 0; r < replicas; ++r) d.push_back(Device::host(r));
        return d;
    }

    // ---- generic ----------------------------------------------------------------------------

    template <class T>
    static void fill(const Ex&, T_<T>& t, T value) {
        std::fill(t.data(), t.data() + t.numel(), value);
    }

    //! dst[dst_offset, +count) = src[src_offset, +count).
    template <class T>
    static void copy(const Ex&, T_<T>& dst, std::int64_t dst_offset, const T_<T>& src, std::int64_t src_offset,
                     std::int64_t count) {
        if (count > 0) std::memcpy(dst.data() + dst_offset, src.data() + src_offset, static_cast<std::size_t>(count) * sizeof(T));
    }

    //! t *= factor (in fp32).
    static void scale(const Ex&, T_<float>& t, double factor) {
        const auto f = static_cast<float>(factor);
        for (float& v : t.span()) v *= f;
    }

    //! acc += x, element by element.
    template <class T>
    static void add(const Ex&, T_<T>& acc, const T_<T>& x) {
        for (std::int64_t i = 0; i < acc.numel(); ++i) acc[i] += x[i];
    }

    //! dst = src rounded to bfloat16 (Note [bfloat16 storage]): an activation stored in bf16.
    static void to_bf16(const Ex&, const T_<float>& src, T_<BFloat16>& dst) {
        check_same_count(src.numel(), dst.numel(), "to_bf16");
        const float* s = src.data();
        BFloat16* d = dst.data();
        for (std::int64_t i = 0; i < src.numel(); ++i) d[i] = BFloat16::round(s[i]);
    }

    //! dst = src widened to fp32 (exact).
    static void from_bf16(const Ex&, const T_<BFloat16>& src, T_<float>& dst) {
        check_same_count(src.numel(), dst.numel(), "from_bf16");
        const BFloat16* s = src.data();
        float* d = dst.data();
        for (std::int64_t i = 0; i < src.numel(); ++i) d[i] = s[i].widen();
    }

    //! Element `i` of `t`, on the host.
    template <class T>
    static T read(const Ex&, const T_<T>& t, std::int64_t i) {
        return t[i];
    }

    //! acc[index] += sum(t^2) in fp64 (NaN or infinity anywhere in t makes it non-finite).
    static void add_sum_squares(const Ex&, const T_<float>& t, T_<double>& acc, std::int64_t index = 0) {
        double s = 0;
        for (const float v : t.span()) s += static_cast<double>(v) * v;
        acc[index] += s;
    }

    //! All of `t`'s elements on the host, in one copy (the step's one wait for the device on CUDA).
    template <class T>
    static std::vector<T> to_vector(const Ex&, const T_<T>& t) {
        return {t.data(), t.data() + t.numel()};
    }

    //! Host copies are complete when they return: nothing to mark or wait for (see Ops<Cuda>).
    static void mark_inputs_read(const Ex&) noexcept {}
    static void wait_inputs_read(const Ex&) noexcept {}
    //! Host work has no streams to order (see Ops<Cuda>).
    static Ex caller_execution(const Device&) noexcept { return {}; }
    static void order_after(const Ex&, const Ex&) noexcept {}

    //! t *= min(1, max_norm / (sqrt(sum_squares[0]) + 1e-6)): clipping by a global norm, as
    //! torch.nn.utils.clip_grad_norm_.
    static void clip_to_norm(const Ex& ex, T_<float>& t, const T_<double>& sum_squares, double max_norm) {
        const double coef = max_norm / (std::sqrt(sum_squares[0]) + 1e-6);
        if (coef < 1.0) scale(ex, t, coef);
    }

    // ---- convolution and linear layers --------------------------------------------------------

    //! What a convolution keeps between calls: a convolution library's plans for its recent shapes
    //! (Note [oneDNN convolutions]), or one sample's im2col matrix and its gradient, and NCHW
    //! copies of NHWC tensors for the im2col path.
    struct ConvScratch {
        detail::FreshOnCopy plans;
        std::vector<float> cols, dcols, a, b;
    };

    //! y = conv(x, weight) + bias; `bias` may be null.
    static void conv2d_forward(const Ex&, const ConvGeometry& g, const T_<float>& x, const T_<float>& weight,
                               const T_<float>* bias, T_<float>& y, ConvScratch& s) {
        const auto& engine = detail::host_conv_engine();
        if (g.batch > 0 && engine.forward != nullptr &&
            engine.forward(s.plans, g, x.data(), weight.data(), bias != nullptr ? bias->data() : nullptr, y.data()))
            return;
        if (!g.channels_last) return im2col_forward(g, x.data(), weight.data(), bias, y.data(), s);
        // im2col works on NCHW: NHWC goes through NCHW copies.
        const std::int64_t OH = g.out_height(), OW = g.out_width();
        s.a.resize(static_cast<std::size_t>(x.numel()));
        s.b.resize(static_cast<std::size_t>(y.numel()));
        to_channels_first(x.data(), s.a.data(), g.batch, g.in_channels, g.height * g.width);
        im2col_forward(g, s.a.data(), weight.data(), bias, s.b.data(), s);
        to_channels_last(s.b.data(), y.data(), g.batch, g.out_channels, OH * OW);
    }

    //! weight_grad += dL/dweight, bias_grad += dL/dbias (may be null), dx = dL/dx.
    static void conv2d_backward(const Ex&, const ConvGeometry& g, const T_<float>& x, const T_<float>& dy,
                                const T_<float>& weight, T_<float>& weight_grad, T_<float>* bias_grad, T_<float>& dx,
                                ConvScratch& s) {
        const auto& engine = detail::host_conv_engine();
        if (g.batch > 0 && engine.backward != nullptr &&
            engine.backward(s.plans, g, x.data(), dy.data(), weight.data(), weight_grad.data(),
                            bias_grad != nullptr ? bias_grad->data() : nullptr, dx.data()))
            return;
        if (!g.channels_last) return im2col_backward(g, x.data(), dy.data(), weight, weight_grad, bias_grad, dx.data(), s);
        const std::int64_t P = g.height * g.width, OP = g.out_height() * g.out_width();
        s.a.resize(static_cast<std::size_t>(x.numel()));
        s.b.resize(static_cast<std::size_t>(dy.numel()));
        to_channels_first(x.data(), s.a.data(), g.batch, g.in_channels, P);
        to_channels_first(dy.data(), s.b.data(), g.batch, g.out_channels, OP);
        std::vector<float> dx_first(static_cast<std::size_t>(dx.numel()));
        im2col_backward(g, s.a.data(), s.b.data(), weight, weight_grad, bias_grad, dx_first.data(), s);
        to_channels_last(dx_first.data(), dx.data(), g.batch, g.in_channels, P);
    }

    //! y (N, out) = x (N, in) weight^T + bias (`bias` may be null); with `relu`, y = max(0, y) in the
    //! same pass over y and `mask` (may be null) = (y > 0).
    static void linear_forward(const Ex&, const T_<float>& x, const T_<float>& weight, const T_<float>* bias, T_<float>& y,
                               bool relu, T_<std::uint8_t>* mask) {
        const std::int64_t N = x.dim(0), in = x.dim(1), out = weight.dim(0);
        linear_gemm(false, true, N, out, in, x.data(), in, weight.data(), in, 0.0f, y.data(), out);
        if (bias == nullptr && !relu) return;
        float* LOCKSTEP_RESTRICT p = y.data();
        const float* LOCKSTEP_RESTRICT b = bias != nullptr ? bias->data() : nullptr;
        std::uint8_t* LOCKSTEP_RESTRICT m = mask != nullptr ? mask->data() : nullptr;
        for (std::int64_t n = 0; n < N; ++n)
            for (std::int64_t o = 0; o < out; ++o) {
                const std::int64_t i = n * out + o;
                const float v = b != nullptr ? p[i] + b[o] : p[i];
                if (m != nullptr) m[i] = v > 0.0f;
                p[i] = relu ? host::relu(v) : v;
            }
    }

    //! weight_grad += dy^T x, bias_grad += column sums of dy (may be null), dx = dy weight; `mask`
    //! (may be null) zeroes dy where the fused ReLU's output was not positive.
    static void linear_backward(const Ex&, const T_<float>& x, const T_<float>& dy, const T_<std::uint8_t>* mask,
                                const T_<float>& weight, T_<float>& weight_grad, T_<float>* bias_grad, T_<float>& dx) {
        const std::int64_t N = x.dim(0), in = x.dim(1), out = weight.dim(0);
        const float* g = dy.data();
        if (mask != nullptr) {
            float* masked = host::thread_buffer(static_cast<std::size_t>(N * out));
            host::mask_into(dy.data(), mask->data(), masked, N * out);
            g = masked;
        }
        linear_gemm(true, false, out, in, N, g, out, x.data(), in, 1.0f, weight_grad.data(), in);
        if (bias_grad != nullptr)
            for (std::int64_t n = 0; n < N; ++n)
                for (std::int64_t o = 0; o < out; ++o) (*bias_grad)[o] += g[n * out + o];
        linear_gemm(false, false, N, in, out, g, out, weight.data(), in, 0.0f, dx.data(), in);
    }

    // The linear layers' products: oneDNN's matmul where the program has it (Note [oneDNN matmul
    // for linear layers]), else OpenBLAS.
    static void linear_gemm(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, const float* a,
                            std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c, std::int64_t ldc) {
        if (const auto hook = detail::host_conv_engine().gemm;
            hook != nullptr && hook(trans_a, trans_b, m, n, k, a, lda, b, ldb, beta, c, ldc))
            return;
        blas::gemm(trans_a, trans_b, m, n, k, 1.0f, a, lda, b, ldb, beta, c, ldc);
    }

    // ---- activations and pooling --------------------------------------------------------------

    //! x = max(x, 0) in place (NaN stays NaN); `mask` (may be null) records where x > 0.
    static void relu_forward(const Ex&, T_<float>& x, T_<std::uint8_t>* mask) {
        float* LOCKSTEP_RESTRICT p = x.data();
        const std::int64_t n = x.numel();
        if (mask == nullptr) {
            for (std::int64_t i = 0; i < n; ++i) p[i] = host::relu(p[i]);
            return;
        }
        std::uint8_t* LOCKSTEP_RESTRICT m = mask->data();
        for (std::int64_t i = 0; i < n; ++i) {
            const float v = p[i];
            m[i] = v > 0.0f;
            p[i] = host::relu(v);
        }
    }

    //! dx = mask ? dy : 0.
    static void relu_backward(const Ex&, const T_<float>& dy, const T_<std::uint8_t>& mask, T_<float>& dx) {
        host::mask_into(dy.data(), mask.data(), dx.data(), dy.numel());
    }

    //! y = the maximum of each window (NaN wins, as in PyTorch: the last NaN of the window in row
    //! order), argmax = its index in the plane. One pass over x, a row of outputs at a time.
    static void maxpool_forward(const Ex&, const PoolGeometry& g, const T_<float>& x, T_<float>& y, T_<std::int32_t>& argmax) {
        const std::int64_t H = g.height, W = g.width, OH = g.out_height(), OW = g.out_width(), k = g.kernel, s = g.stride;
        for (std::int64_t nc = 0; nc < g.batch * g.channels; ++nc) {
            const float* LOCKSTEP_RESTRICT src = x.data() + nc * H * W;
            for (std::int64_t oh = 0; oh < OH; ++oh) {
                float* LOCKSTEP_RESTRICT best = y.data() + (nc * OH + oh) * OW;
                std::int32_t* LOCKSTEP_RESTRICT at = argmax.data() + (nc * OH + oh) * OW;
                const std::int64_t top = oh * s * W;
                for (std::int64_t ow = 0; ow < OW; ++ow) {
                    best[ow] = src[top + ow * s];
                    at[ow] = static_cast<std::int32_t>(top + ow * s);
                }
                for (std::int64_t i = 0; i < k; ++i)
                    for (std::int64_t j = 0; j < k; ++j) {
                        if (i == 0 && j == 0) continue;
                        const std::int64_t row = top + i * W + j;
                        for (std::int64_t ow = 0; ow < OW; ++ow) {
                            const float v = src[row + ow * s];
                            const bool take = v > best[ow] || v != v;
                            best[ow] = take ? v : best[ow];
                            at[ow] = take ? static_cast<std::int32_t>(row + ow * s) : at[ow];
                        }
                    }
            }
        }
    }

    //! dx = dy scattered onto the window maxima (dx is zeroed first).
    static void maxpool_backward(const Ex&, const PoolGeometry& g, const T_<float>& dy, const T_<std::int32_t>& argmax,
                                 T_<float>& dx) {
        dx.zero();
        const std::int64_t HW = g.height * g.width, per = g.out_height() * g.out_width();
        const float* LOCKSTEP_RESTRICT d = dy.data();
        const std::int32_t* LOCKSTEP_RESTRICT a = argmax.data();
        float* LOCKSTEP_RESTRICT out = dx.data();
        for (std::int64_t plane = 0; plane * per < dy.numel(); ++plane)
            for (std::int64_t o = plane * per; o < (plane + 1) * per; ++o) out[plane * HW + a[o]] += d[o];
    }

    //! y = the mean of each window (Note [pooling and dropout per element]: the CUDA kernel's bits).
    static void avgpool_forward(const Ex&, const AvgPoolGeometry& g, const T_<float>& x, T_<float>& y) {
        check_count(x.numel(), g.in_numel(), "avgpool_forward", "x");
        check_count(y.numel(), g.out_numel(), "avgpool_forward", "y");
        const float* src = x.data();
        float* LOCKSTEP_RESTRICT out = y.data();
        for (std::int64_t i = 0; i < g.out_numel(); ++i) out[i] = pool::forward_at(g, src, i);
    }

    //! dx = each window's share of dy. Scattered window by window from zero: every input element
    //! receives its shares in the windows' row order, the order in which the CUDA kernel gathers
    //! them (pool::backward_at), so the bits are the same without a division per element.
    static void avgpool_backward(const Ex&, const AvgPoolGeometry& g, const T_<float>& dy, T_<float>& dx) {
        check_count(dy.numel(), g.out_numel(), "avgpool_backward", "dy");
        check_count(dx.numel(), g.in_numel(), "avgpool_backward", "dx");
        dx.zero();
        const float* LOCKSTEP_RESTRICT src = dy.data();
        for (std::int64_t plane = 0; plane < g.planes(); ++plane) {
            float* LOCKSTEP_RESTRICT out = dx.data() + plane * g.height * g.width;
            for (std::int64_t oh = 0; oh < g.out_height; ++oh) {
                const auto r = pool::window(oh, g.height, g.out_height, g.kernel_h, g.stride_h, g.adaptive);
                for (std::int64_t ow = 0; ow < g.out_width; ++ow) {
                    const auto c = pool::window(ow, g.width, g.out_width, g.kernel_w, g.stride_w, g.adaptive);
                    const float share = *src++ / static_cast<float>((r.end - r.begin) * (c.end - c.begin));
                    for (std::int64_t h = r.begin; h < r.end; ++h)
                        for (std::int64_t w = c.begin; w < c.end; ++w) out[h * g.width + w] += share;
                }
            }
        }
    }

    //! x *= (kept ? scale : 0) in place, element i kept where dropout::keep(d, i); mask = kept.
    static void dropout_forward(const Ex&, T_<float>& x, const DropoutDraw& d, T_<std::uint8_t>& mask) {
        check_count(mask.numel(), x.numel(), "dropout_forward", "the mask");
        float* LOCKSTEP_RESTRICT p = x.data();
        std::uint8_t* LOCKSTEP_RESTRICT m = mask.data();
        for (std::int64_t i = 0; i < x.numel(); ++i) {
            const bool k = dropout::keep(d, static_cast<std::uint64_t>(i));
            m[i] = k ? 1 : 0;
            p[i] = p[i] * (k ? d.scale : 0.0f);
        }
    }

    //! dx = dy * (mask ? scale : 0).
    static void dropout_backward(const Ex&, const T_<float>& dy, const T_<std::uint8_t>& mask, const DropoutDraw& d,
                                 T_<float>& dx) {
        check_count(mask.numel(), dy.numel(), "dropout_backward", "the mask");
        check_count(dx.numel(), dy.numel(), "dropout_backward", "dx");
        const float* LOCKSTEP_RESTRICT g = dy.data();
        const std::uint8_t* LOCKSTEP_RESTRICT m = mask.data();
        float* LOCKSTEP_RESTRICT out = dx.data();
        for (std::int64_t i = 0; i < dy.numel(); ++i) out[i] = g[i] * (m[i] != 0 ? d.scale : 0.0f);
    }

    // ---- the public tensor operations (nn/tensor_ops.hpp, Note [tensor operations per element]) ----

    //! out = alpha a + beta b, element by element (out may be a or b).
    static void axpby(const Ex&, float alpha, const T_<float>& a, float beta, const T_<float>& b, T_<float>& out) {
        check_count(b.numel(), a.numel(), "axpby", "b");
        check_count(out.numel(), a.numel(), "axpby", "out");
        const float* pa = a.data();
        const float* pb = b.data();
        float* po = out.data();
        for (std::int64_t i = 0; i < a.numel(); ++i) po[i] = tensor_math::axpby(alpha, pa[i], beta, pb[i]);
    }

    //! out = a * b, element by element (out may be a or b).
    static void multiply(const Ex&, const T_<float>& a, const T_<float>& b, T_<float>& out) {
        check_count(b.numel(), a.numel(), "multiply", "b");
        check_count(out.numel(), a.numel(), "multiply", "out");
        const float* pa = a.data();
        const float* pb = b.data();
        float* po = out.data();
        for (std::int64_t i = 0; i < a.numel(); ++i) po[i] = pa[i] * pb[i];
    }

    //! y (contiguous) = the scaled sums of x over the reduced dimensions.
    static void reduce(const Ex&, const ReduceGeometry& g, const T_<float>& x, T_<float>& y) {
        check_count(y.numel(), g.kept.count(), "reduce", "y");
        check_count(x.numel(), g.kept.count() * g.reduced.count(), "reduce", "x");
        // tensor_math::reduce_at's sums, in its order, the reduced walk's innermost dimension in a tight loop.
        const float* src = x.data();
        for (std::int64_t o = 0; o < y.numel(); ++o) {
            const float* base = src + g.kept.offset(o);
            double sum = 0;
            tensor_math::for_each_offset(
                g.reduced, [&](std::int64_t, std::int64_t off) { sum = rounding::add_rn(sum, static_cast<double>(base[off])); });
            y.data()[o] = static_cast<float>(rounding::mul_rn(sum, g.scale));
        }
    }

    //! dx = dy broadcast back over the reduced dimensions, scaled.
    static void broadcast(const Ex&, const BroadcastGeometry& g, const T_<float>& dy, T_<float>& dx) {
        check_count(dx.numel(), g.input.count(), "broadcast", "dx");
        const float* src = dy.data();
        float* out = dx.data();
        tensor_math::for_each_offset(g.input, [&](std::int64_t i, std::int64_t off) {
            out[i] = static_cast<float>(rounding::mul_rn(static_cast<double>(src[off]), g.scale));  // broadcast_at
        });
    }

    //! y = softmax of x along the geometry's lines (y may be x).
    static void softmax_forward(const Ex&, const LineGeometry& g, const T_<float>& x, T_<float>& y) {
        check_count(x.numel(), g.lines.count() * g.length, "softmax_forward", "x");
        check_count(y.numel(), x.numel(), "softmax_forward", "y");
        for (std::int64_t l = 0; l < g.lines.count(); ++l) {
            const std::int64_t start = g.lines.offset(l);
            const auto line = tensor_math::softmax_stats(x.data() + start, g.length, g.step);
            for (std::int64_t k = 0; k < g.length; ++k)
                y.data()[start + k * g.step] = tensor_math::softmax_value(x.data()[start + k * g.step], line);
        }
    }

    //! dx = y (dy - sum(dy y)) along the lines.
    static void softmax_backward(const Ex&, const LineGeometry& g, const T_<float>& y, const T_<float>& dy, T_<float>& dx) {
        check_count(y.numel(), g.lines.count() * g.length, "softmax_backward", "y");
        check_count(dy.numel(), y.numel(), "softmax_backward", "dy");
        check_count(dx.numel(), y.numel(), "softmax_backward", "dx");
        for (std::int64_t l = 0; l < g.lines.count(); ++l) {
            const std::int64_t start = g.lines.offset(l);
            const double dot = tensor_math::softmax_dot(y.data() + start, dy.data() + start, g.length, g.step);
            for (std::int64_t k = 0; k < g.length; ++k) {
                const std::int64_t at = start + k * g.step;
                dx.data()[at] = tensor_math::softmax_grad_value(y.data()[at], dy.data()[at], dot);
            }
        }
    }

    //! index[l] = the position of line l's largest element.
    static void argmax(const Ex&, const LineGeometry& g, const T_<float>& x, T_<std::int64_t>& index) {
        check_count(x.numel(), g.lines.count() * g.length, "argmax", "x");
        check_count(index.numel(), g.lines.count(), "argmax", "the index");
        for (std::int64_t l = 0; l < index.numel(); ++l) index.data()[l] = tensor_math::argmax_line(g, x.data(), l);
    }

    //! dst[base + walk.offset(i)] = src[i] for every element of src (a slice put in its place).
    static void place(const Ex&, const PlaceGeometry& g, const T_<float>& src, T_<float>& dst) {
        check_count(src.numel(), g.walk.count(), "place", "src");
        const float* in = src.data();
        float* out = dst.data() + g.base;
        tensor_math::for_each_offset(g.walk, [&](std::int64_t i, std::int64_t off) { out[off] = in[i]; });
    }

    //! dst[i] = src[base + walk.offset(i)] for every element of dst (a slice taken out).
    static void take(const Ex&, const PlaceGeometry& g, const T_<float>& src, T_<float>& dst) {
        check_count(dst.numel(), g.walk.count(), "take", "dst");
        const float* in = src.data() + g.base;
        float* out = dst.data();
        tensor_math::for_each_offset(g.walk, [&](std::int64_t i, std::int64_t off) { out[i] = in[off]; });
    }

    //! Layer norm of each row of M values (Note [layer norm per row]): y, and each row's mean and
    //! 1/sqrt(var + eps) for backward; weight and bias (M each) may be null.
    static void layer_norm_forward(const Ex&, const T_<float>& x, std::int64_t M, const T_<float>* weight, const T_<float>* bias,
                                   double eps, T_<float>& y, T_<float>& mean, T_<float>& rstd) {
        const std::int64_t R = M > 0 ? x.numel() / M : 0;
        check_count(y.numel(), x.numel(), "layer_norm_forward", "y");
        check_count(mean.numel(), R, "layer_norm_forward", "mean");
        check_count(rstd.numel(), R, "layer_norm_forward", "rstd");
        const float* w = weight != nullptr ? weight->data() : nullptr;
        const float* b = bias != nullptr ? bias->data() : nullptr;
        for (std::int64_t i = 0; i < R; ++i) {
            const float* row = x.data() + i * M;
            float mu = 0, r = 0;
            layer_norm::row_stats(row, M, eps, mu, r);
            mean[i] = mu;
            rstd[i] = r;
            float* out = y.data() + i * M;
            for (std::int64_t j = 0; j < M; ++j) out[j] = layer_norm::forward_at(row[j], mu, r, w, b, j);
        }
    }

    //! Layer norm backward: dx per row; weight_grad and bias_grad (may be null) += their sums over rows.
    static void layer_norm_backward(const Ex&, const T_<float>& x, const T_<float>& dy, std::int64_t M, const T_<float>* weight,
                                    const T_<float>& mean, const T_<float>& rstd, T_<float>& dx, T_<float>* weight_grad,
                                    T_<float>* bias_grad) {
        const std::int64_t R = M > 0 ? x.numel() / M : 0;
        check_count(dy.numel(), x.numel(), "layer_norm_backward", "dy");
        check_count(dx.numel(), x.numel(), "layer_norm_backward", "dx");
        const float* w = weight != nullptr ? weight->data() : nullptr;
        for (std::int64_t i = 0; i < R; ++i)
            layer_norm::backward_row(x.data() + i * M, dy.data() + i * M, M, w, mean[i], rstd[i], dx.data() + i * M);
        if (weight_grad == nullptr && bias_grad == nullptr) return;
        for (std::int64_t j = 0; j < M; ++j)
            layer_norm::param_grads_at(x.data(), dy.data(), R, M, mean.data(), rstd.data(), j,
                                       weight_grad != nullptr ? weight_grad->data() : nullptr,
                                       bias_grad != nullptr ? bias_grad->data() : nullptr);
    }

    // ---- losses -------------------------------------------------------------------------------

    //! The values of `labels`, readable here without a wait: host memory is.
    static std::optional<std::span<const std::int64_t>> host_values(const T_<std::int64_t>& labels) {
        return std::span<const std::int64_t>(labels.data(), static_cast<std::size_t>(labels.numel()));
    }

    //! dst = `labels`.
    static void upload_labels(const Ex&, std::span<const std::int64_t> labels, T_<std::int64_t>& dst) {
        LOCKSTEP_CHECK_AS(ShapeError, dst.numel() == static_cast<std::int64_t>(labels.size()), "upload_labels: ", labels.size(),
                          " labels for a tensor of ", dst.numel());
        std::copy(labels.begin(), labels.end(), dst.data());
    }

    //! Softmax cross-entropy against labels in a tensor (checked by the caller), as below.
    static void softmax_cross_entropy(const Ex& ex, const T_<float>& logits, const T_<std::int64_t>& labels, double inv_count,
                                      T_<float>& grad, T_<double>& totals) {
        softmax_cross_entropy(ex, logits, std::span<const std::int64_t>(labels.data(), static_cast<std::size_t>(labels.numel())),
                              inv_count, grad, totals);
    }

    //! Softmax cross-entropy of `logits` (N, K) against `labels` (checked by the caller):
    //! totals = [sum of per-sample losses, samples whose arg-max is the label], grad =
    //! (softmax - onehot) * inv_count.
    static void softmax_cross_entropy(const Ex&, const T_<float>& logits, std::span<const std::int64_t> labels, double inv_count,
                                      T_<float>& grad, T_<double>& totals) {
        const std::int64_t N = logits.dim(0), K = logits.dim(1);
        double sum = 0;
        std::int64_t correct = 0;
        for (std::int64_t n = 0; n < N; ++n) {
            const std::int64_t label = labels[static_cast<std::size_t>(n)];
            const float* z = logits.data() + n * K;
            float* gr = grad.data() + n * K;
            const std::int64_t best = std::max_element(z, z + K) - z;
            const double zmax = z[best];
            double denom = 0;
            for (std::int64_t k = 0; k < K; ++k) denom += std::exp(static_cast<double>(z[k]) - zmax);
            const double log_denom = std::log(denom);
            sum += log_denom - (static_cast<double>(z[label]) - zmax);
            correct += best == label;
            for (std::int64_t k = 0; k < K; ++k) {
                const double p = std::exp(static_cast<double>(z[k]) - zmax - log_denom);
                gr[k] = static_cast<float>((p - (k == label ? 1.0 : 0.0)) * inv_count);
            }
        }
        totals[0] = sum;
        totals[1] = static_cast<double>(correct);
    }

    //! Mean squared error per sample (mean over a sample's D elements): totals = [sum over samples
    //! of mean((out - target)^2), 0], grad = 2 (out - target) / D * inv_count.
    static void mse(const Ex&, const T_<float>& out, const T_<float>& target, double inv_count, T_<float>& grad,
                    T_<double>& totals) {
        const std::int64_t N = out.rank() > 0 ? out.dim(0) : 0;
        const std::int64_t D = N > 0 ? out.numel() / N : 0;
        double sum = 0;
        for (std::int64_t n = 0; n < N; ++n) {
            double s = 0;
            for (std::int64_t d = 0; d < D; ++d) {
                const std::int64_t i = n * D + d;
                const double diff = static_cast<double>(out[i]) - static_cast<double>(target[i]);
                s += diff * diff;
                grad[i] = static_cast<float>(2.0 * diff / static_cast<double>(D) * inv_count);
            }
            sum += s / static_cast<double>(D);
        }
        totals[0] = sum;
        totals[1] = 0;
    }

    // ---- optimizer ----------------------------------------------------------------------------

    //! One torch.optim.SGD update of `value` from `grad`; `momentum_buffer` is ignored without
    //! momentum and initialized from the gradient when `first`.
    static void sgd_step(const Ex&, T_<float>& value, const T_<float>& grad, T_<float>& momentum_buffer, bool first,
                         const SgdUpdate& u) {
        sgd_loop(value.data(), grad.data(), momentum_buffer.data(), value.numel(), first, u);
    }

    //! sgd_step for every entry; entries that lie back to back in value, gradient and momentum
    //! (a DataParallel bucket: Note [momentum beside its bucket] in nn/sgd.hpp) run as one loop.
    static void sgd_step_many(const Ex&, std::span<const SgdTensors<Host>> items, const SgdUpdate& u) {
        const bool momentum = u.momentum != 0;
        for (std::size_t lo = 0; lo < items.size();) {
            std::int64_t n = items[lo].value->numel();
            std::size_t hi = lo + 1;
            while (hi < items.size() && items[hi].first == items[lo].first && items[hi].value->follows(*items[hi - 1].value) &&
                   items[hi].grad->follows(*items[hi - 1].grad) &&
                   (!momentum || items[hi].momentum->follows(*items[hi - 1].momentum))) {
                n += items[hi].value->numel();
                ++hi;
            }
            sgd_loop(items[lo].value->data(), items[lo].grad->data(), momentum ? items[lo].momentum->data() : nullptr, n,
                     items[lo].first, u);
            lo = hi;
        }
    }

    //! The update over n elements of flat arrays; each variant a loop of its own, so it vectorizes.
    static void sgd_loop(float* __restrict w, const float* __restrict gr, float* __restrict v, std::int64_t n, bool first,
                         const SgdUpdate& u) {
        const float lr = static_cast<float>(u.lr), mu = static_cast<float>(u.momentum),
                    damp = static_cast<float>(1.0 - u.dampening), wd = static_cast<float>(u.weight_decay);
        if (mu == 0.0f) {
            for (std::int64_t k = 0; k < n; ++k) w[k] -= lr * (gr[k] + wd * w[k]);
            return;
        }
        if (n > 0) LOCKSTEP_CHECK(v != nullptr, "sgd_step with momentum ", u.momentum, " got no momentum buffer");
        if (first && u.nesterov) {
            for (std::int64_t k = 0; k < n; ++k) {
                const float g = gr[k] + wd * w[k];
                v[k] = g;
                w[k] -= lr * (g + mu * g);
            }
        } else if (first) {
            for (std::int64_t k = 0; k < n; ++k) {
                const float g = gr[k] + wd * w[k];
                v[k] = g;
                w[k] -= lr * g;
            }
        } else if (u.nesterov) {
            for (std::int64_t k = 0; k < n; ++k) {
                const float g = gr[k] + wd * w[k];
                const float m = mu * v[k] + damp * g;
                v[k] = m;
                w[k] -= lr * (g + mu * m);
            }
        } else {
            for (std::int64_t k = 0; k < n; ++k) {
                const float g = gr[k] + wd * w[k];
                const float m = mu * v[k] + damp * g;
                v[k] = m;
                w[k] -= lr * m;
            }
        }
    }

    //! copy for every piece (on CUDA one launch for many pieces).
    //! One torch.optim.Adam (or AdamW) update of every entry (optim::adam_one per element, the
    //! CUDA kernel's bits).
    static void adam_step_many(const Ex&, std::span<const AdamTensors<Host>> items, const AdamUpdate& u) {
        for (const auto& it : items) {
            LOCKSTEP_CHECK_AS(UsageError, it.value && it.grad && it.exp_avg && it.exp_avg_sq,
                              "adam_step_many: an entry without its parameter, gradient or moment estimates");
            const std::int64_t n = it.value->numel();
            check_count(it.grad->numel(), n, "adam_step_many", "a gradient");
            check_count(it.exp_avg->numel(), n, "adam_step_many", "an exp_avg");
            check_count(it.exp_avg_sq->numel(), n, "adam_step_many", "an exp_avg_sq");
            float* LOCKSTEP_RESTRICT w = it.value->data();
            const float* LOCKSTEP_RESTRICT g = it.grad->data();
            float* LOCKSTEP_RESTRICT m = it.exp_avg->data();
            float* LOCKSTEP_RESTRICT v = it.exp_avg_sq->data();
            for (std::int64_t k = 0; k < n; ++k) optim::adam_one(u, w[k], g[k], m[k], v[k]);
        }
    }

    static void copy_many(const Ex& ex, std::span<const CopyPiece<Host>> pieces) {
        for (const auto& p : pieces) copy(ex, *p.dst, p.dst_offset, *p.src, p.src_offset, p.count);
    }

    // ---- batch norm (see batch_norm_math.hpp for the formulas) ---------------------------------

    //! Forward payload [S | Q | M | n] (3C+1) of the local batch (Note [shifted statistics]);
    //! leaves the local shifts in `k.shift` for `bn_centre`.
    static void bn_local_stats(const Ex&, const T_<float>& x, const BnGeometry& g, BnConstants<Host>& k, T_<double>& payload) {
        if (k.shift.numel() != g.channels) k.shift = T_<float>(Shape{g.channels});
        host::bn_local_stats(x.data(), g, k.shift.data(), payload.data());
    }

    //! Between the two all-reduces: [S | Q] re-centred on the batch's shift mu = M/N.
    static void bn_centre(const Ex&, const BnGeometry& g, const BnConstants<Host>& k, T_<double>& payload) {
        LOCKSTEP_CHECK_AS(UsageError, k.shift.numel() == g.channels,
                          "SyncBatchNorm: bn_centre ran without its statistics pass (bn_local_stats) before it");
        host::bn_centre(g, k.shift.data(), payload.data());
    }

    //! Statistics from the all-reduced payload (its count is the global count): fills `k`, and
    //! updates the running statistics once when `o.update_running` (null pointers: not tracked;
    //! `weight`/`bias` null: not affine).
    static void bn_forward_finish(const Ex&, const T_<double>& payload, const BnFinishOptions& o, T_<float>* running_mean,
                                  T_<float>* running_var, T_<std::int64_t>* num_batches_tracked, const T_<float>* weight,
                                  const T_<float>* bias, BnConstants<Host>& k) {
        const std::int64_t C = channels_of(k);
        const bn::ForwardPayload layout{C};
        const double count = payload[layout.count()];
        double factor = o.momentum.value_or(0.0);
        if (o.update_running) {
            (*num_batches_tracked)[0] += 1;
            if (!o.momentum) factor = 1.0 / static_cast<double>((*num_batches_tracked)[0]);
        }
        for (std::int64_t c = 0; c < C; ++c) {
            const auto st = bn::channel_stats(payload.data(), layout, c, o.eps);
            k.stats[c] = st.mean;
            k.stats[C + c] = st.invstd;
            if (o.update_running) bn::update_running((*running_mean)[c], (*running_var)[c], st, count, factor);
        }
        k.stats[2 * C] = count;
        fold(k, weight, bias);
    }

    //! Evaluation: the statistics are the running ones.
    static void bn_eval_constants(const Ex&, const T_<float>& running_mean, const T_<float>& running_var, double eps,
                                  const T_<float>* weight, const T_<float>* bias, BnConstants<Host>& k) {
        const std::int64_t C = channels_of(k);
        for (std::int64_t c = 0; c < C; ++c) {
            k.stats[c] = running_mean[c];
            k.stats[C + c] = 1.0 / std::sqrt(static_cast<double>(running_var[c]) + eps);
        }
        k.stats[2 * C] = 0;  // no batch was counted
        fold(k, weight, bias);
    }

    //! Whether a fused ReLU's forward keeps a mask for backward: yes, a byte per element (Note
    //! [fused batch norm + ReLU]); the layer hands it to bn_normalize and to backward.
    static constexpr bool bn_keeps_relu_mask = true;

    //! y = the normalized x; with `relu`, y = max(0, y) and `mask` (may be null) = (y > 0) (Note
    //! [fused batch norm + ReLU]).
    static void bn_normalize(const Ex&, const T_<float>& x, T_<float>& y, const BnGeometry& g, const BnConstants<Host>& k,
                             bool relu, T_<std::uint8_t>* mask) {
        const std::int64_t C = g.channels;
        const float* f = k.folded.data();
        if (relu)
            host::bn_normalize_relu(x.data(), y.data(), g, f, f + 2 * C, f + 3 * C, mask != nullptr ? mask->data() : nullptr);
        else
            host::bn_normalize(x.data(), y.data(), g, f, f + 2 * C, f + 3 * C);
    }

    //! Backward payload [sum(dy) | sum(dy * (x - mean))] (2C) of the local batch; with `relu`,
    //! `mask` (the forward's) zeroes dy where the fused ReLU's output was not positive.
    static void bn_backward_sums(const Ex&, const T_<float>& x, const T_<float>& dy, bool relu, const T_<std::uint8_t>* mask,
                                 const BnGeometry& g, const BnConstants<Host>& k, T_<double>& payload) {
        const std::int64_t C = g.channels;
        const float* f = k.folded.data();
        check_relu_mask(relu, mask, x.numel(), "bn_backward_sums");
        if (relu)
            host::bn_backward_sums_masked(x.data(), dy.data(), mask->data(), g, f, f + C, payload.data());
        else
            host::bn_backward_sums(x.data(), dy.data(), g, f, f + C, payload.data());
    }

    //! weight_grad += sum(dy * xhat), bias_grad += sum(dy) from the local backward payload.
    static void bn_param_grads(const Ex&, const T_<double>& payload, const BnConstants<Host>& k, T_<float>& weight_grad,
                               T_<float>& bias_grad) {
        const std::int64_t C = weight_grad.numel();
        const bn::BackwardPayload layout{C};
        for (std::int64_t c = 0; c < C; ++c) {
            weight_grad[c] += static_cast<float>(payload[layout.sum_dy_xmu(c)] * k.stats[C + c]);
            bias_grad[c] += static_cast<float>(payload[layout.sum_dy(c)]);
        }
    }

    //! dx from the all-reduced backward payload, with the forward's global count, written over `x`.
    static void bn_backward_dx(const Ex&, const T_<double>& payload, const BnConstants<Host>& k, const T_<float>* weight,
                               T_<float>& x_to_dx, const T_<float>& dy, bool relu, const T_<std::uint8_t>* mask,
                               const BnGeometry& g) {
        check_relu_mask(relu, mask, x_to_dx.numel(), "bn_backward_dx");
        const std::int64_t C = g.channels;
        const bn::BackwardPayload layout{C};
        const double count = k.stats[2 * C];
        std::vector<float> abc(static_cast<std::size_t>(3 * C));
        for (std::int64_t c = 0; c < C; ++c) {
            const auto q = bn::backward_constants(count, payload[layout.sum_dy(c)], payload[layout.sum_dy_xmu(c)], k.stats[c],
                                                  k.stats[C + c], weight != nullptr ? (*weight)[c] : 1.0);
            abc[static_cast<std::size_t>(c)] = q.a;
            abc[static_cast<std::size_t>(C + c)] = q.b;
            abc[static_cast<std::size_t>(2 * C + c)] = q.c;
        }
        if (relu)
            host::bn_backward_dx_masked(x_to_dx.data(), dy.data(), mask->data(), x_to_dx.data(), g, k.folded.data(), abc.data(),
                                        abc.data() + C, abc.data() + 2 * C);
        else
            host::bn_backward_dx(x_to_dx.data(), dy.data(), x_to_dx.data(), g, k.folded.data(), abc.data(), abc.data() + C,
                                 abc.data() + 2 * C);
    }

private:
    // (N, C, P) channels-last <-> channels-first.
    static void to_channels_first(const float* LOCKSTEP_RESTRICT src, float* LOCKSTEP_RESTRICT dst, std::int64_t N,
                                  std::int64_t C, std::int64_t P) {
        for (std::int64_t n = 0; n < N; ++n)
            for (std::int64_t p = 0; p < P; ++p)
                for (std::int64_t c = 0; c < C; ++c) dst[(n * C + c) * P + p] = src[(n * P + p) * C + c];
    }
    static void to_channels_last(const float* LOCKSTEP_RESTRICT src, float* LOCKSTEP_RESTRICT dst, std::int64_t N, std::int64_t C,
                                 std::int64_t P) {
        for (std::int64_t n = 0; n < N; ++n)
            for (std::int64_t p = 0; p < P; ++p)
                for (std::int64_t c = 0; c < C; ++c) dst[(n * P + p) * C + c] = src[(n * C + c) * P + p];
    }

    // The im2col + GEMM convolution over NCHW arrays, a sample at a time.
    static void im2col_forward(const ConvGeometry& g, const float* x, const float* weight, const T_<float>* bias, float* y,
                               ConvScratch& s) {
        const std::int64_t O = g.out_channels, P = g.out_height() * g.out_width(), K = g.in_channels * g.kernel * g.kernel;
        const std::int64_t in_sample = g.in_channels * g.height * g.width;
        s.cols.resize(static_cast<std::size_t>(K * P));
        for (std::int64_t n = 0; n < g.batch; ++n) {
            im2col(g, x + n * in_sample, s.cols.data());
            float* yn = y + n * O * P;
            blas::gemm(false, false, O, P, K, 1.0f, weight, K, s.cols.data(), P, 0.0f, yn, P);
            if (bias != nullptr)
                for (std::int64_t o = 0; o < O; ++o) {
                    const float b = (*bias)[o];
                    for (std::int64_t p = 0; p < P; ++p) yn[o * P + p] += b;
                }
        }
    }

    static void im2col_backward(const ConvGeometry& g, const float* x, const float* dy, const T_<float>& weight,
                                T_<float>& weight_grad, T_<float>* bias_grad, float* dx, ConvScratch& s) {
        const std::int64_t O = g.out_channels, P = g.out_height() * g.out_width(), K = g.in_channels * g.kernel * g.kernel;
        const std::int64_t in_sample = g.in_channels * g.height * g.width;
        s.cols.resize(static_cast<std::size_t>(K * P));
        s.dcols.resize(static_cast<std::size_t>(K * P));
        std::fill(dx, dx + g.batch * in_sample, 0.0f);  // col2im adds
        for (std::int64_t n = 0; n < g.batch; ++n) {
            const float* dyn = dy + n * O * P;
            im2col(g, x + n * in_sample, s.cols.data());
            blas::gemm(false, true, O, K, P, 1.0f, dyn, P, s.cols.data(), P, 1.0f, weight_grad.data(), K);
            if (bias_grad != nullptr)
                for (std::int64_t o = 0; o < O; ++o) {
                    float sum = 0;
                    for (std::int64_t p = 0; p < P; ++p) sum += dyn[o * P + p];
                    (*bias_grad)[o] += sum;
                }
            blas::gemm(true, false, K, P, O, 1.0f, weight.data(), K, dyn, P, 0.0f, s.dcols.data(), P);
            col2im(g, s.dcols.data(), dx + n * in_sample);
        }
    }

    static std::int64_t channels_of(const BnConstants<Host>& k) { return k.folded.numel() / 4; }

    static void check_count(std::int64_t got, std::int64_t expected, const char* op, const char* what) {
        LOCKSTEP_CHECK_AS(ShapeError, got == expected, op, ": ", what, " has ", got, " elements, expected ", expected);
    }
    static void check_same_count(std::int64_t src, std::int64_t dst, const char* op) {
        LOCKSTEP_CHECK_AS(ShapeError, src == dst, op, ": the source has ", src, " elements but the destination ", dst,
                          "; give both the same shape");
    }

    // A fused ReLU's backward on the host reads the forward's mask (bn_keeps_relu_mask).
    static void check_relu_mask(bool relu, const T_<std::uint8_t>* mask, std::int64_t n, const char* op) {
        LOCKSTEP_CHECK_AS(UsageError, !relu || (mask != nullptr && mask->numel() == n), op,
                          " on the host with a fused ReLU needs the forward's mask of ", n,
                          " bytes (Ops<Host>::bn_keeps_relu_mask); pass the mask bn_normalize wrote");
    }

    // Splits each mean into hi + lo and folds the affine parameters into scale and shift.
    static void fold(BnConstants<Host>& k, const T_<float>* weight, const T_<float>* bias) {
        const std::int64_t C = channels_of(k);
        for (std::int64_t c = 0; c < C; ++c) {
            const double mean = k.stats[c], invstd = k.stats[C + c];
            const auto split = bn::split_mean(mean);
            const auto q =
                bn::normalize_constants(mean, invstd, weight != nullptr ? (*weight)[c] : 1.0, bias != nullptr ? (*bias)[c] : 0.0);
            k.folded[c] = split.hi;
            k.folded[C + c] = split.lo;
            k.folded[2 * C + c] = q.scale;
            k.folded[3 * C + c] = q.shift;
        }
    }

    // cols[(c, i, j), (oh, ow)] = x[c, oh*s - p + i, ow*s - p + j], zero outside the image.
    static void im2col(const ConvGeometry& g, const float* x, float* col) {
        const std::int64_t s = g.stride, pad = g.padding, k = g.kernel, H = g.height, W = g.width;
        const std::int64_t OH = g.out_height(), OW = g.out_width(), P = OH * OW;
        for (std::int64_t c = 0; c < g.in_channels; ++c)
            for (std::int64_t i = 0; i < k; ++i)
                for (std::int64_t j = 0; j < k; ++j) {
                    float* row = col + ((c * k + i) * k + j) * P;
                    for (std::int64_t oh = 0; oh < OH; ++oh) {
                        const std::int64_t h = oh * s - pad + i;
                        float* out = row + oh * OW;
                        if (h < 0 || h >= H) {
                            std::fill(out, out + OW, 0.0f);
                            continue;
                        }
                        const float* src = x + (c * H + h) * W;
                        for (std::int64_t ow = 0; ow < OW; ++ow) {
                            const std::int64_t w = ow * s - pad + j;
                            out[ow] = (w >= 0 && w < W) ? src[w] : 0.0f;
                        }
                    }
                }
    }

    // The adjoint of im2col: adds dcols back onto the image positions they were read from.
    static void col2im(const ConvGeometry& g, const float* col, float* dx) {
        const std::int64_t s = g.stride, pad = g.padding, k = g.kernel, H = g.height, W = g.width;
        const std::int64_t OH = g.out_height(), OW = g.out_width(), P = OH * OW;
        for (std::int64_t c = 0; c < g.in_channels; ++c)
            for (std::int64_t i = 0; i < k; ++i)
                for (std::int64_t j = 0; j < k; ++j) {
                    const float* row = col + ((c * k + i) * k + j) * P;
                    for (std::int64_t oh = 0; oh < OH; ++oh) {
                        const std::int64_t h = oh * s - pad + i;
                        if (h < 0 || h >= H) continue;
                        float* dst = dx + (c * H + h) * W;
                        const float* in = row + oh * OW;
                        for (std::int64_t ow = 0; ow < OW; ++ow) {
                            const std::int64_t w = ow * s - pad + j;
                            if (w >= 0 && w < W) dst[w] += in[ow];
                        }
                    }
                }
    }
};

static_assert(BackendOps<Ops<Host>, Host>, "Ops<Host> lacks an operation of BackendOps (kernels/ops.hpp)");

}  // namespace lockstep::kernels
