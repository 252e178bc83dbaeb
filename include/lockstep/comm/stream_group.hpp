// SPDX-License-Identifier: MIT
//! `StreamGroup<Api>` and `StreamCommunicator<Api>`: a replica group whose collectives are
//! enqueued on the replicas' streams (NCCL across GPUs, one rank-order kernel where replicas share
//! a GPU). Written once over the device calls it makes (`Api`), so host tests drive the same code
//! with a recording double; `comm::CudaGroup` is `StreamGroup` over NCCL and the CUDA runtime.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <span>
#include <string>
#include <vector>

#include "lockstep/comm/collective_tag.hpp"
#include "lockstep/comm/collectives.hpp"
#include "lockstep/comm/shared_tensor.hpp"
#include "lockstep/core/backend.hpp"
#include "lockstep/core/device_span.hpp"
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
//   aborts the rendezvous and calls the Api's abort on every communicator of the group, once,
//   never concurrently with an enqueue. The pool then calls reset(), which marks them for
//   rebuilding and, in local mode, orders every rank's streams after rank 0's (whose reduction
//   may still write its peers' buffers); the next step's first collective builds new
//   communicators, so the failing call returns at once and the next step runs on a fresh group.
//   If that build fails, every later collective throws a `DeviceError` saying why, and the
//   object must be made anew.
// - A replica's host waits on its device (the step's scalars) poll an event against the group's
//   timeout and consult the group meanwhile (`DeviceWatch`): never an unbounded synchronize.
// - Teardown: every communicator is finalized (polled against a deadline) and destroyed, then the
//   group's streams and events; the replicas' compute streams go after (DataParallel's Core).
//
// The Api (NcclApi in cuda_group.cuh; doubles in tests/test_stream_group.cpp) provides:
//   using backend, Stream, Event, Comm;
//   int device_count();
//   Stream compute_stream(const Execution<backend>&, int device);   (checks the replica's device)
//   void watch(Execution<backend>&, DeviceWatch*, std::chrono::milliseconds timeout);
//   Stream make_stream(int device);  void destroy_stream(int device, Stream, deadline) noexcept;
//   Event make_event(int device);    void destroy_event(int device, Event) noexcept;
//   void record(Event, Stream);  void wait(Stream, Event);
//   std::vector<Comm> init(const std::vector<int>& devices, deadline, const std::atomic<bool>& stop);
//   void all_reduce(Comm, void*, std::size_t count, DType, Stream, deadline, stop);
//   void broadcast(Comm, void*, std::size_t count, DType, int root, Stream, deadline, stop);
//   void check(Comm);                  (throws on an asynchronous error of the communicator)
//   void abort(Comm) noexcept;  void finalize(Comm, deadline) noexcept;  void destroy(Comm) noexcept;
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
class StreamCommunicator final : public Collectives, public DeviceWatch {
    using Stream = typename Api::Stream;
    using Event = typename Api::Event;
    using clock = std::chrono::steady_clock;

public:
    int rank() const noexcept override { return rank_; }
    int size() const noexcept override { return st_->size(); }
    std::uint64_t collective_count() const noexcept override { return st_->rendezvous.collectives(rank_); }
    bool stream_ordered() const noexcept override { return true; }

    void all_reduce_sum(DeviceSpan<float> data, CollectiveSite site) override { run(data, -1, site, false, DType::f32); }
    void all_reduce_sum(DeviceSpan<double> data, CollectiveSite site) override { run(data, -1, site, false, DType::f64); }
    void start_all_reduce_sum(DeviceSpan<float> data, CollectiveSite site) override { run(data, -1, site, true, DType::f32); }
    void broadcast(DeviceSpan<float> data, int root, CollectiveSite site) override { run(data, root, site, false, DType::f32); }
    void broadcast(DeviceSpan<double> data, int root, CollectiveSite site) override { run(data, root, site, false, DType::f64); }
    void broadcast(DeviceSpan<std::int64_t> data, int root, CollectiveSite site) override {
        run(data, root, site, false, DType::i64);
    }
    void barrier(CollectiveSite site) override {
        st_->rendezvous.count_collective(rank_);
        st_->rendezvous.arrive(rank_, CollectiveTag{site, CollectiveKind::barrier, DType::none, 0, -1}, nullptr);
    }
    //! Sums 16-bit floats in place over all ranks (on CUDA: `DeviceSpan<__half>` with DType::f16,
    //! `DeviceSpan<__nv_bfloat16>` with DType::bf16; NCCL sums them in their own precision, the
    //! device-local group in fp32, rounding once).
    template <class T>
    void all_reduce_sum(DeviceSpan<T> data, DType dtype, CollectiveSite site) {
        static_assert(sizeof(T) == 2, "the DType overload is for 16-bit floats; float and double have their own");
        LOCKSTEP_CHECK_AS(UsageError, dtype == DType::f16 || dtype == DType::bf16,
                          "a 16-bit all-reduce takes DType::f16 or DType::bf16");
        run(data, -1, site, false, dtype);
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
        if (st_->mode != StreamGroupMode::peer) return;
        std::shared_lock lock(st_->comms_mutex);
        if (!st_->comms_aborted) st_->api.check(st_->comms[static_cast<std::size_t>(rank_)]);
    }
    void timed_out(const std::string& what) noexcept override { st_->abort(what, rank_); }

