// SPDX-License-Identifier: MIT
//! `nn::Context`: what a replica's layers know about the step they run in.
#pragma once

#include <cstdint>
#include <functional>

#include "lockstep/comm/collectives.hpp"
#include "lockstep/core/backend.hpp"

namespace lockstep::nn {

//! Per-replica, per-step state handed to every `forward` and `backward`. A default Context is
//! one replica alone (no communication), in training mode.
struct Context {
    int rank = 0;
    int world = 1;
    Device device{};
    bool training = true;
    //! The replica group; null means a group of one.
    comm::Collectives* comm = nullptr;
    //! Samples in the global batch of this step (all replicas); the loss divides by it.
    //! -1: this replica's batch is the whole batch.
    std::int64_t global_batch = -1;
    //! Called by a layer when the gradient of one of its parameters is final (backward is done
    //! with it): DataParallel starts that bucket's all-reduce without waiting for the rest.
    std::function<void(const void* parameter)> grad_ready;
    //! The replica's stream on the Cuda backend (a cudaStream_t); unused on the host.
    void* stream = nullptr;

    void mark_grad_ready(const void* parameter) const {
        if (grad_ready) grad_ready(parameter);
    }
};

}  // namespace lockstep::nn
