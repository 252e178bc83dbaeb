// SPDX-License-Identifier: MIT
//! `StreamGroup<Api>` and `StreamCommunicator<Api>`: a replica group whose collectives are
//! enqueued on the replicas' streams (NCCL across GPUs, one rank-order kernel where replicas share
//! a GPU). Written once over the device calls it makes (`Api`), so host tests drive the same code
//! with a recording double; `comm::CudaGroup` is `StreamGroup` over NCCL and the CUDA runtime.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "lockstep/comm/collective_tag.hpp"
#include "lockstep/comm/collectives.hpp"
#include "lockstep/comm/process_group.hpp"
#include "lockstep/comm/shared_tensor.hpp"
#include "lockstep/core/backend.hpp"
#include "lockstep/core/device_span.hpp"
#include "lockstep/core/device_watch.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/runtime/abortable_barrier.hpp"

namespace lockstep::comm {

// Note [stream-ordered collectives]
// A collective of a stream group is the host rendezvous (SharedTensor: tag check, abort,
// timeout) and then device work enqueued on a stream. Nothing is enqueued before every rank has
// passed the rendezvous, so no rank ever enters NCCL alone, and a mismatch is reported on every
// rank before any NCCL call.
// - all_reduce_sum and broadcast run on the replica's compute stream: the replica's later kernels
//   see the result through stream order, and the host does not wait.
// - start_all_reduce_sum (a gradient bucket) runs on the rank's communication stream behind an
//   event recorded on the compute stream; join() makes the compute stream wait for the
//   communication stream. The replica thread itself makes both calls, at the same program point
//   on every rank, so every rank enqueues the same collectives in the same order (NCCL deadlocks
//   otherwise); no second host thread calls the communicator.
// - Modes, chosen from the devices: `peer`, one rank per GPU: one communicator per rank (NCCL).
//   `local`, every rank on one GPU (NCCL refuses two ranks on a device): ranks other than 0
//   record an event on their stream before the rendezvous; after it, rank 0's stream waits for
//   those events, one kernel sums the buffers in rank order (Note [rank-order sum]) and writes
//   every buffer, rank 0 records an event, and after a second rendezvous every other rank's stream
//   waits for it. `single`: one rank, nothing to enqueue. Mixed layouts (several GPUs, some with
//   more than one replica) are refused when the group is made.
// - Failures: abort() (a replica threw, the pool gave up on one, a wait passed its deadline)
//   aborts the rendezvous and takes every communicator of the group, once, never concurrently
//   with an enqueue, for a helper thread to abort (Note [aborting communicators]). The pool then
//   calls reset(), which marks them for rebuilding and, in local mode, orders every rank's
//   streams after rank 0's (whose reduction may still write its peers' buffers); the next step's
//   first collective builds new communicators, so the failing call does not wait for a rebuild
//   and the next step runs on a fresh group. If that build fails, every later collective throws a
//   `DeviceError` saying why, and the object must be made anew.
// - A replica's host waits on its device (the step's scalars) poll an event against the group's
//   timeout and consult the group meanwhile (`DeviceWatch`): never an unbounded synchronize.
// - Teardown: the helpers' aborts are waited for (bounded); every communicator is finalized and
//   destroyed once every rank's streams are idle, else aborted (Note [blocking communicators]);
//   then the group's streams and events go; the replicas' compute streams go after
//   (DataParallel's Core).
// - Across processes (made with a ProcessGroup): Note [stream groups across processes] in
//   comm/process_group.hpp.
//
// The Api (NcclApi in cuda_group.cuh; doubles in tests/test_stream_group.cpp) provides:
//   using backend, Stream, Event, Comm;
//   int device_count();
//   Stream compute_stream(const Execution<backend>&, int device);   (checks the replica's device)
//   void watch(Execution<backend>&, DeviceWatch*, std::chrono::milliseconds timeout);
//   Stream make_stream(int device);  void destroy_stream(int device, Stream, deadline) noexcept;
//   using StreamToken;  StreamToken stream_token(const Execution<backend>&);   (expires with the replica's stream)
//   bool idle(int device, Stream, const StreamToken&, deadline) noexcept;
//       (its work so far has run, polled until deadline; true for a stream whose token expired)
//   Event make_event(int device);    void destroy_event(int device, Event) noexcept;
//   void record(Event, Stream);  void wait(Stream, Event);
//   using UniqueId;  UniqueId unique_id();   (trivially copyable: ncclUniqueId)
//   std::uint64_t device_key(int device);  (the GPU's identity across processes, below 2^52: its UUID's hash)
//   std::vector<Comm> init(const std::vector<int>& devices, const UniqueId&, int first_rank, int ranks,
//                          deadline, const std::atomic<bool>& stop, bool blocking);
//       (the communicators of ranks first_rank.. of `ranks` on `devices`, in one group call;
//        blocking ones for a group within one process: Note [blocking communicators])
//   void all_reduce(Comm, void*, std::size_t count, DType, Stream, deadline, stop);
//   void broadcast(Comm, void*, std::size_t count, DType, int root, Stream, deadline, stop);
//   void check(Comm);                  (throws on an asynchronous error of the communicator)
//   void abort(Comm) noexcept;  void destroy(Comm) noexcept;
//   void finalize(std::span<const Comm>, deadline) noexcept;  (this process's communicators, in one group call)
//   void rank_sum(int device, Stream, std::span<void* const> buffers, std::size_t count, DType);
//   void copy(int device, Stream, void* dst, const void* src, std::size_t bytes);

//! How a stream group's ranks exchange data (Note [stream-ordered collectives]).
enum class StreamGroupMode { single, peer, local };

inline const char* to_string(StreamGroupMode m) {
    return m == StreamGroupMode::peer ? "peer" : m == StreamGroupMode::local ? "local" : "single";
}

template <class Api>
class StreamGroup;

//! One replica's handle on a `StreamGroup` (see Note [stream-ordered collectives]). Buffers are
//! device memory of the replica's GPU; the calls enqueue and return.
template <class Api>
class StreamCommunicator final : public TypedCollectives<StreamCommunicator<Api>>, public DeviceWatch {
    using Base = TypedCollectives<StreamCommunicator<Api>>;
    using Stream = typename Api::Stream;
    using Event = typename Api::Event;
    using clock = std::chrono::steady_clock;

public:
    //! The global rank (across processes) and the number of ranks of the group.
    int rank() const noexcept override { return st_->span.first_rank() + rank_; }
    int size() const noexcept override { return st_->span.global(); }
    std::uint64_t collective_count() const noexcept override { return st_->rendezvous.collectives(rank_); }
    bool stream_ordered() const noexcept override { return true; }

