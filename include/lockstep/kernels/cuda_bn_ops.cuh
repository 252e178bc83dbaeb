// SPDX-License-Identifier: MIT
//! The CUDA backend's batch-norm operations: the SyncBatchNorm passes as fused kernels (CUB), see
//! Note [batch-norm kernels]. Part of `kernels::Ops<Cuda>`.
#pragma once

#include <cstdint>
#include <string>

#include "lockstep/kernels/cuda_common.cuh"
#include "lockstep/kernels/device/bn_passes.cuh"
#include "lockstep/kernels/device/launch.cuh"

namespace lockstep::kernels {
template <>
inline constexpr bool bn_storage<Cuda, __half> = true;
template <>
inline constexpr bool bn_storage<Cuda, __nv_bfloat16> = true;
//! lockstep's own bf16 type, an activation stored in bf16 (Note [activation precision]): the same
//! kernels as __nv_bfloat16.
template <>
inline constexpr bool bn_storage<Cuda, BFloat16> = true;
}  // namespace lockstep::kernels

namespace lockstep::kernels::cuda_ops {

//! The batch-norm part of `Ops<Cuda>` (see Note [backend operations]); everything runs on
//! `ex.stream`, and nothing waits for the device. Templates on the storage type T (float, __half,
//! __nv_bfloat16, lockstep::BFloat16): statistics, parameters and running statistics stay fp32/fp64.
struct BatchNormOps {
    //! Forward payload [S | Q | M | n] (3C+1) of the local batch (Note [shifted statistics]);
    //! leaves the local shifts in `k.shift` for `bn_centre`.
    template <class T>
    static void bn_local_stats(const Ex& ex, const T_<T>& x, const BnGeometry& g, BnConstants<Cuda>& k, T_<double>& payload) {
        check_on(ex, x.device(), "SyncBatchNorm's input");
        if (k.shift.numel() != g.channels || k.shift.device() != x.device())
            k.shift = T_<float>(Shape{g.channels}, MemoryFormat::nchw, x.device());
        auto run = runner(ex);
        device::bn_kernels::local_stats(run, on_device(x.data()), g, payload.data(), k.shift.data());
    }

    //! Between the two all-reduces: [S | Q] re-centred on the batch's shift mu = M/N.
    static void bn_centre(const Ex& ex, const BnGeometry& g, const BnConstants<Cuda>& k, T_<double>& payload) {
        LOCKSTEP_CHECK_AS(UsageError, k.shift.numel() == g.channels,
                          "SyncBatchNorm on CUDA: bn_centre ran without its statistics pass (bn_local_stats) before it");
        auto run = runner(ex);
        device::bn_kernels::centre(run, g, k.shift.data(), payload.data());
    }

    //! Records the finish; the normalize kernel's prologue does it (Note [batch-norm kernels]).
    static void bn_forward_finish(const Ex&, const T_<double>& payload, const BnFinishOptions& o, T_<float>* running_mean,
                                  T_<float>* running_var, T_<std::int64_t>* num_batches_tracked, const T_<float>* weight,
                                  const T_<float>* bias, BnConstants<Cuda>& k) {
        BnConstants<Cuda>::Pending p;
        p.payload = payload.data();
        if (o.update_running) {
            p.running_mean = running_mean->data();
            p.running_var = running_var->data();
            p.num_batches_tracked = num_batches_tracked->data();
        }
        p.weight = weight != nullptr ? weight->data() : nullptr;
        p.bias = bias != nullptr ? bias->data() : nullptr;
        p.eps = o.eps;
        p.momentum = o.momentum;
        p.update_running = o.update_running;
        k.pending = p;
    }

    //! Evaluation: the statistics are the running ones.
    static void bn_eval_constants(const Ex& ex, const T_<float>& running_mean, const T_<float>& running_var, double eps,
                                  const T_<float>* weight, const T_<float>* bias, BnConstants<Cuda>& k) {
        k.pending.reset();
        auto run = runner(ex);
        device::bn_kernels::eval_constants(run, running_mean.numel(), running_mean.data(), running_var.data(), eps,
                                           weight != nullptr ? weight->data() : nullptr, bias != nullptr ? bias->data() : nullptr,
                                           k.stats.data(), k.folded.data());
    }

    //! Whether a fused ReLU's forward keeps a mask for backward: no, backward recomputes it from x
    //! and the forward's constants (Note [ReLU mask from x] in device/bn_kernels.cuh).
    static constexpr bool bn_keeps_relu_mask = false;

