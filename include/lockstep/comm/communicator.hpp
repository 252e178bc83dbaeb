// SPDX-License-Identifier: MIT
//! The `CommunicatorLike` concept: what a replica's view of its group must offer.
#pragma once

#include <concepts>
#include <span>

namespace lockstep::comm {

//! A replica's handle on its group. Collectives are in place, reached by every rank in the
//! same order, and leave every rank with bit-identical results.
template <class C>
concept CommunicatorLike = requires(C& c, const C& cc, std::span<float> f, std::span<double> d) {
    { cc.rank() } -> std::convertible_to<int>;
    { cc.size() } -> std::convertible_to<int>;
    c.all_reduce_sum(f);
    c.all_reduce_sum(d);
    c.broadcast(f, 0);
    c.broadcast(d, 0);
    c.barrier();
};

}  // namespace lockstep::comm