    using Base::all_reduce_sum;
    using Base::broadcast;
    void start_all_reduce_sum(DeviceSpan<float> data, CollectiveSite site) override {
        run(data, Request::started_all_reduce(), site, DType::f32);
    }
    void start_all_reduce_sum_bf16(DeviceSpan<std::uint16_t> data, CollectiveSite site) override {
        run(data, Request::started_all_reduce(), site, DType::bf16);
    }
    void barrier(CollectiveSite site) override {
        st_->check_usable();
        st_->rendezvous.count_collective(rank_);
        const CollectiveTag tag{site, CollectiveKind::barrier, DType::none, 0, -1};
        st_->rendezvous.arrive(rank_, tag, nullptr);
        if (st_->span.spans()) {
            if (rank_ == 0) st_->span.agree(tag);
            st_->rendezvous.arrive(rank_, phase(tag, 1), nullptr, st_->span.timeout());
        }
    }
    //! Sums 16-bit floats in place over all ranks (on CUDA: `DeviceSpan<__half>` with DType::f16,
    //! `DeviceSpan<__nv_bfloat16>` with DType::bf16; NCCL sums them in their own precision, the
    //! device-local group in fp32, rounding once).
    template <class T>
    void all_reduce_sum(DeviceSpan<T> data, DType dtype, CollectiveSite site) {
        static_assert(sizeof(T) == 2, "the DType overload is for 16-bit floats; float and double have their own");
        LOCKSTEP_CHECK_AS(UsageError, dtype == DType::f16 || dtype == DType::bf16,
                          "a 16-bit all-reduce takes DType::f16 or DType::bf16");
        run(data, Request::all_reduce(), site, dtype);
    }

    void join() override {
        if (!started_) return;
        auto& me = st_->ranks[static_cast<std::size_t>(rank_)];
        st_->api.wait(me.compute, me.done);
        started_ = false;
    }

    // DeviceWatch: consulted by this replica's host waits on its device.
    void poll() override {
        if (st_->aborted.load(std::memory_order_acquire)) [[unlikely]]
            throw CollectiveAborted("the replica group was aborted: " + st_->abort_reason());
        st_->span.check_peers();
        if (!st_->holds_comm(rank_)) return;
        std::shared_lock lock(st_->comms_mutex);
        if (!st_->comms_aborted && !st_->comms.empty()) st_->api.check(st_->comm_of(rank_));
    }
    void timed_out(const std::string& what) noexcept override { st_->abort(what, rank_); }

    //! The group's mode (single, peer or local) in this process.
    StreamGroupMode mode() const noexcept { return st_->mode; }

private:
    friend class StreamGroup<Api>;
    friend class TypedCollectives<StreamCommunicator<Api>>;
    struct State;

    StreamCommunicator(std::shared_ptr<State> st, int rank) : st_(std::move(st)), rank_(rank) {}

