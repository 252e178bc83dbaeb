// SPDX-License-Identifier: MIT
//! `ReplicaPool`: one persistent thread per replica; `run(fn)` executes `fn(rank)` on all of them.
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>
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
// replica thread to a CPU of its own removes that (docs/reference.md, Benchmarks). It is the default only where it cannot crowd
// other work: when the process may run on exactly as many CPUs as there are replicas (a 2-core machine, or a job restricted with
// taskset/cpusets to one CPU per replica). `spread` asks for it whenever there are enough CPUs (replica r on the r-th allowed
// CPU; several such processes on one machine would share the same CPUs, which is why it is not the default); `none` never binds.

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

// Note [stuck replicas]
// A replica can be stuck where no collective sees it: in user code, or in a library it calls
// (seen: one spinning in OpenBLAS's allocator after a peer failed under a memory limit). Its
// peers' collectives time out and fail, but nothing can end a thread from outside, and waiting
// for every replica would hold the call for as long as that one is stuck. So `run` waits for the
// rest at most the pool's timeout (DataParallel: its groups' timeout) after the first replica
// failed or finished its part; then it throws `ReplicaStuck` naming the replicas still running
// (the first failure nested in it) and leaves their threads running the job. The pool is then
// unusable: every later `run` throws `ReplicaStuck` again, the attached groups stay aborted (a
// stuck replica that comes back fails at its next collective), and idle threads exit. The
// destructor waits the timeout once more for stuck threads to come back, then reports them on
// stderr and detaches them: a thread that never comes back is leaked, never joined forever.
// An abandoned thread still runs its job, so the job and what it touches must not die when `run`
// returns: the pool keeps its own state and the job through `std::shared_ptr`s that each thread
// co-owns, and a job must own what it uses the same way (DataParallel's jobs do). A job that
// captures the caller's locals by reference is safe only where no replica can be abandoned.

//! A fixed set of worker threads, one per replica, created once and joined in the destructor.
//! A job runs on every replica; if one replica throws, the pool aborts every attached group (so
//! peers blocked in a collective wake up), waits for all replicas, resets the groups and rethrows
//! the first failure to the caller (with its rank: an exception that is not a `lockstep::Error`
//! comes wrapped in `ReplicaError`). The pool stays usable afterwards, unless a replica did not
//! finish within the timeout (see Note [stuck replicas]).
class ReplicaPool {
public:
    using Job = std::function<void(int rank)>;
    using ThreadInit = std::function<void(int rank)>;
    using clock = std::chrono::steady_clock;

    //! Starts `replicas` threads, bound to CPUs as `binding` says (before `init` runs);
    //! `init(rank)` runs once on each (e.g. to bind a CUDA device). If a thread cannot start or
    //! `init` throws, already started threads are stopped and joined and the error is rethrown.
    //! `timeout`: how long the others may take once one replica has failed or finished (see
    //! Note [stuck replicas]); it bounds `init` the same way.
    explicit ReplicaPool(int replicas, ThreadInit init = {}, CpuBinding binding = CpuBinding::automatic,
                         std::chrono::milliseconds timeout = AbortableBarrier::default_timeout)
        : state_(std::make_shared<State>(checked_size(replicas))) {
        set_timeout(timeout);
        State& s = *state_;
        s.cpus = choose_cpus(replicas, binding);
        threads_.reserve(static_cast<std::size_t>(replicas));
        try {
            for (int r = 0; r < replicas; ++r) threads_.emplace_back([state = state_, r, init] { worker(*state, r, init); });
        } catch (...) {
            shutdown(s.timeout);
            throw;
        }
        std::unique_lock lock(s.mutex);
        if (!wait_for_all(lock, [&] { return s.started == s.size; })) {
            auto stuck = unfinished_locked();
            const auto [summary, message] = describe_stuck_locked(stuck, "did not finish starting (its ThreadInit)");
            auto first = s.failure_order.empty() ? nullptr : s.errors[static_cast<std::size_t>(s.failure_order.front())];
            abandon_locked(stuck, summary);
            lock.unlock();
            shutdown(std::chrono::milliseconds(0));  // waited for already
            throw_stuck(message, std::move(stuck), first);
        }
        if (auto first = first_failure_locked(); first >= 0) {
            auto error = s.errors[static_cast<std::size_t>(first)];
            lock.unlock();
            shutdown(s.timeout);
            std::rethrow_exception(error);
        }
    }

