// SPDX-License-Identifier: MIT
//! `ProcessGroup` (the processes one DataParallel spans, each running some of its replicas) and
//! `ProcessSpan`, the level of a replica group that spans processes, the same for every group.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "lockstep/comm/collective_tag.hpp"
#include "lockstep/comm/collectives.hpp"
#include "lockstep/core/device_span.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/runtime/abortable_barrier.hpp"

namespace lockstep::comm {

//! The processes a DataParallel spans (`DataParallelOptions::process_group`; the MPI one is
//! `comm::MpiProcessGroup` in `<lockstep/mpi.hpp>`). Its collectives are on host buffers and made
//! by one thread of each process at a time, per channel; channels never mix their messages.
class ProcessGroup {
public:
    //! Channels: the layer collectives, the gradient buckets, and the step's own exchanges (the
    //! batch's row counts, the step's totals, a checkpoint's status), made by the calling thread.
    enum Channel : int { layer = 0, gradients = 1, control = 2 };

    virtual ~ProcessGroup() = default;
    //! This process's rank among the group's processes, and their number.
    virtual int rank() const = 0;
    virtual int size() const = 0;
    virtual Collectives& channel(Channel c) = 0;
    //! Checks on `c` that every process reached the collective `tag` (whose data moves on
    //! another path, e.g. NCCL): every process throws the same `CollectiveMismatch` when they did
    //! not, `CollectiveAborted` when one failed. Made by one thread of each process, as channels are.
    virtual void agree(Channel c, const CollectiveTag& tag) = 0;
    //! From any thread: throws `CollectiveAborted` naming the process once another process has
    //! failed (`abort`); returns otherwise. A replica's host waits on its GPU consult it.
    virtual void check_peers() = 0;
    //! From any thread: whether a failure reached this process from another (an abort message
    //! received, a process that never answered). A process passing such a failure on does not
    //! name one of its own replicas as the failing one.
    virtual bool peer_failed() const noexcept = 0;
    //! How long a collective of this group may wait for another process: the local replicas that
    //! wait for their leader's process-level collective wait that much longer, so the process
    //! that is late is the one named, not the leader.
    virtual std::chrono::milliseconds timeout() const noexcept = 0;
    //! Tells every other process that this one failed, from any thread.
    virtual void abort(const std::string& reason) noexcept = 0;
};

//! Makes every rank's `text` rank `root`'s (its first 1024 bytes) over `link`, at `site`: one
//! broadcast of a fixed size, so the other ranks need not know the length.
inline void broadcast_text(Collectives& link, int root, std::string& text, CollectiveSite site) {
    std::vector<std::int64_t> words(1 + 1024, 0);  // length, then the bytes
    if (link.rank() == root) {
        words[0] = static_cast<std::int64_t>(std::min<std::size_t>(text.size(), 1024));
        for (std::size_t i = 0; i < static_cast<std::size_t>(words[0]); ++i) words[1 + i] = static_cast<unsigned char>(text[i]);
    }
    link.broadcast(DeviceSpan<std::int64_t>::host(words), root, site);
    text.clear();
    for (std::int64_t i = 0; i < words[0]; ++i) text += static_cast<char>(words[static_cast<std::size_t>(1 + i)]);
}

//! After each process's own checks, which need no collective (options, devices, files): every
//! process learns whether any failed. Returns "" when none did, else the same text on every
//! process, "process q of P: <q's error>" for the first failed process q (", and k more" when
//! others failed too), for every process to throw, so that none waits in a collective for one
//! that left. `failure`: this process's error, or null. On `channel`, at the sites
//! Exchange::setup_failures and Exchange::setup_failure_message.
inline std::string agreed_failure(ProcessGroup& procs, ProcessGroup::Channel channel, const std::exception_ptr& failure) {
    std::string text;
    if (failure) {
        try {
            std::rethrow_exception(failure);
        } catch (const Error& e) {
            text = e.message();
        } catch (const std::exception& e) {
            text = e.what();
        } catch (...) {
            text = "an exception that is not a std::exception";
        }
        if (text.empty()) text = "an error without a message";
    }
    Collectives& link = procs.channel(channel);
    std::vector<double> failed(static_cast<std::size_t>(procs.size()), 0.0);
    failed[static_cast<std::size_t>(procs.rank())] = failure ? 1.0 : 0.0;
    link.all_reduce_sum(DeviceSpan<double>::host(failed), CollectiveSite::control(Exchange::setup_failures));
    const auto first = std::find(failed.begin(), failed.end(), 1.0);
    if (first == failed.end()) return {};
    const int who = static_cast<int>(first - failed.begin());
    const auto more = std::count(failed.begin(), failed.end(), 1.0) - 1;
    std::string quoted = text;
    broadcast_text(link, who, quoted, CollectiveSite::control(Exchange::setup_failure_message));
    return "process " + std::to_string(who) + " of " + std::to_string(procs.size()) +
           (more > 0 ? " (and " + std::to_string(more) + " more)" : std::string()) + ": " + quoted;
}

//! Runs `check()`, this process's own checks, so that every process of `procs` throws alike when
//! any of them fails: the same UsageError, "<context>: <comm::agreed_failure's text>", on `channel`.
template <class Check>
void check_alike(ProcessGroup& procs, ProcessGroup::Channel channel, std::string_view context, Check&& check) {
    std::exception_ptr failure;
    try {
        check();
    } catch (...) {
        failure = std::current_exception();
    }
    const std::string agreed = agreed_failure(procs, channel, failure);
    if (!agreed.empty()) throw UsageError(std::string(context) + ": " + agreed);
}

//! Tells the other processes of `procs` that this one failed: the failing replica's global rank
//! when the failure started on `failed_rank` (a replica of this process, `local_replicas` in
//! all); the reason alone when it came from another process (ProcessGroup::peer_failed), whose
//! own message named its replica already: then `failed_rank` is that process's rank, not a
//! replica here.
inline void tell_processes(ProcessGroup& procs, int local_replicas, const std::string& reason, int failed_rank) noexcept {
    try {
        const int p = procs.rank();
        std::string who = "process " + std::to_string(p);
        if (failed_rank >= 0 && failed_rank < local_replicas && !procs.peer_failed())
            who = "global rank " + std::to_string(p * local_replicas + failed_rank) + " (" + who + ", replica " +
                  std::to_string(failed_rank) + ")";
        procs.abort(who + ": " + reason);
    } catch (...) {
        procs.abort(reason);
    }
}

// Note [replicas across processes]
// A replica group made with a ProcessGroup spans processes: this process's L replicas are global
// ranks p x L .. p x L + L - 1 of P x L. That level is `ProcessSpan`, the same for every group:
// - Made by every process together: first every process learns whether any refused its own part
//   (comm::agreed_failure), then every process's replica count and arrangement are exchanged
//   once, and unless all are alike every process throws the same UsageError. So no process waits
//   in a collective for one that left.
// - A collective's process-level step is made by local rank 0 on the group's channel; the other
//   local replicas wait for it that much longer (`timeout()`), so the process that is late is
//   the one named, not rank 0.
// - A failure is passed on to the other processes (`tell`, naming the failing global rank when
//   it started here).
// What moves the data differs: a host group sums on the channel itself (Note [host groups across
// processes] in comm/host_communicator.hpp); a stream group checks the tag on the channel and
// moves the data with NCCL (Note [stream groups across processes] below).

// Note [stream groups across processes]
// A stream group (comm/stream_group.hpp) made with a ProcessGroup spans processes through its
// ProcessSpan (Note [replicas across processes] above): every process runs L replicas laid out alike (the
// span's arrangement: one per GPU or all on one), or all throw the same UsageError, as they do
// when one refuses its own layout (a mix). Then no GPU may serve two processes (NCCL refuses a
// GPU twice in a communicator; Api::device_key identifies GPUs across processes, whatever each
// one's numbering, e.g. under CUDA_VISIBLE_DEVICES): every process sees every GPU's identity.
// - Setup: process 0 makes the NCCL unique id and broadcasts it over the process group (MPI);
//   every process then creates its communicators in one group call (ncclCommInitRankConfig).
// - Layouts. `peer` (one replica per GPU): every replica holds a communicator of all P x L ranks,
//   its rank the global one. `local` (all L replicas on one GPU) and `single`: local rank 0 alone
//   holds a communicator, of the P processes. A collective sums the process's buffers in local
//   rank order with the device-local kernel (local mode), all-reduces rank 0's buffer over the
//   processes with NCCL, and copies the result to the other local buffers, all on rank 0's
//   stream; the others wait for its event as in one process. A broadcast from global rank g
//   goes from local rank g % L of process g / L to its rank 0, over the processes, then to
//   every local buffer.
// - Rendezvous before enqueue, across processes too: after the local rendezvous, local rank 0
//   checks the collective's tag with every process (ProcessGroup::agree, a small MPI exchange
//   with deadlines, which also receives abort messages), and a second local rendezvous lets the
//   replicas enqueue. So no replica enters NCCL unless every replica of every process reached
//   the same collective; a mismatch throws CollectiveMismatch everywhere instead of hanging.
//   While rank 0 is in agree (bounded by the process group's timeout), the others wait for it
//   at the second crossing that much longer than the group's timeout: a late process is named
//   by agree's Timeout, not rank 0 by the local barrier's.
// - Failures: abort() also tells the other processes (ProcessGroup::abort), naming the failing
//   global rank when the failure started here (comm::tell_processes; a failure passed on from
//   another process is sent on without naming a replica here); their next agree, or their
//   replicas' waits on the GPU (DeviceWatch::poll consults ProcessGroup::check_peers), throw
//   CollectiveAborted naming it, and their own abort() aborts
//   their communicators, so a kernel waiting for a peer that is gone is ended too. A dead process
//   is caught by the deadlines (agree's, the event waits'). The group is not rebuilt: after a
//   failed step every later collective throws, as a multi-process DataParallel ends there.

//! This process's part of a replica group (Note [replicas across processes]): its replicas'
//! global ranks and, when the group spans processes, the process-level channel.
class ProcessSpan {
public:
    //! What a process says of its replicas when a group is made: how many, and how they are
    //! arranged (the group's own code, e.g. one replica per GPU).
    struct Layout {
        int replicas = 0;
        int arrangement = 0;
        friend bool operator==(const Layout&, const Layout&) = default;
    };
    //! What every process says, after the replica counts when they differ, when the layouts
    //! differ, given every process's layout.
    using Refusal = std::function<std::string(std::span<const Layout>)>;

