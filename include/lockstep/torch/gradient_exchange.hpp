// SPDX-License-Identifier: MIT
//! How lockstep::torch::DataParallel all-reduces its gradient buckets: through the host group
//! (CPU replicas; CUDA replicas staged through page-locked memory), or stream-ordered on the
//! replicas' devices (NCCL: Note [libtorch NCCL buckets]).
#pragma once

#include <torch/torch.h>

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "lockstep/comm/collectives.hpp"
#include "lockstep/comm/host_communicator.hpp"
#include "lockstep/comm/process_group.hpp"
#include "lockstep/comm/stream_group.hpp"
#include "lockstep/core/backend.hpp"
#include "lockstep/runtime/abortable_barrier.hpp"

#if LOCKSTEP_TORCH_NCCL
#include "lockstep/torch/nccl_group.hpp"
#endif

namespace lockstep::torch {

//! Whether this build of the torch component all-reduces CUDA replicas' buckets with NCCL (it was
//! configured against a CUDA libtorch, the CUDA toolkit and NCCL: LOCKSTEP_TORCH_NCCL).
inline constexpr bool nccl_available() noexcept {
#if LOCKSTEP_TORCH_NCCL
    return true;
#else
    return false;
#endif
}

namespace detail {

//! Devices host:0 .. host:n-1, a host group's replicas.
inline std::vector<Device> host_devices(int n) {
    std::vector<Device> d;
    for (int r = 0; r < n; ++r) d.push_back(Device::host(r));
    return d;
}

//! A DataParallel's gradient group, as its replicas use it. Built on the caller's thread with the
//! object; `bind` runs on each replica's thread, in a job (its device and stream current), before
//! its first collective.
class GradientExchange {
public:
    virtual ~GradientExchange() = default;
    virtual comm::Collectives& communicator(int rank) = 0;
    virtual std::shared_ptr<Abortable> abortable() const = 0;
    //! Whether buckets are summed where they are, stream-ordered on the replica's device (else on
    //! the host: a CUDA replica's are staged through page-locked memory).
    virtual bool on_device() const noexcept = 0;
    //! The device a replica's buffers are on, as the group names it.
    virtual Device device(int rank) const = 0;
    virtual void bind(int rank, const ::torch::Device& device) = 0;
    //! After join(): returns once the replica's collectives, and its work enqueued so far, have run
    //! on its device, throwing what a failed group throws; bounded by the group's timeout.
    virtual void wait_for_work(int rank) = 0;
    //! "host" or the device library's name ("nccl"), for reports.
    virtual const char* transport() const noexcept = 0;
};

//! The host group: replicas of one process sum in rank order (bit-identical on every replica).
class HostExchange final : public GradientExchange {
public:
    HostExchange(int replicas, std::chrono::milliseconds timeout, std::shared_ptr<comm::ProcessGroup> processes)
        : group_(host_devices(replicas), timeout, std::move(processes), comm::ProcessGroup::gradients) {}
    comm::Collectives& communicator(int rank) override { return group_.communicator(rank); }
    std::shared_ptr<Abortable> abortable() const override { return group_.abortable(); }
    bool on_device() const noexcept override { return false; }
    Device device(int rank) const override { return Device::host(rank); }
    void bind(int, const ::torch::Device&) override {}
    void wait_for_work(int) override {}
    const char* transport() const noexcept override { return "host"; }

private:
    comm::HostGroup group_;
};

//! A stream group (comm::StreamGroup) over `Api`, which adds to a stream group's Api:
//!   Execution<backend> execution(const torch::Device&);   (on the replica's thread: its stream now)
//!   void release(Execution<backend>&) noexcept;
//!   void wait_for_work(Execution<backend>&, const char* what);   (bounded, consulting ex.waits)
//!   static constexpr const char* name;
//! TorchNcclApi (nccl_group.hpp) on GPUs; tests drive it on CPU replicas with a double.
template <class Api>
class StreamExchange final : public GradientExchange {
public:
    StreamExchange(const std::vector<Device>& devices, std::chrono::milliseconds timeout,
                   std::shared_ptr<comm::ProcessGroup> processes)
        : executions_(devices.size()),
          devices_(devices),
          group_(
              std::make_unique<comm::StreamGroup<Api>>(devices, timeout, std::move(processes), comm::ProcessGroup::gradients)) {}
    StreamExchange(const StreamExchange&) = delete;
    StreamExchange& operator=(const StreamExchange&) = delete;
    ~StreamExchange() override {
        group_.reset();  // its teardown waits for the replicas' streams, then the events go
        for (std::size_t r = 0; r < bound_.size(); ++r)
            if (bound_[r]) Api::release(executions_[r]);
    }

    comm::Collectives& communicator(int rank) override { return group_->communicator(rank); }
    std::shared_ptr<Abortable> abortable() const override { return group_->abortable(); }
    bool on_device() const noexcept override { return true; }
    Device device(int rank) const override { return devices_.at(static_cast<std::size_t>(rank)); }
    void bind(int rank, const ::torch::Device& device) override {
        const auto r = static_cast<std::size_t>(rank);
        executions_.at(r) = Api::execution(device);
        bound_.at(r) = 1;
        group_->bind(rank, executions_[r]);
    }
    void wait_for_work(int rank) override {
        Api::wait_for_work(executions_.at(static_cast<std::size_t>(rank)), "the gradient buckets' all-reduce");
    }
    const char* transport() const noexcept override { return Api::name; }

private:
    std::vector<Execution<typename Api::backend>> executions_;            // the group's watches point into them
    std::vector<char> bound_ = std::vector<char>(executions_.size(), 0);  // written by every replica thread at once
    std::vector<Device> devices_;
    std::unique_ptr<comm::StreamGroup<Api>> group_;
};

//! Makes a DataParallel's gradient exchange from its replicas' devices and options; empty: the
//! default one (`default_exchange` in data_parallel.hpp).
using ExchangeMaker = std::function<std::unique_ptr<GradientExchange>(const std::vector<::torch::Device>& devices,
                                                                      std::chrono::milliseconds timeout,
                                                                      std::shared_ptr<comm::ProcessGroup> processes)>;

}  // namespace detail
}  // namespace lockstep::torch