    //! What run() enqueues (Note [stream-ordered collectives]).
    struct Request {
        CollectiveKind kind = CollectiveKind::all_reduce_sum;
        int root = -1;         // a broadcast's sending rank; -1 for an all-reduce (the tag's convention)
        bool started = false;  // on the communication stream behind the compute stream, until join()
        static constexpr Request all_reduce() { return {}; }
        static constexpr Request started_all_reduce() { return {CollectiveKind::all_reduce_sum, -1, true}; }
        static constexpr Request broadcast(int root) { return {CollectiveKind::broadcast, root, false}; }
    };

    template <class T>
    void reduce(DeviceSpan<T> data, CollectiveSite site) {
        run(data, Request::all_reduce(), site, dtype_of<T>());
    }
    template <class T>
    void bcast(DeviceSpan<T> data, int root, CollectiveSite site) {
        run(data, Request::broadcast(root), site, dtype_of<T>());
    }

    template <class T>
    void run(DeviceSpan<T> data, Request what, CollectiveSite site, DType dtype) {
        State& st = *st_;
        const auto ur = static_cast<std::size_t>(rank_);
        auto& me = st.ranks[ur];
        LOCKSTEP_CHECK_AS(UsageError, me.bound, "rank ", rank_,
                          " of a stream group made a collective before its replica was "
                          "bound to it (StreamGroup::bind)");
        const bool broadcast = what.kind == CollectiveKind::broadcast;
        const char* name = broadcast ? "broadcast" : "all_reduce_sum";
        Base::check_buffer(data, name, device_kind_of<typename Api::backend>(), st.devices[ur], "this group",
                           "pass the replica's own tensors", rank_);
        if (broadcast) Base::check_root(what.root, st.span.global());
        st.check_usable();
        st.rendezvous.count_collective(rank_);
        Stream s = me.compute;
        if (what.started) {  // behind the replica's work so far, on the communication stream
            st.api.record(me.ready, me.compute);
            st.api.wait(me.comm, me.ready);
            s = me.comm;
            // From here the communication stream may hold this collective's work (an NCCL call
            // accepted before its settle threw, a kernel of rank 0): join() covers it, thrown or not.
            try {
                enqueue(data, what, site, dtype, s);
            } catch (...) {
                try {
                    st.api.record(me.done, s);
                    started_ = true;
                } catch (...) {  // the device failed too: the abort that follows covers its stream
                }
                throw;
            }
            st.api.record(me.done, s);
            started_ = true;
            return;
        }
        enqueue(data, what, site, dtype, s);
    }

    // run()'s collective on stream `s`, from the rendezvous on.
    template <class T>
    void enqueue(DeviceSpan<T> data, Request what, CollectiveSite site, DType dtype, Stream s) {
        State& st = *st_;
        const auto ur = static_cast<std::size_t>(rank_);
        auto& me = st.ranks[ur];
        const int root = what.root;
        const bool local = st.mode == StreamGroupMode::local;
        if (local && rank_ != 0) st.api.record(me.ready_local, s);  // this rank's buffer is final here
        const CollectiveTag tag{site, what.kind, dtype, data.size, root};
        // Communicators aborted by a failed step are rebuilt here, before this rank arrives: no rank
        // can then be inside an enqueue of this collective, holding the communicators.
        if (st.mode == StreamGroupMode::peer) st.rebuild_if_needed();
        const int parity = st.rendezvous.arrive(rank_, tag, data.data);  // Note [stream-ordered collectives]
        // Rank 0 of a local group takes every rank's buffer now: a later crossing rewrites these slots.
        std::vector<void*> bufs;
        if (rank_ == 0 && st.mode != StreamGroupMode::peer)
            for (int r = 0; r < st.size(); ++r) bufs.push_back(st.rendezvous.buffer(parity, r));
        int next_phase = 1;
        if (st.span.spans()) {  // Note [stream groups across processes]
            if (rank_ == 0) st.span.agree(tag);
            // Rank 0 may wait in agree for as long as the process group allows: the others wait
            // that much longer here, so that a late process is named, not rank 0.
            st.rendezvous.arrive(rank_, phase(tag, next_phase++), data.data, st.span.timeout());
        }
        if (st.span.global() > 1 && !data.empty()) {
            if (st.mode == StreamGroupMode::peer) {
                enqueue_nccl(data.data, data.size, root, s, dtype);
            } else {
                if (rank_ == 0) reduce_on_rank0(bufs, data, root, s, dtype);
                if (local) {
                    st.rendezvous.arrive(rank_, phase(tag, next_phase), data.data);
                    if (rank_ != 0) st.api.wait(s, st.local_done);
                }
            }
        }
    }