    ReplicaPool(const ReplicaPool&) = delete;
    ReplicaPool& operator=(const ReplicaPool&) = delete;

    //! Stops and joins the threads. A thread still running a job the pool gave up on gets the
    //! timeout to come back; then it is reported on stderr and detached (leaked), see
    //! Note [stuck replicas].
    ~ReplicaPool() { shutdown(timeout()); }

    int size() const noexcept { return state_->size; }

    //! The CPU each replica thread is bound to, by rank; empty when the threads are not bound.
    //! A CPU the OS refused to bind to reads -1.
    const std::vector<int>& bound_cpus() const noexcept { return state_->cpus; }

    //! How long `run` waits for the other replicas once one has failed or finished its part.
    std::chrono::milliseconds timeout() const {
        std::lock_guard lock(state_->mutex);
        return state_->timeout;
    }
    void set_timeout(std::chrono::milliseconds timeout) {
        LOCKSTEP_CHECK(timeout.count() > 0, "replica pool timeout must be positive, got ", timeout.count(),
                       " ms; pass a duration such as std::chrono::seconds(30)");
        std::lock_guard lock(state_->mutex);
        state_->timeout = timeout;
    }

    //! Registers a group to abort when a replica fails and to reset after the job.
    void attach(std::shared_ptr<Abortable> group) {
        LOCKSTEP_CHECK(group != nullptr, "attach() needs a group, got a null pointer");
        std::lock_guard lock(state_->mutex);
        state_->groups.push_back(std::move(group));
    }

    //! Runs `job(rank)` on every replica and waits. Rethrows the first failure (in time) with
    //! its rank recorded; must not be called from inside a job. A replica that has not finished
    //! the timeout after another failed or finished makes it throw `ReplicaStuck` instead, and
    //! the pool unusable (see Note [stuck replicas]: the job is then still running there, so it
    //! must own what it touches).
    void run(Job job) {
        LOCKSTEP_CHECK_AS(UsageError, state_slot() != state_.get(),
                          "ReplicaPool::run called from inside one of its own jobs; that would wait for itself");
        std::lock_guard run_lock(run_mutex_);
        State& s = *state_;
        auto shared_job = std::make_shared<const Job>(std::move(job));
        std::shared_ptr<const Job> finished_job;  // released after the lock: its captures are destroyed outside it
        std::unique_lock lock(s.mutex);
        throw_if_unusable_locked("ReplicaPool::run");
        s.job = std::move(shared_job);
        s.finished = 0;
        s.first_done.reset();
        s.first_done_rank = -1;
        s.first_done_failed = false;
        std::fill(s.done.begin(), s.done.end(), 0);
        s.failure_order.clear();
        for (auto& e : s.errors) e = nullptr;
        ++s.generation;
        s.work_cv.notify_all();
        const bool all = wait_for_all(lock, [&] { return s.finished == s.size; });
        finished_job = std::move(s.job);
        if (!all) {
            auto stuck = unfinished_locked();
            const auto [summary, message] = describe_stuck_locked(stuck, "did not finish");
            auto first = s.failure_order.empty() ? nullptr : s.errors[static_cast<std::size_t>(s.failure_order.front())];
            auto groups = s.groups;
            abandon_locked(stuck, summary);
            lock.unlock();
            // The stuck replica fails at its next collective if it ever reaches one.
            for (auto& g : groups) g->abort("the replica pool gave up on " + ranks_text(stuck), stuck.front());
            throw_stuck(message, std::move(stuck), first);
        }
        if (s.failure_order.empty()) return;
        for (auto& g : s.groups) g->reset();
        const int first = s.failure_order.front();
        std::exception_ptr error = s.errors[static_cast<std::size_t>(first)];
        lock.unlock();
        std::rethrow_exception(error);
    }

    //! False once a call gave up on a stuck replica (see Note [stuck replicas]).
    bool usable() const {
        std::lock_guard lock(state_->mutex);
        return !state_->abandoned;
    }
    //! The replicas a call gave up on (empty while the pool is usable).
    std::vector<int> stuck_ranks() const {
        std::lock_guard lock(state_->mutex);
        return state_->stuck;
    }
    //! Throws `ReplicaStuck`, naming `who` and the stuck replicas, when the pool is unusable.
    void check_usable(const std::string& who = "ReplicaPool") const {
        std::lock_guard lock(state_->mutex);
        throw_if_unusable_locked(who);
    }

