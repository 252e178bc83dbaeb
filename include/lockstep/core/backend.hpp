// SPDX-License-Identifier: MIT
//! Backend tag types (`Host`, `Cuda`) and the concept every tag meets, `Device` (the place a
//! replica runs) and `Execution<B>`, the backend's part of a replica's execution context.
#pragma once

#include <concepts>
#include <ostream>
#include <string>
#include <string_view>
#include <type_traits>

#include "lockstep/core/error.hpp"

namespace lockstep {

//! Where a replica lives: a backend and an index (GPU ordinal, or host replica number).
struct Device {
    enum class Kind { host, cuda };
    Kind kind = Kind::host;
    int index = 0;

    static constexpr Device host(int i = 0) { return {Kind::host, i}; }
    static constexpr Device cuda(int i) { return {Kind::cuda, i}; }

    friend constexpr bool operator==(const Device&, const Device&) = default;
    friend std::ostream& operator<<(std::ostream& os, const Device& d) {
        return os << (d.kind == Kind::host ? "host:" : "cuda:") << d.index;
    }
    std::string str() const { return (kind == Kind::host ? "host:" : "cuda:") + std::to_string(index); }
};

//! A backend tag: a type naming its backend (`name`, for messages) and the kind of device its
//! memory lives on (`device_kind`), both constants. Templates ask only for these members, so the
//! tag of a new backend needs no change here (its operations come from its `kernels::Ops<B>`).
template <class B>
concept BackendTag = requires {
    { B::name } -> std::convertible_to<std::string_view>;
    { B::device_kind } -> std::same_as<const Device::Kind&>;
    typename std::integral_constant<Device::Kind, B::device_kind>;  // a constant expression
};

//! Threads of this process act as devices; memory is ordinary host memory.
struct Host {
    static constexpr std::string_view name = "host";
    static constexpr Device::Kind device_kind = Device::Kind::host;
};

//! CUDA devices. Storage, kernels and communicators for it live behind `<lockstep/cuda.cuh>`.
struct Cuda {
    static constexpr std::string_view name = "cuda";
    static constexpr Device::Kind device_kind = Device::Kind::cuda;
};

static_assert(BackendTag<Host> && BackendTag<Cuda>);

//! The kind of device backend B's memory lives on.
template <BackendTag B>
constexpr Device::Kind device_kind_of() {
    return B::device_kind;
}

//! Whether memory on `a` can be used where `b` is expected: the same backend and, for CUDA, the
//! same ordinal. Host replicas share one memory, so `host:0` and `host:1` are compatible.
constexpr bool same_memory(const Device& a, const Device& b) {
    return a.kind == b.kind && (a.kind == Device::Kind::host || a.index == b.index);
}

//! Throws `DeviceMismatch` naming both devices when a tensor on `got` is handed to work on `want`.
inline void check_device(const Device& want, const Device& got, std::string_view what) {
    if (!same_memory(want, got)) [[unlikely]]
        throw DeviceMismatch(std::string(what) + " is on " + got.str() + " but runs on " + want.str() + "; move it with .to(" +
                             want.str() + ") or build it on the replica's device");
}

// Note [execution context]
// Each replica owns one execution context (nn::Context), handed to every forward and backward.
// Its backend part, `Execution<B>`, is what the backend operations need besides their operands:
// on the host its math mode alone (a replica is its thread), on CUDA the replica's device, compute stream,
// cuBLAS handle, workspace and kernel scratch (`Execution<Cuda>`, defined with the CUDA backend in
// kernels/cuda_execution.cuh). Backend operations take it as their first argument, so a layer
// written once runs on either backend. A replica group registers with the execution of each
// replica bound to it (`Api::watch(Execution<B>&, DeviceWatch*, timeout)`, Note [stream-ordered
// collectives]), so the backend's host waits on the device consult the group (device_watch.hpp).

// Note [math modes]
// How float32 matrix products (convolutions and linear layers) may round, as PyTorch's switches
// say it (torch.backends.cudnn.allow_tf32 for convolutions, torch.backends.cuda.matmul.allow_tf32
// for matrix products):
// - `pytorch_default`, the default, as PyTorch's defaults: convolutions on TF32 tensor cores
//   (inputs rounded to TF32's 10-bit mantissa, products accumulated in fp32), linear layers in
//   strict fp32. The same network then matches PyTorch at the same speed and rounding.
// - `strict_fp32`: every product in fp32 (what the CUDA-vs-host parity tests pin).
// - `tf32`: convolutions and linear layers on TF32 tensor cores.
// On CUDA the mode is the cuBLAS math mode of each product (CUBLAS_TF32_TENSOR_OP_MATH or
// CUBLAS_DEFAULT_MATH, set before the call on the replica's handle). A mode allows rounding; it
// does not demand it: the host backend has no TF32 arithmetic and computes every mode in strict
// fp32, as PyTorch's CPU operators ignore the switches. Every replica of a DataParallel runs the
// same mode (DataParallelOptions::math), so replicas stay bit-identical.

//! How float32 convolutions and linear layers may round (Note [math modes]).
enum class Math : unsigned char {
    pytorch_default,  //!< TF32 convolutions, strict fp32 linear layers (PyTorch's defaults)
    strict_fp32,      //!< every product in fp32
    tf32,             //!< convolutions and linear layers on TF32 tensor cores
};

constexpr std::string_view to_string(Math m) noexcept {
    switch (m) {
        case Math::pytorch_default: return "pytorch_default";
        case Math::strict_fp32: return "strict_fp32";
        case Math::tf32: return "tf32";
    }
    return "unknown";
}

//! What a product runs for: the two kinds of layer PyTorch's switches tell apart.
enum class ProductOf : unsigned char { convolution, linear };

//! Whether mode `m` lets a product for `of` round its inputs to TF32.
constexpr bool allows_tf32(Math m, ProductOf of) noexcept {
    return m == Math::tf32 || (m == Math::pytorch_default && of == ProductOf::convolution);
}

// Note [precision]
// What a replica's matrix products store their inputs in, as PyTorch's autocast(bfloat16) does for
// convolutions and linear layers:
// - `fp32`, the default: the inputs as they are, rounded only as the math mode allows (Note [math
//   modes]).
// - `bf16`: every product of a convolution or linear layer, forward and backward, takes its two
//   operands rounded to bfloat16 (to nearest, ties to even: 8 significant bits) and accumulates in
//   fp32 into an fp32 result; on CUDA one cublasGemmEx or cublasGemmStridedBatchedEx (CUDA_R_16BF
//   inputs, CUBLAS_COMPUTE_32F) on tensor cores, whatever the math mode says, on GPUs of compute
//   capability 8.0 or newer (older ones are refused, UsageError). Convolutions through cuDNN run
//   its bf16 configuration instead, whose results cuDNN rounds to bf16 (Note [cuDNN convolutions]). The activations between
//   layers are stored in bf16 where the layers take them (Note [activation precision] in core/activation.hpp). Everything else
//   stays fp32: the parameters (the master weights the optimizer updates and checkpoints keep), parameter gradients, batch-norm
//   statistics, losses.
// Separately, DataParallelOptions::gradient_precision = bf16 all-reduces the gradient buckets in
// bf16 (rounded before the sum, widened after it); fp32 by default.
// The host backend has no bf16 products or all-reduces and refuses both (UsageError) rather than
// computing something else under their name. Every replica of a DataParallel runs the same
// precisions, so replicas stay bit-identical.

//! What matrix products round their inputs to (Note [precision]).
enum class Precision : unsigned char {
    fp32,  //!< products in fp32 (or TF32, as the math mode allows)
    bf16,  //!< convolution and linear products on bfloat16 inputs, fp32 accumulation and results
};

constexpr std::string_view to_string(Precision p) noexcept {
    switch (p) {
        case Precision::fp32: return "fp32";
        case Precision::bf16: return "bf16";
    }
    return "unknown";
}

//! The backend's part of an execution context (see Note [execution context]); each backend
//! specializes it beside its operations.
template <BackendTag B>
struct Execution;

//! The host's part: the math mode alone, which the host honours by never rounding below fp32
//! (Note [math modes]); a replica is its thread.
template <>
struct Execution<Host> {
    Math math = Math::pytorch_default;
};

namespace detail {
inline int& host_device_slot() noexcept {
    thread_local int index = 0;
    return index;
}
}  // namespace detail

//! The host device new host tensors of this thread are made on: `host:0` unless the thread was
//! given another (each DataParallel replica thread is given its replica's device).
inline Device current_host_device() noexcept { return Device::host(detail::host_device_slot()); }
inline void set_current_host_device(int index) noexcept { detail::host_device_slot() = index; }

}  // namespace lockstep
