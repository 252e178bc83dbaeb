// SPDX-License-Identifier: MIT
//! "Processes" as threads of this one, for the tests of DataParallel and its groups across
//! processes: each has its own ProcessGroup and its own DataParallel or group, as under mpirun.
//! The channels are host groups of P ranks; agree() is a rendezvous that compares tags; abort()
//! reaches the others as an MPI abort message would (their waits on the channels and agree throw,
//! check_peers throws). Like an MPI message taken from any source, check_peers gives the newest
//! abort of another process, which may be one passed on: the exception carries the sender's
//! process rank, as MpiCommunicator's do.
#pragma once

#include <lockstep/comm/host_communicator.hpp>
#include <lockstep/comm/process_group.hpp>
#include <lockstep/comm/shared_tensor.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace lockstep::test {

struct ThreadWorld {
    explicit ThreadWorld(int processes, std::chrono::milliseconds wait = std::chrono::seconds(5)) : P(processes), timeout(wait) {
        std::vector<Device> devices;
        for (int p = 0; p < P; ++p) devices.push_back(Device::host(p));
        for (auto& g : channels) g = std::make_unique<comm::HostGroup>(devices, timeout);
        for (auto& a : agreements) a = std::make_shared<comm::SharedTensor>(P, timeout);
    }
    int P;
    std::chrono::milliseconds timeout;
    std::array<std::unique_ptr<comm::HostGroup>, 3> channels;
    std::array<std::shared_ptr<comm::SharedTensor>, 3> agreements;
    std::mutex m;
    std::vector<std::pair<int, std::string>> aborts;  // (process, text), in order
    std::atomic<int> agrees{0};
};

class ThreadProcessGroup final : public comm::ProcessGroup {
public:
    ThreadProcessGroup(std::shared_ptr<ThreadWorld> w, int p) : w_(std::move(w)), p_(p) {}
    int rank() const override { return p_; }
    int size() const override { return w_->P; }
    comm::Collectives& channel(Channel c) override { return w_->channels[static_cast<std::size_t>(c)]->communicator(p_); }
    void agree(Channel c, const comm::CollectiveTag& tag) override {
        ++w_->agrees;
        w_->agreements[static_cast<std::size_t>(c)]->arrive(p_, tag, nullptr);
    }
    void check_peers() override {
        std::lock_guard lock(w_->m);
        for (auto it = w_->aborts.rbegin(); it != w_->aborts.rend(); ++it)
            if (it->first != p_)
                throw CollectiveAborted("process " + std::to_string(it->first) + " failed: " + it->second, it->first);
    }
    std::chrono::milliseconds timeout() const noexcept override { return w_->timeout; }
    // Once another process has aborted: its message reaches this one through check_peers, agree
    // or a channel's wait, whichever comes first, as with MPI.
    bool peer_failed() const noexcept override {
        std::lock_guard lock(w_->m);
        return std::any_of(w_->aborts.begin(), w_->aborts.end(), [&](const auto& a) { return a.first != p_; });
    }
    void abort(const std::string& reason) noexcept override {
        {
            std::lock_guard lock(w_->m);
            for (const auto& a : w_->aborts)
                if (a.first == p_) return;  // once per process, as MpiCommunicator::abort
            w_->aborts.emplace_back(p_, reason);
        }
        for (auto& a : w_->agreements) a->abort("process " + std::to_string(p_) + " failed: " + reason, p_);
        for (auto& g : w_->channels) g->abortable()->abort("process " + std::to_string(p_) + " failed: " + reason, p_);
    }

private:
    std::shared_ptr<ThreadWorld> w_;
    int p_;
};

//! Runs `on_start(p)`, then `body(p, process_group)`, for every process p on its own thread;
//! returns per-process errors (a throw from either).
template <class F, class Start>
std::vector<std::exception_ptr> as_processes(int P, F body, Start on_start,
                                             std::chrono::milliseconds timeout = std::chrono::seconds(5)) {
    auto world = std::make_shared<ThreadWorld>(P, timeout);
    std::vector<std::exception_ptr> errors(static_cast<std::size_t>(P));
    std::vector<std::thread> threads;
    for (int p = 0; p < P; ++p)
        threads.emplace_back([&, p] {
            try {
                on_start(p);
                body(p, std::make_shared<ThreadProcessGroup>(world, p));
            } catch (...) {
                errors[static_cast<std::size_t>(p)] = std::current_exception();
            }
        });
    for (auto& t : threads) t.join();
    return errors;
}

}  // namespace lockstep::test
