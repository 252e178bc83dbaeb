// SPDX-License-Identifier: MIT
//! `nn::Context<B>`: a replica's execution context, what its layers know about the step they run in.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>

#include "lockstep/comm/collectives.hpp"
#include "lockstep/core/backend.hpp"
#include "lockstep/core/error.hpp"

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
    //! Which forward pass this is: DataParallel gives each forward of a replica a number no other
    //! pass of the process has (`next_pass()`), so that a layer can tell a second use within one
    //! pass (`OneUse`); 0 outside DataParallel, where nothing is checked. Code that drives a module
    //! itself may number its passes the same way.
    std::uint64_t pass = 0;
    //! Called by a layer when the gradient of one of its parameters is final (backward is done
    //! with it): DataParallel starts that bucket's all-reduce without waiting for the rest.
    std::function<void(const void* parameter)> grad_ready;
    //! The backend's part: nothing on the host; device, stream, cuBLAS handle, workspace on CUDA.
    [[no_unique_address]] Execution<B> exec{};

    void mark_grad_ready(const void* parameter) const {
        if (grad_ready) grad_ready(parameter);
    }
};

// Note [one instance, one use]
// A layer keeps what its backward needs (its input, a mask, statistics) in itself, so one layer
// instance can serve one place in a forward pass: used twice, the second forward overwrites what
// the first kept and backward computes a wrong gradient without a word (where PyTorch's autograd
// would keep both). Each of the kit's layers therefore holds a `OneUse` and enters it at every
// training forward: within one DataParallel pass (Context::pass, unique in the process) the second entry throws
// UsageError naming the layer, before anything is overwritten. A module that needs the same
// weights twice holds two layers and ties nothing, or writes its own module; a module of one's
// own can hold a OneUse as the kit's layers do.

//! A pass number no earlier call gave in this process (Context::pass): a module copied from one
//! DataParallel into another never meets a number it has seen.
inline std::uint64_t next_pass() noexcept {
    static std::atomic<std::uint64_t> passes{0};
    return passes.fetch_add(1, std::memory_order_relaxed) + 1;
}

//! Refuses a second training forward of one layer instance within one pass (Note [one instance, one use]).
class OneUse {
public:
    //! Call at the start of a forward; `describe()` names the layer in the error.
    template <BackendTag B, class Describe>
    void enter(const Context<B>& ctx, Describe&& describe) {
        if (!ctx.training || ctx.pass == 0) return;
        LOCKSTEP_CHECK_AS(UsageError, last_ != ctx.pass, describe(),
                          ": this layer instance ran twice in one training forward; the second use would overwrite what "
                          "backward needs from the first. Give each use its own instance (a module that reuses one "
                          "cannot train correctly without autograd)");
        last_ = ctx.pass;
    }

private:
    std::uint64_t last_ = 0;
};

}  // namespace lockstep::nn
