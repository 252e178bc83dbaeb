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
    //! Waits until what abort() left running in the background has ended (a CUDA group's
    //! communicators: Note [aborting communicators] in comm/stream_group.hpp), or until `deadline`;
    //! false if it has not ended by then. Objects whose abort() completes in place return true.
    virtual bool settle(std::chrono::steady_clock::time_point /*deadline*/) noexcept { return true; }
};

// Note [no wait forever]
// Every wait in lockstep ends: when all parties arrive, when a party aborts the group (a replica
// threw, so its peers would otherwise wait for a collective it will never reach), or when the
// group's timeout passes (a replica is stuck outside lockstep's control). The timeout message
// names the ranks that never arrived, so a hang becomes a diagnosis.

// Note [barrier crossing]
// A crossing takes no lock unless someone must sleep. The barrier's state is one word: the
// phase's number times two, plus one once the barrier is aborted. Each party stores the phase it
// arrives in (its slot) and counts itself in with one atomic add; the last to arrive opens the
// next phase with a compare-and-swap of that word, which the others spin on (with more parties
// than CPUs, yield on). Only a party that spun in vain takes the mutex and parks on the condition
// variable; the last arriver notifies under the mutex only when some party has parked.
// - A phase ends one way for every party: the abort (or a waiter's timeout) sets the word's low
//   bit, the last arriver's swap expects it clear, so either the phase opens (every party returns,
//   even if an abort comes right after) or it never does (every party throws: the waiters, and the
//   last arriver whose swap failed). A commit barrier (Note [commit point]) relies on it.
// - Everything a party wrote before arriving is visible to every party after the crossing: the
//   arrivals' read-modify-writes of the count form one release sequence, which the last arriver's
//   add acquires and its swap (release) passes on to the waiters' loads (acquire).
// - No lost wake-up: a parking party counts itself as parked and then reads the word, the last
//   arriver swaps the word and then reads the parked count (both sequentially consistent), so
//   either the waiter sees the new phase or the notifier sees the waiter; the waiter holds the
//   mutex from its count to its wait, so the notification reaches it.
// - A party reads the word before counting itself in: the phase cannot end without it.
// Abort, timeout and their messages take the mutex; they are rare.

//! Reusable barrier for a fixed number of parties, identified by rank.
class AbortableBarrier final : public Abortable {
public:
    using clock = std::chrono::steady_clock;
    static constexpr std::chrono::milliseconds default_timeout{std::chrono::minutes(5)};

    explicit AbortableBarrier(int parties, std::chrono::milliseconds timeout = default_timeout)
        : parties_(parties), slots_(static_cast<std::size_t>(parties > 0 ? parties : 0)) {
        LOCKSTEP_CHECK(parties > 0, "a barrier needs at least one party, got ", parties,
                       "; create the replica group with one or more replicas");
        set_timeout(timeout);
    }

    int parties() const noexcept { return parties_; }
    std::chrono::milliseconds timeout() const noexcept {
        return std::chrono::milliseconds(timeout_ms_.load(std::memory_order_relaxed));
    }

    //! Sets how long one wait may last before the barrier times out (must be positive).
    void set_timeout(std::chrono::milliseconds timeout) {
        LOCKSTEP_CHECK(timeout.count() > 0, "barrier timeout must be positive, got ", timeout.count(),
                       " ms; pass a duration such as std::chrono::seconds(30)");
        timeout_ms_.store(timeout.count(), std::memory_order_relaxed);
    }

