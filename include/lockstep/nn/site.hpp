// SPDX-License-Identifier: MIT
//! Layer ids: each layer that communicates draws one at construction; copies keep it.
#pragma once

#include <atomic>
#include <cstdint>

namespace lockstep::nn::detail {

//! A process-unique id for a layer's collectives (`comm::CollectiveSite::layer(id, part)`).
//! Replicas are copies of one prototype, so the same layer has the same id on every replica and
//! the tag check can tell layers apart.
inline std::uint64_t next_layer_id() noexcept {
    static std::atomic<std::uint64_t> counter{1};
    return counter.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace lockstep::nn::detail
