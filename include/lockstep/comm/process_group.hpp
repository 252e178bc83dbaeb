// SPDX-License-Identifier: MIT
//! `ProcessGroup` (the processes one DataParallel spans, each running some of its replicas) and
//! `HierarchicalGroup`: replicas = processes x threads, threads meeting in the process's
//! SharedTensor and one leader thread per process running the process-level collective.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "lockstep/comm/collective_tag.hpp"
#include "lockstep/comm/collectives.hpp"
#include "lockstep/comm/host_communicator.hpp"
#include "lockstep/comm/shared_tensor.hpp"
#include "lockstep/core/device_span.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/runtime/abortable_barrier.hpp"

namespace lockstep::comm {

//! The processes a DataParallel spans (`DataParallelOptions::process_group`; the MPI one is
//! `comm::MpiProcessGroup` in `<lockstep/mpi.hpp>`). Its collectives are on host buffers and made
//! by one thread of each process at a time, per channel; channels never mix their messages.
class ProcessGroup {
public:
    //! Channels: the layer collectives, the gradient buckets, and the step's own exchanges (the
    //! batch's row counts, the step's totals, a checkpoint's status), made by the calling thread.
    enum Channel : int { layer = 0, gradients = 1, control = 2 };

    virtual ~ProcessGroup() = default;
    //! This process's rank among the group's processes, and their number.
    virtual int rank() const = 0;
    virtual int size() const = 0;
    virtual Collectives& channel(Channel c) = 0;
    //! Checks on `c` that every process reached the collective `tag` (whose data moves on
    //! another path, e.g. NCCL): every process throws the same `CollectiveMismatch` when they did
    //! not, `CollectiveAborted` when one failed. Made by one thread of each process, as channels are.
    virtual void agree(Channel c, const CollectiveTag& tag) = 0;
    //! From any thread: throws `CollectiveAborted` naming the process once another process has
    //! failed (`abort`); returns otherwise. A replica's host waits on its GPU consult it.
    virtual void check_peers() = 0;
    //! From any thread: whether a failure reached this process from another (an abort message
    //! received, a process that never answered). A process passing such a failure on does not
    //! name one of its own replicas as the failing one.
    virtual bool peer_failed() const noexcept = 0;
    //! How long a collective of this group may wait for another process: the local replicas that
    //! wait for their leader's process-level collective wait that much longer, so the process
    //! that is late is the one named, not the leader.
    virtual std::chrono::milliseconds timeout() const noexcept = 0;
    //! Tells every other process that this one failed, from any thread.
    virtual void abort(const std::string& reason) noexcept = 0;
};

//! After each process's own checks, which need no collective (options, devices, files): every
//! process learns whether any failed. Returns "" when none did, else the same text on every
//! process, "process q of P: <q's error>" for the first failed process q (", and k more" when
//! others failed too), for every process to throw, so that none waits in a collective for one
//! that left. `failure`: this process's error, or null. On `channel`, at the sites
//! Exchange::setup_failures and Exchange::setup_failure_message.
inline std::string agreed_failure(ProcessGroup& procs, ProcessGroup::Channel channel, const std::exception_ptr& failure) {
    std::string text;
    if (failure) {
        try {
            std::rethrow_exception(failure);
        } catch (const Error& e) {
            text = e.message();
        } catch (const std::exception& e) {
            text = e.what();
        } catch (...) {
            text = "an exception that is not a std::exception";
        }
        if (text.empty()) text = "an error without a message";
    }
    Collectives& link = procs.channel(channel);
    std::vector<double> failed(static_cast<std::size_t>(procs.size()), 0.0);
    failed[static_cast<std::size_t>(procs.rank())] = failure ? 1.0 : 0.0;
    link.all_reduce_sum(DeviceSpan<double>::host(failed), CollectiveSite::control(Exchange::setup_failures));
    const auto first = std::find(failed.begin(), failed.end(), 1.0);
    if (first == failed.end()) return {};
    const int who = static_cast<int>(first - failed.begin());
    const auto more = std::count(failed.begin(), failed.end(), 1.0) - 1;
    std::vector<std::int64_t> message(1 + 1024, 0);  // length, then the bytes
    if (procs.rank() == who) {
        message[0] = static_cast<std::int64_t>(std::min<std::size_t>(text.size(), 1024));
        for (std::size_t i = 0; i < static_cast<std::size_t>(message[0]); ++i) message[1 + i] = static_cast<unsigned char>(text[i]);
    }
    link.broadcast(DeviceSpan<std::int64_t>::host(message), who, CollectiveSite::control(Exchange::setup_failure_message));
    std::string quoted;
    for (std::int64_t i = 0; i < message[0]; ++i) quoted += static_cast<char>(message[static_cast<std::size_t>(1 + i)]);
    return "process " + std::to_string(who) + " of " + std::to_string(procs.size()) +
           (more > 0 ? " (and " + std::to_string(more) + " more)" : std::string()) + ": " + quoted;
}

//! Tells the other processes of `procs` that this one failed: the failing replica's global rank
//! when the failure started on `failed_rank` (a replica of this process, `local_replicas` in
//! all); the reason alone when it came from another process (ProcessGroup::peer_failed), whose
//! own message named its replica already: then `failed_rank` is that process's rank, not a
//! replica here.
inline void tell_processes(ProcessGroup& procs, int local_replicas, const std::string& reason, int failed_rank) noexcept {
    try {
        const int p = procs.rank();
        std::string who = "process " + std::to_string(p);
        if (failed_rank >= 0 && failed_rank < local_replicas && !procs.peer_failed())
            who = "global rank " + std::to_string(p * local_replicas + failed_rank) + " (" + who + ", replica " +
                  std::to_string(failed_rank) + ")";
        procs.abort(who + ": " + reason);
    } catch (...) {
        procs.abort(reason);
    }
}

// Note [hierarchical groups]
// Replicas = processes x threads, global rank = process rank x local replicas + local rank. A
// collective is: the threads of a process meet in the process's SharedTensor (tag check); the
// leader (local rank 0) sums the local buffers in local rank order into its own and runs the
// process-level collective on it (tags checked across processes, sums in process rank order);
// the other threads then copy the leader's result. So a group of P processes with one replica
// each adds exactly as a HostGroup of P threads (bit-identical), and a process running all
// replicas adds as a HostGroup; other groupings add the same values in another order. A failure
// aborts the process's SharedTensor and tells the other processes (ProcessGroup::abort): every
// replica of every process fails its step. The process-level communicator stays failed: a
// multi-process DataParallel does not continue after a failed step.

//! One replica's handle on a `HierarchicalGroup` (Note [hierarchical groups]).
class HierarchicalCommunicator final : public Collectives {
public:
    HierarchicalCommunicator(std::shared_ptr<SharedTensor> local, std::shared_ptr<ProcessGroup> processes,
                             ProcessGroup::Channel channel, int local_rank)
        : local_(std::move(local)), procs_(std::move(processes)), channel_(channel), l_(local_rank) {}

