// SPDX-License-Identifier: MIT
//! `SharedTensor`: the rendezvous of one replica group, through which every collective passes.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "lockstep/comm/collective_tag.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/runtime/abortable_barrier.hpp"

namespace lockstep::comm {

// Note [tag check at every crossing]
// Each crossing of the group's barrier publishes (tag, buffer) in a slot per rank; after the
// barrier every rank compares all tags, so all ranks see the same mismatch and all throw
// `CollectiveMismatch` together. Slots are double-buffered by the parity of the crossing count:
// a fast rank can be at most one crossing ahead of a slow one, so it never overwrites a slot
// the slow rank is still reading.

//! Shared state of one replica group: the barrier, the published buffers and the tag check.
//! Communicators of the group hold it through a `std::shared_ptr`; `ReplicaPool::attach` lets a
//! failing replica abort it.
class SharedTensor final : public Abortable {
public:
    explicit SharedTensor(int world_size, std::chrono::milliseconds timeout = AbortableBarrier::default_timeout)
        : barrier_(world_size, timeout),
          crossings_(static_cast<std::size_t>(world_size), 0),
          collectives_(static_cast<std::size_t>(world_size), 0) {
        for (auto& s : slots_) s.resize(static_cast<std::size_t>(world_size));
    }

    int world_size() const noexcept { return barrier_.parties(); }
    void set_timeout(std::chrono::milliseconds t) { barrier_.set_timeout(t); }
    std::chrono::milliseconds timeout() const noexcept { return barrier_.timeout(); }

    //! Publishes `tag` and `buffer` for `rank`, waits for every rank and checks that all tags
    //! agree. Returns the crossing's parity, to pass to `buffer()`. `extra` lengthens the wait
    //! (a rank known to be in a slower collective of its own, e.g. the process-level one).
    int arrive(int rank, const CollectiveTag& tag, void* buffer, std::chrono::milliseconds extra = std::chrono::milliseconds(0)) {
        LOCKSTEP_CHECK_AS(UsageError, rank >= 0 && rank < world_size(), "rank ", rank, " is not a member of a group of ",
                          world_size());
        const int parity = static_cast<int>(crossings_[static_cast<std::size_t>(rank)]++ & 1u);
        auto& slots = slots_[static_cast<std::size_t>(parity)];
        slots[static_cast<std::size_t>(rank)] = Slot{tag, buffer};
        barrier_.arrive_and_wait(rank, extra);
        for (std::size_t r = 1; r < slots.size(); ++r) {
            if (slots[r].tag != slots[0].tag) [[unlikely]] {
                throw CollectiveMismatch("replicas reached different collectives: rank 0 reached " + slots[0].tag.str() +
                                         " but rank " + std::to_string(r) + " reached " + slots[r].tag.str() +
                                         "; every replica must run the same layers in the same order on tensors "
                                         "of the same size");
            }
        }
        return parity;
    }

    //! The buffer rank `r` published at the crossing of `parity`.
    void* buffer(int parity, int r) const noexcept {
        return slots_[static_cast<std::size_t>(parity)][static_cast<std::size_t>(r)].buffer;
    }

    //! Counts one user-visible collective for `rank` (tests assert how many a layer makes).
    void count_collective(int rank) noexcept { ++collectives_[static_cast<std::size_t>(rank)]; }
    std::uint64_t collectives(int rank) const noexcept { return collectives_[static_cast<std::size_t>(rank)]; }

    void abort(const std::string& reason, int failed_rank) noexcept override { barrier_.abort(reason, failed_rank); }

    void reset() override {
        barrier_.reset();
        std::fill(crossings_.begin(), crossings_.end(), 0);
    }

private:
    struct Slot {
        CollectiveTag tag{};
        void* buffer = nullptr;
    };

    AbortableBarrier barrier_;
    std::array<std::vector<Slot>, 2> slots_;
    std::vector<std::uint64_t> crossings_;    // each touched only by its own rank
    std::vector<std::uint64_t> collectives_;  // each touched only by its own rank
};

}  // namespace lockstep::comm
