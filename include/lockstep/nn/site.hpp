// SPDX-License-Identifier: MIT
//! Call-site ids: each layer that communicates draws one at construction; copies keep it.
#pragma once

#include <atomic>
#include <cstdint>

namespace lockstep::nn::detail {

//! A process-unique id for a layer's collectives. Replicas are copies of one prototype, so the
//! same layer has the same id on every replica and the tag check can tell layers apart.
inline std::uint64_t next_site() noexcept {
    static std::atomic<std::uint64_t> counter{1};
    return counter.fetch_add(1, std::memory_order_relaxed) << 8;  // low bits: collectives of one layer
}

}  // namespace lockstep::nn::detail