    int rank() const noexcept override { return procs_->rank() * local_->world_size() + l_; }
    int size() const noexcept override { return procs_->size() * local_->world_size(); }
    std::uint64_t collective_count() const noexcept override { return local_->collectives(l_); }

    void all_reduce_sum(DeviceSpan<float> data, CollectiveSite site) override { reduce(data, site); }
    void all_reduce_sum(DeviceSpan<double> data, CollectiveSite site) override { reduce(data, site); }
    void broadcast(DeviceSpan<float> data, int root, CollectiveSite site) override { bcast(data, root, site); }
    void broadcast(DeviceSpan<double> data, int root, CollectiveSite site) override { bcast(data, root, site); }
    void broadcast(DeviceSpan<std::int64_t> data, int root, CollectiveSite site) override { bcast(data, root, site); }
    void barrier(CollectiveSite site) override {
        local_->count_collective(l_);
        const CollectiveTag tag{site, CollectiveKind::barrier, DType::none, 0, -1};
        local_->arrive(l_, tag, nullptr);
        if (l_ == 0) procs_->channel(channel_).barrier(site);
        local_->arrive(l_, phase(tag, 1), nullptr, procs_->timeout());
    }

private:
    template <class T>
    void check_buffer(const DeviceSpan<T>& data, const char* what) const {
        LOCKSTEP_CHECK(data.data != nullptr || data.empty(), what, " got a null buffer with ", data.size, " elements");
        if (data.device.kind != Device::Kind::host) [[unlikely]]
            throw DeviceMismatch(std::string(what) + ": a multi-process group moves host memory, got a buffer on " +
                                 data.device.str());
    }

