// SPDX-License-Identifier: MIT
//! What a DataParallel's replica threads touch (`Core`): the options, devices, replica groups,
//! the replicas and their backend resources, owned by the object and by every job it gives its
//! replicas (Note [jobs own their state] in parallel/call_state.hpp).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "lockstep/comm/collectives.hpp"
#include "lockstep/comm/group.hpp"
#include "lockstep/comm/process_group.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/kernels/ops.hpp"
#include "lockstep/nn/bucket_layout.hpp"
#include "lockstep/parallel/options.hpp"
#include "lockstep/parallel/process_coordination.hpp"
#include "lockstep/parallel/replica.hpp"
#include "lockstep/runtime/abortable_barrier.hpp"

namespace lockstep::parallel::detail {

//! A DataParallel's shared state. A thread the pool gave up on keeps it alive, and destroys it
//! when it comes back after the object is gone.
template <class Module, class Group>
struct Core {
    using backend = typename Module::backend;
    using K = kernels::Ops<backend>;

    DataParallelOptions options;
    std::vector<Device> devices;
    int world = 0;  // this process's replicas
    // Destroyed in reverse: the replicas, then the groups (a CUDA group finalizes its
    // communicators and destroys its streams), then the replicas' resources (their streams).
    std::vector<std::unique_ptr<typename K::ReplicaResources>> resources;  // made on the replica threads
    std::unique_ptr<Group> layer_group;   // layer collectives (SyncBatchNorm), on the replica threads
    std::unique_ptr<Group> grad_group;    // gradient buckets and commit barriers (Note [gradient buckets])
    comm::ProcessGroup* procs = nullptr;  // options.process_group: null for this process alone
    int first_rank = 0;                   // global rank of this process's replica 0
    int global_world = 0;                 // replicas over all processes
    nn::BucketLayout layout;              // every replica's buckets, handed to the optimizer
    // Bumped by every call that failed, and by load and resync: replicas drop the graphs of an
    // older epoch before their next step (Note [captured steps] in parallel/step.hpp).
    std::atomic<std::uint64_t> graph_epoch{0};
    // Each replica's vote on running a step as graph (a), read after a barrier; across processes,
    // the decision of all processes, which replica 0 writes (Note [captured steps]).
    std::unique_ptr<std::atomic<int>[]> graph_votes;
    std::atomic<int> graph_decision{0};
    std::vector<std::unique_ptr<Replica<Module>>> replicas;  // destroyed first: they use the groups and resources

    comm::Collectives& layer(int r) { return layer_group->communicator(r); }
    comm::Collectives& grad(int r) { return grad_group->communicator(r); }
    std::shared_ptr<Abortable> abortable(int which) const {
        return which == 0 ? layer_group->abortable() : grad_group->abortable();
    }
    void bind(int r, Execution<backend>& ex) {
        layer_group->bind(r, ex);
        grad_group->bind(r, ex);
    }
    Replica<Module>& replica(int r) { return *replicas[static_cast<std::size_t>(r)]; }

    //! Checks the options and devices (every process alike when they span processes) and makes
    //! the two replica groups.
    static std::shared_ptr<Core> make(const DataParallelOptions& options, const std::vector<Device>& devices) {
        auto core = std::make_shared<Core>();
        core->procs = options.process_group.get();
        const auto check = [&] {
            core->options = check_options(options);
            core->devices = check_devices(devices, core->options.graphs);
            if constexpr (K::bf16_products)
                if (options.precision == Precision::bf16)
                    for (const auto& d : core->devices) K::check_bf16(d, "DataParallelOptions::precision");
        };
        // Every process refuses alike (comm::agreed_failure): none waits for one that left.
        if (core->procs) {
            comm::check_alike(*core->procs, comm::ProcessGroup::control, "DataParallel across processes", check);
            check_same_modes(*core->procs, options);
        } else {
            check();
        }
        core->world = static_cast<int>(core->devices.size());
        core->graph_votes = std::make_unique<std::atomic<int>[]>(core->devices.size());
        core->resources.resize(core->devices.size());
        core->layer_group =
            std::make_unique<Group>(core->devices, options.timeout, options.process_group, comm::ProcessGroup::layer);
        core->grad_group =
            std::make_unique<Group>(core->devices, options.timeout, options.process_group, comm::ProcessGroup::gradients);
        core->first_rank = core->layer(0).rank();
        core->global_world = core->layer(0).size();
        return core;
    }

private:
    static DataParallelOptions check_options(const DataParallelOptions& o) {
        LOCKSTEP_CHECK(o.bucket_bytes > 0, "DataParallelOptions::bucket_bytes must be positive");
        LOCKSTEP_CHECK(!o.clip_grad_norm || *o.clip_grad_norm > 0, "DataParallelOptions::clip_grad_norm must be positive, got ",
                       o.clip_grad_norm.value_or(0), "; leave it unset to not clip");
        LOCKSTEP_CHECK(to_string(o.math) != "unknown", "DataParallelOptions::math is not a lockstep::Math (",
                       static_cast<int>(o.math), "); use Math::pytorch_default, Math::strict_fp32 or Math::tf32");
        LOCKSTEP_CHECK(to_string(o.precision) != "unknown", "DataParallelOptions::precision is not a lockstep::Precision (",
                       static_cast<int>(o.precision), "); use Precision::fp32 or Precision::bf16");
        LOCKSTEP_CHECK_AS(UsageError, o.precision == Precision::fp32 || K::bf16_products,
                          "DataParallelOptions::precision = bf16: the ", backend::name,
                          " backend has no bf16 products (Note [precision]); use Precision::fp32 on it, or the CUDA backend");
        LOCKSTEP_CHECK(to_string(o.gradient_precision) != "unknown",
                       "DataParallelOptions::gradient_precision is not a lockstep::Precision (",
                       static_cast<int>(o.gradient_precision), "); use Precision::fp32 or Precision::bf16");
        LOCKSTEP_CHECK_AS(UsageError, o.gradient_precision == Precision::fp32 || K::bf16_products,
                          "DataParallelOptions::gradient_precision = bf16: the ", backend::name,
                          " backend has no bf16 all-reduce; use Precision::fp32 on it, or the CUDA backend");
        LOCKSTEP_CHECK_AS(UsageError, !o.graphs || K::graphs, "DataParallelOptions::graphs: the ", backend::name,
                          " backend runs every step eagerly (graphs are CUDA's); leave graphs off on it");
        LOCKSTEP_CHECK_AS(UsageError, o.graph_capacity > 0,
                          "DataParallelOptions::graph_capacity must be at least 1 (leave graphs off to capture nothing)");
        return o;
    }