    // Local and single modes, on local rank 0 after the rendezvous: every local buffer is read and
    // written on rank 0's stream, behind the other ranks' events; across processes rank 0's buffer
    // also goes through NCCL (Note [stream groups across processes]).
    template <class T>
    void reduce_on_rank0(const std::vector<void*>& bufs, DeviceSpan<T> data, int root, Stream s, DType dtype) {
        State& st = *st_;
        const int n = st.size();
        const std::size_t bytes = data.size * sizeof(T);
        for (int r = 1; r < n; ++r) st.api.wait(s, st.ranks[static_cast<std::size_t>(r)].ready_local);
        const int device = st.devices[0];
        const auto copy_out = [&](int except) {  // rank 0's buffer to every other local buffer
            for (int r = 1; r < n; ++r)
                if (r != except) st.api.copy(device, s, bufs[static_cast<std::size_t>(r)], bufs[0], bytes);
        };
        if (root < 0) {
            if (n > 1) st.api.rank_sum(device, s, std::span<void* const>(bufs), data.size, dtype);
            if (st.span.spans()) {
                enqueue_nccl(data.data, data.size, -1, s, dtype);
                copy_out(-1);
            }
        } else if (!st.span.spans()) {
            for (int r = 0; r < n; ++r)
                if (r != root)
                    st.api.copy(device, s, bufs[static_cast<std::size_t>(r)], bufs[static_cast<std::size_t>(root)], bytes);
        } else {
            const int root_process = root / n, root_local = root % n;
            const bool mine = st.span.processes()->rank() == root_process;
            if (mine && root_local != 0) st.api.copy(device, s, bufs[0], bufs[static_cast<std::size_t>(root_local)], bytes);
            enqueue_nccl(data.data, data.size, root_process, s, dtype);
            copy_out(mine ? root_local : -1);
        }
        if (n > 1) st.api.record(st.local_done, s);
    }

    // This rank's communicator: an all-reduce (root < 0) or a broadcast from NCCL rank `root`.
    void enqueue_nccl(void* data, std::size_t count, int root, Stream s, DType dtype) {
        State& st = *st_;
        std::shared_lock lock(st.comms_mutex);  // never concurrently with abort()
        if (st.comms_aborted || st.comms.empty()) throw CollectiveAborted("the replica group was aborted: " + st.abort_reason());
        const auto comm = st.comm_of(rank_);
        const auto deadline = clock::now() + st.rendezvous.timeout();
        if (root < 0)
            st.api.all_reduce(comm, data, count, dtype, s, deadline, st.aborted);
        else
            st.api.broadcast(comm, data, count, dtype, root, s, deadline, st.aborted);
    }

    std::shared_ptr<State> st_;
    int rank_;
    bool started_ = false;  // a started collective not joined yet
};

//! The shared state of a stream group: the rendezvous, the communicators and the group's streams
//! and events; what the replica pool aborts and resets.
template <class Api>
struct StreamCommunicator<Api>::State final : public Abortable {
    using clock = std::chrono::steady_clock;

    struct Rank {
        Stream compute{};     // the replica's compute stream (bound)
        typename Api::StreamToken compute_token{};  // expires when its owner destroys it
        Stream comm{};        // this group's communication stream on the replica's GPU
        Event ready{};        // compute -> comm, before a started collective
        Event done{};         // comm -> compute, at join()
        Event ready_local{};  // local mode: this rank's buffer is final
        bool bound = false;
    };

    State(std::vector<int> devs, StreamGroupMode m, std::chrono::milliseconds timeout, ProcessSpan s)
        : rendezvous(static_cast<int>(devs.size()), timeout),
          devices(std::move(devs)),
          mode(m),
          ranks(devices.size()),
          span(std::move(s)) {}

    ~State() override { teardown(); }

    int size() const noexcept { return static_cast<int>(devices.size()); }

    // Which local ranks hold a communicator: all in peer mode; across processes in the other
    // modes, local rank 0 (Note [stream groups across processes]).
    bool holds_comm(int r) const noexcept { return mode == StreamGroupMode::peer || (span.spans() && r == 0); }
    typename Api::Comm comm_of(int r) const { return comms[mode == StreamGroupMode::peer ? static_cast<std::size_t>(r) : 0]; }

    // Peer mode in one process: a communicator per rank, from a fresh unique id, blocking (Note
    // [blocking communicators]: their init involves no other process).
    std::vector<typename Api::Comm> make_comms(clock::time_point deadline, const std::atomic<bool>& stop) {
        return api.init(devices, api.unique_id(), 0, size(), deadline, stop, true);
    }