    template <class T>
    void reduce(DeviceSpan<T> data, CollectiveSite site) {
        check_buffer(data, "all_reduce_sum");
        local_->count_collective(l_);
        const CollectiveTag tag{site, CollectiveKind::all_reduce_sum, dtype_of<T>(), data.size, -1};
        const int parity = local_->arrive(l_, tag, data.data);
        const void* leader = local_->buffer(parity, 0);  // read before the next crossing may rewrite the slot
        const int n = local_->world_size();
        if (l_ == 0 && !data.empty()) {
            std::vector<const T*> bufs(static_cast<std::size_t>(n));  // local rank order; bufs[0] is data
            for (int r = 0; r < n; ++r) bufs[static_cast<std::size_t>(r)] = static_cast<const T*>(local_->buffer(parity, r));
            sum_in_rank_order(bufs, data.data, 0, data.size);
            procs_->channel(channel_).all_reduce_sum(data, site);
        }
        share_from_leader(tag, leader, data);
    }

    template <class T>
    void bcast(DeviceSpan<T> data, int root, CollectiveSite site) {
        check_buffer(data, "broadcast");
        LOCKSTEP_CHECK(root >= 0 && root < size(), "broadcast root ", root, " is outside a group of ", size());
        local_->count_collective(l_);
        const int n = local_->world_size();
        const CollectiveTag tag{site, CollectiveKind::broadcast, dtype_of<T>(), data.size, root};
        const int parity = local_->arrive(l_, tag, data.data);
        const void* leader = local_->buffer(parity, 0);  // read before the next crossing may rewrite the slot
        const int root_process = root / n, root_local = root % n;
        if (l_ == 0 && !data.empty()) {
            if (procs_->rank() == root_process && root_local != 0)
                std::memcpy(data.data, local_->buffer(parity, root_local), data.size * sizeof(T));
            procs_->channel(channel_).broadcast(data, root_process, site);
        }
        share_from_leader(tag, leader, data);
    }

    // After the leader's process-level collective: every other thread copies the leader's buffer
    // (`leader`, taken from the first crossing's slot: the third crossing rewrites that slot).
    template <class T>
    void share_from_leader(const CollectiveTag& tag, const void* leader, DeviceSpan<T> data) {
        local_->arrive(l_, phase(tag, 1), data.data, procs_->timeout());  // the leader is in the process-level collective
        if (l_ != 0 && !data.empty())
            std::memcpy(data.data, leader, data.size * sizeof(T));
        local_->arrive(l_, phase(tag, 2), data.data);  // the leader's buffer is read by now
    }

    std::shared_ptr<SharedTensor> local_;
    std::shared_ptr<ProcessGroup> procs_;
    ProcessGroup::Channel channel_;
    int l_;
};

//! The replicas of this process in a group that spans processes (Note [hierarchical groups]).
class HierarchicalGroup {
public:
    HierarchicalGroup(int local_replicas, std::shared_ptr<ProcessGroup> processes, ProcessGroup::Channel channel,
                      std::chrono::milliseconds timeout)
        : local_(std::make_shared<SharedTensor>(local_replicas, timeout)),
          abortable_(std::make_shared<Aborter>(local_, processes)) {
        LOCKSTEP_CHECK(processes != nullptr, "a hierarchical group needs a process group");
        for (int r = 0; r < local_replicas; ++r) comms_.emplace_back(local_, processes, channel, r);
    }

    int size() const noexcept { return static_cast<int>(comms_.size()); }
    HierarchicalCommunicator& communicator(int local_rank) { return comms_.at(static_cast<std::size_t>(local_rank)); }
    //! Aborts the process's threads and tells the other processes.
    std::shared_ptr<Abortable> abortable() const { return abortable_; }

private:
    struct Aborter final : Abortable {
        Aborter(std::shared_ptr<SharedTensor> l, std::shared_ptr<ProcessGroup> p) : local(std::move(l)), procs(std::move(p)) {}
        void abort(const std::string& reason, int failed_rank) noexcept override {
            local->abort(reason, failed_rank);
            tell_processes(*procs, local->world_size(), reason, failed_rank);
        }
        void reset() override { local->reset(); }
        std::shared_ptr<SharedTensor> local;
        std::shared_ptr<ProcessGroup> procs;
    };

    std::shared_ptr<SharedTensor> local_;
    std::shared_ptr<Aborter> abortable_;
    std::vector<HierarchicalCommunicator> comms_;
};

}  // namespace lockstep::comm
