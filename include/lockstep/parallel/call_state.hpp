// SPDX-License-Identifier: MIT
//! What a DataParallel call shares with the jobs it gives its replicas (Note [jobs own their
//! state]): guarded access to the caller's objects, copies of them, and "no optimizer" as a type.
#pragma once

#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <shared_mutex>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "lockstep/core/error.hpp"

namespace lockstep::parallel {

// Note [jobs own their state]
// A call may give up on a stuck replica and return while that replica's thread still runs the
// call's job (Note [stuck replicas] in runtime/replica_pool.hpp). So no job references the
// caller's stack or the DataParallel object: the replicas, groups and options live in a `Core`
// that the object and every job own jointly, and a call's own state (shards, per-replica results,
// a copy of the loss) in a `std::shared_ptr` the job holds. The caller's input batch, targets and
// prototype are read only at the start of a replica's part, through `CallerRefs`, and a call that
// returns first marks them gone, so a late replica can never read them. What a stuck replica is
// inside of stays in use: the user's layer, loss copy or optimizer it is stuck in.

namespace detail {

//! "No optimizer": what accumulate(), load(checkpoint) and resync() pass where the others pass
//! the user's optimizer.
struct NoOptimizer {};
inline NoOptimizer no_optimizer;
template <class Optimizer>
inline constexpr bool has_optimizer = !std::is_same_v<Optimizer, NoOptimizer>;

//! The caller's objects a job may read (the input batch, the targets, the prototype): readable
//! until the call releases them, which waits for the reads in progress (library copies only,
//! never user code) and makes later reads fail.
class CallerRefs {
public:
    //! Runs `f` if the caller's objects are still there; false when the call has returned. A
    //! read may only enqueue its copies (on a device stream): `settle` then waits until they have
    //! run, and the call runs it before it returns (Note [jobs own their state]).
    template <class F>
    bool read(F&& f, std::function<void()> settle = {}) {
        std::shared_lock lock(mutex_);
        if (gone_) return false;
        f();
        if (settle) {
            std::lock_guard settle_lock(settle_mutex_);
            settles_.push_back(std::move(settle));
        }
        return true;
    }
    //! Waits for the reads made so far to settle; throws the first failure (a settle that timed
    //! out has aborted the groups: the call fails, and the caller must not reuse its input).
    void settle() {
        std::lock_guard settle_lock(settle_mutex_);
        std::exception_ptr first;
        for (auto& s : settles_) {
            try {
                s();
            } catch (...) {
                if (!first) first = std::current_exception();
            }
        }
        settles_.clear();
        if (first) std::rethrow_exception(first);
    }
    //! Later reads fail; reads not settled yet are settled (bounded waits; on a call that is
    //! failing already, its own failure is what the caller sees).
    void release() noexcept {
        std::unique_lock lock(mutex_);
        gone_ = true;
        try {
            settle();
        } catch (...) {
        }
    }

private:
    std::shared_mutex mutex_;
    bool gone_ = false;
    std::mutex settle_mutex_;
    std::vector<std::function<void()>> settles_;
};

//! A copy of a caller's object when it can be copied, else a pointer to it.
template <class T>
class Held {
public:
    explicit Held(const T& value) : value_(hold(value)) {}
    const T& get() const noexcept {
        if constexpr (std::is_copy_constructible_v<T>)
            return value_;
        else
            return *value_;
    }

private:
    static auto hold(const T& value) {
        if constexpr (std::is_copy_constructible_v<T>)
            return value;
        else
            return &value;
    }
    std::conditional_t<std::is_copy_constructible_v<T>, T, const T*> value_;
};

//! One replica's targets as the replica keeps them: class labels copied out of the caller's
//! container, a tensor shard as it is (already a copy).
template <class Shard>
struct OwnedShard {
    using type = Shard;
    static Shard own(Shard s) { return s; }
    static const Shard& view(const Shard& s) noexcept { return s; }
};
template <>
struct OwnedShard<std::span<const std::int64_t>> {
    using type = std::vector<std::int64_t>;
    static type own(std::span<const std::int64_t> s) { return type(s.begin(), s.end()); }
    static std::span<const std::int64_t> view(const type& v) noexcept { return std::span<const std::int64_t>(v); }
};

inline CollectiveAborted caller_gone() {
    return CollectiveAborted("this replica started after its call had given up on a stuck peer and returned");
}

}  // namespace detail

}  // namespace lockstep::parallel