    // Every process learns every process's math mode, precisions and whether it captures its
    // steps; all throw alike unless they are one (replicas in different modes would round
    // differently: Note [math modes], Note [precision]; buckets all-reduced in different types
    // would not meet; a process voting on a captured step would meet another's eager collective:
    // Note [captured steps]).
    static void check_same_modes(comm::ProcessGroup& procs, const DataParallelOptions& o) {
        const auto P = static_cast<std::size_t>(procs.size());
        std::vector<double> modes(P, 0.0);
        modes[static_cast<std::size_t>(procs.rank())] = static_cast<double>(o.math) + 16.0 * static_cast<double>(o.precision) +
                                                        256.0 * static_cast<double>(o.gradient_precision) +
                                                        4096.0 * (o.graphs ? 1.0 : 0.0);
        procs.channel(comm::ProcessGroup::control)
            .all_reduce_sum(DeviceSpan<double>::host(modes), comm::CollectiveSite::control(comm::Exchange::math_modes));
        const auto math = [](double m) { return static_cast<int>(m) % 4096; };
        if (std::any_of(modes.begin(), modes.end(), [&](double m) { return math(m) != math(modes[0]); })) {
            std::string each;
            for (const double m : modes) {
                const int code = math(m);
                each += std::string(to_string(static_cast<Math>(code % 16))) + "/" +
                        std::string(to_string(static_cast<Precision>(code / 16 % 16))) + "/" +
                        std::string(to_string(static_cast<Precision>(code / 256))) + ", ";
            }
            throw UsageError("DataParallel across " + std::to_string(P) + " processes: they run different math modes (" + each +
                             "by process, math/precision/gradient_precision); give every process the same "
                             "DataParallelOptions::math, ::precision and ::gradient_precision");
        }
        if (std::all_of(modes.begin(), modes.end(), [&](double m) { return m == modes[0]; })) return;
        std::string each;
        for (const double m : modes) each += m >= 4096.0 ? "on, " : "off, ";
        throw UsageError("DataParallel across " + std::to_string(P) + " processes: they differ in DataParallelOptions::graphs (" +
                         each + "by process); turn graphs on in every process or in none");
    }

    static std::vector<Device> check_devices(const std::vector<Device>& devices, bool graphs) {
        LOCKSTEP_CHECK(!devices.empty(),
                       "DataParallel needs at least one device, got none; pass e.g. "
                       "lockstep::DataParallel(model, 2) for two host replicas");
        for (const auto& d : devices)
            LOCKSTEP_CHECK_AS(DeviceMismatch, d.kind == device_kind_of<backend>(), "DataParallel of a ", backend::name,
                              " module cannot use device ", d);
        // Replays meet in NCCL with no host rendezvous: replicas sharing a GPU sum on the host's
        // word (Note [stream-ordered collectives]), which a graph cannot hold.
        if (graphs)
            for (std::size_t i = 0; i < devices.size(); ++i)
                for (std::size_t j = 0; j < i; ++j)
                    LOCKSTEP_CHECK_AS(UsageError, !(devices[i] == devices[j]), "DataParallelOptions::graphs: replicas ", j,
                                      " and ", i, " share ", devices[i],
                                      "; captured steps need one replica per GPU (or leave graphs off)");
        return devices;
    }
};

}  // namespace lockstep::parallel::detail
