// SPDX-License-Identifier: MIT
//! Layer ids: each layer that communicates draws one at construction; copies keep it; a
//! DataParallel renumbers its replicas' layers by their place in the module (Note [layer ids]).
#pragma once

#include <atomic>
#include <cstdint>

#include "lockstep/comm/collective_tag.hpp"

namespace lockstep::nn::detail {

// Note [layer ids]
// A layer's collectives carry its id (`comm::CollectiveSite::layer(id, part)`), so the tag check
// tells layers apart. Replicas are copies of one prototype, so within a process the same layer
// has the same id on every replica. Across processes the ids are compared too (ProcessGroup::agree,
// or a host group's channel), and an id drawn at construction depends on what else the process
// built before (an evaluation model on process 0 alone, a layer built on one process only): the
// same layer would carry different ids and every process would throw a CollectiveMismatch. So a
// DataParallel gives each replica's layers ids by their place in the module tree instead
// (nn::number_layers: depth first, in the order `visit` lists the modules), the same on every
// process that runs the same model, from `placed_layer_ids` up, above every id drawn here.
// A layer of one's own that makes collectives takes part by drawing an id at construction and
// offering `void set_layer_id(std::uint64_t)`, as SyncBatchNorm does; it must be listed with
// `v.module` to be reached. Two DataParallels of one model then give their layers the same ids:
// the tag check tells their layers' collectives apart only by order, as it does their buckets'.

//! A process-unique id for a layer's collectives, drawn at construction.
inline std::uint64_t next_layer_id() noexcept {
    static std::atomic<std::uint64_t> counter{1};
    return counter.fetch_add(1, std::memory_order_relaxed);
}

//! The first id nn::number_layers gives (Note [layer ids]); messages name such a layer by its place.
inline constexpr std::uint64_t placed_layer_ids = comm::CollectiveSite::placed_layers;

}  // namespace lockstep::nn::detail