    //! Records `error` as replica `rank`'s failure now and aborts the attached groups, from
    //! inside a job that must still clean up (wait for its own helpers) before it rethrows.
    //! The job's later rethrow of the same failure is not recorded twice. Static: it finds the
    //! pool through the calling thread, so a job need not reference the pool object.
    static void report_failure(int rank, std::exception_ptr error) {
        State* s = state_slot();
        LOCKSTEP_CHECK_AS(UsageError, s != nullptr && rank >= 0 && rank < s->size && current_rank() == rank,
                          "report_failure must be called by replica ", rank, "'s own thread");
        record_failure(*s, rank, std::move(error));
    }

    //! Rank of the calling replica thread, or -1 outside the pool's threads.
    static int current_rank() noexcept { return rank_slot(); }

private:
    // What the threads touch: owned jointly by the pool and by every thread, so that a thread the
    // pool left behind (Note [stuck replicas]) never outlives it.
    struct State {
        explicit State(int n)
            : size(n),
              done(static_cast<std::size_t>(n), 0),
              exited(static_cast<std::size_t>(n), 0),
              errors(static_cast<std::size_t>(n)) {}
        const int size;
        std::vector<int> cpus;  // written before the threads start; each entry by its own thread
        std::mutex mutex;
        std::condition_variable work_cv;
        std::condition_variable done_cv;
        std::chrono::milliseconds timeout = AbortableBarrier::default_timeout;
        std::shared_ptr<const Job> job;
        std::uint64_t generation = 0;
        int started = 0;
        int finished = 0;
        std::vector<char> done;                       // by rank: finished its init, then its part of the current job
        std::vector<char> exited;                     // by rank: the thread left its loop
        std::optional<clock::time_point> first_done;  // when a replica first failed or finished
        int first_done_rank = -1;
        bool first_done_failed = false;
        bool stopping = false;
        bool abandoned = false;  // a call gave up on `stuck`: the pool is unusable
        std::vector<int> stuck;
        std::string stuck_reason;
        std::vector<std::exception_ptr> errors;
        std::vector<int> failure_order;
        std::vector<std::shared_ptr<Abortable>> groups;
    };

    static int checked_size(int replicas) {
        LOCKSTEP_CHECK(replicas > 0, "a replica pool needs at least one replica, got ", replicas,
                       "; pass the number of devices to train on");
        return replicas;
    }

    static int& rank_slot() noexcept { return detail::replica_rank_slot(); }
    static State*& state_slot() noexcept {
        thread_local State* state = nullptr;
        return state;
    }

    int first_failure_locked() const {
        for (int r = 0; r < state_->size; ++r)
            if (state_->errors[static_cast<std::size_t>(r)]) return r;
        return -1;
    }

    // Waits until `all()`, at most the timeout after the first replica failed or finished.
    template <class Pred>
    bool wait_for_all(std::unique_lock<std::mutex>& lock, Pred all) {
        State& s = *state_;
        while (!all()) {
            if (!s.first_done) {
                s.done_cv.wait(lock);
                continue;
            }
            // Saturating: a timeout of years must not wrap around.
            const auto room = clock::time_point::max() - *s.first_done;
            if (std::chrono::duration<double>(s.timeout) >= std::chrono::duration<double>(room)) {
                s.done_cv.wait(lock);
                continue;
            }
            const auto deadline = *s.first_done + s.timeout;
            if (s.done_cv.wait_until(lock, deadline) == std::cv_status::timeout && !all() && clock::now() >= deadline)
                return false;
        }
        return true;
    }

    std::vector<int> unfinished_locked() const {
        std::vector<int> ranks;
        for (int r = 0; r < state_->size; ++r)
            if (!state_->done[static_cast<std::size_t>(r)]) ranks.push_back(r);
        return ranks;
    }

    static std::string ranks_text(const std::vector<int>& ranks) {
        std::string text = ranks.size() == 1 ? "replica " : "replicas ";
        for (std::size_t i = 0; i < ranks.size(); ++i) text += (i > 0 ? ", " : "") + std::to_string(ranks[i]);
        return text;
    }

    static std::string what_of(const std::exception_ptr& error) {
        try {
            std::rethrow_exception(error);
        } catch (const std::exception& e) {
            return e.what();
        } catch (...) {
            return "an exception that is not a std::exception";
        }
    }

