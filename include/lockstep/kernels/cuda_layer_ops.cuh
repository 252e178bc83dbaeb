// SPDX-License-Identifier: MIT
//! The CUDA backend's layer operations: fills and arithmetic over tensors, convolution and linear
//! layers (cuBLAS), activations, pooling, losses and SGD. Part of `kernels::Ops<Cuda>`.
#pragma once

#include <array>
#include <concepts>
#include <cstdint>
#include <span>
#include <vector>

#include "lockstep/kernels/cuda_common.cuh"
#include "lockstep/kernels/cuda_cudnn.cuh"
#include "lockstep/kernels/cuda_layer_run.cuh"
#include "lockstep/kernels/device/launch.cuh"
#include "lockstep/kernels/device/gemm_layers.cuh"
#include "lockstep/kernels/device/layer_kernels.cuh"
#include "lockstep/kernels/device/loss_kernels.cuh"
#include "lockstep/kernels/device/table_kernels.cuh"

namespace lockstep::kernels::cuda_ops {

//! The layer part of `Ops<Cuda>` (see Note [backend operations]); everything runs on `ex.stream`
//! and nothing waits for the device. The kernels and their launch configurations are in device/
//! (layer_kernels.cuh, loss_kernels.cuh, table_kernels.cuh: Note [layer kernels]), the cuBLAS
//! arguments in device/gemm_layers.cuh (Note [convolution on CUDA]).
struct LayerOps {
    template <class T>
    static void fill(const Ex& ex, T_<T>& t, T value) {
        layer_detail::check_on(ex, t, "fill's tensor");
        layer_detail::LayerRun run(ex);
        device::layer_kernels::fill(run, t.data(), t.numel(), value);
    }

    //! t *= factor (in fp32).
    static void scale(const Ex& ex, T_<float>& t, double factor) {
        layer_detail::check_on(ex, t, "scale's tensor");
        layer_detail::LayerRun run(ex);
        device::layer_kernels::scale(run, t.data(), t.numel(), static_cast<float>(factor));
    }

    //! acc += x, element by element.
    template <class T>
    static void add(const Ex& ex, T_<T>& acc, const T_<T>& x) {
        layer_detail::check_on(ex, acc, "add's accumulator");
        layer_detail::check_on(ex, x, "add's operand");
        layer_detail::check_numel(x, acc.numel(), "add", "the operand");
        layer_detail::LayerRun run(ex);
        device::layer_kernels::add(run, acc.data(), x.data(), acc.numel());
    }

    //! dst = src rounded to bfloat16 (Note [precision]; a gradient bucket's bf16 all-reduce, an
    //! activation stored in bf16), `dst` holding the bf16 bits: lockstep::BFloat16 or raw 16 bits.
    template <bf16_bits Bits>
    static void to_bf16(const Ex& ex, const T_<float>& src, T_<Bits>& dst) {
        layer_detail::check_on(ex, src, "to_bf16's source");
        layer_detail::check_on(ex, dst, "to_bf16's destination");
        layer_detail::check_numel(dst, src.numel(), "to_bf16", "the destination");
        layer_detail::LayerRun run(ex);
        device::layer_kernels::to_bf16(run, src.data(), reinterpret_cast<__nv_bfloat16*>(dst.data()), src.numel());
    }

    //! dst = src's bfloat16 bits widened to fp32 (exact).
    template <bf16_bits Bits>
    static void from_bf16(const Ex& ex, const T_<Bits>& src, T_<float>& dst) {
        layer_detail::check_on(ex, src, "from_bf16's source");
        layer_detail::check_on(ex, dst, "from_bf16's destination");
        layer_detail::check_numel(dst, src.numel(), "from_bf16", "the destination");
        layer_detail::LayerRun run(ex);
        device::layer_kernels::from_bf16(run, reinterpret_cast<const __nv_bfloat16*>(src.data()), dst.data(), src.numel());
    }

    //! acc[index] += sum(t^2) in fp64, on the device.
    static void add_sum_squares(const Ex& ex, const T_<float>& t, T_<double>& acc, std::int64_t index = 0) {
        layer_detail::check_on(ex, t, "add_sum_squares's tensor");
        layer_detail::check_on(ex, acc, "add_sum_squares's accumulator");
        LOCKSTEP_CHECK_AS(ShapeError, index >= 0 && index < acc.numel(), "add_sum_squares on CUDA: index ", index,
                          " is outside the accumulator of ", acc.numel(), " elements");
        layer_detail::LayerRun run(ex);
        device::layer_kernels::add_sum_squares(run, t.data(), t.numel(), acc.data() + index);
    }

    //! t *= min(1, max_norm / (sqrt(sum_squares[0]) + 1e-6)), the coefficient computed on the
    //! device from the device's sum of squares (no read on the host).
    static void clip_to_norm(const Ex& ex, T_<float>& t, const T_<double>& sum_squares, double max_norm) {
        layer_detail::check_on(ex, t, "clip_to_norm's tensor");
        layer_detail::check_on(ex, sum_squares, "clip_to_norm's sum of squares");
        LOCKSTEP_CHECK_AS(ShapeError, sum_squares.numel() >= 1,
                          "clip_to_norm on CUDA needs the sum of squares, got an empty tensor");
        layer_detail::LayerRun run(ex);
        device::layer_kernels::clip_to_norm(run, t.data(), t.numel(), sum_squares.data(), max_norm);
    }

    // ---- layers -----------------------------------------------------------------------------

    //! What a convolution keeps between calls: nothing on CUDA; its buffers are the replica's
    //! (Note [one layer workspace]).
    struct ConvScratch {};

    //! y = conv(x, weight) + bias; `bias` may be null. NCHW only (NotImplemented for NHWC).
    static void conv2d_forward(const Ex& ex, const ConvGeometry& g, const T_<float>& x, const T_<float>& weight,
                               const T_<float>* bias, T_<float>& y, ConvScratch&) {
        const device::layer_kernels::ConvPlan c(g);
        check_conv(ex, c, x, weight, bias, "conv2d_forward");
        layer_detail::check_numel(y, c.N * c.O * c.P, "conv2d_forward", "y");
        layer_detail::LayerRun run(ex);
#if LOCKSTEP_WITH_CUDNN
        if (ex.cudnn != nullptr && ex.precision == Precision::fp32 && c.N > 0 && c.O > 0 &&
            c.C > 0 &&  // Note [cuDNN convolutions]
            ex.cudnn->forward(ex.stream, c, ex.math, x.data(), weight.data(), y.data(), workspace_bytes(ex))) {
            if (bias != nullptr) device::layer_kernels::bias_act(run, y.data(), c.N, c.O, c.P, bias->data(), false, nullptr);
            return;
        }
#endif
        if (ex.precision == Precision::bf16 && c.N > 0 && c.O > 0 && c.K > 0 && c.P > 0) {
#if LOCKSTEP_WITH_CUDNN
            if (cudnn_bf16(ex, c)) {  // y widened from cuDNN's bf16 y, then the bias in fp32
                const __nv_bfloat16* y16 = cudnn_forward_bf16(run, ex, c, x.data(), weight, nullptr);
                device::layer_kernels::from_bf16(run, y16, y.data(), y.numel());
                if (bias != nullptr) device::layer_kernels::bias_act(run, y.data(), c.N, c.O, c.P, bias->data(), false, nullptr);
                return;
            }
#endif
            conv_forward_on_bf16(run, ex, c, x.data(), weight, bias, y.data());
            return;
        }
        float* cols = workspace(ex).at_least(device::layer_kernels::conv_forward_buffers(c).cols, ex.device);
        device::layer_kernels::conv2d_forward(run, c, x.data(), weight.data(), bias != nullptr ? bias->data() : nullptr, y.data(),
                                              cols);
    }