    //! The group's mode (single, peer or local).
    StreamGroupMode mode() const noexcept { return st_->mode; }

private:
    friend class StreamGroup<Api>;
    struct State;

    StreamCommunicator(std::shared_ptr<State> st, int rank) : st_(std::move(st)), rank_(rank) {}

    template <class T>
    void run(DeviceSpan<T> data, int root, CollectiveSite site, bool started, DType dtype) {
        State& st = *st_;
        const auto ur = static_cast<std::size_t>(rank_);
        auto& me = st.ranks[ur];
        LOCKSTEP_CHECK_AS(UsageError, me.bound, "rank ", rank_, " of a stream group made a collective before its replica was "
                          "bound to it (StreamGroup::bind)");
        check_buffer(data, root >= 0 ? "broadcast" : "all_reduce_sum");
        st.check_usable();
        st.rendezvous.count_collective(rank_);
        Stream s = me.compute;
        if (started) {  // behind the replica's work so far, on the communication stream
            st.api.record(me.ready, me.compute);
            st.api.wait(me.comm, me.ready);
            s = me.comm;
        }
        const bool local = st.mode == StreamGroupMode::local;
        if (local && rank_ != 0) st.api.record(me.ready_local, s);  // this rank's buffer is final here
        const CollectiveKind kind = root >= 0 ? CollectiveKind::broadcast : CollectiveKind::all_reduce_sum;
        const CollectiveTag tag{site, kind, dtype, data.size, root};
        // Communicators aborted by a failed step are rebuilt here, before this rank arrives: no rank
        // can then be inside an enqueue of this collective, holding the communicators.
        if (st.mode == StreamGroupMode::peer) st.rebuild_if_needed();
        const int parity = st.rendezvous.arrive(rank_, tag, data.data);  // Note [stream-ordered collectives]
        if (st.size() > 1 && !data.empty()) {
            if (st.mode == StreamGroupMode::peer) {
                enqueue_peer(data, root, s, dtype);
            } else {
                if (rank_ == 0) {
                    std::vector<void*> bufs(static_cast<std::size_t>(st.size()));
                    for (int r = 0; r < st.size(); ++r) {
                        bufs[static_cast<std::size_t>(r)] = st.rendezvous.buffer(parity, r);
                        if (r != 0) st.api.wait(s, st.ranks[static_cast<std::size_t>(r)].ready_local);
                    }
                    const int device = st.devices[0];
                    if (root < 0) {
                        st.api.rank_sum(device, s, std::span<void* const>(bufs), data.size, dtype);
                    } else {
                        for (int r = 0; r < st.size(); ++r)
                            if (r != root)
                                st.api.copy(device, s, bufs[static_cast<std::size_t>(r)], bufs[static_cast<std::size_t>(root)],
                                            data.size * sizeof(T));
                    }
                    st.api.record(st.local_done, s);
                }
                st.rendezvous.arrive(rank_, phase(tag, 1), data.data);
                if (rank_ != 0) st.api.wait(s, st.local_done);
            }
        }
        if (started) {
            st.api.record(me.done, s);
            started_ = true;
        }
    }

    template <class T>
    void enqueue_peer(DeviceSpan<T> data, int root, Stream s, DType dtype) {
        State& st = *st_;
        std::shared_lock lock(st.comms_mutex);  // never concurrently with abort()
        if (st.comms_aborted) throw CollectiveAborted("the replica group was aborted: " + st.abort_reason());
        const auto comm = st.comms[static_cast<std::size_t>(rank_)];
        const auto deadline = clock::now() + st.rendezvous.timeout();
        if (root < 0) st.api.all_reduce(comm, data.data, data.size, dtype, s, deadline, st.aborted);
        else st.api.broadcast(comm, data.data, data.size, dtype, root, s, deadline, st.aborted);
    }