    //! This process alone, with `replicas` replicas.
    explicit ProcessSpan(int replicas) : local_(replicas), global_(replicas) {}

    //! Made by every process of `procs` together (by this process alone when `procs` is null):
    //! `local()` checks this process's part and returns its layout (throwing when it refuses it);
    //! every process throws alike when any refuses, or when their layouts differ (`refusal`).
    template <class Local>
    static ProcessSpan join(std::shared_ptr<ProcessGroup> procs, ProcessGroup::Channel channel, Local&& local,
                            const Refusal& refusal) {
        if (procs == nullptr) return ProcessSpan(local().replicas);
        Layout mine;
        check_alike(*procs, channel, "a replica group across processes", [&] { mine = local(); });
        const auto P = static_cast<std::size_t>(procs->size()), p = static_cast<std::size_t>(procs->rank());
        std::vector<double> all(2 * P, 0.0);  // by process: replicas, then arrangements
        all[p] = mine.replicas;
        all[P + p] = mine.arrangement;
        procs->channel(channel).all_reduce_sum(DeviceSpan<double>::host(all), CollectiveSite::control(Exchange::group_layout));
        std::vector<Layout> layouts(P);
        for (std::size_t q = 0; q < P; ++q) layouts[q] = {static_cast<int>(all[q]), static_cast<int>(all[P + q])};
        if (std::any_of(layouts.begin(), layouts.end(), [&](const Layout& l) { return l != layouts[0]; })) {
            std::string text = "a replica group across " + std::to_string(P) + " processes: ";
            if (std::any_of(layouts.begin(), layouts.end(), [&](const Layout& l) { return l.replicas != layouts[0].replicas; })) {
                text += "they run different replica counts (";
                for (std::size_t q = 0; q < P; ++q) text += std::to_string(layouts[q].replicas) + ", ";
                text += "by process); ";
            }
            throw UsageError(text + refusal(layouts));
        }
        ProcessSpan span(mine.replicas);
        span.first_ = procs->rank() * mine.replicas;
        span.global_ = procs->size() * mine.replicas;
        span.procs_ = std::move(procs);
        span.channel_ = channel;
        return span;
    }

