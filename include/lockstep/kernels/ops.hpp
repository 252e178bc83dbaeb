// SPDX-License-Identifier: MIT
//! The backend operations seam: `kernels::Ops<B>`, the operations every layer, loss, optimizer
//! and DataParallel call instead of touching tensor memory, and the geometry they take.
#pragma once

#include <cstdint>
#include <optional>

#include "lockstep/core/backend.hpp"
#include "lockstep/core/tensor.hpp"

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

//! The operations of backend `B`. Specialized for `Host` in host_ops.hpp and for `Cuda` in
//! <lockstep/cuda.cuh>.
template <BackendTag B>
struct Ops;

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
};

//! On CUDA the constants also hold the shared shift K the statistics kernel used, and a training
//! forward's finish, deferred into the normalize kernel's prologue (Note [batch-norm kernels]).
template <>
struct BnConstants<Cuda> {
    Tensor<double, Cuda> stats;
    Tensor<float, Cuda> folded;
    //! K per channel, written by the statistics kernel.
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

}  // namespace lockstep::kernels
