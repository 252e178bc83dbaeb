// SPDX-License-Identifier: MIT
//! The lockstep exception hierarchy and the `LOCKSTEP_CHECK` macro that raises it with context.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace lockstep {

//! Base of every exception lockstep throws. Carries the replica rank and device it happened on
//! (-1 when not known, e.g. outside a parallel region).
class Error : public std::runtime_error {
public:
    explicit Error(const std::string& what, int rank = -1, int device = -1)
        : std::runtime_error(what), message_(what), rank_(rank), device_(device) {}

    int rank() const noexcept { return rank_; }
    int device() const noexcept { return device_; }

    //! Records where the error happened; the replica pool fills it in for errors raised by a replica.
    void set_origin(int rank, int device) noexcept {
        if (rank_ < 0) rank_ = rank;
        if (device_ < 0) device_ = device;
    }

    const char* what() const noexcept override {
        if (rank_ < 0) return message_.c_str();
        if (decorated_.empty()) {
            try {
                decorated_ = "[rank " + std::to_string(rank_) +
                             (device_ >= 0 ? ", device " + std::to_string(device_) : std::string()) + "] " + message_;
            } catch (...) {
                return message_.c_str();
            }
        }
        return decorated_.c_str();
    }

    //! The message without the rank/device prefix.
    const std::string& message() const noexcept { return message_; }

private:
    std::string message_;
    mutable std::string decorated_;
    int rank_;
    int device_;
};

//! An argument or input the caller can fix (shape, size, value out of range).
class InvalidArgument : public Error {
    using Error::Error;
};
//! A tensor's shape or layout does not match what the operation needs.
class ShapeError : public InvalidArgument {
    using InvalidArgument::InvalidArgument;
};
//! Replicas reached different collectives (different site, kind or element count).
class CollectiveMismatch : public Error {
    using Error::Error;
};
//! A collective was abandoned because another replica failed or `abort()` was called.
class CollectiveAborted : public Error {
    using Error::Error;
};
//! A wait exceeded its timeout; the message names the ranks that never arrived.
class Timeout : public Error {
    using Error::Error;
};
//! A file could not be read or written, or its content is not what was expected.
class IoError : public Error {
    using Error::Error;
};
//! A CUDA runtime, cuBLAS or NCCL call failed.
class DeviceError : public Error {
    using Error::Error;
};
//! A device allocation failed: the message names the device, the bytes asked for and the bytes free.
class OutOfMemory : public DeviceError {
    using DeviceError::DeviceError;
};
//! CUDA refused a stream capture: the recorded work broke one of its rules (it synchronized,
//! allocated with cudaMalloc, freed memory made outside the capture, ...).
class CaptureRefused : public DeviceError {
    using DeviceError::DeviceError;
};
//! The library was used in a way it does not support (wrong order of calls, missing backend).
class UsageError : public Error {
    using Error::Error;
};
//! A tensor is on another device than the operation runs on (another GPU, or another backend).
class DeviceMismatch : public InvalidArgument {
    using InvalidArgument::InvalidArgument;
};
//! An operation the chosen backend does not implement yet; the message names the issue that adds it.
class NotImplemented : public UsageError {
    using UsageError::UsageError;
};
//! A training step produced a loss or gradient that is NaN or infinite; no replica applied it.
class NonFinite : public Error {
    using Error::Error;
};
//! Replicas may differ: a step failed after some replica applied it. `DataParallel::resync()` mends it.
class Diverged : public Error {
    using Error::Error;
};
//! A replica did not finish its part of a call within the timeout after a peer failed or finished
//! (see Note [stuck replicas] in runtime/replica_pool.hpp): the call gave up on it and left its
//! thread running, so the `ReplicaPool` (and the `DataParallel`) that owns the thread refuses every
//! later call with this same exception; make a new one. `rank()` is the first stuck replica,
//! `stuck_ranks()` all of them; the failure that came first, if any, is nested
//! (`std::rethrow_if_nested`).
class ReplicaStuck : public Timeout {
public:
    ReplicaStuck(const std::string& what, std::vector<int> stuck_ranks)
        : Timeout(what, stuck_ranks.empty() ? -1 : stuck_ranks.front()), stuck_ranks_(std::move(stuck_ranks)) {}
    const std::vector<int>& stuck_ranks() const noexcept { return stuck_ranks_; }

private:
    std::vector<int> stuck_ranks_;
};
//! An exception that is not a `lockstep::Error`, thrown by code running on a replica (a layer, a
//! loss, an optimizer, a job): `rank()` names the replica, `message()` is the original `what()`
//! unchanged, and the original exception is nested (`std::rethrow_if_nested(e)` rethrows it).
class ReplicaError : public Error {
    using Error::Error;
};

namespace detail {

//! The replica rank of the calling thread (-1 outside a replica thread); set by `ReplicaPool`,
//! read where an error is raised so it can say which replica failed.
inline int& replica_rank_slot() noexcept {
    thread_local int rank = -1;
    return rank;
}

template <class... Args>
std::string concat(Args&&... args) {
    std::ostringstream os;
    (os << ... << std::forward<Args>(args));
    return os.str();
}

template <class E, class... Args>
[[noreturn]] void raise(const char* expr, const char* file, int line, Args&&... args) {
    std::ostringstream os;
    if constexpr (sizeof...(Args) > 0) (os << ... << std::forward<Args>(args));
    if (expr != nullptr)
        os << (sizeof...(Args) > 0 ? " " : "") << "(check `" << expr << "` failed at " << file << ':' << line << ')';
    throw E(os.str());
}

}  // namespace detail
}  // namespace lockstep

//! Throws `ErrorType` with the streamed message (optional), the failed expression, file and line
//! when `cond` is false.
#define LOCKSTEP_CHECK_AS(ErrorType, cond, ...)                                                         \
    do {                                                                                                \
        if (!(cond)) [[unlikely]]                                                                       \
            ::lockstep::detail::raise<ErrorType>(#cond, __FILE__, __LINE__ __VA_OPT__(, ) __VA_ARGS__); \
    } while (0)

//! Throws `lockstep::InvalidArgument` when `cond` is false.
#define LOCKSTEP_CHECK(cond, ...) LOCKSTEP_CHECK_AS(::lockstep::InvalidArgument, cond, __VA_ARGS__)
