// SPDX-License-Identifier: MIT
//! The collective kernel of the CUDA backend: the device-local all-reduce of replicas that share
//! one GPU (Note [rank-order sum]), a map kernel launched as the layer kernels are (Note [layer
//! kernels]).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "lockstep/core/error.hpp"
#include "lockstep/kernels/device/grid.cuh"
#include "lockstep/kernels/device/launch_config.cuh"

namespace lockstep::kernels::device::comm_kernels {

// Note [rank-order sum]
// Replicas that share one GPU all-reduce through one kernel (comm/stream_group.hpp, the `local`
// mode): element i of every rank's buffer becomes b0[i] + b1[i] + ... + b{n-1}[i], summed in rank
// order as the host group sums (Note [deterministic host all-reduce]), so the result has the same
// bits on both backends and in every buffer. Each thread reads all ranks' element before writing
// any, so the buffers are read and written in place. 16-bit floats (__half, __nv_bfloat16) are
// summed in fp32 in the same order and rounded once.

//! The most ranks one device-local all-reduce takes (their pointers travel in the parameters).
inline constexpr int rank_max = 16;

template <class T>
struct RankSumParams {
    T* buf[rank_max];
    int ranks = 0;
    long long n = 0;
};

//! buf[r][i] = sum over ranks in rank order of buf[r][i], for every r (Note [rank-order sum]).
template <class T>
struct RankSum {
    using Params = RankSumParams<T>;
    static constexpr int threads = layer_kernels::threads, min_blocks = layer_kernels::min_blocks;
    LOCKSTEP_HD static void run(const Params& p, const Where& w) {
        for (long long i = layer_kernels::first_index(w); i < p.n; i += layer_kernels::grid_threads(w)) {
            if constexpr (sizeof(T) == 2) {  // __half, __nv_bfloat16: summed in fp32, rounded once
                float acc = to_float(p.buf[0][i]);
                for (int r = 1; r < p.ranks; ++r) acc = acc + to_float(p.buf[r][i]);
                const T out = from_float<T>(acc);
                for (int r = 0; r < p.ranks; ++r) store(p.buf[r] + i, out);
            } else {
                T acc = p.buf[0][i];
                for (int r = 1; r < p.ranks; ++r) acc = acc + p.buf[r][i];
                for (int r = 0; r < p.ranks; ++r) store(p.buf[r] + i, acc);
            }
        }
    }
};

//! The device-local all-reduce of `ranks` buffers of `n` elements each, in one launch.
template <class T, class Run>
void rank_sum(Run& run, std::span<T* const> bufs, std::int64_t n) {
    LOCKSTEP_CHECK_AS(UsageError, !bufs.empty() && bufs.size() <= static_cast<std::size_t>(rank_max),
                      "a device-local all-reduce takes 1 to ", rank_max, " replicas on one GPU, got ", bufs.size(),
                      "; put fewer replicas on each GPU");
    if (n <= 0) return;
    RankSumParams<T> p;
    p.ranks = static_cast<int>(bufs.size());
    p.n = n;
    for (std::size_t r = 0; r < bufs.size(); ++r) p.buf[r] = bufs[r];
    run.template map<RankSum<T>>(p, layer_kernels::map_grid(n, run.info()));
}

}  // namespace lockstep::kernels::device::comm_kernels
