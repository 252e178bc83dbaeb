// SPDX-License-Identifier: MIT
//! `comm::CudaGroup`, the replica group of CUDA replicas, and the NCCL check macro. The group is
//! declared with the interface DataParallel drives; NCCL and the device-local reduction come with
//! issue 13, and until then building one says so.
#pragma once

#include <nccl.h>

#include <chrono>
#include <memory>
#include <vector>

#include "lockstep/comm/collectives.hpp"
#include "lockstep/comm/group.hpp"
#include "lockstep/core/cuda_runtime.cuh"
#include "lockstep/core/error.hpp"
#include "lockstep/runtime/abortable_barrier.hpp"

//! Throws `lockstep::DeviceError` when an NCCL call fails, with NCCL's own error string.
#define LOCKSTEP_NCCL_CHECK(expr)                                                                   \
    do {                                                                                              \
        const ncclResult_t lockstep_res_ = (expr);                                                    \
        if (lockstep_res_ != ncclSuccess) [[unlikely]]                                                \
            ::lockstep::cuda::detail::raise("NCCL", static_cast<int>(lockstep_res_), "ncclResult_t",  \
                                            ncclGetErrorString(lockstep_res_), #expr, __FILE__, __LINE__); \
    } while (0)

namespace lockstep::comm {

//! The group of CUDA replicas (DataParallel's default on the Cuda backend): NCCL across devices,
//! a device-local reduction where replicas share a GPU.
class CudaGroup {
public:
    using backend = Cuda;

    CudaGroup(const std::vector<Device>&, std::chrono::milliseconds) {
        throw NotImplemented(
            "comm::CudaGroup: collectives between CUDA replicas are not implemented yet (issue 13); train on the host "
            "backend meanwhile");
    }

    int size() const noexcept { return 0; }
    Collectives& communicator(int rank);
    std::shared_ptr<Abortable> abortable() const { return nullptr; }
};

inline Collectives& CudaGroup::communicator(int) {
    throw NotImplemented("comm::CudaGroup::communicator is not implemented yet (issue 13)");
}

static_assert(GroupLike<CudaGroup>);

}  // namespace lockstep::comm
