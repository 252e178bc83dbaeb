// SPDX-License-Identifier: MIT
//! `DataParallelOptions` (how a DataParallel runs) and `StepResult` (what a training step reports).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>

#include "lockstep/comm/process_group.hpp"
#include "lockstep/core/backend.hpp"
#include "lockstep/runtime/abortable_barrier.hpp"
#include "lockstep/runtime/replica_pool.hpp"

namespace lockstep {

//! How a DataParallel runs.
struct DataParallelOptions {
    //! Gradients are all-reduced in flat buckets of about this many bytes, last layers first.
    std::size_t bucket_bytes = std::size_t{25} << 20;
    //! Run each bucket's all-reduce on the replica's communication thread as soon as the bucket's
    //! gradients are final, overlapping the rest of backward (false: after backward, in line).
    bool overlap = true;
    //! No collective waits longer than this for a peer, and no call waits longer than this for
    //! a replica once another has failed or finished (then it throws `ReplicaStuck`).
    std::chrono::milliseconds timeout = AbortableBarrier::default_timeout;
    //! Where the replica threads run (see Note [replica CPU binding]).
    CpuBinding cpu_binding = CpuBinding::automatic;
    //! Clip the all-reduced gradients to this global L2 norm before the optimizer step, as
    //! torch.nn.utils.clip_grad_norm_ (must be positive; unset: no clipping).
    std::optional<double> clip_grad_norm = std::nullopt;
    //! Check the loss and the all-reduced gradients before the commit point: a step with NaN or
    //! infinity throws `NonFinite` and no replica applies it (costs a pass over the gradients).
    bool check_finite = false;
    //! How convolutions and linear layers may round (Note [math modes] in core/backend.hpp): by
    //! default as PyTorch's defaults (TF32 convolutions, strict fp32 linear layers on CUDA);
    //! `Math::strict_fp32` for fp32 everywhere, `Math::tf32` for TF32 everywhere. The host
    //! backend computes every mode in strict fp32.
    Math math = Math::pytorch_default;
    //! What convolutions and linear layers round their products' inputs to (Note [precision] in
    //! core/backend.hpp): `Precision::bf16` multiplies bfloat16 operands with fp32 accumulation
    //! and stores the activations between layers in bf16 (Note [activation precision]), as
    //! PyTorch's autocast(bfloat16) does, and keeps parameters, gradients, batch-norm statistics
    //! and checkpoints in fp32 (the gradients' all-reduce: `gradient_precision`). CUDA only,
    //! compute capability 8.0 or newer (refused otherwise).
    Precision precision = Precision::fp32;
    //! What the gradient buckets are all-reduced in: fp32 (the default), or bf16, rounded from
    //! the fp32 gradients before the sum and widened back after it (half the bytes on the wire;
    //! each replica's gradient loses its bits below bf16's 8, and the sum is rounded to bf16).
    //! Independent of `precision`. CUDA only (the host backend refuses it).
    Precision gradient_precision = Precision::fp32;
    //! Run each replica's training step as CUDA graphs (Note [captured steps] in
    //! parallel/step.hpp): forward, loss, backward and every collective of the step in one
    //! launch, clipping and the optimizer's update in a second, the commit point between them.
    //! The first step of each input shape runs eagerly, the next one is captured, later ones
    //! launch it. CUDA only, one replica per GPU (across processes too: they decide each step
    //! together); the loss must also take its targets on the device (nn::SoftmaxCrossEntropy and
    //! nn::MseLoss do).
    bool graphs = false;
    //! Captured steps kept per replica (input shapes and module structures), least recently
    //! launched dropped first.
    std::size_t graph_capacity = 8;
    //! The processes this DataParallel spans (Note [replicas across processes] in
    //! comm/process_group.hpp; `comm::MpiProcessGroup` from `<lockstep/mpi.hpp>`); empty: this
    //! process alone. Then the devices are this process's replicas, every process runs as many,
    //! global rank = process rank x replicas + local rank, and train_step and forward take this
    //! process's rows of the global batch: those of its global ranks' shards, contiguous, in
    //! global-rank order.
    std::shared_ptr<comm::ProcessGroup> process_group = nullptr;
};

//! What one training step reports, computed identically for any split of the batch. It covers
//! every sample since the previous step: the step's own batch and those of `accumulate` calls.
struct StepResult {
    double loss = 0;           //!< mean loss over those samples
    std::int64_t count = 0;    //!< samples
    std::int64_t correct = 0;  //!< samples classified correctly (classification losses only; 0 otherwise)
};

}  // namespace lockstep
