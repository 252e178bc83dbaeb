// SPDX-License-Identifier: MIT
//! `kernels::Ops<Cuda>`: the backend operations on CUDA devices. This holds the operations'
//! signatures, the replica's resources and the copies; the kernels themselves (cuBLAS, CUB) come
//! with issue 12, and until then each says so when called.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "lockstep/core/backend.hpp"
#include "lockstep/core/cuda_runtime.cuh"
#include "lockstep/core/error.hpp"
#include "lockstep/core/tensor.hpp"
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

[[noreturn]] inline void not_implemented_yet(const char* op) {
    throw NotImplemented(std::string("kernels::Ops<Cuda>::") + op +
                         " is not implemented yet: the CUDA kernels come with issue 12; train on the host backend meanwhile");
}

}  // namespace lockstep::cuda::detail

//! Throws `lockstep::DeviceError` when a cuBLAS call fails.
#define LOCKSTEP_CUBLAS_CHECK(expr)                                                                 \
    do {                                                                                              \
        const cublasStatus_t lockstep_st_ = (expr);                                                   \
        if (lockstep_st_ != CUBLAS_STATUS_SUCCESS) [[unlikely]]                                       \
            ::lockstep::cuda::detail::raise("cuBLAS", static_cast<int>(lockstep_st_),               \
                                            ::lockstep::cuda::detail::cublas_status_name(lockstep_st_), \
                                            cublasGetStatusString(lockstep_st_), #expr, __FILE__, __LINE__); \
    } while (0)

namespace lockstep::kernels {

//! The CUDA backend's operations (see Note [backend operations]): every operation is enqueued on
//! the replica's stream (`Execution<Cuda>::stream`).
template <>
struct Ops<Cuda> {
    using Ex = Execution<Cuda>;
    template <class T>
    using T_ = Tensor<T, Cuda>;

    // ---- replicas ----------------------------------------------------------------------------

    //! Nothing process-wide to hold on CUDA.
    struct Runtime {};

    //! A replica's stream, cuBLAS handle and workspace (created with issue 13's DataParallel on
    //! CUDA); `enter()` makes its device and stream current on a thread working for the replica.
    struct ReplicaResources {
        explicit ReplicaResources(const Device& device) : device(device.index) {
            cuda::detail::not_implemented_yet("ReplicaResources (DataParallel on CUDA comes with issue 13)");
        }
        Ex execution() const { return Ex{device, nullptr, nullptr, nullptr, 0}; }
        void enter() const { LOCKSTEP_CUDA_CHECK(cudaSetDevice(device)); }
        int device;
    };

    //! `replicas` replicas over the visible GPUs, round-robin.
    static std::vector<Device> default_devices(int replicas) {
        LOCKSTEP_CHECK(replicas > 0, "DataParallel needs at least one replica, got ", replicas);
        const int gpus = cuda::device_count();
        LOCKSTEP_CHECK_AS(DeviceMismatch, gpus > 0, "DataParallel on CUDA found no GPU; use the host backend");
        std::vector<Device> d;
        for (int r = 0; r < replicas; ++r) d.push_back(Device::cuda(r % gpus));
        return d;
    }

    // ---- generic ----------------------------------------------------------------------------

    template <class T>
    static void fill(const Ex&, T_<T>&, T) { cuda::detail::not_implemented_yet("fill"); }

    //! dst[dst_offset, +count) = src[src_offset, +count), on the replica's stream.
    template <class T>
    static void copy(const Ex& ex, T_<T>& dst, std::int64_t dst_offset, const T_<T>& src, std::int64_t src_offset,
                     std::int64_t count) {
        if (count <= 0) return;
        LOCKSTEP_CUDA_CHECK(cudaMemcpyAsync(dst.data() + dst_offset, src.data() + src_offset,
                                            static_cast<std::size_t>(count) * sizeof(T), cudaMemcpyDefault, ex.stream));
    }

    static void scale(const Ex&, T_<float>&, double) { cuda::detail::not_implemented_yet("scale"); }

    template <class T>
    static void add(const Ex&, T_<T>&, const T_<T>&) {
        cuda::detail::not_implemented_yet("add");
    }

    //! Element `i` of `t`, on the host: waits for the replica's stream.
    template <class T>
    static T read(const Ex& ex, const T_<T>& t, std::int64_t i) {
        T value{};
        LOCKSTEP_CUDA_CHECK(cudaMemcpyAsync(&value, t.data() + i, sizeof(T), cudaMemcpyDeviceToHost, ex.stream));
        LOCKSTEP_CUDA_CHECK(cudaStreamSynchronize(ex.stream));
        return value;
    }

    static void add_sum_squares(const Ex&, const T_<float>&, T_<double>&, std::int64_t = 0) {
        cuda::detail::not_implemented_yet("add_sum_squares");
    }

    //! All of `t`'s elements on the host, in one copy: waits for the replica's stream.
    template <class T>
    static std::vector<T> to_vector(const Ex& ex, const T_<T>& t) {
        std::vector<T> out(static_cast<std::size_t>(t.numel()));
        if (!out.empty()) {
            LOCKSTEP_CUDA_CHECK(cudaMemcpyAsync(out.data(), t.data(), t.bytes(), cudaMemcpyDeviceToHost, ex.stream));
            LOCKSTEP_CUDA_CHECK(cudaStreamSynchronize(ex.stream));
        }
        return out;
    }
    static void clip_to_norm(const Ex&, T_<float>&, const T_<double>&, double) {
        cuda::detail::not_implemented_yet("clip_to_norm");
    }

    // ---- layers -----------------------------------------------------------------------------

    struct ConvScratch {};

    static void conv2d_forward(const Ex&, const ConvGeometry&, const T_<float>&, const T_<float>&, const T_<float>*,
                               T_<float>&, ConvScratch&) {
        cuda::detail::not_implemented_yet("conv2d_forward");
    }
    static void conv2d_backward(const Ex&, const ConvGeometry&, const T_<float>&, const T_<float>&, const T_<float>&,
                                T_<float>&, T_<float>*, T_<float>&, ConvScratch&) {
        cuda::detail::not_implemented_yet("conv2d_backward");
    }
    static void linear_forward(const Ex&, const T_<float>&, const T_<float>&, const T_<float>*, T_<float>&, bool,
                               T_<std::uint8_t>*) {
        cuda::detail::not_implemented_yet("linear_forward");
    }
    static void linear_backward(const Ex&, const T_<float>&, const T_<float>&, const T_<std::uint8_t>*, const T_<float>&,
                                T_<float>&, T_<float>*, T_<float>&) {
        cuda::detail::not_implemented_yet("linear_backward");
    }
    static void relu_forward(const Ex&, T_<float>&, T_<std::uint8_t>*) { cuda::detail::not_implemented_yet("relu_forward"); }
    static void relu_backward(const Ex&, const T_<float>&, const T_<std::uint8_t>&, T_<float>&) {
        cuda::detail::not_implemented_yet("relu_backward");
    }
    static void maxpool_forward(const Ex&, const PoolGeometry&, const T_<float>&, T_<float>&, T_<std::int32_t>&) {
        cuda::detail::not_implemented_yet("maxpool_forward");
    }
    static void maxpool_backward(const Ex&, const PoolGeometry&, const T_<float>&, const T_<std::int32_t>&, T_<float>&) {
        cuda::detail::not_implemented_yet("maxpool_backward");
    }

    // ---- losses and optimizer -----------------------------------------------------------------

    static void softmax_cross_entropy(const Ex&, const T_<float>&, std::span<const std::int64_t>, double, T_<float>&,
                                      T_<double>&) {
        cuda::detail::not_implemented_yet("softmax_cross_entropy");
    }
    static void mse(const Ex&, const T_<float>&, const T_<float>&, double, T_<float>&, T_<double>&) {
        cuda::detail::not_implemented_yet("mse");
    }
    static void sgd_step(const Ex&, T_<float>&, const T_<float>&, T_<float>&, bool, const SgdUpdate&) {
        cuda::detail::not_implemented_yet("sgd_step");
    }

    // ---- batch norm ---------------------------------------------------------------------------

    static void bn_local_stats(const Ex&, const T_<float>&, const BnGeometry&, const T_<float>*, T_<double>&) {
        cuda::detail::not_implemented_yet("bn_local_stats");
    }
    static void bn_forward_finish(const Ex&, const T_<double>&, const BnFinishOptions&, T_<float>*, T_<float>*,
                                  T_<std::int64_t>*, const T_<float>*, const T_<float>*, BnConstants<Cuda>&) {
        cuda::detail::not_implemented_yet("bn_forward_finish");
    }
    static void bn_eval_constants(const Ex&, const T_<float>&, const T_<float>&, double, const T_<float>*, const T_<float>*,
                                  BnConstants<Cuda>&) {
        cuda::detail::not_implemented_yet("bn_eval_constants");
    }
    static void bn_normalize(const Ex&, const T_<float>&, T_<float>&, const BnGeometry&, const BnConstants<Cuda>&, bool,
                             T_<std::uint8_t>*) {
        cuda::detail::not_implemented_yet("bn_normalize");
    }
    static void bn_backward_sums(const Ex&, const T_<float>&, const T_<float>&, const T_<std::uint8_t>*, const BnGeometry&,
                                 const BnConstants<Cuda>&, T_<double>&) {
        cuda::detail::not_implemented_yet("bn_backward_sums");
    }
    static void bn_param_grads(const Ex&, const T_<double>&, const BnConstants<Cuda>&, T_<float>&, T_<float>&) {
        cuda::detail::not_implemented_yet("bn_param_grads");
    }
    static void bn_backward_dx(const Ex&, const T_<double>&, const BnConstants<Cuda>&, const T_<float>*, T_<float>&,
                               const T_<float>&, const T_<std::uint8_t>*, const BnGeometry&) {
        cuda::detail::not_implemented_yet("bn_backward_dx");
    }
};

}  // namespace lockstep::kernels
