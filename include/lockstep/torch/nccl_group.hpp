// SPDX-License-Identifier: MIT
//! The device calls of lockstep::torch's gradient group on CUDA replicas: NCCL on the stream
//! libtorch runs each replica's work on (Note [libtorch NCCL buckets]). Included where the torch
//! component was configured with NCCL (LOCKSTEP_TORCH_NCCL).
#pragma once

#include <torch/torch.h>
#include <c10/cuda/CUDAStream.h>

#include <chrono>
#include <cstddef>
#include <span>
#include <string>

#include "lockstep/comm/nccl_calls.cuh"
#include "lockstep/core/error.hpp"

namespace lockstep::torch::detail {

// Note [libtorch NCCL buckets]
// On CUDA replicas (one per GPU, Note [libtorch CUDA replicas]) a bucket is all-reduced in place
// by NCCL, stream-ordered, through lockstep's stream group (Note [stream-ordered collectives] in
// comm/stream_group.hpp): its rendezvous first (tag check, abort, timeout), so no rank enters NCCL
// alone, then ncclAllReduce on the group's communication stream of the GPU, behind an event
// recorded on the replica's compute stream. That compute stream is the one libtorch runs the
// replica's work on: its device's default stream, which every job makes current (a null handle,
// CUDA's legacy default stream; the communication stream does not block on it). So:
//   - the hooks copy a bucket's gradients into its flat buffer on that stream (autograd runs a
//     node on the stream its forward ran on), and the communication thread starts the all-reduce
//     behind them; backward goes on meanwhile;
//   - after backward, join() makes the compute stream wait for the communication stream, and the
//     sums are copied back into the gradients on it;
//   - then the replica's host waits, bounded by Options::timeout and consulting the group (an
//     aborted peer, NCCL's asynchronous errors), until all of that has run: the commit barrier is
//     passed only by a replica whose all-reduces completed, and a peer that died inside NCCL
//     becomes a Timeout, not a hang in libtorch's next synchronization.
// NCCL adds the ranks in an order of its own, the same for every rank: the replicas stay
// identical to each other, though not bit-equal to a rank-order sum. No lockstep kernel is
// involved (a host compiler builds this against any GPU), so two replicas on one GPU, which would
// need the group's device-local sum, are refused before (check_devices). SyncBatchNorm's sums and
// the step's totals stay on the host group.

//! `StreamGroup`'s Api for the torch component (see Note [libtorch NCCL buckets]).
struct TorchNcclApi : comm::NcclCalls<TorchNcclApi> {
    static constexpr const char* name = "nccl";

    //! One communicator per GPU: any NCCL release as recent as the headers will do (Note [two
    //! communicators on one device]).
    static void prepare_nccl() {
        require_headers_release();
        set_environment();
    }

    //! The replica's device, and libtorch's current stream there (called on the replica's thread
    //! in a job, so its device's default stream).
    static Execution<Cuda> execution(const ::torch::Device& d) {
        Execution<Cuda> ex;
        ex.device = d.index();
        ex.stream = c10::cuda::getCurrentCUDAStream(d.index()).stream();
        cuda::DeviceGuard guard(ex.device);
        LOCKSTEP_CUDA_CHECK(cudaEventCreateWithFlags(&ex.done_event, cudaEventDisableTiming));
        return ex;
    }
    static void release(Execution<Cuda>& ex) noexcept {
        destroy_event(ex.device, ex.done_event);
        ex.done_event = nullptr;
    }
    //! The legacy default stream's handle is null: accepted, unlike lockstep's own replicas'.
    static Stream compute_stream(const Execution<Cuda>& ex, int device) {
        LOCKSTEP_CHECK_AS(DeviceMismatch, ex.device == device, "a replica of cuda:", device,
                          " bound the stream of cuda:", ex.device);
        return ex.stream;
    }
    static bool idle(int device, Stream s, const StreamToken&, clock::time_point deadline) noexcept {
        return drained(device, s, deadline);
    }
    static void wait_for_work(Execution<Cuda>& ex, const char* what) {
        cuda::DeviceGuard guard(ex.device);
        LOCKSTEP_CUDA_CHECK(cudaEventRecord(ex.done_event, ex.stream));
        cuda::wait_watched(ex.done_event, ex.device, ex.waits, what, "lockstep::torch::Options::timeout");
    }
    [[noreturn]] static void rank_sum(int, Stream, std::span<void* const>, std::size_t, comm::DType) { refuse(); }
    [[noreturn]] static void copy(int, Stream, void*, const void*, std::size_t) { refuse(); }

private:
    [[noreturn]] static void refuse() {
        throw NotImplemented(
            "lockstep::torch's gradient group runs one replica per GPU; replicas sharing a GPU "
            "need lockstep's device-local sum, which the torch component does not build");
    }
};

}  // namespace lockstep::torch::detail