    //! weight_grad += dL/dweight, bias_grad += dL/dbias (may be null), dx = dL/dx. NCHW only.
    static void conv2d_backward(const Ex& ex, const ConvGeometry& g, const T_<float>& x, const T_<float>& dy,
                                const T_<float>& weight, T_<float>& weight_grad, T_<float>* bias_grad, T_<float>& dx,
                                ConvScratch&) {
        const device::layer_kernels::ConvPlan c(g);
        check_conv_backward(ex, c, x, dy, weight, weight_grad, bias_grad, dx);
        layer_detail::LayerRun run(ex);
#if LOCKSTEP_WITH_CUDNN
        if (ex.cudnn != nullptr && ex.precision == Precision::fp32 && c.N > 0 && c.O > 0 &&
            c.C > 0 &&  // Note [cuDNN convolutions]
            ex.cudnn->backward(ex.stream, c, ex.math, x.data(), dy.data(), weight.data(), weight_grad.data(), dx.data(),
                               workspace_bytes(ex))) {
            if (bias_grad != nullptr) device::layer_kernels::channel_sums(run, dy.data(), c.N, c.O, c.P, bias_grad->data());
            return;
        }
#endif
        if (ex.precision == Precision::bf16 && c.N > 0 && c.O > 0 && c.K > 0 && c.P > 0) {
#if LOCKSTEP_WITH_CUDNN
            if (cudnn_bf16(ex, c)) {  // dx widened from cuDNN's bf16 dx
                const __nv_bfloat16* dx16 =
                    cudnn_backward_bf16(run, ex, c, x.data(), dy.data(), weight, weight_grad, bias_grad, nullptr);
                device::layer_kernels::from_bf16(run, dx16, dx.data(), dx.numel());
                return;
            }
#endif
            conv_backward_on_bf16(run, ex, c, x.data(), dy.data(), weight, weight_grad, bias_grad, dx.data());
            return;
        }
        const auto sizes = device::layer_kernels::conv_backward_buffers(c);
        const std::int64_t at_dcols = LayerWorkspace::aligned(sizes.cols),
                           at_dyt = at_dcols + LayerWorkspace::aligned(sizes.dcols);
        float* cols = workspace(ex).at_least(at_dyt + sizes.dyt, ex.device);
        float* dcols = cols + at_dcols;
        float* dyt = cols + at_dyt;
        device::layer_kernels::conv2d_backward(run, c, x.data(), dy.data(), weight.data(), weight_grad.data(),
                                               bias_grad != nullptr ? bias_grad->data() : nullptr, dx.data(), cols, dcols, dyt);
    }

    //! The bf16 form of conv2d_forward (Note [activation precision]): y stored in bf16, from x in
    //! fp32 or stored in bf16, the products on bf16 operands (Note [precision]) accumulated in fp32,
    //! the bias added in fp32 before the one rounding (through cuDNN, y is rounded by cuDNN before
    //! the bias too: Note [cuDNN convolutions]). Under Precision::bf16 only.
    template <activation_storage X>
    static void conv2d_forward(const Ex& ex, const ConvGeometry& g, const T_<X>& x, const T_<float>& weight,
                               const T_<float>* bias, T_<BFloat16>& y, ConvScratch&) {
        const device::layer_kernels::ConvPlan c(g);
        check_conv(ex, c, x, weight, bias, "conv2d_forward");
        layer_detail::check_numel(y, c.N * c.O * c.P, "conv2d_forward", "y");
        check_bf16_activations(ex, "conv2d_forward");
        if (y.numel() == 0) return;
        layer_detail::LayerRun run(ex);
#if LOCKSTEP_WITH_CUDNN
        if (cudnn_bf16(ex, c)) {  // cuDNN's bf16 y, then the bias in fp32 and a second rounding
            __nv_bfloat16* y16 = on_device(y.data());
            cudnn_forward_bf16(run, ex, c, on_device(x.data()), weight, y16);
            if (bias != nullptr) device::layer_kernels::bias_act(run, y16, c.N, c.O, c.P, bias->data(), false, nullptr);
            return;
        }
#endif
        // y in fp32 in the workspace's fp32 buffer (the products' operands are in its bf16 one),
        // then the bias and the rounding in one pass: y = round(y32 + bias)
        float* y32 = workspace(ex).at_least(y.numel(), ex.device);
        conv_forward_on_bf16(run, ex, c, on_device(x.data()), weight, nullptr, y32);
        device::layer_kernels::bias_act(run, on_device(y.data()), c.N, c.O, c.P, bias != nullptr ? bias->data() : nullptr, false,
                                        nullptr, y32);
    }

    //! The bf16 form of conv2d_backward (Note [activation precision]): x and dx in one type, dy in
    //! either, at least one of them bf16; the products on bf16 operands, the bias gradient summed
    //! in fp32, dx rounded once where it is bf16. Under Precision::bf16 only.
    template <activation_storage X, activation_storage D>
    requires(!(std::same_as<X, float> && std::same_as<D, float>)) static void conv2d_backward(
        const Ex& ex, const ConvGeometry& g, const T_<X>& x, const T_<D>& dy, const T_<float>& weight, T_<float>& weight_grad,
        T_<float>* bias_grad, T_<X>& dx, ConvScratch&) {
        const device::layer_kernels::ConvPlan c(g);
        check_conv_backward(ex, c, x, dy, weight, weight_grad, bias_grad, dx);
        check_bf16_activations(ex, "conv2d_backward");
        if (c.N == 0) return;
        layer_detail::LayerRun run(ex);
#if LOCKSTEP_WITH_CUDNN
        if (cudnn_bf16(ex, c)) {  // dx from cuDNN's bf16 dx
            if constexpr (std::same_as<X, float>) {
                const __nv_bfloat16* dx16 =
                    cudnn_backward_bf16(run, ex, c, x.data(), on_device(dy.data()), weight, weight_grad, bias_grad, nullptr);
                device::layer_kernels::from_bf16(run, dx16, dx.data(), dx.numel());
            } else {
                cudnn_backward_bf16(run, ex, c, on_device(x.data()), on_device(dy.data()), weight, weight_grad, bias_grad,
                                    on_device(dx.data()));
            }
            return;
        }
#endif
        // dy read in its own type (the bias's sums, its channel-major bf16 copy), dx written in x's.
        conv_backward_on_bf16(run, ex, c, on_device(x.data()), on_device(dy.data()), weight, weight_grad, bias_grad,
                              on_device(dx.data()));
    }

    //! y (N, out) = x (N, in) weight^T + bias (`bias` may be null); with `relu`, y = max(0, y) and
    //! `mask` (may be null) = (y > 0), as the host.
    static void linear_forward(const Ex& ex, const T_<float>& x, const T_<float>& weight, const T_<float>* bias, T_<float>& y,
                               bool relu, T_<std::uint8_t>* mask) {
        const auto [N, in, out] = check_linear_forward(ex, x, weight, bias, y, mask);
        layer_detail::LayerRun run(ex);
        device::layer_kernels::linear_forward(run, N, in, out, x.data(), weight.data(), bias != nullptr ? bias->data() : nullptr,
                                              y.data(), relu, mask != nullptr ? mask->data() : nullptr);
    }