    //! Blocks until all parties arrived. Throws `CollectiveAborted` after `abort()`, `Timeout`
    //! (naming the missing ranks; its `rank()` is the first of them) when the timeout (plus
    //! `extra`: a party known to be busy elsewhere for up to that long) passes first. Either every
    //! party returns from a phase or every party throws (Note [barrier crossing]).
    void arrive_and_wait(int rank, std::chrono::milliseconds extra = std::chrono::milliseconds(0)) {
        LOCKSTEP_CHECK_AS(UsageError, rank >= 0 && rank < parties_, "rank ", rank, " is not in a barrier of ", parties_,
                          " parties");
        const std::uint64_t open = word_.load(std::memory_order_acquire);  // this phase, not aborted
        if (open & 1u) [[unlikely]]
            throw_aborted();
        const std::uint64_t phase = open >> 1;
        auto& mine = slots_[static_cast<std::size_t>(rank)].phase;
        if (mine.exchange(phase + 1, std::memory_order_relaxed) == phase + 1) [[unlikely]] {
            // Cannot happen while every party calls once per phase; if it does, the program is broken.
            abort("rank " + std::to_string(rank) + " arrived twice at the same barrier phase", rank);
            throw_aborted();
        }
        if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == parties_) {
            arrived_.store(0, std::memory_order_relaxed);
            std::uint64_t expected = open;
            if (!word_.compare_exchange_strong(expected, open + 2, std::memory_order_seq_cst)) [[unlikely]] {
                // Aborted before the last party came: the phase never opens. Or the phase had
                // ended before this party counted itself in: two threads arrived as one rank.
                if ((expected >> 1) != phase)
                    abort("rank " + std::to_string(rank) +
                              " arrived at a barrier phase that had already ended (two threads "
                              "arrived as one rank)",
                          rank);
                throw_aborted();
            }
            if (parked_.load(std::memory_order_seq_cst) > 0) {
                std::lock_guard lock(mutex_);
                cv_.notify_all();
            }
            return;
        }
        // Spin briefly: replicas usually arrive within microseconds of each other, and a futex
        // round-trip costs more than that. With more parties than CPUs, a few yields instead,
        // which let the parties still to come run.
        const int spins = spin_ ? spin_iterations : yield_iterations;
        for (int i = 0; i < spins; ++i) {
            const std::uint64_t now = word_.load(std::memory_order_acquire);
            if (now != open) {
                if ((now >> 1) != phase) return;  // the phase opened
                throw_aborted();
            }
            if (!spin_ || (i & 63) == 63) std::this_thread::yield();
        }
        std::unique_lock lock(mutex_);
        parked_.fetch_add(1, std::memory_order_seq_cst);
        struct Unpark {
            std::atomic<int>& parked;
            ~Unpark() { parked.fetch_sub(1, std::memory_order_relaxed); }
        } unpark{parked_};
        const auto waited = timeout() + extra;
        const auto deadline = clock::now() + waited;
        std::uint64_t now = open;
        while ((now = word_.load(std::memory_order_seq_cst)) == open) {
            if (cv_.wait_until(lock, deadline) != std::cv_status::timeout) continue;
            std::string missing;
            int first_missing = -1;
            for (int r = 0; r < parties_; ++r) {
                if (slots_[static_cast<std::size_t>(r)].phase.load(std::memory_order_relaxed) == phase + 1) continue;
                if (first_missing < 0) first_missing = r;
                missing += (missing.empty() ? "" : ", ") + std::to_string(r);
            }
            if (first_missing < 0) {  // every party is in: the last one is opening the next phase
                lock.unlock();
                std::this_thread::yield();
                lock.lock();
                continue;
            }
            // The Timeout is the stuck replica's failure: its rank() is the first that never
            // arrived, not the rank of whoever waited for it. It ends the phase only if the phase
            // is still open (a party arriving now finds its swap failed and throws too).
            std::uint64_t expected = open;
            if (word_.compare_exchange_strong(expected, open | 1u, std::memory_order_seq_cst))
                record_abort("barrier timed out after " + std::to_string(waited.count()) +
                                 " ms; ranks that never arrived: " + missing +
                                 " (a replica is stuck or skipped a collective; raise the timeout if the step is "
                                 "legitimately that slow)",
                             first_missing, true);
        }
        if ((now >> 1) != phase) return;  // the phase opened (an abort may have come after)
        lock.unlock();
        throw_aborted();
    }

    void abort(const std::string& reason, int failed_rank) noexcept override {
        std::lock_guard lock(mutex_);
        if (aborted_) return;
        word_.fetch_or(1u, std::memory_order_seq_cst);
        record_abort(reason, failed_rank, false);
    }

    //! Clears an abort and any half-finished phase, and starts a new phase. Call only when no
    //! party is inside `arrive_and_wait`.
    void reset() override {
        std::lock_guard lock(mutex_);
        aborted_ = false;
        timed_out_ = false;
        reason_.clear();
        failed_rank_ = -1;
        arrived_.store(0, std::memory_order_relaxed);
        for (auto& s : slots_) s.phase.store(0, std::memory_order_relaxed);
        word_.store((word_.load(std::memory_order_relaxed) | 1u) + 1, std::memory_order_release);
    }

    bool aborted() const {
        std::lock_guard lock(mutex_);
        return aborted_;
    }

private:
    static constexpr int spin_iterations = 4000;  // while every party can own a CPU
    static constexpr int yield_iterations = 64;   // with more parties than CPUs

    // With the mutex held, after the word's abort bit is set: why, and wakes the parked parties.
    void record_abort(std::string reason, int failed_rank, bool timed_out) noexcept {
        try {
            reason_ = std::move(reason);
        } catch (...) {
        }
        failed_rank_ = failed_rank;
        timed_out_ = timed_out;
        aborted_ = true;
        cv_.notify_all();
    }

    // Throws the abort the word's bit says happened (its reason was recorded in the critical
    // section that set the bit, so whoever saw the bit and then takes the mutex reads it).
    [[noreturn]] void throw_aborted() const {
        std::lock_guard lock(mutex_);
        if (timed_out_) throw Timeout(reason_, failed_rank_);
        throw CollectiveAborted("collective abandoned because " +
                                (failed_rank_ >= 0 ? "rank " + std::to_string(failed_rank_) + " failed: " : std::string()) +
                                reason_);
    }

    // A party's slot: 1 + the phase it last arrived in (0: none since a reset), on a cache line
    // of its own.
    struct alignas(64) Slot {
        std::atomic<std::uint64_t> phase{0};
    };

    const int parties_;
    const bool spin_ = static_cast<unsigned>(parties_) <= std::max(1u, std::thread::hardware_concurrency());
    std::vector<Slot> slots_;
    alignas(64) std::atomic<int> arrived_{0};
    alignas(64) std::atomic<std::uint64_t> word_{0};  // phase * 2, + 1 once aborted
    std::atomic<int> parked_{0};
    std::atomic<std::int64_t> timeout_ms_{default_timeout.count()};
    alignas(64) mutable std::mutex mutex_;  // parking, abort and its reason
    std::condition_variable cv_;
    bool aborted_ = false;
    bool timed_out_ = false;
    std::string reason_;
    int failed_rank_ = -1;
};

}  // namespace lockstep
