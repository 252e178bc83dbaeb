// SPDX-License-Identifier: MIT
//! Splitting a global batch (and its targets) into contiguous shards, and putting outputs back
//! together, through the backend operations.
#pragma once

#include <concepts>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "lockstep/core/error.hpp"
#include "lockstep/core/tensor.hpp"
#include "lockstep/kernels/ops.hpp"

namespace lockstep::parallel {

//! Rows [begin, begin + count) of the global batch that one replica takes.
struct ShardRange {
    std::int64_t begin = 0;
    std::int64_t count = 0;
};

//! Contiguous shards of a batch of `batch` rows over `replicas`, as even as possible (sizes differ
//! by at most one; the first `batch % replicas` shards hold the extra row).
inline std::vector<ShardRange> shard_ranges(std::int64_t batch, int replicas) {
    LOCKSTEP_CHECK(replicas > 0, "cannot shard over ", replicas, " replicas");
    LOCKSTEP_CHECK(batch >= replicas, "batch of ", batch, " cannot be split over ", replicas,
                   " replicas; use a batch of at least ", replicas, " or fewer replicas");
    std::vector<ShardRange> shards(static_cast<std::size_t>(replicas));
    const std::int64_t base = batch / replicas, extra = batch % replicas;
    std::int64_t at = 0;
    for (int r = 0; r < replicas; ++r) {
        const std::int64_t n = base + (r < extra ? 1 : 0);
        shards[static_cast<std::size_t>(r)] = {at, n};
        at += n;
    }
    return shards;
}

//! dst = rows [begin, begin + count) of `x`, into a tensor of that many rows (rows are contiguous
//! in NCHW and NHWC alike).
template <class T, BackendTag B>
void copy_rows(const Execution<B>& ex, Tensor<T, B>& dst, const Tensor<T, B>& x, ShardRange range) {
    const std::int64_t row = x.shape().row_numel();
    kernels::Ops<B>::copy(ex, dst, 0, x, range.begin * row, range.count * row);
}

//! A copy of rows [begin, begin + count) of `x` on `device`.
template <class T, BackendTag B>
Tensor<T, B> take_rows(const Execution<B>& ex, const Tensor<T, B>& x, ShardRange range, Device device) {
    Tensor<T, B> shard(x.shape().with(0, range.count), x.format(), device, uninitialized);
    copy_rows(ex, shard, x, range);
    return shard;
}

//! Concatenation of `parts` along dimension 0, in order, on `device` (the gather of outputs),
//! made by `ex`'s stream. `producers[i]` is the execution that made `parts[i]`: the copies wait
//! for its work, and its later work (the part's free, in its allocation stream's order: Note
//! [current stream] in core/cuda_runtime.cuh) waits for the copies. No host wait.
template <class T, BackendTag B>
Tensor<T, B> gather_rows(const Execution<B>& ex, const std::vector<Tensor<T, B>>& parts,
                         const std::vector<Execution<B>>& producers, Device device) {
    LOCKSTEP_CHECK(!parts.empty(), "nothing to concatenate");
    LOCKSTEP_CHECK(producers.size() == parts.size(), "gather_rows: ", parts.size(), " parts but ", producers.size(),
                   " producers");
    std::int64_t rows = 0;
    for (const auto& p : parts) {
        LOCKSTEP_CHECK_AS(ShapeError, p.rank() == parts[0].rank() && p.shape().row_numel() == parts[0].shape().row_numel(),
                          "replica outputs disagree in shape: ", p.shape(), " vs ", parts[0].shape());
        rows += p.dim(0);
    }
    for (const auto& producer : producers) kernels::Ops<B>::order_after(ex, producer);
    Tensor<T, B> out(parts[0].shape().with(0, rows), parts[0].format(), device, uninitialized);
    std::int64_t at = 0;
    for (const auto& p : parts) {
        kernels::Ops<B>::copy(ex, out, at, p, 0, p.numel());
        at += p.numel();
    }
    for (const auto& producer : producers) kernels::Ops<B>::order_after(producer, ex);
    return out;
}

// ---- targets: class labels (host values) or a tensor of per-sample rows ----

//! Class labels are host values whatever the backend: a replica's share is a subspan.
inline std::int64_t target_rows(std::span<const std::int64_t> labels) { return static_cast<std::int64_t>(labels.size()); }
template <class T, BackendTag B>
std::int64_t target_rows(const Tensor<T, B>& t) {
    return t.rank() >= 1 ? t.dim(0) : 0;
}

template <BackendTag B>
std::span<const std::int64_t> shard_targets(const Execution<B>&, std::span<const std::int64_t> labels, ShardRange range, Device) {
    return labels.subspan(static_cast<std::size_t>(range.begin), static_cast<std::size_t>(range.count));
}
template <class T, BackendTag B>
Tensor<T, B> shard_targets(const Execution<B>& ex, const Tensor<T, B>& t, ShardRange range, Device device) {
    return take_rows(ex, t, range, device);
}

//! Targets a train_step can split over its replicas (class labels as a span, or a tensor).
template <class View, class B>
concept ShardableTargets = BackendTag<B> && requires(const Execution<B>& ex, const View& t, ShardRange r, Device d) {
    parallel::shard_targets(ex, t, r, d);
    { parallel::target_rows(t) } -> std::convertible_to<std::int64_t>;
};

//! The type of one replica's share of `View` targets (void when they cannot be split).
template <class View, class B>
struct shard_of {
    using type = void;
};
template <class View, class B>
requires ShardableTargets<View, B>
struct shard_of<View, B> {
    using type = decltype(parallel::shard_targets(std::declval<const Execution<B>&>(), std::declval<const View&>(), ShardRange{},
                                                  Device{}));
};

//! How a train_step sees the targets it was given: labels in any contiguous container as a span,
//! a tensor as itself.
template <class Targets>
decltype(auto) targets_view(const Targets& targets) {
    if constexpr (std::convertible_to<const Targets&, std::span<const std::int64_t>>)
        return std::span<const std::int64_t>(targets);
    else
        return (targets);
}

}  // namespace lockstep::parallel
