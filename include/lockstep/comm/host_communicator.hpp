// SPDX-License-Identifier: MIT
//! `HostCommunicator`: collectives between the threads of a process in shared memory, and
//! across processes on a process group; `HostGroup`, the replica group DataParallel uses on the
//! host backend.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <vector>

#include "lockstep/comm/collective_tag.hpp"
#include "lockstep/comm/collectives.hpp"
#include "lockstep/comm/process_group.hpp"
#include "lockstep/comm/shared_tensor.hpp"
#include "lockstep/core/device_span.hpp"
#include "lockstep/core/error.hpp"

namespace lockstep::comm {

//! out[i] = bufs[0][i] + bufs[1][i] + ... in rank order, for i in [lo, hi): the one summation of
//! every host-side all-reduce (Note [deterministic host all-reduce]), so the host group, the MPI
//! communicator and a host group across processes give the same bits. One block at a time through a
//! local accumulator: `out` may be one of the buffers, read before it is written.
template <class T>
void sum_in_rank_order(const std::vector<const T*>& bufs, T* out, std::size_t lo, std::size_t hi) {
    constexpr std::size_t block = 1024;
    alignas(64) T acc[block];
    for (std::size_t b = lo; b < hi; b += block) {
        const std::size_t len = std::min(block, hi - b);
        const T* b0 = bufs[0] + b;
        for (std::size_t i = 0; i < len; ++i) acc[i] = b0[i];
        for (std::size_t r = 1; r < bufs.size(); ++r) {
            const T* br = bufs[r] + b;
            for (std::size_t i = 0; i < len; ++i) acc[i] += br[i];
        }
        std::memcpy(out + b, acc, len * sizeof(T));
    }
}

// Note [deterministic host all-reduce]
// Reduce-scatter then all-gather over the replicas' own buffers: rank r sums slice r of every
// buffer in rank order (b0 + b1 + ... + b{n-1}) and writes it into its own buffer; then every
// rank copies the other slices from their owners. Each element is summed exactly once, in a
// fixed order, so all ranks hold the same bits and every run gives the same bits. Slices are
// multiples of 16 elements so the summing loops stay vectorized.

// Note [host groups across processes]
// Replicas = processes x threads (Note [replicas across processes] in comm/process_group.hpp). A
// collective is: the threads of a process meet in the process's SharedTensor (tag check); the
// leader (local rank 0) sums the local buffers in local rank order into its own and runs the
// process-level collective on it (tags checked across processes, sums in process rank order);
// the other threads then copy the leader's result. So a group of P processes with one replica
// each adds exactly as a HostGroup of P threads (bit-identical), and a process running all
// replicas adds as a HostGroup; other groupings add the same values in another order. A failure
// aborts the process's SharedTensor and tells the other processes (ProcessGroup::abort): every
// replica of every process fails its step. The process-level communicator stays failed: a
// multi-process DataParallel does not continue after a failed step.

//! One replica's handle on a host replica group: threads of this process, and when the group
//! spans processes (Note [host groups across processes]) their leaders' process-level channel.
//! Buffers are host memory; every rank's buffer is read by its peers during the collective.
class HostCommunicator final : public TypedCollectives<HostCommunicator> {
public:
    //! Local rank `rank` of `group`; across processes, of this process's part `span` of a group
    //! that spans them (null: this process alone).
    HostCommunicator(std::shared_ptr<SharedTensor> group, int rank, std::shared_ptr<const ProcessSpan> span = nullptr)
        : group_(std::move(group)), span_(std::move(span)), rank_(rank) {
        LOCKSTEP_CHECK(group_ != nullptr,
                       "HostCommunicator needs a group; create one with "
                       "std::make_shared<lockstep::comm::SharedTensor>(world_size)");
        LOCKSTEP_CHECK(rank >= 0 && rank < group_->world_size(), "rank ", rank, " is outside a group of ", group_->world_size());
    }

    //! The communicators of a fresh group of `world_size` ranks, rank order.
    static std::vector<HostCommunicator> create_group(int world_size,
                                                      std::chrono::milliseconds timeout = AbortableBarrier::default_timeout) {
        auto group = std::make_shared<SharedTensor>(world_size, timeout);
        std::vector<HostCommunicator> comms;
        comms.reserve(static_cast<std::size_t>(world_size));
        for (int r = 0; r < world_size; ++r) comms.emplace_back(group, r);
        return comms;
    }

    //! The global rank (across processes) and the ranks of every process.
    int rank() const noexcept override { return span_ ? span_->first_rank() + rank_ : rank_; }
    int size() const noexcept override { return span_ ? span_->global() : group_->world_size(); }
    SharedTensor& group() const noexcept { return *group_; }
    const std::shared_ptr<SharedTensor>& group_ptr() const noexcept { return group_; }
    //! Collectives this rank has made (all_reduce_sum, broadcast, barrier).
    std::uint64_t collective_count() const noexcept override { return group_->collectives(rank_); }

