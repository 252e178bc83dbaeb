// SPDX-License-Identifier: MIT
//! `HostCommunicator`: collectives between the threads of one process, in shared memory, and
//! `HostGroup`, the replica group DataParallel uses on the host backend.
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
#include "lockstep/comm/shared_tensor.hpp"
#include "lockstep/core/device_span.hpp"
#include "lockstep/core/error.hpp"

namespace lockstep::comm {

//! out[i] = bufs[0][i] + bufs[1][i] + ... in rank order, for i in [lo, hi): the one summation of
//! every host-side all-reduce (Note [deterministic host all-reduce]), so the host group, the MPI
//! communicator and the hierarchical group give the same bits. One block at a time through a
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

//! One replica's handle on a host replica group (threads of this process). Buffers are host
//! memory; every rank's buffer is read by its peers during the collective.
class HostCommunicator final : public Collectives {
public:
    HostCommunicator(std::shared_ptr<SharedTensor> group, int rank) : group_(std::move(group)), rank_(rank) {
        LOCKSTEP_CHECK(group_ != nullptr, "HostCommunicator needs a group; create one with "
                                          "std::make_shared<lockstep::comm::SharedTensor>(world_size)");
        LOCKSTEP_CHECK(rank >= 0 && rank < group_->world_size(), "rank ", rank, " is outside a group of ",
                       group_->world_size());
    }

    //! The communicators of a fresh group of `world_size` ranks, rank order.
    static std::vector<HostCommunicator> create_group(int world_size,
                                                      std::chrono::milliseconds timeout =
                                                          AbortableBarrier::default_timeout) {
        auto group = std::make_shared<SharedTensor>(world_size, timeout);
        std::vector<HostCommunicator> comms;
        comms.reserve(static_cast<std::size_t>(world_size));
        for (int r = 0; r < world_size; ++r) comms.emplace_back(group, r);
        return comms;
    }

    int rank() const noexcept override { return rank_; }
    int size() const noexcept override { return group_->world_size(); }
    SharedTensor& group() const noexcept { return *group_; }
    const std::shared_ptr<SharedTensor>& group_ptr() const noexcept { return group_; }
    //! Collectives this rank has made (all_reduce_sum, broadcast, barrier).
    std::uint64_t collective_count() const noexcept override { return group_->collectives(rank_); }

    // Peers read a rank's buffer directly: if a collective is aborted midway, a peer may still be
    // reading it for a moment after this call has thrown, so keep the buffer alive (layers keep
    // theirs as members).
    void all_reduce_sum(DeviceSpan<float> data, CollectiveSite site) override { reduce(data, site); }
    void all_reduce_sum(DeviceSpan<double> data, CollectiveSite site) override { reduce(data, site); }
    void broadcast(DeviceSpan<float> data, int root, CollectiveSite site) override { bcast(data, root, site); }
    void broadcast(DeviceSpan<double> data, int root, CollectiveSite site) override { bcast(data, root, site); }
    void broadcast(DeviceSpan<std::int64_t> data, int root, CollectiveSite site) override { bcast(data, root, site); }
    void barrier(CollectiveSite site) override {
        group_->count_collective(rank_);
        group_->arrive(rank_, CollectiveTag{site, CollectiveKind::barrier, DType::none, 0, -1}, nullptr);
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
    template <Reducible T>
    void reduce(DeviceSpan<T> data, CollectiveSite site) {
        check_buffer(data, "all_reduce_sum");
        group_->count_collective(rank_);
        const int n = size();
        const CollectiveTag tag{site, CollectiveKind::all_reduce_sum, dtype_of<T>(), data.size, -1};
        const int parity = group_->arrive(rank_, tag, data.data);
        if (n == 1 || data.empty()) return;
        std::vector<const T*> bufs(static_cast<std::size_t>(n));
        for (int r = 0; r < n; ++r) bufs[static_cast<std::size_t>(r)] = static_cast<const T*>(group_->buffer(parity, r));

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
        check_buffer(data, "broadcast");
        LOCKSTEP_CHECK(root >= 0 && root < size(), "broadcast root ", root, " is outside a group of ", size());
        group_->count_collective(rank_);
        const CollectiveTag tag{site, CollectiveKind::broadcast, dtype_of<T>(), data.size, root};
        const int parity = group_->arrive(rank_, tag, data.data);
        if (size() == 1 || data.empty()) return;
        if (rank_ != root)
            std::memcpy(data.data, group_->buffer(parity, root), data.size * sizeof(T));
        group_->arrive(rank_, phase(tag, 1), data.data);
    }

    template <class T>
    void check_buffer(const DeviceSpan<T>& data, const char* what) const {
        LOCKSTEP_CHECK(data.data != nullptr || data.empty(), what, " got a null buffer with ", data.size,
                       " elements; pass the tensor's storage");
        if (data.device.kind != Device::Kind::host) [[unlikely]]
            throw DeviceMismatch(std::string(what) + ": a HostCommunicator moves host memory, got a buffer on " +
                                 data.device.str() + "; use the CUDA backend's group for device buffers");
    }

    std::shared_ptr<SharedTensor> group_;
    int rank_;
};

//! The replica group of host replicas: one `HostCommunicator` per rank over one `SharedTensor`.
//! DataParallel's default group on the host backend (see `comm::default_group_t`).
class HostGroup {
public:
    using backend = Host;

    HostGroup(const std::vector<Device>& devices, std::chrono::milliseconds timeout = AbortableBarrier::default_timeout)
        : comms_(HostCommunicator::create_group(checked_size(devices), timeout)) {}

    int size() const noexcept { return static_cast<int>(comms_.size()); }
    HostCommunicator& communicator(int rank) { return comms_.at(static_cast<std::size_t>(rank)); }
    const HostCommunicator& communicator(int rank) const { return comms_.at(static_cast<std::size_t>(rank)); }
    //! What a replica pool aborts when a replica fails.
    std::shared_ptr<Abortable> abortable() const { return comms_[0].group_ptr(); }
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
    std::vector<HostCommunicator> comms_;
};

}  // namespace lockstep::comm