    // Note [aborting communicators]
    // ncclCommAbort (NCCL 2.26 and newer) runs in its caller's thread, for a non-blocking
    // communicator too, and returns only once every CUDA graph that captured the communicator is
    // destroyed. The thread that aborts a group is a failing replica's, the caller's (the pool's)
    // or one whose wait timed out; any of them may own such graphs (a replica's captured steps), or
    // be waited for by their owner, so aborting in place can wait forever, holding the group. So
    // abort() takes the communicators out of the group under its mutex (no enqueue can reach them
    // after) and hands them to a helper thread that aborts them: abort() returns at once. The
    // owners of graphs drop them when the failed call ends (DataParallel does, on every replica),
    // and settle() waits for the helpers with a bound: normally the communicators are aborted then.
    // NCCL's abort also waits for the launches in flight of those graphs (CUDA frees an executable
    // destroyed in flight when its launch ends), which a kernel that never ends holds: the helper
    // then outlives the bound. Teardown settles the same way; a helper still blocked past its bound
    // is reported on stderr and left running: it owns what it aborts.
    void abort(const std::string& reason, int failed_rank) noexcept override {
        {
            std::lock_guard lock(reason_mutex);
            if (!aborted.load(std::memory_order_relaxed)) reason_text = reason;
        }
        aborted.store(true, std::memory_order_release);  // an enqueue polling NCCL gives up now
        rendezvous.abort(reason, failed_rank);
        std::vector<typename Api::Comm> taken;
        {
            std::unique_lock lock(comms_mutex);
            if (!comms_aborted && !comms.empty()) {
                taken = std::move(comms);
                comms.clear();
                comms_aborted = true;
            }
        }
        if (!taken.empty()) abort_in_background(std::move(taken));
        span.tell(reason, failed_rank);  // after: this process's kernels are told to end first
    }

    //! Waits until the communicators abort() took are aborted, or `deadline` (Note [aborting
    //! communicators]); false when a helper is still at it then.
    bool settle(clock::time_point deadline) noexcept override {
        for (;;) {
            {
                std::lock_guard lock(aborters_mutex);  // not held while sleeping: an abort may come meanwhile
                std::erase_if(aborters, [](Aborter& a) {
                    if (!a.done->load(std::memory_order_acquire)) return false;
                    a.thread.join();
                    return true;
                });
                if (aborters.empty()) return true;
            }
            if (clock::now() >= deadline) return false;
            std::this_thread::sleep_for(std::chrono::microseconds(200));
        }
    }

    // After a failed call, with every replica out of it (the pool calls this before it rethrows):
    // the communicators are rebuilt at the next collective (`rebuild_if_needed`), not here, so the
    // failing call does not wait for a rebuild. In local mode rank 0 may have enqueued a reduction that writes
    // its peers' buffers before the abort reached them: every rank's streams wait for rank 0's.
    void reset() override {
        rendezvous.reset();
        {
            std::unique_lock lock(comms_mutex);
            if (span.spans()) {  // Note [stream groups across processes]: not rebuilt
                if (unusable.empty()) unusable = "a step failed across processes (" + abort_reason() + ")";
            } else if (comms_aborted) {
                rebuild = true;
            }
        }
        if (mode == StreamGroupMode::local && local_done_made) {
            try {
                const Stream firsts[] = {ranks[0].compute, ranks[0].comm};
                for (const Stream& s0 : firsts) {
                    api.record(local_done, s0);
                    for (auto& k : ranks)
                        if (k.bound) {
                            api.wait(k.compute, local_done);
                            api.wait(k.comm, local_done);
                        }
                }
            } catch (...) {  // a failed device: the next call reports it
            }
        }
        std::lock_guard rl(reason_mutex);
        reason_text.clear();
        aborted.store(false, std::memory_order_release);
    }

    // Peer mode, at a collective after a failed one, before the rendezvous: new communicators
    // for every rank, made once (by whichever rank gets here first; the others wait for it and
    // find them made). They are made outside comms_mutex, which abort() takes: an abort never
    // waits for an init (a blocking one has no deadline).
    void rebuild_if_needed() {
        {
            std::shared_lock lock(comms_mutex);  // the common case: peers may be enqueueing
            if (!rebuild) return;
        }
        (void)settle(clock::now());  // joins the helpers that are done
        std::lock_guard building(rebuild_mutex);
        {
            std::shared_lock lock(comms_mutex);
            if (!rebuild) return;
        }
        std::vector<typename Api::Comm> fresh;
        try {
            fresh = make_comms(clock::now() + rendezvous.timeout(), aborted);
        } catch (const std::exception& e) {
            std::unique_lock lock(comms_mutex);
            unusable = std::string("rebuilding its communicators after a failed step failed: ") + e.what();
            throw DeviceError("this replica group cannot run collectives any more: " + unusable +
                              "; destroy the DataParallel object and make a new one");
        }
        std::unique_lock lock(comms_mutex);
        if (aborted.load(std::memory_order_acquire)) {  // aborted while they were made: they go too
            lock.unlock();
            abort_in_background(std::move(fresh));
            throw CollectiveAborted("the replica group was aborted: " + abort_reason());
        }
        comms = std::move(fresh);
        comms_aborted = false;
        rebuild = false;
    }

