// SPDX-License-Identifier: MIT
//! `CollectiveTag`: what a replica says it is about to do at a rendezvous, so mismatches are caught.
#pragma once

#include <cstdint>
#include <string>
#include <type_traits>

namespace lockstep::comm {

enum class CollectiveKind : std::uint8_t { all_reduce_sum, broadcast, barrier, phase };
enum class DType : std::uint8_t { none, f32, f64, i64 };

template <class T>
constexpr DType dtype_of() {
    if constexpr (std::is_same_v<T, float>) return DType::f32;
    else if constexpr (std::is_same_v<T, double>) return DType::f64;
    else if constexpr (std::is_same_v<T, std::int64_t>) return DType::i64;
    else return DType::none;
}

//! Element types the collectives reduce.
template <class T>
concept Reducible = dtype_of<T>() != DType::none;

//! Identifies one collective call: the call site (a layer's id, a bucket's index), the kind,
//! the element type and count. Every replica must present the same tag at the same point.
struct CollectiveTag {
    std::uint64_t site = 0;
    CollectiveKind kind = CollectiveKind::barrier;
    DType dtype = DType::none;
    std::uint64_t count = 0;
    std::int32_t root = -1;  // broadcast root; for a phase, which inner barrier of the collective

    friend bool operator==(const CollectiveTag&, const CollectiveTag&) = default;

    std::string str() const {
        static constexpr const char* kinds[] = {"all_reduce_sum", "broadcast", "barrier", "phase"};
        static constexpr const char* types[] = {"", "<float>", "<double>", "<int64>"};
        std::string s = kinds[static_cast<int>(kind)];
        s += types[static_cast<int>(dtype)];
        if (kind != CollectiveKind::barrier) s += "[" + std::to_string(count) + "]";
        if (kind == CollectiveKind::phase) s += " step " + std::to_string(root);  // a collective's inner barrier
        else if (root >= 0) s += " from root " + std::to_string(root);
        return s + " at site " + std::to_string(site);
    }
};

}  // namespace lockstep::comm
