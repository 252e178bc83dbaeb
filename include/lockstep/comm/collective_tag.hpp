// SPDX-License-Identifier: MIT
//! `CollectiveSite` (which call a collective is) and `CollectiveTag` (what a replica says it is
//! about to do at a rendezvous), so replicas that reach different collectives are caught.
#pragma once

#include <cstdint>
#include <string>
#include <type_traits>

namespace lockstep::comm {

enum class CollectiveKind : std::uint8_t { all_reduce_sum, broadcast, barrier, phase };
enum class DType : std::uint8_t { none, f32, f64, i64, f16, bf16 };  // f16, bf16: CUDA's __half, __nv_bfloat16

template <class T>
constexpr DType dtype_of() {
    if constexpr (std::is_same_v<T, float>)
        return DType::f32;
    else if constexpr (std::is_same_v<T, double>)
        return DType::f64;
    else if constexpr (std::is_same_v<T, std::int64_t>)
        return DType::i64;
    else
        return DType::none;
}

//! Element types the collectives move.
template <class T>
concept Reducible = dtype_of<T>()
!= DType::none;

//! The exchanges between processes outside the replicas' collectives (`CollectiveSite::control`).
enum class Exchange : std::uint32_t {
    batch_rows,             // DataParallel: each process's rows of a global batch
    step_totals,            // DataParallel: a step's loss and correct counts
    checkpoint_status,      // DataParallel: whether process 0 wrote or read a checkpoint
    group_layout,           // a replica group: each process's replicas and their arrangement
    device_keys,            // a stream group: the GPUs each process's communicators use
    nccl_unique_id,         // a stream group: process 0's NCCL unique id
    setup_failures,         // which processes failed to set up
    setup_failure_message,  // the first failing process's message
    math_modes,             // DataParallel: each process's math mode
    graph_votes,            // DataParallel with graphs: each process's vote on a step's graph (a)
};

//! What `Exchange` `e` exchanges, for messages.
constexpr const char* to_string(Exchange e) {
    switch (e) {
        case Exchange::batch_rows: return "a batch's rows";
        case Exchange::step_totals: return "a step's totals";
        case Exchange::checkpoint_status: return "a checkpoint's status";
        case Exchange::group_layout: return "a replica group's layout";
        case Exchange::device_keys: return "a replica group's GPUs";
        case Exchange::nccl_unique_id: return "a replica group's NCCL unique id";
        case Exchange::setup_failures: return "setup failures";
        case Exchange::setup_failure_message: return "a setup failure's message";
        case Exchange::math_modes: return "the processes' math modes";
        case Exchange::graph_votes: return "the processes' votes on a captured step";
    }
    return "?";
}

//! Which call a collective is. Every replica reaches the same sites in the same order; a
//! different site at the same point is a `CollectiveMismatch`.
struct CollectiveSite {
    enum class Kind : std::uint8_t { user, layer, bucket, broadcast, commit, control };
    Kind kind = Kind::user;
    std::uint64_t id = 0;    // the user's number, a layer's id, a bucket's or a tensor's index
    std::uint32_t part = 0;  // which collective of a layer (0, 2: forward, 1: backward), which commit barrier

    //! A collective of the user's own (e.g. a direct all-reduce between `ReplicaPool` jobs).
    static constexpr CollectiveSite user(std::uint64_t id = 0) { return {Kind::user, id, 0}; }
    //! The first layer id DataParallel gives by a layer's place in the module (Note [layer ids] in
    //! nn/site.hpp); ids below it were drawn at construction.
    static constexpr std::uint64_t placed_layers = std::uint64_t{1} << 40;

    //! Collective `part` of the layer whose id is `layer_id` (Note [layer ids] in nn/site.hpp).
    static constexpr CollectiveSite layer(std::uint64_t layer_id, std::uint32_t part) { return {Kind::layer, layer_id, part}; }
    //! The all-reduce of gradient bucket `index`.
    static constexpr CollectiveSite bucket(std::uint64_t index) { return {Kind::bucket, index, 0}; }
    //! The broadcast of the `index`-th tensor of a module (initial values, a resync).
    static constexpr CollectiveSite broadcast(std::uint64_t index) { return {Kind::broadcast, index, 0}; }
    //! The barriers of a training step around the optimizer (0: before it, 1: after it).
    static constexpr CollectiveSite commit(std::uint32_t which = 0) { return {Kind::commit, 0, which}; }
    //! An exchange between processes outside the replicas' collectives.
    static constexpr CollectiveSite control(Exchange which) { return {Kind::control, 0, static_cast<std::uint32_t>(which)}; }

    friend constexpr bool operator==(const CollectiveSite&, const CollectiveSite&) = default;

    std::string str() const {
        std::string n = std::to_string(id);
        switch (kind) {
            case Kind::layer:
                if (id >= placed_layers)
                    n = "#" + std::to_string(id - placed_layers + 1) + " of the model's communicating layers";
                return part == 0   ? "layer " + n + " (forward)"
                       : part == 1 ? "layer " + n + " (backward)"
                       : part == 2 ? "layer " + n + " (forward, second)"
                                   : "layer " + n + " (collective " + std::to_string(part) + ")";
            case Kind::bucket: return "gradient bucket " + n;
            case Kind::broadcast: return "broadcast of tensor " + n;
            case Kind::commit:
                return part == 0   ? "the commit barrier"
                       : part == 1 ? "the barrier after the optimizer step"
                       : part == 2 ? "the replicas' agreement on a captured step"
                       : part == 3 ? "the end of the replicas' captures of a step"
                                   : "the replicas' reading of the processes' agreement on a captured step";
            case Kind::control:
                return std::string("the exchange of ") + to_string(static_cast<Exchange>(part)) + " between processes";
            default: return "user site " + n;
        }
    }
};

//! Identifies one collective call: the site, the kind, the element type and count. Every
//! replica must present the same tag at the same point.
struct CollectiveTag {
    CollectiveSite site{};
    CollectiveKind kind = CollectiveKind::barrier;
    DType dtype = DType::none;
    std::uint64_t count = 0;
    std::int32_t root = -1;  // broadcast root; for a phase, which inner barrier of the collective

    friend bool operator==(const CollectiveTag&, const CollectiveTag&) = default;

    std::string str() const {
        static constexpr const char* kinds[] = {"all_reduce_sum", "broadcast", "barrier", "phase"};
        static constexpr const char* types[] = {"", "<float>", "<double>", "<int64>", "<half>", "<bfloat16>"};
        std::string s = kinds[static_cast<int>(kind)];
        s += types[static_cast<int>(dtype)];
        if (kind != CollectiveKind::barrier) {
            s += '[';
            s += std::to_string(count);
            s += ']';
        }
        if (kind == CollectiveKind::phase)
            s += " step ";  // a collective's inner barrier
        else if (root >= 0)
            s += " from root ";
        if (kind == CollectiveKind::phase || root >= 0) s += std::to_string(root);
        s += " at ";
        s += site.str();
        return s;
    }
};

//! The tag of inner barrier `step` of the collective tagged `tag` (a collective that crosses its
//! group's barrier more than once checks each crossing).
inline CollectiveTag phase(CollectiveTag tag, std::uint64_t step) {
    tag.kind = CollectiveKind::phase;
    tag.root = static_cast<std::int32_t>(step);
    return tag;
}

}  // namespace lockstep::comm
