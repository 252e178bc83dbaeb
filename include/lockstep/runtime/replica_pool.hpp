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

#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#endif

#include "lockstep/core/error.hpp"
#include "lockstep/runtime/abortable_barrier.hpp"

namespace lockstep {

// Note [replica CPU binding]
// Replicas meet at every collective, so a step runs at the pace of the slowest one; two replica
// threads that the OS puts on the same CPU halve the step's speed until it moves one of them (the
// wake-up that ends a collective tends to place the woken thread beside its waker). Binding each
// replica thread to a CPU of its own removes that (README, Benchmarks). It is the default only where it cannot crowd other work: when the
// process may run on exactly as many CPUs as there are replicas (a 2-core machine, or a job
// restricted with taskset/cpusets to one CPU per replica). `spread` asks for it whenever there
// are enough CPUs (replica r on the r-th allowed CPU; several such processes on one machine
// would share the same CPUs, which is why it is not the default); `none` never binds.

//! Where a pool's replica threads run (see Note [replica CPU binding]).
enum class CpuBinding {
    automatic,  //!< one CPU per replica when the process is allowed exactly that many CPUs
    spread,     //!< one CPU per replica whenever the process is allowed at least that many
    none,       //!< wherever the OS schedules them
};

//! The CPUs the calling thread may run on, ascending: the process's, unless the thread was bound.
//! Empty where the OS does not say (not Linux, or the query failed).
inline std::vector<int> allowed_cpus() {
    std::vector<int> cpus;
#if defined(__linux__)
    cpu_set_t set;
    CPU_ZERO(&set);
    if (::sched_getaffinity(0, sizeof set, &set) != 0) return cpus;
    for (int c = 0; c < CPU_SETSIZE; ++c)
        if (CPU_ISSET(c, &set)) cpus.push_back(c);
#endif
    return cpus;
}

//! A fixed set of worker threads, one per replica, created once and joined in the destructor.
//! A job runs on every replica; if one replica throws, the pool aborts every attached group (so
//! peers blocked in a collective wake up), waits for all replicas, resets the groups and rethrows
//! the first failure to the caller. The pool stays usable afterwards.
class ReplicaPool {
public:
    using Job = std::function<void(int rank)>;
    using ThreadInit = std::function<void(int rank)>;

    //! Starts `replicas` threads, bound to CPUs as `binding` says (before `init` runs);
    //! `init(rank)` runs once on each (e.g. to bind a CUDA device). If a thread cannot start or
    //! `init` throws, already started threads are stopped and joined and the error is rethrown.
    explicit ReplicaPool(int replicas, ThreadInit init = {}, CpuBinding binding = CpuBinding::automatic)
        : size_(replicas) {
        LOCKSTEP_CHECK(replicas > 0, "a replica pool needs at least one replica, got ", replicas,
                       "; pass the number of devices to train on");
        cpus_ = choose_cpus(replicas, binding);
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

    //! The CPU each replica thread is bound to, by rank; empty when the threads are not bound.
    //! A CPU the OS refused to bind to reads -1.
    const std::vector<int>& bound_cpus() const noexcept { return cpus_; }

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
    static int& rank_slot() noexcept { return detail::replica_rank_slot(); }
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

    // The CPUs to bind replica threads to, or none (see Note [replica CPU binding]).
    static std::vector<int> choose_cpus(int replicas, CpuBinding binding) {
        if (binding == CpuBinding::none) return {};
        std::vector<int> cpus = allowed_cpus();
        const auto n = static_cast<std::size_t>(replicas);
        const bool bind = binding == CpuBinding::spread ? cpus.size() >= n : cpus.size() == n;
        if (!bind) return {};
        cpus.resize(n);
        return cpus;
    }

    // Binds the calling replica thread to its CPU; a refusal (a cpuset changed under the process)
    // leaves the thread where the OS puts it and marks the CPU -1.
    void bind_this_thread(int rank) noexcept {
#if defined(__linux__)
        if (cpus_.empty()) return;
        auto& cpu = cpus_[static_cast<std::size_t>(rank)];
        cpu_set_t one;
        CPU_ZERO(&one);
        CPU_SET(cpu, &one);
        if (::pthread_setaffinity_np(::pthread_self(), sizeof one, &one) != 0) cpu = -1;
#else
        (void)rank;
#endif
    }

    void worker(int rank, const ThreadInit& init) {
        rank_slot() = rank;
        pool_slot() = this;
        bind_this_thread(rank);
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
    std::vector<int> cpus_;  // written before the threads start; each entry by its own thread
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
