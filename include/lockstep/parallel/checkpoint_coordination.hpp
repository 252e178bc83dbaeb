// SPDX-License-Identifier: MIT
//! How a DataParallel writes and reads checkpoints: once for all processes when it spans them
//! (process 0 writes, every process learns the outcome), and everything checked against the model
//! before any replica changes.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <set>
#include <string>
#include <vector>

#include "lockstep/comm/collective_tag.hpp"
#include "lockstep/comm/process_group.hpp"
#include "lockstep/core/device_span.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/nn/bucket_layout.hpp"
#include "lockstep/nn/checkpoint.hpp"
#include "lockstep/parallel/call_state.hpp"

namespace lockstep::parallel {

//! Runs `write` on process 0 of `procs` only, then tells every process its outcome: every
//! process returns, or all throw the same IoError (`procs` null: `write` here).
template <class Write>
nn::Checkpoint::SaveReport save_once(comm::ProcessGroup* procs, Write&& write) {
    if (procs == nullptr) return write();
    nn::Checkpoint::SaveReport report;
    std::string failure;
    if (procs->rank() == 0) {
        try {
            report = write();
        } catch (const std::exception& e) {
            failure = e.what();
            if (failure.empty()) failure = "the checkpoint could not be written";
        }
    }
    comm::broadcast_text(procs->channel(comm::ProcessGroup::control), 0, failure,
                         comm::CollectiveSite::control(comm::Exchange::checkpoint_status));
    if (!failure.empty()) throw IoError(procs->rank() == 0 ? failure : "process 0 failed to write the checkpoint: " + failure);
    return report;
}

//! Checks every tensor of `ck` against `module` (a replica) and, with an optimizer, every
//! "optimizer." state against `optimizer`'s states of replica 0: a checkpoint of another model
//! throws IoError naming the checkpoint, the tensor and both shapes, before anything changes.
template <class Module, class Optimizer>
void check_loadable(const nn::Checkpoint& ck, Module& module, Optimizer* optimizer, int replicas,
                    const nn::BucketLayout& layout) {
    nn::check_module_fits(ck, module, {}, nn::Unmatched::refused, "optimizer.");
    if constexpr (detail::has_optimizer<Optimizer>) {
        optimizer->prepare(replicas, layout);
        std::set<std::string> states;
        optimizer->visit_state(0, module, [&](const std::string& name, const auto&, const auto& p) {
            const std::string key = "optimizer." + name;
            states.insert(key);
            if (ck.contains(key)) ck.check_fits(key, p.value);
        });
        if constexpr (nn::detail::has_counters<Optimizer, Module>)
            optimizer->visit_counters(0, module, [&](const std::string& name, const std::int64_t&) {
                const std::string key = "optimizer." + name;
                states.insert(key);
                if (ck.contains(key)) {
                    ck.check_fits(key, Tensor<float, Host>(Shape{}));
                    (void)nn::get_counter(ck, key);  // a whole number, or IoError before anything changes
                }
            });
        for (const auto& name : ck.names())
            if (name.rfind("optimizer.", 0) == 0 && states.count(name) == 0)
                throw IoError(ck.label() + " has optimizer state '" + name + "' that this model's optimizer does not have");
    }
}

}  // namespace lockstep::parallel
