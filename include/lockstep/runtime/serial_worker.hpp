// SPDX-License-Identifier: MIT
//! `SerialWorker`: one persistent thread that runs submitted jobs in order (a replica's
//! communication thread, so gradient all-reduces overlap the rest of backward).
#pragma once

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>

namespace lockstep {

//! Runs jobs one after another on its own thread. After a job throws, later jobs are skipped
//! until `wait()` has reported the error. The destructor finishes queued jobs and joins.
class SerialWorker {
public:
    //! `init` runs once on the worker's thread before any job (e.g. to make a replica's device
    //! current there); it must not throw.
    explicit SerialWorker(std::function<void()> init = {}) : init_(std::move(init)), thread_([this] { loop(); }) {}
    SerialWorker(const SerialWorker&) = delete;
    SerialWorker& operator=(const SerialWorker&) = delete;
    ~SerialWorker() {
        {
            std::lock_guard lock(mutex_);
            stopping_ = true;
        }
        cv_.notify_all();
        thread_.join();
    }

    void submit(std::function<void()> job) {
        {
            std::lock_guard lock(mutex_);
            queue_.push_back(std::move(job));
        }
        cv_.notify_all();
    }

    //! Waits until every submitted job has finished; rethrows the first error among them.
    void wait() {
        std::unique_lock lock(mutex_);
        idle_cv_.wait(lock, [&] { return queue_.empty() && !busy_; });
        if (error_) {
            auto e = std::exchange(error_, nullptr);
            std::rethrow_exception(e);
        }
    }

    //! Like `wait()` but drops the error (used while unwinding from another failure).
    void wait_quietly() noexcept {
        std::unique_lock lock(mutex_);
        idle_cv_.wait(lock, [&] { return queue_.empty() && !busy_; });
        error_ = nullptr;
    }

private:
    void loop() {
        if (init_) init_();
        std::unique_lock lock(mutex_);
        for (;;) {
            cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
            if (queue_.empty()) return;  // stopping and drained
            auto job = std::move(queue_.front());
            queue_.pop_front();
            busy_ = true;
            const bool skip = error_ != nullptr;
            lock.unlock();
            std::exception_ptr err;
            if (!skip) {
                try {
                    job();
                } catch (...) {
                    err = std::current_exception();
                }
            }
            lock.lock();
            if (err && !error_) error_ = err;
            busy_ = false;
            if (queue_.empty()) idle_cv_.notify_all();
        }
    }

    std::mutex mutex_;
    std::condition_variable cv_, idle_cv_;
    std::deque<std::function<void()>> queue_;
    bool busy_ = false;
    bool stopping_ = false;
    std::exception_ptr error_;
    std::function<void()> init_;
    std::thread thread_;  // last: starts after the state it uses exists
};

}  // namespace lockstep