    void check_usable() const {
        std::shared_lock lock(comms_mutex);
        if (!unusable.empty()) [[unlikely]]
            throw DeviceError("this replica group cannot run collectives any more: " + unusable +
                              "; destroy the DataParallel object and make a new one");
    }

    std::string abort_reason() const {
        std::lock_guard lock(reason_mutex);
        return reason_text.empty() ? std::string("no reason given") : reason_text;
    }

    // A helper thread aborts `taken` (Note [aborting communicators]); where none can start, this
    // thread does.
    void abort_in_background(std::vector<typename Api::Comm> taken) noexcept {
        auto owned = std::make_shared<std::vector<typename Api::Comm>>(std::move(taken));
        auto done = std::make_shared<std::atomic<bool>>(false);
        try {
            std::lock_guard lock(aborters_mutex);
            aborters.reserve(aborters.size() + 1);
            std::thread t([a = api, owned, done]() mutable {
                for (auto& c : *owned) a.abort(c);
                done->store(true, std::memory_order_release);
            });
            aborters.push_back(Aborter{std::move(t), done});
        } catch (...) {
            if (!done->load()) {
                for (auto& c : *owned) api.abort(c);
                done->store(true, std::memory_order_release);
            }
        }
    }

    // Helpers still aborting past teardown's bound (a graph nobody destroyed, or a kernel that
    // never ends: NCCL's abort also waits for the launches in flight of the graphs that hold the
    // communicator): reported and left running, detached; each owns the communicators it aborts.
    void leave_aborters() noexcept {
        std::lock_guard lock(aborters_mutex);
        std::fprintf(stderr,
                     "lockstep: aborting a replica group's NCCL communicators did not end within %lld ms (a CUDA "
                     "graph that captured them is alive or still running); leaving %zu helper thread(s) to finish it\n",
                     static_cast<long long>(rendezvous.timeout().count()), aborters.size());
        for (auto& a : aborters) a.thread.detach();
        aborters.clear();
    }

    // Whether every bound rank's streams have run their work by `deadline`: a compute stream whose
    // owner destroyed it drained before it went (Note [current stream]).
    bool streams_idle(clock::time_point deadline) noexcept {
        for (std::size_t r = 0; r < ranks.size(); ++r) {
            const auto& k = ranks[r];
            if (k.bound && !(api.idle(devices[r], k.compute, k.compute_token, deadline) &&
                             api.idle(devices[r], k.comm, typename Api::StreamToken{}, deadline)))
                return false;
        }
        return true;
    }

    void teardown() noexcept {
        const auto bound = [this] { return clock::now() + rendezvous.timeout(); };
        if (!settle(bound())) leave_aborters();
        std::unique_lock lock(comms_mutex);
        // Finalize waits for the communicators' work, without a deadline for a blocking one: only
        // once every rank's streams are idle, else the communicators are aborted (with a bound).
        if (!comms_aborted && !comms.empty() && !streams_idle(bound())) {
            auto taken = std::move(comms);
            comms.clear();
            comms_aborted = true;
            lock.unlock();
            abort_in_background(std::move(taken));
            if (!settle(bound())) leave_aborters();
            lock.lock();
        }
        const auto deadline = bound();
        if (!comms_aborted) {
            api.finalize(std::span<const typename Api::Comm>(comms), deadline);
            for (auto& c : comms) api.destroy(c);
        }
        comms.clear();
        for (std::size_t r = 0; r < ranks.size(); ++r) {
            auto& k = ranks[r];
            if (!k.bound) continue;
            api.destroy_stream(devices[r], k.comm, deadline);
            api.destroy_event(devices[r], k.ready);
            api.destroy_event(devices[r], k.done);
            api.destroy_event(devices[r], k.ready_local);
            k.bound = false;
        }
        if (local_done_made) api.destroy_event(devices[0], local_done);
        local_done_made = false;
    }

    Api api;
    SharedTensor rendezvous;
    std::vector<int> devices;  // device of each rank
    StreamGroupMode mode;
    std::vector<Rank> ranks;
    ProcessSpan span;    // this process's part (Note [stream groups across processes])
    Event local_done{};  // local mode: rank 0's reduction is done
    bool local_done_made = false;

    mutable std::shared_mutex comms_mutex;  // enqueues (shared) against abort, reset, teardown
    std::vector<typename Api::Comm> comms;  // peer mode: one per rank; across processes otherwise: rank 0's
    bool comms_aborted = false;
    bool rebuild = false;  // aborted communicators to replace at the next collective
    struct Aborter {  // Note [aborting communicators]
        std::thread thread;
        std::shared_ptr<std::atomic<bool>> done;
    };
    std::mutex aborters_mutex;
    std::vector<Aborter> aborters;
    std::mutex rebuild_mutex;  // the rank that rebuilds the communicators; never taken by abort()
    std::string unusable;  // why collectives cannot run any more (empty: they can)

