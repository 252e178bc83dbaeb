// SPDX-License-Identifier: MIT
//! Splitting a global batch into contiguous shards, and putting outputs back together.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "lockstep/core/error.hpp"
#include "lockstep/core/tensor.hpp"

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

//! Copy of rows [begin, begin + count) of `x` (rows are contiguous in NCHW and NHWC alike).
template <class T>
Tensor<T, Host> take_rows(const Tensor<T, Host>& x, ShardRange range) {
    Tensor<T, Host> shard(x.shape().with(0, range.count), x.format(), x.device(), uninitialized);
    const std::int64_t row = x.shape().row_numel();
    if (range.count > 0) std::memcpy(shard.data(), x.data() + range.begin * row, static_cast<std::size_t>(range.count * row) * sizeof(T));
    return shard;
}

//! Concatenation of `parts` along dimension 0, in order (the gather of per-replica outputs).
template <class T>
Tensor<T, Host> concat_rows(const std::vector<Tensor<T, Host>>& parts) {
    LOCKSTEP_CHECK(!parts.empty(), "nothing to concatenate");
    std::int64_t rows = 0;
    for (const auto& p : parts) {
        LOCKSTEP_CHECK_AS(ShapeError, p.rank() == parts[0].rank() && p.shape().row_numel() == parts[0].shape().row_numel(),
                          "replica outputs disagree in shape: ", p.shape(), " vs ", parts[0].shape());
        rows += p.dim(0);
    }
    Tensor<T, Host> out(parts[0].shape().with(0, rows), parts[0].format(), parts[0].device(), uninitialized);
    std::int64_t at = 0;
    for (const auto& p : parts) {
        if (p.numel() > 0) std::memcpy(out.data() + at, p.data(), p.bytes());
        at += p.numel();
    }
    return out;
}

}  // namespace lockstep::parallel