    // What a call that gives up says: {the summary later calls repeat, the whole message}.
    std::pair<std::string, std::string> describe_stuck_locked(const std::vector<int>& stuck, const char* did) const {
        const State& s = *state_;
        std::string summary = ranks_text(stuck) + " " + did + " within " + std::to_string(s.timeout.count()) + " ms after rank " +
                              std::to_string(s.first_done_rank) + (s.first_done_failed ? " failed" : " finished");
        std::string cause;
        if (!s.failure_order.empty()) {
            const int f = s.failure_order.front();
            cause = (s.first_done_failed && f == s.first_done_rank ? std::string(": ")
                                                                   : "; rank " + std::to_string(f) + " failed: ") +
                    what_of(s.errors[static_cast<std::size_t>(f)]);
        }
        std::string message = summary + cause + ". " + (stuck.size() == 1 ? "Its thread is" : "Their threads are") +
                              " left running (stuck outside any collective: in user code, or in a library it calls), "
                              "and this pool refuses every later call: make a new DataParallel (or ReplicaPool)";
        return {std::move(summary), std::move(message)};
    }

    void abandon_locked(const std::vector<int>& stuck, const std::string& summary) {
        State& s = *state_;
        s.abandoned = true;
        s.stuck = stuck;
        s.stuck_reason = summary;
        s.work_cv.notify_all();  // idle threads exit; none starts the abandoned job late
    }

    [[noreturn]] static void throw_stuck(const std::string& message, std::vector<int> stuck, const std::exception_ptr& first) {
        if (!first) throw ReplicaStuck(message, std::move(stuck));
        try {
            std::rethrow_exception(first);
        } catch (...) {
            std::throw_with_nested(ReplicaStuck(message, std::move(stuck)));
        }
    }

    void throw_if_unusable_locked(const std::string& who) const {
        const State& s = *state_;
        if (!s.abandoned) return;
        throw ReplicaStuck(who + ": unusable since an earlier call gave up on " + ranks_text(s.stuck) + " (" + s.stuck_reason +
                               "), whose " + (s.stuck.size() == 1 ? "thread" : "threads") +
                               " may still be running; make a new DataParallel (or ReplicaPool)",
                           s.stuck);
    }

    // A failure with its rank: a lockstep::Error gets the rank recorded (unless it names one
    // already, as a Timeout names the stuck replica); anything else is wrapped in a ReplicaError
    // naming the rank, with the original nested.
    struct Attributed {
        std::exception_ptr error;
        std::string what;  // without the rank prefix: the reason given to aborted peers
        int rank;          // the replica the failure is about
    };
    static Attributed attribute(int rank, std::exception_ptr error) {
        try {
            std::rethrow_exception(error);
        } catch (Error& e) {
            e.set_origin(rank, -1);
            return {error, e.message(), e.rank()};
        } catch (const std::exception& e) {
            return {nest_in_replica_error(rank, e.what()), e.what(), rank};
        } catch (...) {
            const std::string what = "threw an exception that is not a std::exception (std::rethrow_if_nested gives it back)";
            return {nest_in_replica_error(rank, what), what, rank};
        }
    }
    // Called inside a handler: the exception being handled, nested in a ReplicaError.
    static std::exception_ptr nest_in_replica_error(int rank, const std::string& what) {
        try {
            std::throw_with_nested(ReplicaError(what, rank));
        } catch (...) {
            return std::current_exception();
        }
    }

