// SPDX-License-Identifier: MIT
//! The SyncBatchNorm passes of the CUDA backend over any runner (the device, or the host emulator):
//! the vector width and grid of each pass (Note [batch-norm kernels]) and the operations that
//! launch the kernels of bn_kernels.cuh and bn_channel_kernels.cuh.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <type_traits>

#include "lockstep/core/error.hpp"
#include "lockstep/kernels/device/bn_channel_kernels.cuh"
#include "lockstep/kernels/device/bn_kernels.cuh"
#include "lockstep/kernels/device/grid.cuh"

namespace lockstep::kernels::device::bn_kernels {

// ---- launch configurations -------------------------------------------------------------------

//! The elements a pass's thread loads as one vector, only where every pointer is aligned to it;
//! else 1. Channels-last: `channels_last_width` channels where C is a multiple of it (Note
//! [channels-last vectors]). Channels-first (Note [channels-first windows]): the widest vector of 16
//! or 8 bytes of which every plane is a whole number (14 x 14 planes of bf16 take 8-byte vectors);
//! else windows of the widest vector of at least 4 bytes of which a plane holds at least
//! `min_windows` (7 x 7 planes take 16-byte windows); else 4-byte vectors where planes are whole
//! numbers of them.
inline constexpr std::int64_t min_windows = 4;

template <class T>
inline int vector_width(const BnGeometry& g, std::initializer_list<const void*> pointers, int channels_last_width = nhwc_vec) {
    const auto aligned = [&](int V) {
        for (const void* q : pointers)
            if (q != nullptr && reinterpret_cast<std::uintptr_t>(q) % (sizeof(T) * static_cast<std::size_t>(V)) != 0)
                return false;
        return true;
    };
    if (g.channels_last) return g.channels % channels_last_width == 0 && aligned(channels_last_width) ? channels_last_width : 1;
    constexpr int bytes = static_cast<int>(sizeof(T));
    for (int V = vec16<T>; V > 1 && V * bytes >= 8; V /= 2)  // whole vectors of 16 or 8 bytes
        if (g.inner % V == 0 && aligned(V)) return V;
    for (int V = vec16<T>; V > 1 && V * bytes >= 4; V /= 2)  // windows
        if (g.inner >= min_windows * V && aligned(V)) return V;
    if (bytes == 2 && g.inner % 2 == 0 && aligned(2)) return 2;  // whole vectors of 4 bytes (small even planes)
    return 1;
}

//! Channels-first: the windows of V elements every (n, c) plane of P elements gets (Note
//! [channels-first windows]).
inline std::int64_t windows_per_plane(std::int64_t P, int V) { return P % V == 0 ? P / V : (P + 2 * V - 2) / V; }

//! Calls `f(std::integral_constant<int, V>{})` for a channels-first width V that vector_width
//! gives (a kernel template instantiated for each).
template <class T, class F>
void with_channels_first_width(int V, F&& f) {
    constexpr int W = vec16<T>;
    if (V == W) return f(std::integral_constant<int, W>{});
    if constexpr (W / 2 > 1) {
        if (V == W / 2) return f(std::integral_constant<int, W / 2>{});
    }
    if constexpr (W / 4 > 1) {
        if (V == W / 4) return f(std::integral_constant<int, W / 4>{});
    }
    f(std::integral_constant<int, 1>{});
}

//! The grid and item split of a pass over `g` with V-element items (Note [batch-norm kernels]).
inline Span plan(const BnGeometry& g, int V, const DeviceInfo& info, Grid& grid, bool reverse = false) {
    constexpr std::int64_t int_limit = std::numeric_limits<int>::max();
    Span s;
    s.N = g.batch;
    s.C = g.channels;
    s.P = g.inner;
    s.reverse = reverse;
    if (g.channels_last) s.lanes = channels_last_lanes(g.channels, V);
    const std::int64_t per_group = g.channels_last ? std::int64_t{s.lanes} * V : 1;  // channels (Note [channels-last lanes])
    const std::int64_t groups = (g.channels + per_group - 1) / per_group;
    LOCKSTEP_CHECK_AS(ShapeError, groups <= scratch_counters, "SyncBatchNorm on CUDA handles at most ",
                      static_cast<std::int64_t>(scratch_counters) * per_group, " channels in ",
                      g.channels_last ? "channels-last" : "channels-first", " layout, got ", g.channels);
    const std::int64_t per_plane = g.channels_last ? 1 : windows_per_plane(g.inner, V);
    const std::int64_t items = g.channels_last ? g.rows() : g.batch * per_plane;
    LOCKSTEP_CHECK_AS(ShapeError, items < int_limit, "SyncBatchNorm on CUDA handles fewer than 2^31 ",
                      g.channels_last ? "rows" : "vectors per channel", ", got ", items);
    s.items = static_cast<unsigned int>(items);
    if (!g.channels_last) s.per_plane = Divider(static_cast<unsigned int>(per_plane));
    grid.threads = threads;
    grid.y = static_cast<int>(groups);
    if (items == 0 || groups == 0) {
        grid.x = 0;
        return s;
    }
    const std::int64_t row_threads = g.channels_last ? threads / s.lanes : threads;
    const std::int64_t by_work = std::max<std::int64_t>(1, items / (row_threads * 4));  // >= 4 items a thread
    const std::int64_t by_occupancy =
        std::max<std::int64_t>(1, (std::int64_t{blocks_per_sm} * info.multiprocessors + groups - 1) / groups);
    // Partials: one Sums2 per channel-first group and chunk; per channels-last group and chunk, V
    // per thread column (Note [channels-last lanes]).
    const std::int64_t per_slot = g.channels_last ? std::int64_t{tile} * V : 1;
    const std::int64_t slots = static_cast<std::int64_t>(scratch_partial_bytes / sizeof(Sums2)) / per_slot;
    LOCKSTEP_CHECK_AS(ShapeError, groups <= slots, "SyncBatchNorm on CUDA over ", g.channels, " channels in ",
                      g.channels_last ? "channels-last" : "channels-first",
                      " layout needs more partials than the replica's scratch of ", scratch_partial_bytes,
                      " bytes holds (at most ", slots * per_group, " channels); split the channels over several layers");
    const std::int64_t by_scratch = std::max<std::int64_t>(1, slots / groups);
    const std::int64_t chunks = std::min({by_work, by_occupancy, by_scratch});
    s.chunk_items = static_cast<unsigned int>((items + chunks - 1) / chunks);
    grid.x = static_cast<int>((items + s.chunk_items - 1) / s.chunk_items);
    return s;
}

// ---- the operations, for any runner (the device, or the host emulator) -----------------------

// A runner launches kernels: `run.template map<K>(params, grid)`, `run.template reduce<K>(params,
// grid)`, `run.zero(pointer, bytes)`, and `run.info()` (the device's DeviceInfo), `run.scratch()`.
// The CUDA operations use the device runner (cuda_bn_ops.cuh), the emulation tests the host one,
// so both go through the same choice of kernel, vector width and grid.

//! Forward payload [S | Q | M | n] (3C + 1) of the local batch: sums about the local shift k per
//! channel, which goes to `shift_out` (Note [shifted statistics]).
template <class Run, class T>
void local_stats(Run& run, const T* x, const BnGeometry& g, double* payload, float* shift_out) {
    const int V = vector_width<T>(g, {x});
    Grid grid;
    StatsParams<T> p;
    p.span = plan(g, V, run.info(), grid);
    p.x = x;
    p.payload = payload;
    p.shift_out = shift_out;
    const Scratch s = run.scratch();
    p.partials = s.template partials_as<Sums2>(static_cast<std::int64_t>(grid.x) * grid.y * (g.channels_last ? tile * V : 1));
    p.counters = s.counters;
    if (grid.x == 0) {  // an empty shard: nothing counted, and its local shifts are 0
        run.zero(payload, static_cast<std::size_t>(bn::ForwardPayload{g.channels}.size()) * sizeof(double));
        run.zero(shift_out, static_cast<std::size_t>(g.channels) * sizeof(float));
        return;
    }
    if (g.channels_last && V > 1)
        run.template reduce<StatsChannelsLast<T, nhwc_vec>>(p, grid);
    else if (g.channels_last)
        run.template reduce<StatsChannelsLast<T, 1>>(p, grid);
    else
        with_channels_first_width<T>(V, [&](auto w) { run.template reduce<StatsChannelsFirst<T, decltype(w)::value>>(p, grid); });
}

//! The finish `forward_normalize` folds into its prologue: a training forward's.
struct FinishRequest {
    const double* payload = nullptr;
    float* running_mean = nullptr;  // null: not updated
    float* running_var = nullptr;
    std::int64_t* num_batches_tracked = nullptr;
    double eps = 1e-5;
    bool cumulative = false;  // momentum: 1 / num_batches_tracked after this batch
    double momentum = 0.1;
};

//! y = the normalized x (with `relu`: max(0, y); no mask is kept: Note [ReLU mask from x]). With
//! `finish`, the statistics come from the all-reduced payload, and stats/folded and the running
//! statistics are written once per channel; without, they are read from `folded`.
template <class Run, class T>
void forward_normalize(Run& run, const T* x, T* y, const BnGeometry& g, const FinishRequest* finish, const float* weight,
                       const float* bias, double* stats, float* folded, bool relu) {
    const int V = vector_width<T>(g, {x, y});
    Grid grid;
    NormalizeParams<T> p;
    const bool fits_l2 = 2 * static_cast<std::int64_t>(g.batch * g.channels * g.inner * sizeof(T)) <= run.info().l2_bytes;
    p.span = plan(g, V, run.info(), grid, /*reverse=*/fits_l2);
    p.x = x;
    p.y = y;
    p.relu = relu;
    p.weight = weight;
    p.bias = bias;
    p.stats = stats;
    p.folded = folded;
    if (finish != nullptr) {
        p.finish = true;
        p.f.payload = finish->payload;
        p.f.running_mean = finish->running_mean;
        p.f.running_var = finish->running_var;
        p.f.num_batches_tracked = finish->num_batches_tracked;
        p.f.count_batch = finish->running_mean != nullptr && !finish->cumulative;
        p.f.cumulative = finish->cumulative;
        p.f.eps = finish->eps;
        p.f.momentum = finish->momentum;
    }
    if (grid.x == 0 && finish != nullptr) grid.x = 1;  // an empty shard still finishes (its blocks loop over nothing)
    if (g.channels_last && V > 1)
        run.template map<NormalizeChannelsLast<T, nhwc_vec>>(p, grid);
    else if (g.channels_last)
        run.template map<NormalizeChannelsLast<T, 1>>(p, grid);
    else
        with_channels_first_width<T>(V,
                                     [&](auto w) { run.template map<NormalizeChannelsFirst<T, decltype(w)::value>>(p, grid); });
    if (finish != nullptr && finish->running_mean != nullptr && finish->cumulative) {
        ChannelParams c;
        c.num_batches_tracked = finish->num_batches_tracked;
        run.template map<CountBatch>(c, Grid{1, 1, CountBatch::threads});
    }
}

//! Backward payload [sum dy | sum dy (x - mean)] (2C) of the local batch; with `relu` dy counts
//! only where the fused ReLU's output was positive (Note [ReLU mask from x]).
template <class Run, class T>
void backward_sums(Run& run, const T* x, const T* dy, bool relu, const BnGeometry& g, const float* folded, double* payload) {
    const int V = vector_width<T>(g, {x, dy}, nhwc_sums_vec<T>);
    Grid grid;
    BackwardSumsParams<T> p;
    p.span = plan(g, V, run.info(), grid);
    p.x = x;
    p.dy = dy;
    p.relu = relu;
    p.folded = folded;
    p.payload = payload;
    const Scratch s = run.scratch();
    p.partials = s.template partials_as<Sums2>(static_cast<std::int64_t>(grid.x) * grid.y * (g.channels_last ? tile * V : 1));
    p.counters = s.counters;
    if (grid.x == 0) {
        run.zero(payload, static_cast<std::size_t>(2 * g.channels) * sizeof(double));
        return;
    }
    if (g.channels_last && V > 1)
        run.template reduce<BackwardSumsChannelsLast<T, nhwc_sums_vec<T>>>(p, grid);
    else if (g.channels_last)
        run.template reduce<BackwardSumsChannelsLast<T, 1>>(p, grid);
    else
        with_channels_first_width<T>(
            V, [&](auto w) { run.template reduce<BackwardSumsChannelsFirst<T, decltype(w)::value>>(p, grid); });
}

//! dx from the all-reduced backward payload and the forward's global count; `dx` may be `x`;
//! with `relu` dy counts only where the fused ReLU's output was positive.
template <class Run, class T>
void backward_dx(Run& run, const T* x, const T* dy, bool relu, T* dx, const BnGeometry& g, const double* payload,
                 const double* stats, const float* folded, const float* weight) {
    const int V = vector_width<T>(g, {x, dy, dx});
    Grid grid;
    DxParams<T> p;
    const bool fits_l2 = 3 * static_cast<std::int64_t>(g.batch * g.channels * g.inner * sizeof(T)) <= run.info().l2_bytes;
    p.span = plan(g, V, run.info(), grid, /*reverse=*/fits_l2);
    p.x = x;
    p.dy = dy;
    p.relu = relu;
    p.dx = dx;
    p.payload = payload;
    p.stats = stats;
    p.folded = folded;
    p.weight = weight;
    if (g.channels_last && V > 1)
        run.template map<DxChannelsLast<T, nhwc_vec>>(p, grid);
    else if (g.channels_last)
        run.template map<DxChannelsLast<T, 1>>(p, grid);
    else
        with_channels_first_width<T>(V, [&](auto w) { run.template map<DxChannelsFirst<T, decltype(w)::value>>(p, grid); });
}

//! The host emulator as a runner (the emulation tests'), with the device facts it pretends to have.
struct EmulatedRun {
    DeviceInfo device;
    HostScratch* host_scratch = nullptr;
    DeviceInfo info() const { return device; }
    Scratch scratch() const { return host_scratch->view(); }
    template <class K>
    void map(const typename K::Params& p, const Grid& g) {
        emulate_map<K>(p, g);
    }
    template <class K>
    void reduce(const typename K::Params& p, const Grid& g) {
        emulate_reduce<K>(p, g);
    }
    void zero(void* p, std::size_t bytes) { std::memset(p, 0, bytes); }
};

}  // namespace lockstep::kernels::device::bn_kernels