    //! weight_grad += dy^T x, bias_grad += column sums of dy (may be null), dx = dy weight; `mask`
    //! (may be null) zeroes dy where the fused ReLU's output was not positive.
    static void linear_backward(const Ex& ex, const T_<float>& x, const T_<float>& dy, const T_<std::uint8_t>* mask,
                                const T_<float>& weight, T_<float>& weight_grad, T_<float>* bias_grad, T_<float>& dx) {
        const auto [N, in, out] = check_linear_backward(ex, x, dy, mask, weight, weight_grad, bias_grad, dx);
        layer_detail::LayerRun run(ex);
        T_<float> masked;  // dy where the mask is set, on the replica's stream for this call
        if (mask != nullptr) masked = T_<float>(Shape{N * out}, MemoryFormat::nchw, Device::cuda(ex.device), uninitialized);
        device::layer_kernels::linear_backward(run, N, in, out, x.data(), dy.data(), mask != nullptr ? mask->data() : nullptr,
                                               masked.data(), weight.data(), weight_grad.data(),
                                               bias_grad != nullptr ? bias_grad->data() : nullptr, dx.data());
    }

    //! The bf16 form of linear_forward (Note [activation precision]): y in bf16, from x (fp32 or
    //! bf16) and the weight rounded to bf16, accumulated in fp32, the bias and ReLU added in fp32
    //! (the mask from the fp32 value) before the one rounding.
    template <activation_storage X>
    static void linear_forward(const Ex& ex, const T_<X>& x, const T_<float>& weight, const T_<float>* bias, T_<BFloat16>& y,
                               bool relu, T_<std::uint8_t>* mask) {
        const auto [N, in, out] = check_linear_forward(ex, x, weight, bias, y, mask);
        check_bf16_activations(ex, "linear_forward");
        if (N == 0 || out == 0) return;
        layer_detail::LayerRun run(ex);
        using Run = layer_detail::LayerRun;
        const std::int64_t at_x = Run::bf16_aligned(out * in);
        __nv_bfloat16* w16 = workspace(ex).bf16_at_least(at_x + (std::same_as<X, float> ? N * in : 0), ex.device);
        device::layer_kernels::to_bf16(run, weight.data(), w16, out * in);
        const __nv_bfloat16* x16 = bf16_operand(run, x.data(), N * in, w16 + at_x);
        T_<float> y32(Shape{N * out}, MemoryFormat::nchw, Device::cuda(ex.device), uninitialized);
        run.gemm_on_bf16(device::layer_kernels::linear_forward_gemm(N, in, out, nullptr, nullptr, y32.data()), w16, x16);
        if (bias != nullptr || relu)  // the epilogue and the rounding in one pass
            device::layer_kernels::bias_act(run, on_device(y.data()), N, out, 1, bias != nullptr ? bias->data() : nullptr, relu,
                                            mask != nullptr ? mask->data() : nullptr, y32.data());
        else
            device::layer_kernels::to_bf16(run, y32.data(), on_device(y.data()), N * out);
    }

    //! The bf16 form of linear_backward (Note [activation precision]): x and dx in one type, dy in
    //! either, at least one of them bf16. The products take bf16 operands (x and dy as they are
    //! where they are bf16, else rounded; the weight rounded) and accumulate in fp32; the bias
    //! gradient sums dy in fp32; dx is rounded once where it is bf16.
    template <activation_storage X, activation_storage D>
    requires(!(std::same_as<X, float> &&
               std::same_as<D, float>)) static void linear_backward(const Ex& ex, const T_<X>& x, const T_<D>& dy,
                                                                    const T_<std::uint8_t>* mask, const T_<float>& weight,
                                                                    T_<float>& weight_grad, T_<float>* bias_grad, T_<X>& dx) {
        const auto [N, in, out] = check_linear_backward(ex, x, dy, mask, weight, weight_grad, bias_grad, dx);
        check_bf16_activations(ex, "linear_backward");
        layer_detail::LayerRun run(ex);
        using Run = layer_detail::LayerRun;
        const Device here = Device::cuda(ex.device);
        // g = dy where the mask is set, in dy's type.
        T_<D> masked;
        const D* g = dy.data();
        if (mask != nullptr && N * out > 0) {
            masked = T_<D>(Shape{N * out}, MemoryFormat::nchw, here, uninitialized);
            device::layer_kernels::relu_backward(run, on_device(dy.data()), mask->data(), on_device(masked.data()), N * out);
            g = masked.data();
        }
        if (bias_grad != nullptr && N > 0)  // summed in fp64 from dy's own type
            device::layer_kernels::channel_sums(run, on_device(g), N, out, 1, bias_grad->data());
        if (N == 0) return;
        // The operands in bf16: the weight, then dy and x where they are fp32.
        const std::int64_t at_g = Run::bf16_aligned(out * in),
                           at_x = at_g + Run::bf16_aligned(std::same_as<D, float> ? N * out : 0);
        __nv_bfloat16* w16 = workspace(ex).bf16_at_least(at_x + (std::same_as<X, float> ? N * in : 0), ex.device);
        device::layer_kernels::to_bf16(run, weight.data(), w16, out * in);
        const __nv_bfloat16* g16 = bf16_operand(run, g, N * out, w16 + at_g);
        const __nv_bfloat16* x16 = bf16_operand(run, x.data(), N * in, w16 + at_x);
        run.gemm_on_bf16(device::layer_kernels::linear_weight_grad_gemm(N, in, out, nullptr, nullptr, weight_grad.data()), x16,
                         g16);
        if constexpr (std::same_as<X, float>) {
            run.gemm_on_bf16(device::layer_kernels::linear_input_grad_gemm(N, in, out, nullptr, nullptr, dx.data()), w16, g16);
        } else {
            T_<float> dx32(Shape{N * in}, MemoryFormat::nchw, here, uninitialized);
            run.gemm_on_bf16(device::layer_kernels::linear_input_grad_gemm(N, in, out, nullptr, nullptr, dx32.data()), w16, g16);
            device::layer_kernels::to_bf16(run, dx32.data(), on_device(dx.data()), N * in);
        }
    }

    //! x = max(x, 0) in place (NaN stays NaN); `mask` (may be null) records where x > 0.
    template <activation_storage T>
    static void relu_forward(const Ex& ex, T_<T>& x, T_<std::uint8_t>* mask) {
        layer_detail::check_on(ex, x, "relu_forward's tensor");
        if (mask != nullptr) layer_detail::check_numel(*mask, x.numel(), "relu_forward", "the mask");
        layer_detail::LayerRun run(ex);
        device::layer_kernels::relu_forward(run, on_device(x.data()), mask != nullptr ? mask->data() : nullptr, x.numel());
    }

