// SPDX-License-Identifier: MIT
//! What the CUDA backend operations share: the cuBLAS check, the replica's reduction scratch and
//! the device facts launch configurations depend on.
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <concepts>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "lockstep/core/backend.hpp"
#include "lockstep/core/bfloat16.hpp"
#include "lockstep/core/cuda_runtime.cuh"
#include "lockstep/core/error.hpp"
#include "lockstep/core/tensor.hpp"
#include "lockstep/kernels/cuda_execution.cuh"
#include "lockstep/kernels/device/grid.cuh"
#include "lockstep/kernels/ops.hpp"

namespace lockstep::cuda::detail {

inline const char* cublas_status_name(cublasStatus_t s) {
    switch (s) {
        case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
        case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
        case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
        case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
        case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
        case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
        default: return "CUBLAS_STATUS_OTHER";
    }
}

}  // namespace lockstep::cuda::detail

//! Throws `lockstep::DeviceError` when a cuBLAS call fails.
#define LOCKSTEP_CUBLAS_CHECK(expr)                                                                          \
    do {                                                                                                     \
        const cublasStatus_t lockstep_st_ = (expr);                                                          \
        if (lockstep_st_ != CUBLAS_STATUS_SUCCESS) [[unlikely]]                                              \
            ::lockstep::cuda::detail::raise("cuBLAS", static_cast<int>(lockstep_st_),                        \
                                            ::lockstep::cuda::detail::cublas_status_name(lockstep_st_),      \
                                            cublasGetStatusString(lockstep_st_), #expr, __FILE__, __LINE__); \
    } while (0)

namespace lockstep::kernels::cuda_ops {

//! A tensor element that holds bfloat16 bits: lockstep's portable type (Note [bfloat16 storage]) or
//! raw 16 bits (a gradient bucket's all-reduce copy); the kernels read both as __nv_bfloat16.
template <class T>
concept bf16_bits = std::same_as<T, BFloat16> || std::same_as<T, std::uint16_t>;

//! What an activation between layers is stored in (Note [activation precision]).
template <class T>
concept activation_storage = std::same_as<T, float> || std::same_as<T, BFloat16>;

//! A tensor's storage as the kernels' element type: BFloat16 as __nv_bfloat16 (the same bits),
//! every other type as it is.
template <class T>
T* on_device(T* p) noexcept {
    return p;
}
inline __nv_bfloat16* on_device(BFloat16* p) noexcept { return reinterpret_cast<__nv_bfloat16*>(p); }
inline const __nv_bfloat16* on_device(const BFloat16* p) noexcept { return reinterpret_cast<const __nv_bfloat16*>(p); }

using Ex = Execution<Cuda>;
template <class T>
using T_ = Tensor<T, Cuda>;

//! The replica's scratch for reducing kernels (Note [kernels proven on the host]).
inline device::Scratch scratch(const Ex& ex) {
    LOCKSTEP_CHECK_AS(UsageError, ex.scratch.counters != nullptr,
                      "a CUDA operation ran without its replica's scratch; "
                      "run it with the execution of a replica's resources (kernels::Ops<Cuda>::ReplicaResources)");
    return ex.scratch;
}

//! The multiprocessor count and L2 size of `device`, asked once per device.
inline device::DeviceInfo device_info(int device) {
    static thread_local int cached_device = -1;
    static thread_local device::DeviceInfo cached;
    if (device != cached_device) {
        int sms = 0, l2 = 0;
        LOCKSTEP_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
        LOCKSTEP_CUDA_CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device));
        cached = {sms, static_cast<std::int64_t>(l2)};
        cached_device = device;
    }
    return cached;
}

//! Throws UsageError unless `device` has bf16 tensor cores (compute capability 8.0 or newer), which
//! Precision::bf16 multiplies on (Note [precision]); `what` names the option that asked.
inline void check_bf16_device(int device, const char* what) {
    int major = 0, minor = 0;
    LOCKSTEP_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    LOCKSTEP_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    LOCKSTEP_CHECK_AS(UsageError, major >= 8, what,
                      ": bf16 needs a GPU of compute capability 8.0 or newer (bf16 tensor cores); cuda:", device, " is ", major,
                      ".", minor, "; use Precision::fp32 on it");
}

}  // namespace lockstep::kernels::cuda_ops