    std::atomic<bool> aborted{false};
    const std::atomic<bool> aborted_never{false};
    mutable std::mutex reason_mutex;
    std::string reason_text;
};

//! A replica group whose collectives are enqueued on the replicas' streams (Note
//! [stream-ordered collectives]). Built from the replicas' devices and a timeout; each replica
//! binds its execution context (its compute stream) on its own thread before its first collective.
template <class Api>
class StreamGroup {
    using State = typename StreamCommunicator<Api>::State;
    using clock = std::chrono::steady_clock;

public:
    //! The most replicas one GPU holds in a group (the rank-order kernel's table).
    static constexpr std::size_t max_replicas_per_device = 16;

    using backend = typename Api::backend;
    using communicator_type = StreamCommunicator<Api>;

    StreamGroup(const std::vector<Device>& devices, std::chrono::milliseconds timeout = AbortableBarrier::default_timeout)
        : StreamGroup(devices, timeout, nullptr, ProcessGroup::layer) {}

    //! A group spanning the processes of `processes` (Note [stream groups across processes]):
    //! `devices` are this process's replicas, laid out as in every other process. Made by every
    //! process together; `channel` carries its setup and its tag checks. Null `processes`: this
    //! process alone.
    StreamGroup(const std::vector<Device>& devices, std::chrono::milliseconds timeout, std::shared_ptr<ProcessGroup> processes,
                ProcessGroup::Channel channel) {
        StreamGroupMode mode = StreamGroupMode::single;
        auto span = ProcessSpan::join(
            std::move(processes), channel,
            [&] {
                mode = choose_mode(devices);
                return ProcessSpan::Layout{static_cast<int>(devices.size()), mode == StreamGroupMode::peer ? 1 : 0};
            },
            refusal);
        st_ = std::make_shared<State>(device_indices(devices), mode, timeout, std::move(span));
        State& st = *st_;
        if (!st.span.spans()) {
            if (st.mode == StreamGroupMode::peer) st.comms = st.make_comms(clock::now() + timeout, st.aborted_never);
        } else {
            check_gpus_apart();
            connect(timeout);
        }
        comms_.reserve(static_cast<std::size_t>(st.size()));
        for (int r = 0; r < st.size(); ++r) comms_.push_back(communicator_type(st_, r));
    }
    StreamGroup(const StreamGroup&) = delete;
    StreamGroup& operator=(const StreamGroup&) = delete;

    int size() const noexcept { return st_->size(); }
    communicator_type& communicator(int rank) { return comms_.at(static_cast<std::size_t>(rank)); }
    std::shared_ptr<Abortable> abortable() const { return st_; }
    //! The group's mode (single, peer or local) in this process.
    StreamGroupMode mode() const noexcept { return st_->mode; }

    //! Binds rank `rank` to its replica's execution context, on the replica's thread (its device
    //! current): makes the rank's communication stream and events, and lets the replica's host
    //! waits on its device consult the group.
    void bind(int rank, Execution<backend>& ex) {
        auto& k = st_->ranks.at(static_cast<std::size_t>(rank));
        LOCKSTEP_CHECK_AS(UsageError, !k.bound, "rank ", rank, " of a stream group was bound twice");
        const int device = st_->devices[static_cast<std::size_t>(rank)];
        auto& api = st_->api;
        k.compute = api.compute_stream(ex, device);
        k.compute_token = api.stream_token(ex);
        k.comm = api.make_stream(device);
        k.ready = api.make_event(device);
        k.done = api.make_event(device);
        k.ready_local = api.make_event(device);
        if (rank == 0 && st_->mode == StreamGroupMode::local) {
            st_->local_done = api.make_event(device);
            st_->local_done_made = true;
        }
        k.bound = true;
        api.watch(ex, &comms_[static_cast<std::size_t>(rank)], st_->rendezvous.timeout());
    }

private:
    // Note [stream groups across processes]: every process's layout, as its replicas' counts and
    // whether each has a GPU of its own.
    static std::string refusal(std::span<const ProcessSpan::Layout> layouts) {
        std::string list;
        for (std::size_t q = 0; q < layouts.size(); ++q) {
            const auto& l = layouts[q];
            list += (q ? ", " : "") + std::to_string(l.replicas) +
                    (l.arrangement != 0 ? " on as many GPUs"
                     : l.replicas > 1   ? " on one GPU"
                                        : "");
        }
        return "they lay out their replicas differently (" + list +
               ", by process); every process must run as many "
               "replicas, laid out alike (one per GPU, or all on one GPU)";
    }