    //! dx = mask ? dy : 0.
    template <activation_storage T>
    static void relu_backward(const Ex& ex, const T_<T>& dy, const T_<std::uint8_t>& mask, T_<T>& dx) {
        layer_detail::check_on(ex, dy, "relu_backward's dy");
        layer_detail::check_numel(mask, dy.numel(), "relu_backward", "the mask");
        layer_detail::check_numel(dx, dy.numel(), "relu_backward", "dx");
        layer_detail::LayerRun run(ex);
        device::layer_kernels::relu_backward(run, on_device(dy.data()), mask.data(), on_device(dx.data()), dy.numel());
    }

    //! y = the maximum of each window (NaN wins: the last NaN of the window in row order),
    //! argmax = its index in the plane, as the host.
    template <activation_storage T>
    static void maxpool_forward(const Ex& ex, const PoolGeometry& g, const T_<T>& x, T_<T>& y, T_<std::int32_t>& argmax) {
        layer_detail::check_on(ex, x, "maxpool_forward's input");
        const std::int64_t planes = g.batch * g.channels;
        layer_detail::check_numel(x, planes * g.height * g.width, "maxpool_forward", "x");
        if (planes > 0 && g.height >= g.kernel && g.width >= g.kernel && g.stride >= 1) {
            layer_detail::check_numel(y, planes * g.out_height() * g.out_width(), "maxpool_forward", "y");
            layer_detail::check_numel(argmax, y.numel(), "maxpool_forward", "argmax");
        }
        layer_detail::LayerRun run(ex);
        device::layer_kernels::maxpool_forward(run, g, on_device(x.data()), on_device(y.data()), argmax.data());
    }

    //! dx = dy gathered from the windows whose maximum each element was (deterministic, no atomics).
    template <activation_storage T>
    static void maxpool_backward(const Ex& ex, const PoolGeometry& g, const T_<T>& dy, const T_<std::int32_t>& argmax,
                                 T_<T>& dx) {
        layer_detail::check_on(ex, dy, "maxpool_backward's dy");
        layer_detail::check_numel(argmax, dy.numel(), "maxpool_backward", "argmax");
        layer_detail::check_numel(dx, g.batch * g.channels * g.height * g.width, "maxpool_backward", "dx");
        layer_detail::LayerRun run(ex);
        device::layer_kernels::maxpool_backward(run, g, on_device(dy.data()), argmax.data(), on_device(dx.data()));
    }

    //! y = the mean of each window, as the host (Note [pooling and dropout per element]).
    static void avgpool_forward(const Ex& ex, const AvgPoolGeometry& g, const T_<float>& x, T_<float>& y) {
        layer_detail::check_on(ex, x, "avgpool_forward's input");
        layer_detail::check_numel(x, g.in_numel(), "avgpool_forward", "x");
        layer_detail::check_numel(y, g.out_numel(), "avgpool_forward", "y");
        layer_detail::LayerRun run(ex);
        device::layer_kernels::avgpool(run, g, on_device(x.data()), on_device(y.data()), false);
    }

    //! dx = each window's share of dy, gathered per input element (deterministic, no atomics).
    static void avgpool_backward(const Ex& ex, const AvgPoolGeometry& g, const T_<float>& dy, T_<float>& dx) {
        layer_detail::check_on(ex, dy, "avgpool_backward's dy");
        layer_detail::check_numel(dy, g.out_numel(), "avgpool_backward", "dy");
        layer_detail::check_numel(dx, g.in_numel(), "avgpool_backward", "dx");
        layer_detail::LayerRun run(ex);
        device::layer_kernels::avgpool(run, g, on_device(dy.data()), on_device(dx.data()), true);
    }

    //! x *= (kept ? scale : 0) in place, mask = kept: the host's draw, element for element.
    static void dropout_forward(const Ex& ex, T_<float>& x, const DropoutDraw& d, T_<std::uint8_t>& mask) {
        layer_detail::check_on(ex, x, "dropout_forward's input");
        layer_detail::check_numel(mask, x.numel(), "dropout_forward", "the mask");
        layer_detail::LayerRun run(ex);
        device::layer_kernels::dropout_forward(run, d, on_device(x.data()), mask.data(), x.numel());
    }

    //! dx = dy * (mask ? scale : 0).
    static void dropout_backward(const Ex& ex, const T_<float>& dy, const T_<std::uint8_t>& mask, const DropoutDraw& d,
                                 T_<float>& dx) {
        layer_detail::check_on(ex, dy, "dropout_backward's dy");
        layer_detail::check_numel(mask, dy.numel(), "dropout_backward", "the mask");
        layer_detail::check_numel(dx, dy.numel(), "dropout_backward", "dx");
        layer_detail::LayerRun run(ex);
        device::layer_kernels::dropout_backward(run, d, on_device(dy.data()), mask.data(), on_device(dx.data()), dy.numel());
    }

    // ---- the public tensor operations (nn/tensor_ops.hpp), as the host (Note [tensor operations
    // per element]) ----

    //! out = alpha a + beta b, element by element (out may be a or b).
    static void axpby(const Ex& ex, float alpha, const T_<float>& a, float beta, const T_<float>& b, T_<float>& out) {
        layer_detail::check_on(ex, a, "axpby's a");
        layer_detail::check_numel(b, a.numel(), "axpby", "b");
        layer_detail::check_numel(out, a.numel(), "axpby", "out");
        device::layer_kernels::TensorOpParams p;
        p.a = a.data(), p.b = b.data(), p.out = out.data(), p.alpha = alpha, p.beta = beta, p.n = a.numel();
        layer_detail::LayerRun run(ex);
        device::layer_kernels::tensor_op<device::layer_kernels::Axpby>(run, p);
    }

    //! out = a * b, element by element (out may be a or b).
    static void multiply(const Ex& ex, const T_<float>& a, const T_<float>& b, T_<float>& out) {
        layer_detail::check_on(ex, a, "multiply's a");
        layer_detail::check_numel(b, a.numel(), "multiply", "b");
        layer_detail::check_numel(out, a.numel(), "multiply", "out");
        device::layer_kernels::TensorOpParams p;
        p.a = a.data(), p.b = b.data(), p.out = out.data(), p.n = a.numel();
        layer_detail::LayerRun run(ex);
        device::layer_kernels::tensor_op<device::layer_kernels::Multiply>(run, p);
    }

    //! y (contiguous) = the scaled sums of x over the reduced dimensions.
    static void reduce(const Ex& ex, const ReduceGeometry& g, const T_<float>& x, T_<float>& y) {
        layer_detail::check_on(ex, x, "reduce's input");
        layer_detail::check_numel(y, g.kept.count(), "reduce", "y");
        layer_detail::check_numel(x, g.kept.count() * g.reduced.count(), "reduce", "x");
        device::layer_kernels::TensorOpParams p;
        p.a = x.data(), p.out = y.data(), p.reduce = g, p.n = y.numel();
        layer_detail::LayerRun run(ex);
        device::layer_kernels::tensor_op<device::layer_kernels::Reduce>(run, p);
    }

    //! dx = dy broadcast back over the reduced dimensions, scaled.
    static void broadcast(const Ex& ex, const BroadcastGeometry& g, const T_<float>& dy, T_<float>& dx) {
        layer_detail::check_on(ex, dy, "broadcast's dy");
        layer_detail::check_numel(dx, g.input.count(), "broadcast", "dx");
        device::layer_kernels::TensorOpParams p;
        p.a = dy.data(), p.out = dx.data(), p.broadcast = g, p.n = dx.numel();
        layer_detail::LayerRun run(ex);
        device::layer_kernels::tensor_op<device::layer_kernels::Broadcast>(run, p);
    }