    //! Whether the group spans more than this process.
    bool spans() const noexcept { return procs_ != nullptr; }
    //! This process's replicas, the global rank of the first, and the replicas of every process.
    int local() const noexcept { return local_; }
    int first_rank() const noexcept { return first_; }
    int global() const noexcept { return global_; }
    //! The processes (null: this process alone) and the group's channel among them.
    ProcessGroup* processes() const noexcept { return procs_.get(); }
    Collectives& link() const { return procs_->channel(channel_); }
    //! Checks with every process that they reached `tag` (ProcessGroup::agree), on local rank 0.
    void agree(const CollectiveTag& tag) const { procs_->agree(channel_, tag); }
    //! How much longer the local replicas wait for local rank 0's process-level step.
    std::chrono::milliseconds timeout() const noexcept { return procs_->timeout(); }
    //! Throws once another process has failed (ProcessGroup::check_peers); nothing alone.
    void check_peers() const {
        if (procs_) procs_->check_peers();
    }
    //! Tells the other processes that this one failed (comm::tell_processes); nothing alone.
    void tell(const std::string& reason, int failed_rank) const noexcept {
        if (procs_) tell_processes(*procs_, local_, reason, failed_rank);
    }

private:
    std::shared_ptr<ProcessGroup> procs_;
    ProcessGroup::Channel channel_ = ProcessGroup::layer;
    int local_ = 0;
    int first_ = 0;
    int global_ = 0;
};

}  // namespace lockstep::comm
