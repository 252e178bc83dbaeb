// SPDX-License-Identifier: MIT
//! `nn::Context<B>`: a replica's execution context, what its layers know about the step they run in.
#pragma once

#include <cstdint>
#include <functional>

#include "lockstep/comm/collectives.hpp"
#include "lockstep/core/backend.hpp"

namespace lockstep::nn {

//! Per-replica state handed to every `forward` and `backward` (see Note [execution context]). A
//! default Context is one replica alone (no communication), in training mode.
template <BackendTag B = Host>
struct Context {
    using backend = B;

    //! The replica's rank among all replicas (over every process) and their number.
    int rank = 0;
    int world = 1;
    //! The replica's index among this process's replicas (its rank when one process runs them all):
    //! what per-replica state such as an optimizer's is indexed by.
    int local_rank = 0;
    bool training = true;
    //! The replica's group; null means a replica alone. SyncBatchNorm with `world > 1` needs it.
    comm::Collectives* comm = nullptr;
    //! Samples of this forward over all replicas (the global batch); -1: this replica's input is
    //! the whole batch. Losses average over it.
    std::int64_t global_batch = -1;
    //! Called by a layer when the gradient of one of its parameters is final (backward is done
    //! with it): DataParallel starts that bucket's all-reduce without waiting for the rest.
    std::function<void(const void* parameter)> grad_ready;
    //! The backend's part: nothing on the host; device, stream, cuBLAS handle, workspace on CUDA.
    [[no_unique_address]] Execution<B> exec{};

    void mark_grad_ready(const void* parameter) const {
        if (grad_ready) grad_ready(parameter);
    }
};

}  // namespace lockstep::nn