    //! y = softmax of x along the geometry's lines (y may be x).
    static void softmax_forward(const Ex& ex, const LineGeometry& g, const T_<float>& x, T_<float>& y) {
        layer_detail::check_on(ex, x, "softmax_forward's input");
        layer_detail::check_numel(x, g.lines.count() * g.length, "softmax_forward", "x");
        layer_detail::check_numel(y, x.numel(), "softmax_forward", "y");
        device::layer_kernels::TensorOpParams p;
        p.a = x.data(), p.out = y.data(), p.line = g, p.n = g.lines.count();
        layer_detail::LayerRun run(ex);
        device::layer_kernels::tensor_op<device::layer_kernels::SoftmaxForward>(run, p);
    }

    //! dx = y (dy - sum(dy y)) along the lines.
    static void softmax_backward(const Ex& ex, const LineGeometry& g, const T_<float>& y, const T_<float>& dy, T_<float>& dx) {
        layer_detail::check_on(ex, y, "softmax_backward's y");
        layer_detail::check_numel(y, g.lines.count() * g.length, "softmax_backward", "y");
        layer_detail::check_numel(dy, y.numel(), "softmax_backward", "dy");
        layer_detail::check_numel(dx, y.numel(), "softmax_backward", "dx");
        device::layer_kernels::TensorOpParams p;
        p.a = y.data(), p.b = dy.data(), p.out = dx.data(), p.line = g, p.n = g.lines.count();
        layer_detail::LayerRun run(ex);
        device::layer_kernels::tensor_op<device::layer_kernels::SoftmaxBackward>(run, p);
    }

    //! index[l] = the position of line l's largest element.
    static void argmax(const Ex& ex, const LineGeometry& g, const T_<float>& x, T_<std::int64_t>& index) {
        layer_detail::check_on(ex, x, "argmax's input");
        layer_detail::check_numel(x, g.lines.count() * g.length, "argmax", "x");
        layer_detail::check_numel(index, g.lines.count(), "argmax", "the index");
        device::layer_kernels::TensorOpParams p;
        p.a = x.data(), p.index = index.data(), p.line = g, p.n = g.lines.count();
        layer_detail::LayerRun run(ex);
        device::layer_kernels::tensor_op<device::layer_kernels::Argmax>(run, p);
    }

    //! dst[base + walk.offset(i)] = src[i] for every element of src.
    static void place(const Ex& ex, const PlaceGeometry& g, const T_<float>& src, T_<float>& dst) {
        layer_detail::check_on(ex, src, "place's source");
        layer_detail::check_numel(src, g.walk.count(), "place", "src");
        device::layer_kernels::TensorOpParams p;
        p.a = src.data(), p.out = dst.data(), p.place = g, p.n = src.numel();
        layer_detail::LayerRun run(ex);
        device::layer_kernels::tensor_op<device::layer_kernels::Place>(run, p);
    }

    //! dst[i] = src[base + walk.offset(i)] for every element of dst.
    static void take(const Ex& ex, const PlaceGeometry& g, const T_<float>& src, T_<float>& dst) {
        layer_detail::check_on(ex, src, "take's source");
        layer_detail::check_numel(dst, g.walk.count(), "take", "dst");
        device::layer_kernels::TensorOpParams p;
        p.a = src.data(), p.out = dst.data(), p.place = g, p.n = dst.numel();
        layer_detail::LayerRun run(ex);
        device::layer_kernels::tensor_op<device::layer_kernels::Take>(run, p);
    }

    //! Layer norm of each row of M values, as the host (Note [layer norm per row]).
    static void layer_norm_forward(const Ex& ex, const T_<float>& x, std::int64_t M, const T_<float>* weight,
                                   const T_<float>* bias, double eps, T_<float>& y, T_<float>& mean, T_<float>& rstd) {
        layer_detail::check_on(ex, x, "layer_norm_forward's input");
        const std::int64_t R = M > 0 ? x.numel() / M : 0;
        layer_detail::check_numel(y, x.numel(), "layer_norm_forward", "y");
        layer_detail::check_numel(mean, R, "layer_norm_forward", "mean");
        layer_detail::check_numel(rstd, R, "layer_norm_forward", "rstd");
        device::layer_kernels::LayerNormParams p;
        p.x = x.data(), p.w = weight != nullptr ? weight->data() : nullptr, p.b = bias != nullptr ? bias->data() : nullptr;
        p.y = y.data(), p.mean = mean.data(), p.rstd = rstd.data(), p.rows = R, p.M = M, p.eps = eps;
        layer_detail::LayerRun run(ex);
        device::layer_kernels::layer_norm_forward(run, p);
    }

    //! Layer norm backward: dx per row; weight_grad and bias_grad (may be null) += their sums over rows.
    static void layer_norm_backward(const Ex& ex, const T_<float>& x, const T_<float>& dy, std::int64_t M,
                                    const T_<float>* weight, const T_<float>& mean, const T_<float>& rstd, T_<float>& dx,
                                    T_<float>* weight_grad, T_<float>* bias_grad) {
        layer_detail::check_on(ex, dy, "layer_norm_backward's dy");
        layer_detail::check_numel(dy, x.numel(), "layer_norm_backward", "dy");
        layer_detail::check_numel(dx, x.numel(), "layer_norm_backward", "dx");
        device::layer_kernels::LayerNormParams p;
        p.x = x.data(), p.dy = dy.data(), p.w = weight != nullptr ? weight->data() : nullptr;
        p.y = dx.data(), p.mean = const_cast<float*>(mean.data()), p.rstd = const_cast<float*>(rstd.data());
        p.dw = weight_grad != nullptr ? weight_grad->data() : nullptr, p.db = bias_grad != nullptr ? bias_grad->data() : nullptr;
        p.rows = M > 0 ? x.numel() / M : 0, p.M = M;
        layer_detail::LayerRun run(ex);
        device::layer_kernels::layer_norm_backward(run, p);
    }

    // ---- losses and optimizer -----------------------------------------------------------------

    //! Softmax cross-entropy of `logits` (N, K) against `labels` (checked by the caller), in fp64:
    //! totals = [sum of per-sample losses, samples whose arg-max is the label], grad =
    //! (softmax - onehot) * inv_count. The labels go to the device asynchronously (Note [labels
    //! on the device]).
    static void softmax_cross_entropy(const Ex& ex, const T_<float>& logits, std::span<const std::int64_t> labels,
                                      double inv_count, T_<float>& grad, T_<double>& totals) {
        layer_detail::check_on(ex, logits, "softmax_cross_entropy's logits");
        LOCKSTEP_CHECK_AS(ShapeError, logits.rank() == 2, "softmax_cross_entropy on CUDA takes (N, K) logits, got rank ",
                          logits.rank());
        const std::int64_t N = logits.dim(0), K = logits.dim(1);
        LOCKSTEP_CHECK_AS(ShapeError, static_cast<std::int64_t>(labels.size()) == N,
                          "softmax_cross_entropy on CUDA: ", labels.size(), " labels for ", N, " samples");
        layer_detail::check_numel(grad, N * K, "softmax_cross_entropy", "grad");
        layer_detail::check_numel(totals, 2, "softmax_cross_entropy", "totals");
        layer_detail::LayerRun run(ex);
        T_<std::int64_t> on_device(Shape{N}, MemoryFormat::nchw, Device::cuda(ex.device), uninitialized);
        layer_detail::LabelStaging::of(ex.device).upload(labels, on_device.data(), ex.stream);
        device::layer_kernels::softmax_cross_entropy(run, logits.data(), N, K, on_device.data(), inv_count, grad.data(),
                                                     totals.data());
    }

