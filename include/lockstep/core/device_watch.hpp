// SPDX-License-Identifier: MIT
//! What a replica's host waits on its device consult while they poll: the replica groups whose
//! collectives run on the device (`DeviceWatch`), and the list of them a replica's execution holds
//! with the deadline they allow (`DeviceWaits`).
#pragma once

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <string>
#include <vector>

namespace lockstep {

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

//! The groups a replica belongs to, which its host waits on the device consult, and how long one
//! such wait may take: the shortest timeout of the groups, 5 minutes while there are none. A group
//! adds itself when a replica is bound to it (`Api::watch`). A replica may belong to any number of
//! groups; the first `inline_watches` are held in place, so copying an execution (every call
//! does) allocates nothing in the usual case of a layer group and a gradient group.
class DeviceWaits {
public:
    static constexpr std::size_t inline_watches = 4;
    static constexpr std::chrono::milliseconds default_timeout{5 * 60 * 1000};

    //! Adds `w` unless it is already here, and shortens the deadline to `timeout` if that is shorter.
    void watch(DeviceWatch* w, std::chrono::milliseconds timeout) {
        if (!contains(w)) {
            if (count_ < inline_watches)
                inline_[count_] = w;
            else
                more_.push_back(w);
            ++count_;
        }
        timeout_ = std::min(timeout_, timeout);
    }

    //! How long a host wait on the device may take.
    std::chrono::milliseconds timeout() const noexcept { return timeout_; }
    //! The groups watched.
    std::size_t size() const noexcept { return count_; }

    //! Consults every group in the order they were added; throws what a failed one throws.
    void poll() const {
        for (std::size_t i = 0; i < count_; ++i) at(i)->poll();
    }
    //! Tells every group that a wait passed its deadline (`what` says which).
    void timed_out(const std::string& what) const noexcept {
        for (std::size_t i = 0; i < count_; ++i) at(i)->timed_out(what);
    }

private:
    DeviceWatch* at(std::size_t i) const noexcept { return i < inline_watches ? inline_[i] : more_[i - inline_watches]; }
    bool contains(const DeviceWatch* w) const noexcept {
        for (std::size_t i = 0; i < count_; ++i)
            if (at(i) == w) return true;
        return false;
    }

    std::array<DeviceWatch*, inline_watches> inline_{};
    std::vector<DeviceWatch*> more_;
    std::size_t count_ = 0;
    std::chrono::milliseconds timeout_ = default_timeout;
};

}  // namespace lockstep
