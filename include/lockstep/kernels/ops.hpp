// SPDX-License-Identifier: MIT
//! The backend operations seam: `kernels::Ops<B>`, the operations every layer, loss, optimizer
//! and DataParallel call instead of touching tensor memory, and the geometry they take.
#pragma once

#include <concepts>
#include <cstdint>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "lockstep/core/backend.hpp"
#include "lockstep/core/bfloat16.hpp"
#include "lockstep/core/tensor.hpp"
#include "lockstep/kernels/batch_norm_math.hpp"  // the batch-norm payload layout layers and backends share
#include "lockstep/kernels/norm_math.hpp"        // layer norm per row on both backends
#include "lockstep/kernels/optim_math.hpp"       // Adam per element on both backends
#include "lockstep/kernels/pool_math.hpp"        // average pooling and dropout, per element on both backends
#include "lockstep/kernels/tensor_math.hpp"      // the public tensor operations, per element on both backends

namespace lockstep::kernels {

// Note [backend operations]
// Everything above kernels/ is written once, as templates on the backend tag B. Layers, losses,
// the optimizer, scatter/gather, gradient buckets and the broadcast of initial values never read
// or write tensor memory themselves (no BLAS call, SIMD loop, memcpy, span() or operator[] on
// tensor data in nn/ or parallel/): they call the static members of `Ops<B>`, each of which takes
// the replica's `Execution<B>` first and tensors of backend B. `Ops<Host>` (host_ops.hpp) is
// OpenBLAS plus the host loops; `Ops<Cuda>` (<lockstep/cuda.cuh>) is cuBLAS plus CUDA kernels on
// the replica's stream. Operations are coarse where a backend may want its own algorithm (a whole
// convolution, not im2col + GEMM: the host may use oneDNN, CUDA cuDNN) and fine where the work is
// generic (copy a range, scale, accumulate). Per-layer state a backend keeps between calls (im2col
// buffers, cached primitives) is the backend's `ConvScratch` type, held by the layer.
// Values a step needs on the host (the loss, counters) stay in small device tensors until the step
// ends; `read` is the one operation that waits for the device, for code outside a step.

//! The operations of backend `B`. Specialized for `Host` in host_ops.hpp (<lockstep/host.hpp>)
//! and for `Cuda` in <lockstep/cuda.cuh>; what each must offer is `BackendOps`.
template <BackendTag B>
struct Ops {
    static_assert(sizeof(B) == 0,
                  "lockstep: this backend's operations are not included: include <lockstep/host.hpp> "
                  "for Host (link lockstep::host) or <lockstep/cuda.cuh> for Cuda (link lockstep::cuda)");
};

//! A 2-D convolution with a square kernel: (N, C, H, W) -> (N, O, OH, OW), input and output in
//! NCHW, or both NHWC (`channels_last`); weights [O, C, k, k] always.
struct ConvGeometry {
    std::int64_t batch = 0, in_channels = 0, height = 0, width = 0;
    std::int64_t out_channels = 0, kernel = 1, stride = 1, padding = 0;
    bool channels_last = false;
    std::int64_t out_height() const { return (height + 2 * padding - kernel) / stride + 1; }
    std::int64_t out_width() const { return (width + 2 * padding - kernel) / stride + 1; }
    friend bool operator==(const ConvGeometry&, const ConvGeometry&) = default;
};

//! Max pooling over `kernel` x `kernel` windows at `stride`, NCHW: (N, C, H, W) -> (N, C, OH, OW).
struct PoolGeometry {
    std::int64_t batch = 0, channels = 0, height = 0, width = 0, kernel = 1, stride = 1;
    std::int64_t out_height() const { return (height - kernel) / stride + 1; }
    std::int64_t out_width() const { return (width - kernel) / stride + 1; }
};

//! Where element (n, c, p) of an (N, C, P) batch-norm input lives; P = H*W (1 for 2-D input). A
//! batch is channels-last when it is NHWC, 2-D, or has P = 1: every row of C channels is contiguous.
struct BnGeometry {
    std::int64_t batch = 0;     // N
    std::int64_t channels = 0;  // C
    std::int64_t inner = 1;     // P = H * W
    bool channels_last = false;

