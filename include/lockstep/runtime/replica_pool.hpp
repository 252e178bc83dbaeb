// SPDX-License-Identifier: MIT
//! `ReplicaPool`: one persistent thread per replica; `run(fn)` executes `fn(rank)` on all of them.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "lockstep/core/error.hpp"
#include "lockstep/runtime/abortable_barrier.hpp"

namespace lockstep {

//! A fixed set of worker threads, one per replica, created once and joined in the destructor.
//! A job runs on every replica; if one replica throws, the pool aborts every attached group (so
//! peers blocked in a collective wake up), waits for all replicas, resets the groups and rethrows
//! the first failure to the caller. The pool stays usable afterwards.
class ReplicaPool {
public:
    using Job = std::function<void(int rank)>;
    using ThreadInit = std::function<void(int rank)>;

    //! Starts `replicas` threads; `init(rank)` runs once on each (e.g. to bind a CUDA device).
    //! If a thread cannot start or `init` throws, already started threads are stopped and joined
    //! and the error is rethrown.
    explicit ReplicaPool(int replicas, ThreadInit init = {}) : size_(replicas) {
        LOCKSTEP_CHECK(replicas > 0, "a replica pool needs at least one replica, got ", replicas,
                       "; pass the number of devices to train on");
        errors_.resize(static_cast<std::size_t>(replicas));
        threads_.reserve(static_cast<std::size_t>(replicas));
        try {
            for (int r = 0; r < replicas; ++r) threads_.emplace_back([this, r, init] { worker(r, init); });
        } catch (...) {
            stop_and_join();
            throw;
        }
        std::unique_lock lock(mutex_);
        done_cv_.wait(lock, [&] { return started_ == size_; });
        if (auto first = first_failure_locked(); first >= 0) {
            auto error = errors_[static_cast<std::size_t>(first)];
            lock.unlock();
            stop_and_join();
            std::rethrow_exception(error);
        }
    }

    ReplicaPool(const ReplicaPool&) = delete;
    ReplicaPool& operator=(const ReplicaPool&) = delete;

    ~ReplicaPool() { stop_and_join(); }

    int size() const noexcept { return size_; }

    //! Registers a group to abort when a replica fails and to reset after the job.
    void attach(std::shared_ptr<Abortable> group) {
        LOCKSTEP_CHECK(group != nullptr, "attach() needs a group, got a null pointer");
        std::lock_guard lock(mutex_);
        groups_.push_back(std::move(group));
    }

    //! Runs `job(rank)` on every replica and waits. Rethrows the first failure (in time) with
    //! its rank recorded; must not be called from inside a job.
    void run(const Job& job) {
        LOCKSTEP_CHECK_AS(UsageError, current_pool() != this,
                          "ReplicaPool::run called from inside one of its own jobs; that would wait for itself");
        std::lock_guard run_lock(run_mutex_);
        std::unique_lock lock(mutex_);
        job_ = &job;
        finished_ = 0;
        failure_order_.clear();
        for (auto& e : errors_) e = nullptr;
        ++generation_;
        work_cv_.notify_all();
        done_cv_.wait(lock, [&] { return finished_ == size_; });
        job_ = nullptr;
        if (failure_order_.empty()) return;
        for (auto& g : groups_) g->reset();
        const int first = failure_order_.front();
        std::exception_ptr error = errors_[static_cast<std::size_t>(first)];
        lock.unlock();
        std::rethrow_exception(error);
    }

    //! Records `error` as replica `rank`'s failure now and aborts the attached groups, from
    //! inside a job that must still clean up (wait for its own helpers) before it rethrows.
    //! The job's later rethrow of the same failure is not recorded twice.
    void report_failure(int rank, std::exception_ptr error) {
        LOCKSTEP_CHECK_AS(UsageError, rank >= 0 && rank < size_ && current_rank() == rank,
                          "report_failure must be called by replica ", rank, "'s own thread");
        record_failure(rank, std::move(error));
    }

    //! Rank of the calling replica thread, or -1 outside the pool's threads.
    static int current_rank() noexcept { return rank_slot(); }

private:
    static int& rank_slot() noexcept {
        thread_local int rank = -1;
        return rank;
    }
    static const ReplicaPool*& pool_slot() noexcept {
        thread_local const ReplicaPool* pool = nullptr;
        return pool;
    }
    static const ReplicaPool* current_pool() noexcept { return pool_slot(); }

    int first_failure_locked() const {
        for (int r = 0; r < size_; ++r)
            if (errors_[static_cast<std::size_t>(r)]) return r;
        return -1;
    }

    void record_failure(int rank, std::exception_ptr error) {
        std::string what = "unknown exception";
        try {
            std::rethrow_exception(error);
        } catch (Error& e) {
            e.set_origin(rank, -1);
            what = e.message();
        } catch (const std::exception& e) {
            what = e.what();
        } catch (...) {
        }
        std::vector<std::shared_ptr<Abortable>> groups;
        {
            std::lock_guard lock(mutex_);
            if (errors_[static_cast<std::size_t>(rank)]) return;  // reported already (report_failure)
            errors_[static_cast<std::size_t>(rank)] = error;
            failure_order_.push_back(rank);
            groups = groups_;
        }
        for (auto& g : groups) g->abort(what, rank);
    }

    void worker(int rank, const ThreadInit& init) {
        rank_slot() = rank;
        pool_slot() = this;
        std::uint64_t seen = 0;
        {
            std::exception_ptr init_error;
            if (init) {
                try {
                    init(rank);
                } catch (...) {
                    init_error = std::current_exception();
                }
            }
            std::lock_guard lock(mutex_);
            errors_[static_cast<std::size_t>(rank)] = init_error;
            ++started_;
            done_cv_.notify_all();
        }
        for (;;) {
            const Job* job = nullptr;
            {
                std::unique_lock lock(mutex_);
                work_cv_.wait(lock, [&] { return stopping_ || generation_ != seen; });
                if (stopping_) return;
                seen = generation_;
                job = job_;
            }
            try {
                (*job)(rank);
            } catch (...) {
                record_failure(rank, std::current_exception());
            }
            std::lock_guard lock(mutex_);
            if (++finished_ == size_) done_cv_.notify_all();
        }
    }

    void stop_and_join() noexcept {
        {
            std::lock_guard lock(mutex_);
            stopping_ = true;
            work_cv_.notify_all();
        }
        for (auto& t : threads_)
            if (t.joinable()) t.join();
        threads_.clear();
    }

    const int size_;
    std::vector<std::thread> threads_;
    std::mutex run_mutex_;
    std::mutex mutex_;
    std::condition_variable work_cv_;
    std::condition_variable done_cv_;
    const Job* job_ = nullptr;
    std::uint64_t generation_ = 0;
    int finished_ = 0;
    int started_ = 0;
    bool stopping_ = false;
    std::vector<std::exception_ptr> errors_;
    std::vector<int> failure_order_;
    std::vector<std::shared_ptr<Abortable>> groups_;
};

}  // namespace lockstep