    //! y = the normalized x, after the pending finish if there is one; with `relu`, y = max(0, y).
    //! `mask` must be null: the CUDA backend keeps none (bn_keeps_relu_mask).
    template <class T>
    static void bn_normalize(const Ex& ex, const T_<T>& x, T_<T>& y, const BnGeometry& g, BnConstants<Cuda>& k, bool relu,
                             T_<std::uint8_t>* mask) {
        check_on(ex, x.device(), "SyncBatchNorm's input");
        LOCKSTEP_CHECK_AS(UsageError, mask == nullptr,
                          "bn_normalize on CUDA keeps no ReLU mask (Ops<Cuda>::bn_keeps_relu_mask is false); pass none");
        auto run = runner(ex);
        if (!k.pending) {
            device::bn_kernels::forward_normalize(run, on_device(x.data()), on_device(y.data()), g, nullptr, nullptr, nullptr,
                                                  k.stats.data(), k.folded.data(), relu);
            return;
        }
        const auto& p = *k.pending;
        LOCKSTEP_CHECK_AS(UsageError, k.shift.numel() == g.channels,
                          "SyncBatchNorm on CUDA: a training forward's "
                          "normalize ran without its statistics pass (bn_local_stats) before it");
        device::bn_kernels::FinishRequest f;
        f.payload = p.payload;
        f.running_mean = p.running_mean;
        f.running_var = p.running_var;
        f.num_batches_tracked = p.num_batches_tracked;
        f.eps = p.eps;
        f.cumulative = !p.momentum.has_value();
        f.momentum = p.momentum.value_or(0.0);
        k.pending.reset();
        device::bn_kernels::forward_normalize(run, on_device(x.data()), on_device(y.data()), g, &f, p.weight, p.bias,
                                              k.stats.data(), k.folded.data(), relu);
    }
    //! Backward payload [sum(dy) | sum(dy * (x - mean))] (2C) of the local batch; with `relu`, dy
    //! counts only where the fused ReLU's output was positive, found from x (no mask: null).
    template <class T>
    static void bn_backward_sums(const Ex& ex, const T_<T>& x, const T_<T>& dy, bool relu, const T_<std::uint8_t>*,
                                 const BnGeometry& g, const BnConstants<Cuda>& k, T_<double>& payload) {
        check_on(ex, dy.device(), "SyncBatchNorm's dy");
        auto run = runner(ex);
        device::bn_kernels::backward_sums(run, on_device(x.data()), on_device(dy.data()), relu, g, k.folded.data(),
                                          payload.data());
    }

    //! weight_grad += sum(dy * xhat), bias_grad += sum(dy) from the local backward payload.
    static void bn_param_grads(const Ex& ex, const T_<double>& payload, const BnConstants<Cuda>& k, T_<float>& weight_grad,
                               T_<float>& bias_grad) {
        auto run = runner(ex);
        device::bn_kernels::param_grads(run, weight_grad.numel(), payload.data(), k.stats.data(), weight_grad.data(),
                                        bias_grad.data());
    }

    //! dx from the all-reduced backward payload, with the forward's global count, written over `x`;
    //! with `relu`, dy counts only where the fused ReLU's output was positive (no mask: null).
    template <class T>
    static void bn_backward_dx(const Ex& ex, const T_<double>& payload, const BnConstants<Cuda>& k, const T_<float>* weight,
                               T_<T>& x_to_dx, const T_<T>& dy, bool relu, const T_<std::uint8_t>*, const BnGeometry& g) {
        auto run = runner(ex);
        device::bn_kernels::backward_dx(run, on_device(x_to_dx.data()), on_device(dy.data()), relu, on_device(x_to_dx.data()), g,
                                        payload.data(), k.stats.data(), k.folded.data(),
                                        weight != nullptr ? weight->data() : nullptr);
    }

private:
    // Launches on the replica's stream with the replica's device current (restored after), so an
    // operation called from a thread whose current device differs still runs where its tensors are.
    struct Runner : device::DeviceRun {
        explicit Runner(const Ex& ex) : device::DeviceRun(run_of(ex)), guard(ex.device) {}
        static device::DeviceRun run_of(const Ex& ex) {
            device::DeviceRun r;
            r.stream = ex.stream;
            r.device = cuda_ops::device_info(ex.device);
            r.scratch_view = cuda_ops::scratch(ex);
            return r;
        }
        cuda::DeviceGuard guard;
    };
    static Runner runner(const Ex& ex) { return Runner(ex); }

    static void check_on(const Ex& ex, const Device& got, const char* what) { check_device(Device::cuda(ex.device), got, what); }
};

}  // namespace lockstep::kernels::cuda_ops