    // Peers read a rank's buffer directly: if a collective is aborted midway, a peer may still be
    // reading it for a moment after this call has thrown, so keep the buffer alive (layers keep
    // theirs as members).
    using TypedCollectives::all_reduce_sum;
    using TypedCollectives::broadcast;
    void barrier(CollectiveSite site) override {
        group_->count_collective(rank_);
        const CollectiveTag tag{site, CollectiveKind::barrier, DType::none, 0, -1};
        group_->arrive(rank_, tag, nullptr);
        if (!span_) return;
        if (rank_ == 0) span_->link().barrier(site);
        group_->arrive(rank_, phase(tag, 1), nullptr, span_->timeout());
    }

    //! Host-memory conveniences for code that drives replicas itself (a `ReplicaPool` job).
    template <Reducible T>
    void all_reduce_sum(std::span<T> data, CollectiveSite site = CollectiveSite::user()) {
        reduce(DeviceSpan<T>::host(data), site);
    }
    template <Reducible T>
    void broadcast(std::span<T> data, int root, CollectiveSite site = CollectiveSite::user()) {
        bcast(DeviceSpan<T>::host(data), root, site);
    }
    void barrier() { barrier(CollectiveSite::user()); }

    //! Even split of `count` elements into `n` slices of 16-element granules; slice `r` as [lo, hi).
    static std::pair<std::size_t, std::size_t> slice(std::size_t count, int n, int r) {
        constexpr std::size_t granule = 16;
        const std::size_t granules = (count + granule - 1) / granule;
        const std::size_t per = granules / static_cast<std::size_t>(n);
        const std::size_t extra = granules % static_cast<std::size_t>(n);
        const auto ur = static_cast<std::size_t>(r);
        const std::size_t g_lo = ur * per + std::min(ur, extra);
        const std::size_t g_hi = g_lo + per + (ur < extra ? 1 : 0);
        return {std::min(count, g_lo * granule), std::min(count, g_hi * granule)};
    }

private:
    friend class TypedCollectives<HostCommunicator>;

    template <Reducible T>
    void reduce(DeviceSpan<T> data, CollectiveSite site) {
        check(data, "all_reduce_sum");
        group_->count_collective(rank_);
        const CollectiveTag tag{site, CollectiveKind::all_reduce_sum, dtype_of<T>(), data.size, -1};
        const int parity = group_->arrive(rank_, tag, data.data);
        if (span_) return reduce_across(tag, parity, data);
        const int n = group_->world_size();
        if (n == 1 || data.empty()) return;
        const auto bufs = buffers<T>(parity);
        const auto [lo, hi] = slice(data.size, n, rank_);
        sum_in_rank_order(bufs, data.data, lo, hi);
        group_->arrive(rank_, phase(tag, 1), data.data);
        for (int r = 0; r < n; ++r) {
            if (r == rank_) continue;
            const auto [rlo, rhi] = slice(data.size, n, r);
            if (rhi > rlo) std::memcpy(data.data + rlo, bufs[static_cast<std::size_t>(r)] + rlo, (rhi - rlo) * sizeof(T));
        }
        group_->arrive(rank_, phase(tag, 2), data.data);  // owners keep their slices until all copied
    }

    template <Reducible T>
    void bcast(DeviceSpan<T> data, int root, CollectiveSite site) {
        check(data, "broadcast");
        check_root(root, size());
        group_->count_collective(rank_);
        const CollectiveTag tag{site, CollectiveKind::broadcast, dtype_of<T>(), data.size, root};
        const int parity = group_->arrive(rank_, tag, data.data);
        if (span_) return bcast_across(tag, parity, data, root);
        if (size() == 1 || data.empty()) return;
        if (rank_ != root) std::memcpy(data.data, group_->buffer(parity, root), data.size * sizeof(T));
        group_->arrive(rank_, phase(tag, 1), data.data);
    }

    // Note [host groups across processes]: the leader sums the local buffers and all-reduces the
    // sum over the processes; the others copy it.
    template <class T>
    void reduce_across(const CollectiveTag& tag, int parity, DeviceSpan<T> data) {
        const void* leader = group_->buffer(parity, 0);  // read before the next crossing may rewrite the slot
        if (rank_ == 0 && !data.empty()) {
            sum_in_rank_order(buffers<T>(parity), data.data, 0, data.size);  // local rank order; the first is data
            span_->link().all_reduce_sum(data, tag.site);
        }
        share_from_leader(tag, leader, data);
    }

    template <class T>
    void bcast_across(const CollectiveTag& tag, int parity, DeviceSpan<T> data, int root) {
        const void* leader = group_->buffer(parity, 0);  // read before the next crossing may rewrite the slot
        const int n = group_->world_size();
        const int root_process = root / n, root_local = root % n;
        if (rank_ == 0 && !data.empty()) {
            if (span_->processes()->rank() == root_process && root_local != 0)
                std::memcpy(data.data, group_->buffer(parity, root_local), data.size * sizeof(T));
            span_->link().broadcast(data, root_process, tag.site);
        }
        share_from_leader(tag, leader, data);
    }

