// SPDX-License-Identifier: MIT
//! `AbortableBarrier`: a reusable barrier whose waiters can be woken with an error (abort or timeout).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "lockstep/core/error.hpp"

namespace lockstep {

//! Something a replica group can be woken out of when one replica fails (see Note [no wait forever]).
class Abortable {
public:
    virtual ~Abortable() = default;
    //! Wakes every waiter with an error naming `failed_rank` and `reason`; later waits fail too.
    virtual void abort(const std::string& reason, int failed_rank) noexcept = 0;
    //! Makes the object usable again once no thread is waiting in it.
    virtual void reset() = 0;
};

// Note [no wait forever]
// Every wait in lockstep ends: when all parties arrive, when a party aborts the group (a replica
// threw, so its peers would otherwise wait for a collective it will never reach), or when the
// group's timeout passes (a replica is stuck outside lockstep's control). The timeout message
// names the ranks that never arrived, so a hang becomes a diagnosis.

//! Reusable barrier for a fixed number of parties, identified by rank.
class AbortableBarrier final : public Abortable {
public:
    using clock = std::chrono::steady_clock;
    static constexpr std::chrono::milliseconds default_timeout{std::chrono::minutes(5)};

    explicit AbortableBarrier(int parties, std::chrono::milliseconds timeout = default_timeout)
        : parties_(parties), here_(static_cast<std::size_t>(parties > 0 ? parties : 0), 0) {
        LOCKSTEP_CHECK(parties > 0, "a barrier needs at least one party, got ", parties,
                       "; create the replica group with one or more replicas");
        set_timeout(timeout);
    }

    int parties() const noexcept { return parties_; }
    std::chrono::milliseconds timeout() const noexcept { return timeout_; }

    //! Sets how long one wait may last before the barrier times out (must be positive).
    void set_timeout(std::chrono::milliseconds timeout) {
        LOCKSTEP_CHECK(timeout.count() > 0, "barrier timeout must be positive, got ", timeout.count(),
                       " ms; pass a duration such as std::chrono::seconds(30)");
        std::lock_guard lock(mutex_);
        timeout_ = timeout;
    }

    //! Blocks until all parties arrived. Throws `CollectiveAborted` after `abort()`, `Timeout`
    //! (naming the missing ranks; its `rank()` is the first of them) when the timeout (plus
    //! `extra`: a party known to be busy elsewhere for up to that long) passes first.
    void arrive_and_wait(int rank, std::chrono::milliseconds extra = std::chrono::milliseconds(0)) {
        std::unique_lock lock(mutex_);
        LOCKSTEP_CHECK_AS(UsageError, rank >= 0 && rank < parties_, "rank ", rank, " is not in a barrier of ", parties_,
                          " parties");
        throw_if_aborted();
        if (here_[static_cast<std::size_t>(rank)]) {
            // Cannot happen while every party calls once per phase; if it does, the program is broken.
            abort_locked("rank " + std::to_string(rank) + " arrived twice at the same barrier phase", rank, false);
            throw_if_aborted();
        }
        here_[static_cast<std::size_t>(rank)] = 1;
        const std::uint64_t gen = generation_.load(std::memory_order_relaxed);
        if (++arrived_ == parties_) {
            arrived_ = 0;
            std::fill(here_.begin(), here_.end(), 0);
            generation_.store(gen + 1, std::memory_order_release);
            cv_.notify_all();
            return;
        }
        lock.unlock();
        // Spin briefly: replicas usually arrive within microseconds of each other, and a futex
        // round-trip costs more than that. Only when every party can own a core.
        if (spin_) {
            for (int i = 0; i < spin_iterations; ++i) {
                if (generation_.load(std::memory_order_acquire) != gen || aborted_flag_.load(std::memory_order_acquire)) break;
                if ((i & 63) == 63) std::this_thread::yield();
            }
        }
        lock.lock();
        const auto waited = timeout_ + extra;
        const auto deadline = clock::now() + waited;
        while (generation_.load(std::memory_order_relaxed) == gen && !aborted_) {
            if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && generation_.load(std::memory_order_relaxed) == gen &&
                !aborted_) {
                std::string missing;
                int first_missing = -1;
                for (int r = 0; r < parties_; ++r) {
                    if (here_[static_cast<std::size_t>(r)]) continue;
                    if (first_missing < 0) first_missing = r;
                    missing += (missing.empty() ? "" : ", ") + std::to_string(r);
                }
                // The Timeout is the stuck replica's failure: its rank() is the first that never
                // arrived, not the rank of whoever waited for it.
                abort_locked("barrier timed out after " + std::to_string(waited.count()) +
                                 " ms; ranks that never arrived: " + missing +
                                 " (a replica is stuck or skipped a collective; raise the timeout if the step is "
                                 "legitimately that slow)",
                             first_missing, true);
            }
        }
        if (generation_.load(std::memory_order_relaxed) != gen) return;
        throw_if_aborted();
    }

    void abort(const std::string& reason, int failed_rank) noexcept override {
        std::lock_guard lock(mutex_);
        if (!aborted_) abort_locked(reason, failed_rank, false);
    }

    //! Clears an abort and any half-finished phase. Call only when no party is waiting.
    void reset() override {
        std::lock_guard lock(mutex_);
        aborted_ = false;
        aborted_flag_.store(false, std::memory_order_release);
        timed_out_ = false;
        reason_.clear();
        failed_rank_ = -1;
        arrived_ = 0;
        std::fill(here_.begin(), here_.end(), 0);
    }

    bool aborted() const {
        std::lock_guard lock(mutex_);
        return aborted_;
    }

private:
    static constexpr int spin_iterations = 4000;

    void abort_locked(std::string reason, int failed_rank, bool timed_out) noexcept {
        try {
            reason_ = std::move(reason);
        } catch (...) {
        }
        failed_rank_ = failed_rank;
        timed_out_ = timed_out;
        aborted_ = true;
        aborted_flag_.store(true, std::memory_order_release);
        cv_.notify_all();
    }

    void throw_if_aborted() const {
        if (!aborted_) return;
        if (timed_out_) throw Timeout(reason_, failed_rank_);
        throw CollectiveAborted("collective abandoned because " +
                                (failed_rank_ >= 0 ? "rank " + std::to_string(failed_rank_) + " failed: " : std::string()) +
                                reason_);
    }

    const int parties_;
    const bool spin_ = static_cast<unsigned>(parties_) <= std::max(1u, std::thread::hardware_concurrency());
    mutable std::mutex mutex_;
    std::condition_variable cv_;
    std::chrono::milliseconds timeout_{default_timeout};
    int arrived_ = 0;
    std::vector<char> here_;
    std::atomic<std::uint64_t> generation_{0};
    std::atomic<bool> aborted_flag_{false};
    bool aborted_ = false;
    bool timed_out_ = false;
    std::string reason_;
    int failed_rank_ = -1;
};

}  // namespace lockstep