    static void record_failure(State& s, int rank, std::exception_ptr error) {
        {
            std::lock_guard lock(s.mutex);
            if (s.errors[static_cast<std::size_t>(rank)]) return;  // reported already (report_failure)
        }
        Attributed a = attribute(rank, std::move(error));
        std::vector<std::shared_ptr<Abortable>> groups;
        {
            std::lock_guard lock(s.mutex);
            if (s.errors[static_cast<std::size_t>(rank)]) return;
            s.errors[static_cast<std::size_t>(rank)] = a.error;
            s.failure_order.push_back(rank);
            if (!s.first_done) {
                s.first_done = clock::now();
                s.first_done_rank = rank;
                s.first_done_failed = true;
            }
            s.done_cv.notify_all();  // the caller's wait is bounded from now on
            groups = s.groups;
        }
        for (auto& g : groups) g->abort(a.what, a.rank);
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
    static void bind_this_thread(State& s, int rank) noexcept {
#if defined(__linux__)
        if (s.cpus.empty()) return;
        auto& cpu = s.cpus[static_cast<std::size_t>(rank)];
        cpu_set_t one;
        CPU_ZERO(&one);
        CPU_SET(cpu, &one);
        if (::pthread_setaffinity_np(::pthread_self(), sizeof one, &one) != 0) cpu = -1;
#else
        (void)s;
        (void)rank;
#endif
    }

    static void mark_done_locked(State& s, int rank) {
        s.done[static_cast<std::size_t>(rank)] = 1;
        if (!s.first_done) {
            s.first_done = clock::now();
            s.first_done_rank = rank;
        }
        s.done_cv.notify_all();
    }

    static void worker(State& s, int rank, const ThreadInit& init) {
        rank_slot() = rank;
        state_slot() = &s;
        bind_this_thread(s, rank);
        {
            std::exception_ptr init_error;
            if (init) {
                try {
                    init(rank);
                } catch (...) {
                    init_error = attribute(rank, std::current_exception()).error;
                }
            }
            std::lock_guard lock(s.mutex);
            s.errors[static_cast<std::size_t>(rank)] = init_error;
            if (init_error) {
                s.failure_order.push_back(rank);
                if (!s.first_done) s.first_done_failed = true;
            }
            ++s.started;
            mark_done_locked(s, rank);
        }
        std::uint64_t seen = 0;
        for (;;) {
            std::shared_ptr<const Job> job;  // this thread's own share: the job outlives `run` if it must
            {
                std::unique_lock lock(s.mutex);
                s.work_cv.wait(lock, [&] { return s.stopping || s.abandoned || s.generation != seen; });
                if (s.stopping || s.abandoned) break;
                seen = s.generation;
                job = s.job;
            }
            try {
                (*job)(rank);
            } catch (...) {
                record_failure(s, rank, std::current_exception());
            }
            job.reset();
            std::lock_guard lock(s.mutex);
            ++s.finished;
            mark_done_locked(s, rank);
        }
        std::lock_guard lock(s.mutex);
        s.exited[static_cast<std::size_t>(rank)] = 1;
        s.done_cv.notify_all();
    }

    // Stops the threads and joins them: idle ones exit at once (waited for at most the timeout),
    // those the pool gave up on get `grace` to come back; any still out then are reported and
    // detached (see Note [stuck replicas]).
    void shutdown(std::chrono::milliseconds grace) noexcept {
        State& s = *state_;
        std::vector<int> left;
        {
            std::unique_lock lock(s.mutex);
            s.stopping = true;
            s.work_cv.notify_all();
            const int started = static_cast<int>(threads_.size());
            const auto out = [&](bool stuck_too) {
                for (int r = 0; r < started; ++r) {
                    if (s.exited[static_cast<std::size_t>(r)]) continue;
                    if (stuck_too || std::find(s.stuck.begin(), s.stuck.end(), r) == s.stuck.end()) return false;
                }
                return true;
            };
            s.done_cv.wait_for(lock, s.timeout, [&] { return out(false); });
            s.done_cv.wait_for(lock, grace, [&] { return out(true); });
            for (int r = 0; r < started; ++r)
                if (!s.exited[static_cast<std::size_t>(r)]) left.push_back(r);
        }
        for (std::size_t r = 0; r < threads_.size(); ++r) {
            auto& t = threads_[r];
            if (!t.joinable()) continue;
            if (std::find(left.begin(), left.end(), static_cast<int>(r)) == left.end())
                t.join();
            else
                t.detach();
        }
        threads_.clear();
        if (!left.empty()) {
            try {
                const std::string report = "lockstep: ReplicaPool stopped while " + ranks_text(left) +
                                           " had not come back from work the pool gave up on (waited " +
                                           std::to_string(grace.count()) + " ms more); leaving " +
                                           (left.size() == 1 ? "its thread" : "their threads") +
                                           " behind, detached (see Note [stuck replicas])\n";
                std::fputs(report.c_str(), stderr);
            } catch (...) {
            }
        }
    }

    std::shared_ptr<State> state_;
    std::vector<std::thread> threads_;  // by rank
    std::mutex run_mutex_;
};

}  // namespace lockstep