    // After the leader's process-level collective: every other thread copies the leader's buffer
    // (`leader`, taken from the first crossing's slot: the third crossing rewrites that slot).
    template <class T>
    void share_from_leader(const CollectiveTag& tag, const void* leader, DeviceSpan<T> data) {
        group_->arrive(rank_, phase(tag, 1), data.data, span_->timeout());  // the leader is in the process-level collective
        if (rank_ != 0 && !data.empty()) std::memcpy(data.data, leader, data.size * sizeof(T));
        group_->arrive(rank_, phase(tag, 2), data.data);  // the leader's buffer is read by now
    }

    // Every local rank's buffer of the crossing `parity`, in local rank order.
    template <class T>
    std::vector<const T*> buffers(int parity) const {
        std::vector<const T*> bufs(static_cast<std::size_t>(group_->world_size()));
        for (std::size_t r = 0; r < bufs.size(); ++r)
            bufs[r] = static_cast<const T*>(group_->buffer(parity, static_cast<int>(r)));
        return bufs;
    }

    template <class T>
    static void check(const DeviceSpan<T>& data, const char* what) {
        check_buffer(data, what, Device::Kind::host, -1, "a HostCommunicator", "use the CUDA backend's group for device buffers");
    }

    std::shared_ptr<SharedTensor> group_;
    std::shared_ptr<const ProcessSpan> span_;
    int rank_;
};

//! The replica group of host replicas: one `HostCommunicator` per rank over one `SharedTensor`,
//! and over a process group when it spans processes. DataParallel's default group on the host
//! backend (see `comm::default_group_t`).
class HostGroup {
public:
    using backend = Host;

    //! The replicas on `devices` (host devices), this process alone.
    explicit HostGroup(const std::vector<Device>& devices, std::chrono::milliseconds timeout = AbortableBarrier::default_timeout)
        : HostGroup(devices, timeout, nullptr, ProcessGroup::layer) {}

    //! A group spanning the processes of `processes` (Note [host groups across processes]):
    //! `devices` are this process's replicas, as many in every process. Made by every process
    //! together; `channel` carries its setup and its process-level collectives. Null
    //! `processes`: this process alone.
    HostGroup(const std::vector<Device>& devices, std::chrono::milliseconds timeout, std::shared_ptr<ProcessGroup> processes,
              ProcessGroup::Channel channel)
        : span_(std::make_shared<const ProcessSpan>(ProcessSpan::join(
              std::move(processes), channel,
              [&] {
                  return ProcessSpan::Layout{checked_size(devices), 0};
              },
              refusal))),
          local_(std::make_shared<SharedTensor>(span_->local(), timeout)),
          abortable_(span_->spans() ? std::shared_ptr<Abortable>(std::make_shared<Aborter>(local_, span_)) : local_) {
        comms_.reserve(static_cast<std::size_t>(span_->local()));
        for (int r = 0; r < span_->local(); ++r) comms_.emplace_back(local_, r, span_->spans() ? span_ : nullptr);
    }

    int size() const noexcept { return static_cast<int>(comms_.size()); }
    HostCommunicator& communicator(int rank) { return comms_.at(static_cast<std::size_t>(rank)); }
    const HostCommunicator& communicator(int rank) const { return comms_.at(static_cast<std::size_t>(rank)); }
    //! What a replica pool aborts when a replica fails (across processes, it tells the others too).
    std::shared_ptr<Abortable> abortable() const { return abortable_; }
    //! Host replicas need nothing bound: a replica is its thread.
    void bind(int, Execution<Host>&) noexcept {}

private:
    static int checked_size(const std::vector<Device>& devices) {
        LOCKSTEP_CHECK(!devices.empty(), "a replica group needs at least one device");
        for (const auto& d : devices)
            LOCKSTEP_CHECK_AS(DeviceMismatch, d.kind == Device::Kind::host, "a host replica group cannot hold device ", d,
                              "; CUDA replicas use comm::CudaGroup");
        return static_cast<int>(devices.size());
    }

    static std::string refusal(std::span<const ProcessSpan::Layout>) {
        return "every process must run the same number (the same --replicas or --devices on every rank)";
    }

    // Across processes: aborts this process's threads and tells the other processes.
    struct Aborter final : Abortable {
        Aborter(std::shared_ptr<SharedTensor> l, std::shared_ptr<const ProcessSpan> s)
            : local(std::move(l)), span(std::move(s)) {}
        void abort(const std::string& reason, int failed_rank) noexcept override {
            local->abort(reason, failed_rank);
            span->tell(reason, failed_rank);
        }
        void reset() override { local->reset(); }
        std::shared_ptr<SharedTensor> local;
        std::shared_ptr<const ProcessSpan> span;
    };

    std::shared_ptr<const ProcessSpan> span_;
    std::shared_ptr<SharedTensor> local_;
    std::shared_ptr<Abortable> abortable_;
    std::vector<HostCommunicator> comms_;
};

}  // namespace lockstep::comm