    //! The same against labels already on the device (a captured step's: Note [captured steps] in
    //! parallel/step.hpp); a label outside [0, K) gives a NaN loss, never a read outside the row.
    static void softmax_cross_entropy(const Ex& ex, const T_<float>& logits, const T_<std::int64_t>& labels, double inv_count,
                                      T_<float>& grad, T_<double>& totals) {
        layer_detail::check_on(ex, logits, "softmax_cross_entropy's logits");
        layer_detail::check_on(ex, labels, "softmax_cross_entropy's labels");
        LOCKSTEP_CHECK_AS(ShapeError, logits.rank() == 2, "softmax_cross_entropy on CUDA takes (N, K) logits, got rank ",
                          logits.rank());
        const std::int64_t N = logits.dim(0), K = logits.dim(1);
        layer_detail::check_numel(labels, N, "softmax_cross_entropy", "the labels");
        layer_detail::check_numel(grad, N * K, "softmax_cross_entropy", "grad");
        layer_detail::check_numel(totals, 2, "softmax_cross_entropy", "totals");
        layer_detail::LayerRun run(ex);
        device::layer_kernels::softmax_cross_entropy(run, logits.data(), N, K, labels.data(), inv_count, grad.data(),
                                                     totals.data());
    }

    //! dst = `labels` (host values), enqueued on the replica's stream through the calling thread's
    //! pinned staging (Note [labels on the device]); the host does not wait.
    static void upload_labels(const Ex& ex, std::span<const std::int64_t> labels, T_<std::int64_t>& dst) {
        layer_detail::check_on(ex, dst, "upload_labels' destination");
        layer_detail::check_numel(dst, static_cast<std::int64_t>(labels.size()), "upload_labels", "the destination");
        cuda::DeviceGuard guard(ex.device);
        layer_detail::LabelStaging::of(ex.device).upload(labels, dst.data(), ex.stream);
    }

    //! Mean squared error per sample (mean over a sample's D elements): totals = [sum over samples
    //! of mean((out - target)^2), 0], grad = 2 (out - target) / D * inv_count.
    static void mse(const Ex& ex, const T_<float>& out, const T_<float>& target, double inv_count, T_<float>& grad,
                    T_<double>& totals) {
        layer_detail::check_on(ex, out, "mse's output");
        layer_detail::check_on(ex, target, "mse's target");
        const std::int64_t N = out.rank() > 0 ? out.dim(0) : 0;
        const std::int64_t D = N > 0 ? out.numel() / N : 0;
        layer_detail::check_numel(target, out.numel(), "mse", "the target");
        layer_detail::check_numel(grad, out.numel(), "mse", "grad");
        layer_detail::check_numel(totals, 2, "mse", "totals");
        layer_detail::LayerRun run(ex);
        device::layer_kernels::mse(run, out.data(), target.data(), N, D, inv_count, grad.data(), totals.data());
    }

    //! One torch.optim.SGD update of `value` from `grad`, in the host's fp32 operations;
    //! `momentum_buffer` is ignored without momentum and initialized from the gradient when `first`.
    static void sgd_step(const Ex& ex, T_<float>& value, const T_<float>& grad, T_<float>& momentum_buffer, bool first,
                         const SgdUpdate& u) {
        layer_detail::check_on(ex, value, "sgd_step's parameter");
        layer_detail::check_on(ex, grad, "sgd_step's gradient");
        layer_detail::check_numel(grad, value.numel(), "sgd_step", "the gradient");
        if (static_cast<float>(u.momentum) != 0.0f)
            layer_detail::check_numel(momentum_buffer, value.numel(), "sgd_step", "the momentum buffer");
        layer_detail::LayerRun run(ex);
        device::layer_kernels::sgd_step(run, value.data(), grad.data(), momentum_buffer.data(), value.numel(), first, u);
    }

    //! sgd_step for every entry, one launch per 32 tensors (Note [tensor tables]).
    static void sgd_step_many(const Ex& ex, std::span<const SgdTensors<Cuda>> items, const SgdUpdate& u) {
        const bool momentum = static_cast<float>(u.momentum) != 0.0f;
        std::vector<device::layer_kernels::SgdEntry> entries;
        entries.reserve(items.size());
        for (const auto& it : items) {
            LOCKSTEP_CHECK_AS(UsageError, it.value != nullptr && it.grad != nullptr && it.momentum != nullptr,
                              "sgd_step_many on CUDA: an entry without its parameter, gradient or momentum buffer");
            layer_detail::check_on(ex, *it.value, "sgd_step_many's parameter");
            layer_detail::check_on(ex, *it.grad, "sgd_step_many's gradient");
            layer_detail::check_numel(*it.grad, it.value->numel(), "sgd_step_many", "a gradient");
            if (momentum) {
                layer_detail::check_on(ex, *it.momentum, "sgd_step_many's momentum buffer");
                layer_detail::check_numel(*it.momentum, it.value->numel(), "sgd_step_many", "a momentum buffer");
            }
            entries.push_back(
                {it.value->data(), it.grad->data(), momentum ? it.momentum->data() : nullptr, it.value->numel(), it.first});
        }
        layer_detail::LayerRun run(ex);
        device::layer_kernels::sgd_step_many(run, entries, u);
    }

    //! One torch.optim.Adam (or AdamW) update of every entry, one launch per 32 tensors (Note
    //! [tensor tables]), the host's bits.
    static void adam_step_many(const Ex& ex, std::span<const AdamTensors<Cuda>> items, const AdamUpdate& u) {
        std::vector<device::layer_kernels::AdamEntry> entries;
        entries.reserve(items.size());
        for (const auto& it : items) {
            LOCKSTEP_CHECK_AS(UsageError, it.value && it.grad && it.exp_avg && it.exp_avg_sq,
                              "adam_step_many on CUDA: an entry without its parameter, gradient or moment estimates");
            layer_detail::check_on(ex, *it.value, "adam_step_many's parameter");
            layer_detail::check_on(ex, *it.grad, "adam_step_many's gradient");
            layer_detail::check_on(ex, *it.exp_avg, "adam_step_many's exp_avg");
            layer_detail::check_on(ex, *it.exp_avg_sq, "adam_step_many's exp_avg_sq");
            const std::int64_t n = it.value->numel();
            layer_detail::check_numel(*it.grad, n, "adam_step_many", "a gradient");
            layer_detail::check_numel(*it.exp_avg, n, "adam_step_many", "an exp_avg");
            layer_detail::check_numel(*it.exp_avg_sq, n, "adam_step_many", "an exp_avg_sq");
            entries.push_back({it.value->data(), it.grad->data(), it.exp_avg->data(), it.exp_avg_sq->data(), n});
        }
        layer_detail::LayerRun run(ex);
        device::layer_kernels::adam_step_many(run, entries, u);
    }

