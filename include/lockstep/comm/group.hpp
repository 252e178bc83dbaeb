// SPDX-License-Identifier: MIT
//! The `GroupLike` concept (a replica group DataParallel can drive) and `default_group_t<B>`,
//! the group each backend uses unless told otherwise.
#pragma once

#include <chrono>
#include <concepts>
#include <memory>
#include <vector>

#include "lockstep/comm/collectives.hpp"
#include "lockstep/comm/host_communicator.hpp"
#include "lockstep/comm/process_group.hpp"
#include "lockstep/core/backend.hpp"
#include "lockstep/runtime/abortable_barrier.hpp"

namespace lockstep::comm {

//! The group of CUDA replicas: NCCL across devices, a device-local reduction where replicas share
//! a GPU. Defined in `<lockstep/cuda.cuh>`.
class CudaGroup;

//! What DataParallel needs of a replica group, the one shape of host, CUDA and multi-process
//! groups: built from this process's replicas' devices and a timeout, and optionally a process
//! group with the channel it uses (null: this process alone; Note [replicas across processes]
//! in comm/process_group.hpp); one `Collectives` per local rank, whose rank() is global;
//! something a failing replica can abort; and `bind(rank, execution)`.
template <class G>
concept GroupLike = requires(G& g, const std::vector<Device>& devices, std::chrono::milliseconds timeout, int rank) {
    typename G::backend;
    requires BackendTag<typename G::backend>;
    requires std::constructible_from < G, const std::vector<Device>
    &, std::chrono::milliseconds > ;
    requires std::constructible_from < G, const std::vector<Device>
    &, std::chrono::milliseconds, std::shared_ptr<ProcessGroup>, ProcessGroup::Channel > ;
    { g.size() } -> std::convertible_to<int>;
    { g.communicator(rank) } -> std::convertible_to<Collectives&>;
    { g.abortable() } -> std::convertible_to<std::shared_ptr<Abortable>>;
    // Each replica binds its execution context to the group on its own thread, before its first
    // collective (a CUDA group learns the replica's stream there).
    requires requires(Execution<typename G::backend> & ex) { g.bind(rank, ex); };
};

template <class B>
struct default_group;
template <>
struct default_group<Host> {
    using type = HostGroup;
};
template <>
struct default_group<Cuda> {
    using type = CudaGroup;
};

//! The group DataParallel uses for modules of backend `B`: `HostGroup` or `CudaGroup`.
template <class B>
using default_group_t = typename default_group<B>::type;

}  // namespace lockstep::comm
