// SPDX-License-Identifier: MIT
//! What a DataParallel that spans processes agrees on outside its replicas' collectives: how a
//! global batch is split over the processes, and a step's totals. Each is one exchange on the
//! process group's control channel.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "lockstep/comm/collective_tag.hpp"
#include "lockstep/comm/process_group.hpp"
#include "lockstep/core/device_span.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/parallel/scatter.hpp"

namespace lockstep::parallel {

//! Where a call's rows lie: the global batch, and this process's replicas' shards as ranges of
//! this process's own rows.
struct BatchSplit {
    std::int64_t batch = 0;
    std::vector<ShardRange> shards;
};

//! The split of `rows` rows in this process, whose `replicas` replicas are global ranks
//! `first_rank`.. of `global` (`procs` null: this process alone). Across processes: one exchange
//! of every process's row count, so every process checks every process's count and all throw the
//! same ShapeError when one passed rows that are not its global ranks' shards.
inline BatchSplit split_batch(comm::ProcessGroup* procs, std::int64_t rows, int replicas, int first_rank, int global,
                              const char* what) {
    if (procs == nullptr) return {rows, shard_ranges(rows, replicas)};
    const int P = procs->size();
    std::vector<double> counts(static_cast<std::size_t>(P), 0.0);
    counts[static_cast<std::size_t>(procs->rank())] = static_cast<double>(rows);
    procs->channel(comm::ProcessGroup::control)
        .all_reduce_sum(DeviceSpan<double>::host(counts), comm::CollectiveSite::control(comm::Exchange::batch_rows));
    BatchSplit split;
    for (const double c : counts) split.batch += static_cast<std::int64_t>(c);
    const auto all = shard_ranges(split.batch, global);
    for (int q = 0; q < P; ++q) {
        std::int64_t want = 0;
        for (int l = 0; l < replicas; ++l) want += all[static_cast<std::size_t>(q * replicas + l)].count;
        const auto passed = static_cast<std::int64_t>(counts[static_cast<std::size_t>(q)]);
        LOCKSTEP_CHECK_AS(ShapeError, passed == want, "DataParallel::", what, ": process ", q, " passed ", passed,
                          " rows, but its ", replicas, " replicas' shards of the global batch of ", split.batch, " hold ", want,
                          "; pass each process the rows of its global ranks (contiguous, in global-rank order: "
                          "parallel::shard_ranges(batch, replicas x processes))");
    }
    const std::int64_t offset = all[static_cast<std::size_t>(first_rank)].begin;
    split.shards.assign(all.begin() + first_rank, all.begin() + first_rank + replicas);
    for (auto& s : split.shards) s.begin -= offset;
    return split;
}

//! A step's loss sum and correct count over every process, summed in process order (the
//! process's own sums alone without `procs`).
inline void sum_step_totals(comm::ProcessGroup* procs, double& loss_sum, double& correct) {
    if (procs == nullptr) return;
    std::vector<double> totals{loss_sum, correct};
    procs->channel(comm::ProcessGroup::control)
        .all_reduce_sum(DeviceSpan<double>::host(totals), comm::CollectiveSite::control(comm::Exchange::step_totals));
    loss_sum = totals[0];
    correct = totals[1];
}

}  // namespace lockstep::parallel