    //! copy for every piece, on the replica's device, one launch per 32 pieces (Note [tensor tables]).
    static void copy_many(const Ex& ex, std::span<const CopyPiece<Cuda>> pieces) {
        std::vector<device::layer_kernels::CopyEntry> entries;
        entries.reserve(pieces.size());
        for (const auto& p : pieces) {
            LOCKSTEP_CHECK_AS(UsageError, p.dst != nullptr && p.src != nullptr, "copy_many on CUDA: a piece without its tensors");
            if (p.count <= 0) continue;
            LOCKSTEP_CHECK_AS(ShapeError,
                              p.dst_offset >= 0 && p.src_offset >= 0 && p.dst_offset + p.count <= p.dst->numel() &&
                                  p.src_offset + p.count <= p.src->numel(),
                              "copy_many on CUDA: ", p.count, " elements from offset ", p.src_offset, " of ", p.src->numel(),
                              " to offset ", p.dst_offset, " of ", p.dst->numel(), " fall outside a tensor");
            layer_detail::check_on(ex, *p.dst, "copy_many's destination");
            layer_detail::check_on(ex, *p.src, "copy_many's source");
            entries.push_back({p.dst->data() + p.dst_offset, p.src->data() + p.src_offset, p.count});
        }
        layer_detail::LayerRun run(ex);
        device::layer_kernels::copy_many(run, entries);
    }

private:
    static LayerWorkspace& workspace(const Ex& ex) { return layer_detail::workspace(ex); }
    static layer_detail::WorkspaceBytes workspace_bytes(const Ex& ex) { return {ex}; }

    // Note [precision]: a convolution's products on bf16 operands, the columns written in bf16 by
    // im2col itself (from x in fp32 or bf16, S), the weight rounded once; y in fp32 (c.N, c.O > 0).
    template <class S>
    static void conv_forward_on_bf16(layer_detail::LayerRun& run, const Ex& ex, const device::layer_kernels::ConvPlan& c,
                                     const S* x, const T_<float>& weight, const T_<float>* bias, float* y) {
        namespace lk = device::layer_kernels;
        if (c.K == 0 || c.P == 0) {  // no products: the bias alone
            lk::fill(run, y, c.N * c.O * c.P, 0.0f);
        } else {
            const std::int64_t at_w = layer_detail::LayerRun::bf16_aligned(c.cols());
            __nv_bfloat16* cols16 = workspace(ex).bf16_at_least(at_w + c.O * c.K, ex.device);
            lk::im2col_bf16(run, c, x, cols16, /*sample_major=*/true);
            lk::to_bf16(run, weight.data(), cols16 + at_w, c.O * c.K);
            run.gemm_on_bf16(lk::conv_forward_gemm(c, nullptr, nullptr, y), cols16, cols16 + at_w);
        }
        if (bias != nullptr) lk::bias_act(run, y, c.N, c.O, c.P, bias->data(), false, nullptr);
    }

    // Note [precision]: the columns in bf16 from im2col itself (x in fp32 or bf16, S); dy (fp32 or
    // bf16, D) laid out channel-major in bf16 in one pass (rounded where it is fp32), its sums for
    // the bias read in its own type; the weight rounded once; dcols in fp32 for col2im, which
    // writes dx in its type (TX: fp32, or bf16 rounded once).
    template <class S, class D, class TX>
    static void conv_backward_on_bf16(layer_detail::LayerRun& run, const Ex& ex, const device::layer_kernels::ConvPlan& c,
                                      const S* x, const D* dy, const T_<float>& weight, T_<float>& weight_grad,
                                      T_<float>* bias_grad, TX* dx) {
        namespace lk = device::layer_kernels;
        if (bias_grad != nullptr) lk::channel_sums(run, dy, c.N, c.O, c.P, bias_grad->data());
        if (c.O == 0 || c.K == 0 || c.P == 0) {  // no products: nothing reaches x
            lk::fill(run, dx, c.N * c.C * c.H * c.W, device::from_float<TX>(0.0f));
            return;
        }
        const std::int64_t dyt_n = c.N * c.O * c.P;
        float* dcols = workspace(ex).at_least(c.cols(), ex.device);
        const auto room = bf16_rooms<3>(ex, {c.cols(), dyt_n, c.O * c.K});
        __nv_bfloat16 *cols16 = room[0], *dyt16 = room[1], *w16 = room[2];
        lk::channel_major(run, dy, dyt16, c.N, c.O, c.P);
        lk::im2col_bf16(run, c, x, cols16, /*sample_major=*/false);
        run.gemm_on_bf16(lk::conv_weight_grad_gemm(c, nullptr, nullptr, weight_grad.data()), cols16, dyt16);
        lk::to_bf16(run, weight.data(), w16, c.O * c.K);
        run.gemm_on_bf16(lk::conv_input_grad_gemm(c, nullptr, nullptr, dcols), dyt16, w16);
        lk::col2im(run, c, dcols, dx, /*sample_major=*/false);
    }

#if LOCKSTEP_WITH_CUDNN
    // Whether a bf16 convolution of `c` runs cuDNN's bf16 configuration on this replica (Note
    // [cuDNN convolutions]): a cuDNN handle and a deterministic algorithm for every direction.
    // A GPU without bf16 tensor cores is refused first, as on the cuBLAS path (UsageError).
    static bool cudnn_bf16(const Ex& ex, const device::layer_kernels::ConvPlan& c) {
        if (ex.cudnn == nullptr || c.N <= 0 || c.O <= 0 || c.C <= 0 || c.P <= 0) return false;
        layer_detail::LayerRun::check_bf16_once(ex.device);
        return ex.cudnn->usable(c, ex.math, Precision::bf16);
    }

    // Note [cuDNN convolutions]: cuDNN's bf16 y (into `y16`, or, where it is null, the workspace's
    // bf16 buffer: the pointer returned) from x (fp32 or bf16, S) and the weight, each rounded
    // once into the workspace's bf16 buffer where it is fp32. Only where cudnn_bf16 said yes.
    template <class S>
    static const __nv_bfloat16* cudnn_forward_bf16(layer_detail::LayerRun& run, const Ex& ex,
                                                   const device::layer_kernels::ConvPlan& c, const S* x, const T_<float>& weight,
                                                   __nv_bfloat16* y16) {
        const std::int64_t nx = c.N * c.C * c.H * c.W, nw = c.O * c.K;
        const auto room = bf16_rooms<3>(ex, {std::same_as<S, float> ? nx : 0, nw, y16 == nullptr ? c.N * c.O * c.P : 0});
        const __nv_bfloat16* x16 = bf16_operand(run, x, nx, room[0]);
        device::layer_kernels::to_bf16(run, weight.data(), room[1], nw);
        if (y16 == nullptr) y16 = room[2];
        const bool ran = ex.cudnn->forward(ex.stream, c, ex.math, x16, room[1], y16, workspace_bytes(ex));
        LOCKSTEP_CHECK_AS(DeviceError, ran, "cuDNN refused a bf16 convolution it had chosen an algorithm for");
        return y16;
    }