    // No GPU may serve two processes (NCCL refuses a GPU twice in a communicator): every process
    // sees every GPU's identity, so all agree or all throw the same error. The GPUs of each
    // process's communicators: every replica's in peer mode, else local rank 0's.
    void check_gpus_apart() {
        State& st = *st_;
        const auto& procs = *st.span.processes();
        const int P = procs.size();
        const auto pz = static_cast<std::size_t>(procs.rank());
        const std::size_t K = st.mode == StreamGroupMode::peer ? static_cast<std::size_t>(st.size()) : 1;
        std::vector<double> keys(static_cast<std::size_t>(P) * K, 0.0);
        for (std::size_t i = 0; i < K; ++i) keys[pz * K + i] = static_cast<double>(st.api.device_key(st.devices[i]));
        st.span.link().all_reduce_sum(DeviceSpan<double>::host(keys), CollectiveSite::control(Exchange::device_keys));
        for (std::size_t i = 0; i < keys.size(); ++i)
            for (std::size_t j = i + 1; j < keys.size(); ++j)
                if (keys[i] == keys[j] && i / K != j / K) {
                    const int d = st.devices[pz == i / K ? i % K : pz == j / K ? j % K : 0];
                    throw UsageError("a replica group across " + std::to_string(P) + " processes: processes " +
                                     std::to_string(i / K) + " and " + std::to_string(j / K) +
                                     " use the same GPU (this process's " + Device{device_kind_of<backend>(), d}.str() +
                                     " if it is one of them), which NCCL refuses; give each process GPUs of its own "
                                     "(at most as many processes per machine as GPUs, --devices lists that do not "
                                     "overlap, or CUDA_VISIBLE_DEVICES per process)");
                }
    }

    // Process 0's NCCL unique id to every process, then this process's communicators: every
    // replica's in peer mode (global ranks), else local rank 0's (process ranks).
    void connect(std::chrono::milliseconds timeout) {
        State& st = *st_;
        const auto& procs = *st.span.processes();
        typename Api::UniqueId id{};
        if (procs.rank() == 0) id = st.api.unique_id();
        std::array<std::int64_t, (sizeof(id) + 7) / 8> words{};
        std::memcpy(words.data(), &id, sizeof(id));
        st.span.link().broadcast(DeviceSpan<std::int64_t>::host(std::span<std::int64_t>(words)), 0,
                                 CollectiveSite::control(Exchange::nccl_unique_id));
        std::memcpy(&id, words.data(), sizeof(id));
        const auto deadline = clock::now() + timeout;
        // Non-blocking: their init waits for the other processes (Note [blocking communicators]).
        if (st.mode == StreamGroupMode::peer)
            st.comms = st.api.init(st.devices, id, st.span.first_rank(), st.span.global(), deadline, st.aborted_never, false);
        else
            st.comms = st.api.init(std::vector<int>{st.devices[0]}, id, procs.rank(), procs.size(), deadline, st.aborted_never,
                                   false);
    }

    static std::vector<int> device_indices(const std::vector<Device>& devices) {
        std::vector<int> out;
        for (const auto& d : devices) out.push_back(d.index);
        return out;
    }

    static StreamGroupMode choose_mode(const std::vector<Device>& devices) {
        LOCKSTEP_CHECK(!devices.empty(), "a replica group needs at least one device");
        constexpr auto kind = device_kind_of<backend>();
        const int visible = Api::device_count();
        for (const auto& d : devices) {
            LOCKSTEP_CHECK_AS(DeviceMismatch, d.kind == kind, "a ", backend::name, " replica group cannot hold device ", d,
                              "; give every replica a device of its backend");
            LOCKSTEP_CHECK_AS(DeviceMismatch, d.index >= 0 && d.index < visible, "no device ", d, " here (", visible,
                              " visible); pick devices 0..", visible - 1);
        }
        if (devices.size() == 1) return StreamGroupMode::single;
        const auto same = [&](const Device& d) { return d.index == devices[0].index; };
        if (std::all_of(devices.begin(), devices.end(), same)) {
            LOCKSTEP_CHECK_AS(NotImplemented, devices.size() <= max_replicas_per_device, devices.size(), " replicas on ",
                              devices[0], ": one GPU takes at most ", max_replicas_per_device,
                              " replicas of a group (their buffers are summed by one kernel); use fewer");
            return StreamGroupMode::local;
        }
        std::vector<int> seen;
        for (const auto& d : devices) {
            if (std::find(seen.begin(), seen.end(), d.index) != seen.end())
                throw NotImplemented("replicas on " + list(devices) +
                                     ": a replica group puts either one replica on each GPU (NCCL) or every replica on "
                                     "one GPU (one kernel sums them); a mix of both is not supported. List each GPU "
                                     "once, or one GPU several times");
            seen.push_back(d.index);
        }
        return StreamGroupMode::peer;
    }

    static std::string list(const std::vector<Device>& devices) {
        std::string s = "{";
        for (std::size_t i = 0; i < devices.size(); ++i) s += (i ? ", " : "") + devices[i].str();
        return s + "}";
    }

    std::shared_ptr<State> st_;
    std::vector<communicator_type> comms_;
};

}  // namespace lockstep::comm