    template <class T>
    void check_buffer(const DeviceSpan<T>& data, const char* what) const {
        LOCKSTEP_CHECK(data.data != nullptr || data.empty(), what, " got a null buffer with ", data.size,
                       " elements; pass the tensor's storage");
        const int want = st_->devices[static_cast<std::size_t>(rank_)];
        if (data.device.kind != device_kind_of<typename Api::backend>() || data.device.index != want) [[unlikely]]
            throw DeviceMismatch(std::string(what) + ": rank " + std::to_string(rank_) + " of this group works on " +
                                 Device{device_kind_of<typename Api::backend>(), want}.str() + " but got a buffer on " +
                                 data.device.str() + "; pass the replica's own tensors");
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
        Stream comm{};        // this group's communication stream on the replica's GPU
        Event ready{};        // compute -> comm, before a started collective
        Event done{};         // comm -> compute, at join()
        Event ready_local{};  // local mode: this rank's buffer is final
        bool bound = false;
    };

    State(std::vector<int> devs, StreamGroupMode m, std::chrono::milliseconds timeout)
        : rendezvous(static_cast<int>(devs.size()), timeout), devices(std::move(devs)), mode(m),
          ranks(devices.size()) {}

    ~State() override { teardown(); }

    int size() const noexcept { return static_cast<int>(devices.size()); }

    void abort(const std::string& reason, int failed_rank) noexcept override {
        {
            std::lock_guard lock(reason_mutex);
            if (!aborted.load(std::memory_order_relaxed)) reason_text = reason;
        }
        aborted.store(true, std::memory_order_release);  // an enqueue polling NCCL gives up now
        rendezvous.abort(reason, failed_rank);
        std::unique_lock lock(comms_mutex);
        if (comms_aborted || comms.empty()) return;
        for (auto& c : comms) api.abort(c);
        comms_aborted = true;
    }

    // After a failed call, with every replica out of it (the pool calls this before it rethrows):
    // the communicators are rebuilt at the next collective (`rebuild_if_needed`), not here, so the
    // failing call returns at once. In local mode rank 0 may have enqueued a reduction that writes
    // its peers' buffers before the abort reached them: every rank's streams wait for rank 0's.
    void reset() override {
        rendezvous.reset();
        {
            std::unique_lock lock(comms_mutex);
            if (comms_aborted) rebuild = true;
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
    // for every rank, made once (by whichever rank gets here first; the others find them made).
    void rebuild_if_needed() {
        {
            std::shared_lock lock(comms_mutex);  // the common case: peers may be enqueueing
            if (!rebuild) return;
        }
        std::unique_lock lock(comms_mutex);
        if (!rebuild) return;
        rebuild = false;
        comms.clear();
        try {
            comms = api.init(devices, clock::now() + rendezvous.timeout(), aborted);
            comms_aborted = false;
        } catch (const std::exception& e) {
            unusable = std::string("rebuilding its communicators after a failed step failed: ") + e.what();
            throw DeviceError("this replica group cannot run collectives any more: " + unusable +
                              "; destroy the DataParallel object and make a new one");
        }
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

    void teardown() noexcept {
        const auto deadline = clock::now() + rendezvous.timeout();
        std::unique_lock lock(comms_mutex);
        if (!comms_aborted) {
            for (auto& c : comms) api.finalize(c, deadline);
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
    Event local_done{};  // local mode: rank 0's reduction is done
    bool local_done_made = false;

    mutable std::shared_mutex comms_mutex;  // enqueues (shared) against abort, reset, teardown
    std::vector<typename Api::Comm> comms;  // peer mode: one per rank
    bool comms_aborted = false;
    bool rebuild = false;  // aborted communicators to replace at the next collective
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
        : st_(std::make_shared<State>(device_indices(devices), choose_mode(devices), timeout)) {
        if (st_->mode == StreamGroupMode::peer) st_->comms = st_->api.init(st_->devices, clock::now() + timeout, st_->aborted_never);
        comms_.reserve(devices.size());
        for (int r = 0; r < st_->size(); ++r) comms_.push_back(communicator_type(st_, r));
    }
    StreamGroup(const StreamGroup&) = delete;
    StreamGroup& operator=(const StreamGroup&) = delete;

    int size() const noexcept { return st_->size(); }
    communicator_type& communicator(int rank) { return comms_.at(static_cast<std::size_t>(rank)); }
    std::shared_ptr<Abortable> abortable() const { return st_; }
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
            LOCKSTEP_CHECK_AS(NotImplemented, devices.size() <= max_replicas_per_device, devices.size(),
                              " replicas on ", devices[0], ": one GPU takes at most ", max_replicas_per_device,
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