    // Note [cuDNN convolutions]: weight_grad += cuDNN's bf16 weight gradient widened, bias_grad
    // (may be null) += the per-channel sums of dy as it is, and cuDNN's bf16 dx into `dx16` (null:
    // the workspace's bf16 buffer, the pointer returned); x (S) and dy (D) rounded once into the
    // workspace where they are fp32.
    template <class S, class D>
    static const __nv_bfloat16* cudnn_backward_bf16(layer_detail::LayerRun& run, const Ex& ex,
                                                    const device::layer_kernels::ConvPlan& c, const S* x, const D* dy,
                                                    const T_<float>& weight, T_<float>& weight_grad, T_<float>* bias_grad,
                                                    __nv_bfloat16* dx16) {
        namespace lk = device::layer_kernels;
        const std::int64_t nx = c.N * c.C * c.H * c.W, ny = c.N * c.O * c.P, nw = c.O * c.K;
        const auto room = bf16_rooms<5>(
            ex, {std::same_as<S, float> ? nx : 0, std::same_as<D, float> ? ny : 0, nw, nw, dx16 == nullptr ? nx : 0});
        if (bias_grad != nullptr) lk::channel_sums(run, dy, c.N, c.O, c.P, bias_grad->data());
        const __nv_bfloat16* x16 = bf16_operand(run, x, nx, room[0]);
        const __nv_bfloat16* dy16 = bf16_operand(run, dy, ny, room[1]);
        lk::to_bf16(run, weight.data(), room[2], nw);
        if (dx16 == nullptr) dx16 = room[4];
        const bool ran = ex.cudnn->backward(ex.stream, c, ex.math, x16, dy16, room[2], room[3], dx16, workspace_bytes(ex));
        LOCKSTEP_CHECK_AS(DeviceError, ran, "cuDNN refused a bf16 convolution it had chosen an algorithm for");
        lk::add_widened(run, weight_grad.data(), room[3], nw);
        return dx16;
    }
#endif

    // Consecutive regions of the workspace's bf16 buffer, of `sizes[i]` elements each (null where
    // 0), from one growth of the buffer.
    template <std::size_t K>
    static std::array<__nv_bfloat16*, K> bf16_rooms(const Ex& ex, const std::array<std::int64_t, K>& sizes) {
        std::array<std::int64_t, K> at{};
        std::int64_t total = 0;
        for (std::size_t i = 0; i < K; ++i) {
            at[i] = total;
            total += layer_detail::LayerRun::bf16_aligned(sizes[i]);
        }
        __nv_bfloat16* base = workspace(ex).bf16_at_least(total, ex.device);
        std::array<__nv_bfloat16*, K> out{};
        for (std::size_t i = 0; i < K; ++i) out[i] = sizes[i] > 0 ? base + at[i] : nullptr;
        return out;
    }

    // The bf16 forms of the layers run under Precision::bf16 alone (the layers call them so).
    static void check_bf16_activations(const Ex& ex, const char* op) {
        LOCKSTEP_CHECK_AS(UsageError, ex.precision == Precision::bf16, op,
                          " on CUDA with bf16 activations runs under Precision::bf16; the replica's precision is ",
                          to_string(ex.precision), " (its layers take fp32 activations there)");
    }

    template <class X>
    static void check_conv(const Ex& ex, const device::layer_kernels::ConvPlan& c, const T_<X>& x, const T_<float>& weight,
                           const T_<float>* bias, const char* op) {
        layer_detail::check_on(ex, x, "a convolution's input");
        layer_detail::check_on(ex, weight, "a convolution's weight");
        layer_detail::check_numel(x, c.N * c.C * c.H * c.W, op, "x");
        layer_detail::check_numel(weight, c.O * c.K, op, "the weight");
        if (bias != nullptr) layer_detail::check_numel(*bias, c.O, op, "the bias");
    }

    // An operand of a bf16 product: `n` elements at `p`, as they are where they are bf16, else
    // rounded into `room` (in the replica's workspace).
    static const __nv_bfloat16* bf16_operand(layer_detail::LayerRun& run, const float* p, std::int64_t n, __nv_bfloat16* room) {
        device::layer_kernels::to_bf16(run, p, room, n);
        return room;
    }
    static const __nv_bfloat16* bf16_operand(layer_detail::LayerRun&, const BFloat16* p, std::int64_t, __nv_bfloat16*) {
        return on_device(p);
    }
    static const __nv_bfloat16* bf16_operand(layer_detail::LayerRun&, const __nv_bfloat16* p, std::int64_t, __nv_bfloat16*) {
        return p;
    }

    template <class X, class D>
    static void check_conv_backward(const Ex& ex, const device::layer_kernels::ConvPlan& c, const T_<X>& x, const T_<D>& dy,
                                    const T_<float>& weight, const T_<float>& weight_grad, const T_<float>* bias_grad,
                                    const T_<X>& dx) {
        check_conv(ex, c, x, weight, bias_grad, "conv2d_backward");
        layer_detail::check_on(ex, dy, "conv2d_backward's dy");
        layer_detail::check_numel(dy, c.N * c.O * c.P, "conv2d_backward", "dy");
        layer_detail::check_numel(weight_grad, c.O * c.K, "conv2d_backward", "the weight gradient");
        layer_detail::check_numel(dx, x.numel(), "conv2d_backward", "dx");
    }

    struct LinearSizes {
        std::int64_t N, in, out;
    };
    template <class X>
    static LinearSizes linear_sizes(const Ex& ex, const T_<X>& x, const T_<float>& weight, const T_<float>* bias,
                                    const char* op) {
        layer_detail::check_on(ex, x, "a linear layer's input");
        layer_detail::check_on(ex, weight, "a linear layer's weight");
        LOCKSTEP_CHECK_AS(ShapeError, x.rank() == 2 && weight.rank() == 2 && weight.dim(1) == x.dim(1), op,
                          " on CUDA takes x (N, in) and weight (out, in), got x of rank ", x.rank(), " and weight of rank ",
                          weight.rank());
        if (bias != nullptr) layer_detail::check_numel(*bias, weight.dim(0), op, "the bias");
        return {x.dim(0), x.dim(1), weight.dim(0)};
    }

    template <class X, class Y>
    static LinearSizes check_linear_forward(const Ex& ex, const T_<X>& x, const T_<float>& weight, const T_<float>* bias,
                                            const T_<Y>& y, const T_<std::uint8_t>* mask) {
        const auto sizes = linear_sizes(ex, x, weight, bias, "linear_forward");
        layer_detail::check_numel(y, sizes.N * sizes.out, "linear_forward", "y");
        if (mask != nullptr) layer_detail::check_numel(*mask, sizes.N * sizes.out, "linear_forward", "the mask");
        return sizes;
    }

    template <class X, class D>
    static LinearSizes check_linear_backward(const Ex& ex, const T_<X>& x, const T_<D>& dy, const T_<std::uint8_t>* mask,
                                             const T_<float>& weight, const T_<float>& weight_grad, const T_<float>* bias_grad,
                                             const T_<X>& dx) {
        const auto sizes = linear_sizes(ex, x, weight, bias_grad, "linear_backward");
        const auto [N, in, out] = sizes;
        layer_detail::check_on(ex, dy, "linear_backward's dy");
        layer_detail::check_numel(dy, N * out, "linear_backward", "dy");
        if (mask != nullptr) layer_detail::check_numel(*mask, N * out, "linear_backward", "the mask");
        layer_detail::check_numel(weight_grad, out * in, "linear_backward", "the weight gradient");
        layer_detail::check_numel(dx, N * in, "linear_backward", "dx");
        return sizes;
    }
};

}  // namespace lockstep::kernels::cuda_ops
