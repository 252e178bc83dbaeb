// SPDX-License-Identifier: MIT
//! `Collectives`: a replica's handle on its group, the one interface through which layers and
//! DataParallel reach every communicator (host threads, NCCL, MPI).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "lockstep/comm/collective_tag.hpp"
#include "lockstep/core/backend.hpp"
#include "lockstep/core/device_span.hpp"
#include "lockstep/core/error.hpp"

namespace lockstep::comm {

// Note [one way to a group]
// Layers are not templated on the communicator: the execution context carries a `Collectives*`,
// and every communicator derives from `Collectives`. Buffers are `DeviceSpan`s on the replica's
// device (host memory for HostCommunicator, the replica's GPU for NCCL, whose communicator owns
// the replica's stream), so nothing here changes between backends. Every collective names its
// `CollectiveSite`; the group checks that all replicas reached the same one.

//! A replica's handle on its replica group. Collectives are in place, reached by every rank in
//! the same order, and leave every rank with bit-identical results.
class Collectives {
public:
    virtual ~Collectives() = default;
    virtual int rank() const = 0;
    virtual int size() const = 0;
    //! Sums `data` over all ranks in place.
    virtual void all_reduce_sum(DeviceSpan<float> data, CollectiveSite site) = 0;
    virtual void all_reduce_sum(DeviceSpan<double> data, CollectiveSite site) = 0;
    //! Copies `root`'s `data` into every rank's `data`.
    virtual void broadcast(DeviceSpan<float> data, int root, CollectiveSite site) = 0;
    virtual void broadcast(DeviceSpan<double> data, int root, CollectiveSite site) = 0;
    virtual void broadcast(DeviceSpan<std::int64_t> data, int root, CollectiveSite site) = 0;
    //! Waits until every rank has reached the same barrier.
    virtual void barrier(CollectiveSite site) = 0;
    //! Collectives this rank has made so far (tests count what a layer or a step makes).
    virtual std::uint64_t collective_count() const = 0;

    // Started collectives (Note [stream-ordered collectives] in comm/stream_group.hpp).
    //! Starts summing `data` over all ranks: the result is there for the replica's work after
    //! `join()`. Communicators that complete a collective in the call (the host's) finish it here.
    virtual void start_all_reduce_sum(DeviceSpan<float> data, CollectiveSite site) { all_reduce_sum(data, site); }
    //! Starts summing bfloat16 values (their bits in `data`) over all ranks, as the float
    //! overload (a gradient bucket all-reduced in bf16: DataParallelOptions::gradient_precision).
    //! Only stream-ordered groups on CUDA can; others throw NotImplemented.
    virtual void start_all_reduce_sum_bf16(DeviceSpan<std::uint16_t> data, CollectiveSite site) {
        (void)data;
        (void)site;
        throw NotImplemented(
            "this replica group cannot all-reduce bfloat16 gradients (CUDA replica groups can); "
            "leave DataParallelOptions::gradient_precision at Precision::fp32");
    }
    //! Orders the replica's later work after every collective started so far.
    virtual void join() {}
    //! True when collectives are enqueued on the replica's streams rather than completed in the
    //! call: the replica thread itself must then make every call, in program order (DataParallel
    //! starts gradient buckets inline instead of on a communication thread).
    virtual bool stream_ordered() const { return false; }
};

//! The base of every communicator: the typed entry points of `Collectives` forwarded to the
//! communicator's own two templates, `reduce(DeviceSpan<T>, site)` and `bcast(DeviceSpan<T>,
//! root, site)` (private, with this base a friend), and the checks every communicator makes of
//! its arguments.
template <class Derived>
class TypedCollectives : public Collectives {
public:
    void all_reduce_sum(DeviceSpan<float> data, CollectiveSite site) override { self().reduce(data, site); }
    void all_reduce_sum(DeviceSpan<double> data, CollectiveSite site) override { self().reduce(data, site); }
    void broadcast(DeviceSpan<float> data, int root, CollectiveSite site) override { self().bcast(data, root, site); }
    void broadcast(DeviceSpan<double> data, int root, CollectiveSite site) override { self().bcast(data, root, site); }
    void broadcast(DeviceSpan<std::int64_t> data, int root, CollectiveSite site) override { self().bcast(data, root, site); }

protected:
    TypedCollectives() = default;

    //! Throws unless `data` holds storage for its elements and lies in memory this communicator
    //! reaches: on a device of kind `kind`, and when `index` >= 0 on that device. `who` names the
    //! communicator ("a HostCommunicator"; with `rank` >= 0, "rank <rank> of <who>"), `hint` says
    //! what to pass instead.
    template <class T>
    static void check_buffer(const DeviceSpan<T>& data, const char* what, Device::Kind kind, int index, std::string_view who,
                             std::string_view hint, int rank = -1) {
        LOCKSTEP_CHECK(data.data != nullptr || data.empty(), what, " got a null buffer with ", data.size,
                       " elements; pass the tensor's storage");
        if (data.device.kind != kind || (index >= 0 && data.device.index != index)) [[unlikely]]
            throw DeviceMismatch(std::string(what) + ": " +
                                 (rank >= 0 ? "rank " + std::to_string(rank) + " of " : std::string()) + std::string(who) +
                                 " works on " +
                                 (index >= 0                   ? Device{kind, index}.str()
                                  : kind == Device::Kind::host ? std::string("host memory")
                                                               : std::string("device memory")) +
                                 ", got a buffer on " + data.device.str() + "; " + std::string(hint));
    }
    //! Throws unless `root` is a rank of a group of `size`.
    static void check_root(int root, int size) {
        LOCKSTEP_CHECK(root >= 0 && root < size, "broadcast root ", root, " is outside a group of ", size,
                       "; pass a rank from 0 to ", size - 1);
    }

private:
    Derived& self() noexcept { return static_cast<Derived&>(*this); }
};

}  // namespace lockstep::comm