    std::int64_t rows() const { return batch * inner; }
    std::int64_t per_channel() const { return batch * inner; }
};

//! Whether backend B's batch norm takes storage type T: fp32 everywhere; the CUDA backend adds
//! fp16 and bf16 (specialized in cuda_bn_ops.cuh), with fp32 statistics and parameters.
template <BackendTag B, class T>
inline constexpr bool bn_storage = std::same_as<T, float>;

//! Per-channel values a batch-norm forward leaves for its normalize pass and its backward, on the
//! layer's device: `stats` = [mean (C) | invstd (C) | global count (1)] in fp64, `folded` =
//! [mean_hi (C) | mean_lo (C) | scale (C) | shift (C)] in fp32 (see Note [split mean]).
template <BackendTag B>
struct BnConstants {
    Tensor<double, B> stats;
    Tensor<float, B> folded;
    //! The local shift k per channel, from `bn_local_stats` to `bn_centre` (Note [shifted statistics]).
    Tensor<float, B> shift;
};

//! On CUDA the constants also hold a training forward's finish, deferred into the normalize
//! kernel's prologue (Note [batch-norm kernels]).
template <>
struct BnConstants<Cuda> {
    Tensor<double, Cuda> stats;
    Tensor<float, Cuda> folded;
    //! The local shift k per channel, written by the statistics kernel for the centring kernel.
    Tensor<float, Cuda> shift;
    //! What `bn_forward_finish` leaves for `bn_normalize`.
    struct Pending {
        const double* payload = nullptr;
        float* running_mean = nullptr;
        float* running_var = nullptr;
        std::int64_t* num_batches_tracked = nullptr;
        const float* weight = nullptr;
        const float* bias = nullptr;
        double eps = 1e-5;
        std::optional<double> momentum;
        bool update_running = false;
    };
    std::optional<Pending> pending;
};

//! How a training forward turns the all-reduced payload into statistics.
struct BnFinishOptions {
    double eps = 1e-5;
    //! Running-statistics factor; nullopt: cumulative average (1 / num_batches_tracked).
    std::optional<double> momentum = 0.1;
    //! Whether the running statistics are updated (training with tracked statistics).
    bool update_running = true;
};

//! The hyper-parameters of one SGD update (torch.optim.SGD).
struct SgdUpdate {
    double lr = 0.01, momentum = 0.0, dampening = 0.0, weight_decay = 0.0;
    bool nesterov = false;
};

//! One parameter of `Ops<B>::sgd_step_many`: its value, gradient and momentum buffer (read only
//! with momentum), and whether the buffer is made from the gradient at this step.
template <BackendTag B>
struct SgdTensors {
    Tensor<float, B>* value = nullptr;
    const Tensor<float, B>* grad = nullptr;
    Tensor<float, B>* momentum = nullptr;
    bool first = false;
};

//! One parameter of `Ops<B>::adam_step_many`: its value, gradient and moment estimates.
template <BackendTag B>
struct AdamTensors {
    Tensor<float, B>* value = nullptr;
    const Tensor<float, B>* grad = nullptr;
    Tensor<float, B>* exp_avg = nullptr;
    Tensor<float, B>* exp_avg_sq = nullptr;
};

//! One piece of `Ops<B>::copy_many`: dst[dst_offset, +count) = src[src_offset, +count), on one
//! device, the pieces not overlapping (DataParallel moving tensors into their bucket buffers).
template <BackendTag B>
struct CopyPiece {
    Tensor<float, B>* dst = nullptr;
    std::int64_t dst_offset = 0;
    const Tensor<float, B>* src = nullptr;
    std::int64_t src_offset = 0;
    std::int64_t count = 0;
};

//! What a backend's `Ops<B>` provides to the generic code (nn/, parallel/), checked by a
//! static_assert next to each specialization so that the backends cannot drift apart. Every
//! operation takes the replica's `Execution<B>` first (Note [backend operations]).
template <class K, class B>
concept BackendOps = requires(const Execution<B>& ex, const Device& device, Tensor<float, B>& f, const Tensor<float, B>& cf,
                              Tensor<double, B>& d, const Tensor<double, B>& cd, Tensor<std::int64_t, B>& i64,
                              Tensor<std::int32_t, B>& i32, const Tensor<std::int32_t, B>& ci32, Tensor<std::uint8_t, B>& mask,
                              const Tensor<std::uint8_t, B>& cmask, std::span<const std::int64_t> labels,
                              typename K::ConvScratch& conv, BnConstants<B>& bn, const BnConstants<B>& cbn,
                              std::span<const SgdTensors<B>> sgd, std::span<const AdamTensors<B>> adam,
                              std::span<const CopyPiece<B>> pieces) {
    // A replica's resources: made for its device, entered by a thread (a guard) or bound to it.
    typename K::ReplicaResources;
    requires std::constructible_from<typename K::ReplicaResources, const Device&>;
    { std::declval<const typename K::ReplicaResources&>().execution() } -> std::same_as<Execution<B>>;
    std::declval<const typename K::ReplicaResources&>().enter();
    std::declval<const typename K::ReplicaResources&>().bind_thread();
    typename K::Range;  // a profiler range
    requires std::constructible_from<typename K::Range, const char*>;
    typename K::Runtime;  // the backend's process-wide settings while replicas exist
    { K::default_devices(1) } -> std::same_as<std::vector<Device>>;
    { K::caller_execution(device) } -> std::same_as<Execution<B>>;
    K::order_after(ex, ex);
    K::mark_inputs_read(ex);
    K::wait_inputs_read(ex);
    // Generic work.
    K::fill(ex, f, 0.0f);
    K::copy(ex, f, 0, cf, 0, 0);
    K::copy_many(ex, pieces);
    K::scale(ex, f, 1.0);
    K::add(ex, d, cd);
    { K::read(ex, cd, 0) } -> std::same_as<double>;
    { K::to_vector(ex, cd) } -> std::same_as<std::vector<double>>;
    K::add_sum_squares(ex, cf, d, 0);
    // Activations stored in bf16 (Note [activation precision]).
    K::to_bf16(ex, cf, std::declval<Tensor<BFloat16, B>&>());
    K::from_bf16(ex, std::declval<const Tensor<BFloat16, B>&>(), f);
    { K::bf16_activations } -> std::convertible_to<bool>;
    K::clip_to_norm(ex, f, cd, 1.0);
    // Layers, losses, the optimizer.
    K::conv2d_forward(ex, ConvGeometry{}, cf, cf, &cf, f, conv);
    K::conv2d_backward(ex, ConvGeometry{}, cf, cf, cf, f, &f, f, conv);
    K::linear_forward(ex, cf, cf, &cf, f, false, &mask);
    K::linear_backward(ex, cf, cf, &cmask, cf, f, &f, f);
    K::relu_forward(ex, f, &mask);
    K::relu_backward(ex, cf, cmask, f);
    K::maxpool_forward(ex, PoolGeometry{}, cf, f, i32);
    K::maxpool_backward(ex, PoolGeometry{}, cf, ci32, f);
    K::avgpool_forward(ex, AvgPoolGeometry{}, cf, f);
    K::avgpool_backward(ex, AvgPoolGeometry{}, cf, f);
    K::dropout_forward(ex, f, DropoutDraw{}, mask);
    K::dropout_backward(ex, cf, cmask, DropoutDraw{}, f);
    K::layer_norm_forward(ex, cf, 1, &cf, &cf, 1e-5, f, f, f);
    K::layer_norm_backward(ex, cf, cf, 1, &cf, cf, cf, f, &f, &f);
    K::softmax_cross_entropy(ex, cf, labels, 1.0, f, d);
    // The public tensor operations (nn/tensor_ops.hpp, Note [tensor operations per element]).
    K::axpby(ex, 1.0f, cf, 1.0f, cf, f);
    K::multiply(ex, cf, cf, f);
    K::reduce(ex, ReduceGeometry{}, cf, f);
    K::broadcast(ex, BroadcastGeometry{}, cf, f);
    K::softmax_forward(ex, LineGeometry{}, cf, f);
    K::softmax_backward(ex, LineGeometry{}, cf, cf, f);
    K::argmax(ex, LineGeometry{}, cf, i64);
    K::place(ex, PlaceGeometry{}, cf, f);
    K::take(ex, PlaceGeometry{}, cf, f);
    // A tensor's values where the host reads them without a wait (labels checked in a loss), or none.
    { K::host_values(std::as_const(i64)) } -> std::same_as<std::optional<std::span<const std::int64_t>>>;
    K::mse(ex, cf, cf, 1.0, f, d);
    K::sgd_step_many(ex, sgd, SgdUpdate{});
    K::adam_step_many(ex, adam, AdamUpdate{});
    // Batch norm (Note [batch-norm kernels]).
    K::bn_local_stats(ex, cf, BnGeometry{}, bn, d);
    K::bn_centre(ex, BnGeometry{}, cbn, d);
    K::bn_forward_finish(ex, cd, BnFinishOptions{}, &f, &f, &i64, &cf, &cf, bn);
    K::bn_eval_constants(ex, cf, cf, 1e-5, &cf, &cf, bn);
    K::bn_normalize(ex, f, f, BnGeometry{}, bn, false, &mask);  // CUDA finishes a deferred forward here
    K::bn_backward_sums(ex, cf, cf, true, &cmask, BnGeometry{}, cbn, d);
    K::bn_param_grads(ex, cd, cbn, f, f);
    K::bn_backward_dx(ex, cd, cbn, &cf, f, cf, true, &cmask, BnGeometry{});
    // Whether a fused ReLU's forward keeps a mask for backward (Note [ReLU mask from x]).
    { K::bn_keeps_relu_mask } -> std::convertible_to<bool>;
};

}  // namespace lockstep::kernels
