// SPDX-License-Identifier: MIT
//! `Collectives`: the type-erased view of a communicator that layers use, so one layer serves
//! every communicator (host threads, NCCL, MPI) without being templated on it.
#pragma once

#include <cstdint>
#include <span>

#include "lockstep/comm/communicator.hpp"

namespace lockstep::comm {

//! What a layer needs from its replica group. Buffers live on the replica's device.
class Collectives {
public:
    virtual ~Collectives() = default;
    virtual int rank() const = 0;
    virtual int size() const = 0;
    virtual void all_reduce_sum(std::span<double> data, std::uint64_t site) = 0;
    virtual void all_reduce_sum(std::span<float> data, std::uint64_t site) = 0;
    virtual void broadcast(std::span<float> data, int root, std::uint64_t site) = 0;
    virtual void broadcast(std::span<double> data, int root, std::uint64_t site) = 0;
    virtual void barrier() = 0;
};

//! Adapts any `CommunicatorLike` (passing the call site on when the communicator takes one).
template <CommunicatorLike C>
class CollectivesOf final : public Collectives {
public:
    explicit CollectivesOf(C& comm) : comm_(&comm) {}
    int rank() const override { return comm_->rank(); }
    int size() const override { return comm_->size(); }
    void all_reduce_sum(std::span<double> d, std::uint64_t site) override { reduce(d, site); }
    void all_reduce_sum(std::span<float> d, std::uint64_t site) override { reduce(d, site); }
    void broadcast(std::span<float> d, int root, std::uint64_t site) override { bcast(d, root, site); }
    void broadcast(std::span<double> d, int root, std::uint64_t site) override { bcast(d, root, site); }
    void barrier() override { comm_->barrier(); }
    C& communicator() const noexcept { return *comm_; }

private:
    template <class T>
    void reduce(std::span<T> d, std::uint64_t site) {
        if constexpr (requires { comm_->all_reduce_sum(d, site); }) comm_->all_reduce_sum(d, site);
        else comm_->all_reduce_sum(d);
    }
    template <class T>
    void bcast(std::span<T> d, int root, std::uint64_t site) {
        if constexpr (requires { comm_->broadcast(d, root, site); }) comm_->broadcast(d, root, site);
        else comm_->broadcast(d, root);
    }
    C* comm_;
};

}  // namespace lockstep::comm
