// SPDX-License-Identifier: MIT
//! Backend tag types (`Host`, `Cuda`) and the concept every tag meets, `Device` (the place a
//! replica runs) and `Execution<B>`, the backend's part of a replica's execution context.
#pragma once

#include <array>
#include <concepts>
#include <cstdint>
#include <cstddef>
#include <memory>
#include <ostream>
#include <string>
#include <string_view>
#include <type_traits>

#include "lockstep/core/error.hpp"

// Opaque CUDA handle types, named here so the CUDA execution part is typed without any CUDA
// header being reachable from the host umbrella header.
struct CUstream_st;
struct CUevent_st;
struct cublasContext;

namespace lockstep {

//! Where a replica lives: a backend and an index (GPU ordinal, or host replica number).
struct Device {
    enum class Kind { host, cuda };
    Kind kind = Kind::host;
    int index = 0;

    static constexpr Device host(int i = 0) { return {Kind::host, i}; }
    static constexpr Device cuda(int i) { return {Kind::cuda, i}; }

    friend constexpr bool operator==(const Device&, const Device&) = default;
    friend std::ostream& operator<<(std::ostream& os, const Device& d) {
        return os << (d.kind == Kind::host ? "host:" : "cuda:") << d.index;
    }
    std::string str() const { return (kind == Kind::host ? "host:" : "cuda:") + std::to_string(index); }
};

//! A backend tag: a type naming its backend (`name`, for messages) and the kind of device its
//! memory lives on (`device_kind`), both constants. Templates ask only for these members, so the
//! tag of a new backend needs no change here (its operations come from its `kernels::Ops<B>`).
template <class B>
concept BackendTag = requires {
    { B::name } -> std::convertible_to<std::string_view>;
    { B::device_kind } -> std::same_as<const Device::Kind&>;
    typename std::integral_constant<Device::Kind, B::device_kind>;  // a constant expression
};

//! Threads of this process act as devices; memory is ordinary host memory.
struct Host {
    static constexpr std::string_view name = "host";
    static constexpr Device::Kind device_kind = Device::Kind::host;
};

//! CUDA devices. Storage, kernels and communicators for it live behind `<lockstep/cuda.cuh>`.
struct Cuda {
    static constexpr std::string_view name = "cuda";
    static constexpr Device::Kind device_kind = Device::Kind::cuda;
};

static_assert(BackendTag<Host> && BackendTag<Cuda>);

//! The kind of device backend B's memory lives on.
template <BackendTag B>
constexpr Device::Kind device_kind_of() {
    return B::device_kind;
}

//! Whether memory on `a` can be used where `b` is expected: the same backend and, for CUDA, the
//! same ordinal. Host replicas share one memory, so `host:0` and `host:1` are compatible.
constexpr bool same_memory(const Device& a, const Device& b) {
    return a.kind == b.kind && (a.kind == Device::Kind::host || a.index == b.index);
}

//! Throws `DeviceMismatch` naming both devices when a tensor on `got` is handed to work on `want`.
inline void check_device(const Device& want, const Device& got, std::string_view what) {
    if (!same_memory(want, got)) [[unlikely]]
        throw DeviceMismatch(std::string(what) + " is on " + got.str() + " but runs on " + want.str() +
                             "; move it with .to(" + want.str() + ") or build it on the replica's device");
}

// Note [execution context]
// Each replica owns one execution context (nn::Context), handed to every forward and backward.
// Its backend part, `Execution<B>`, is what the backend operations need besides their operands:
// on the host nothing (a replica is its thread), on CUDA the replica's device, compute stream,
// cuBLAS handle and workspace. Backend operations take it as their first argument, so a layer
// written once runs on either backend.

//! The backend's part of an execution context (see Note [execution context]).
template <BackendTag B>
struct Execution;

template <>
struct Execution<Host> {};

//! What a replica's host waits on its device consult while they poll (Note [stream-ordered
//! collectives] in comm/stream_group.hpp): a group whose collectives run on the device.
class DeviceWatch {
public:
    //! Throws when the group has failed (an aborted group, an asynchronous communicator error).
    virtual void poll() = 0;
    //! A wait of this replica passed its deadline: abort the group, naming `what`.
    virtual void timed_out(const std::string& what) noexcept = 0;

protected:
    ~DeviceWatch() = default;
};

template <>
struct Execution<Cuda> {
    int device = -1;                     // the replica's CUDA ordinal
    CUstream_st* stream = nullptr;       // its compute stream (a cudaStream_t)
    std::weak_ptr<const void> stream_owner;  // expires with the stream (Note [current stream])
    cublasContext* blas = nullptr;       // its cuBLAS handle (a cublasHandle_t), bound to `stream`
    void* workspace = nullptr;           // cuBLAS workspace on `device`
    std::size_t workspace_bytes = 0;
    // The reducing kernels' scratch on `device` (kernels/device/grid.cuh): `reduce_counters`
    // zeroed tickets that every kernel leaves zeroed again, then `reduce_partial_bytes` of partials.
    unsigned int* reduce_counters = nullptr;
    int reduce_counter_count = 0;
    void* reduce_partials = nullptr;
    std::size_t reduce_partial_bytes = 0;
    // Host waits for the device (a step's scalars): an event recorded on `stream`, polled until
    // `wait_timeout_ms` passes, consulting the replica's groups (`watches`) meanwhile.
    CUevent_st* done_event = nullptr;  // a cudaEvent_t on `device`
    // Recorded after a call's copies of the caller's input; the call returns only once it has
    // completed, so the caller may then free or refill its input (a cudaEvent_t on `device`).
    CUevent_st* inputs_read_event = nullptr;
    std::int64_t wait_timeout_ms = 5 * 60 * 1000;
    std::array<DeviceWatch*, 4> watches{};
};

namespace detail {
inline int& host_device_slot() noexcept {
    thread_local int index = 0;
    return index;
}
}  // namespace detail

//! The host device new host tensors of this thread are made on: `host:0` unless the thread was
//! given another (each DataParallel replica thread is given its replica's device).
inline Device current_host_device() noexcept { return Device::host(detail::host_device_slot()); }
inline void set_current_host_device(int index) noexcept { detail::host_device_slot() = index; }

}  // namespace lockstep
