// SPDX-License-Identifier: MIT
//! `comm::CudaGroup`, the replica group of CUDA replicas (NCCL across GPUs, one rank-order kernel
//! where replicas share a GPU), and `comm::NcclCommunicator`, a replica's handle on it. The group's
//! logic is `StreamGroup` (stream_group.hpp); `NcclApi` is what it calls: `NcclCalls`
//! (nccl_calls.cuh) and the kernels.
#pragma once

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "lockstep/comm/collectives.hpp"
#include "lockstep/comm/group.hpp"
#include "lockstep/comm/nccl_calls.cuh"
#include "lockstep/comm/stream_group.hpp"
#include "lockstep/core/cuda_runtime.cuh"
#include "lockstep/core/error.hpp"
#include "lockstep/kernels/cuda_common.cuh"
#include "lockstep/kernels/device/launch.cuh"
#include "lockstep/kernels/device/comm_kernels.cuh"
#include "lockstep/runtime/abortable_barrier.hpp"

namespace lockstep::comm {

//! The device calls of a CUDA replica group (the `Api` of `StreamGroup`): `NcclCalls`, and the
//! rank-order kernel of replicas that share a GPU.
struct NcclApi : NcclCalls<NcclApi> {
    static Stream make_stream(int device) {
        Stream s = NcclCalls<NcclApi>::make_stream(device);
        cuda::DeviceGuard guard(device);
        // Kernels are loaded before the first collective (CUDA loads lazily, and loading while a
        // peer's NCCL kernel spins can wait on it): the group's own kernels now, on every device.
        cudaFuncAttributes attributes{};
        LOCKSTEP_CUDA_CHECK(cudaFuncGetAttributes(
            &attributes,
            reinterpret_cast<const void*>(&kernels::device::map_kernel<kernels::device::comm_kernels::RankSum<float>>)));
        LOCKSTEP_CUDA_CHECK(cudaFuncGetAttributes(
            &attributes,
            reinterpret_cast<const void*>(&kernels::device::map_kernel<kernels::device::comm_kernels::RankSum<double>>)));
        LOCKSTEP_CUDA_CHECK(cudaFuncGetAttributes(
            &attributes,
            reinterpret_cast<const void*>(&kernels::device::map_kernel<kernels::device::comm_kernels::RankSum<__half>>)));
        LOCKSTEP_CUDA_CHECK(cudaFuncGetAttributes(
            &attributes,
            reinterpret_cast<const void*>(&kernels::device::map_kernel<kernels::device::comm_kernels::RankSum<__nv_bfloat16>>)));
        return s;
    }

    //! The device-local all-reduce: one kernel on `s` (Note [rank-order sum]).
    static void rank_sum(int device, Stream s, std::span<void* const> buffers, std::size_t count, DType t) {
        const Range range("lockstep device-local all-reduce");
        cuda::DeviceGuard guard(device);
        kernels::device::DeviceRun run;
        run.stream = s;
        run.device = kernels::cuda_ops::device_info(device);
        if (t == DType::f32)
            sum_as<float>(run, buffers, count);
        else if (t == DType::f64)
            sum_as<double>(run, buffers, count);
        else if (t == DType::f16)
            sum_as<__half>(run, buffers, count);
        else if (t == DType::bf16)
            sum_as<__nv_bfloat16>(run, buffers, count);
        else
            throw UsageError("an all-reduce takes float, double, __half or __nv_bfloat16 buffers");
    }
    static void copy(int device, Stream s, void* dst, const void* src, std::size_t bytes) {
        cuda::DeviceGuard guard(device);
        LOCKSTEP_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s));
    }

private:
    template <class T>
    static void sum_as(kernels::device::DeviceRun& run, std::span<void* const> buffers, std::size_t count) {
        std::vector<T*> typed;
        for (void* b : buffers) typed.push_back(static_cast<T*>(b));
        kernels::device::comm_kernels::rank_sum<T>(run, std::span<T* const>(typed), static_cast<std::int64_t>(count));
    }
};

//! A CUDA replica's handle on its `CudaGroup`.
using NcclCommunicator = StreamCommunicator<NcclApi>;

//! Sums fp16 or bf16 device data over the group in place (the tags say which type).
inline void all_reduce_sum(NcclCommunicator& c, DeviceSpan<__half> data, CollectiveSite site) {
    c.all_reduce_sum(data, DType::f16, site);
}
inline void all_reduce_sum(NcclCommunicator& c, DeviceSpan<__nv_bfloat16> data, CollectiveSite site) {
    c.all_reduce_sum(data, DType::bf16, site);
}

//! The group of CUDA replicas, DataParallel's default on the Cuda backend (Note [stream-ordered
//! collectives]): one NCCL communicator per replica when each replica has its own GPU, one
//! rank-order kernel when all share one GPU; a mix of both is refused.
class CudaGroup : public StreamGroup<NcclApi> {
public:
    using StreamGroup<NcclApi>::StreamGroup;
};

static_assert(GroupLike<CudaGroup>);

}  // namespace lockstep::comm
