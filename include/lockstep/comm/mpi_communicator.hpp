// SPDX-License-Identifier: MIT
//! `mpi::Environment` (MPI's initialization, RAII) and `comm::MpiCommunicator`: collectives of
//! host buffers between the processes of an MPI communicator, bit-identical on every rank and
//! independent of the MPI library's reduction order, with tags checked across processes, a
//! deadline on every wait, and an abort that reaches every rank.
#pragma once

// The C API only: MPI's deprecated C++ bindings would need their own library.
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

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
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "lockstep/comm/collective_tag.hpp"
#include "lockstep/comm/collectives.hpp"
#include "lockstep/comm/host_communicator.hpp"
#include "lockstep/comm/process_group.hpp"
#include "lockstep/core/device_span.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/runtime/abortable_barrier.hpp"

namespace lockstep::mpi {

namespace detail {
//! Why an MPI collective of this process failed with a silent peer (empty: none did); read by
//! ~Environment, which then ends the job rather than wait in MPI_Finalize for a dead rank.
inline std::string& failure_slot() {
    static std::string why;
    return why;
}
inline std::mutex& failure_mutex() {
    static std::mutex m;
    return m;
}
inline void note_failure(const std::string& why) {
    std::lock_guard lock(failure_mutex());
    if (failure_slot().empty()) failure_slot() = why;
}
//! Whether a rank aborted (this one or another): MPI_Finalize then gets a deadline.
inline std::atomic<bool>& aborted_somewhere() {
    static std::atomic<bool> flag{false};
    return flag;
}
}  // namespace detail

//! MPI for the lifetime of the object: `MPI_Init_thread` asking `MPI_THREAD_MULTIPLE` (an abort
//! reaches peers from whichever thread fails), unless MPI is initialized already, in which case
//! the level it provides is checked. Finalizes MPI if it initialized it. If a collective timed out
//! waiting for a silent rank (one that died), MPI_Finalize could wait for it forever: the
//! destructor then says so on stderr and ends the job with MPI_Abort, the last resort. After an
//! abort (of this rank or another, even one whose message this rank never read), the ranks
//! first meet in a barrier polled against a deadline (`finalize_timeout`), since a rank that
//! aborted may never reach MPI_Finalize; past the deadline the job is ended the same way.
class Environment {
public:
    Environment() : Environment(nullptr, nullptr) {}
    Environment(int* argc, char*** argv) {
        int initialized = 0;
        MPI_Initialized(&initialized);
        if (initialized == 0) {
            int provided = 0;
            if (MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided) != MPI_SUCCESS)
                throw Error("MPI_Init_thread failed; is this program started by mpirun, and is MPI installed?");
            owner_ = true;
            check_level(provided, "MPI_Init_thread provided");
        } else {
            int provided = 0;
            MPI_Query_thread(&provided);
            check_level(provided, "MPI was initialized by the program with");
        }
        MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
        MPI_Comm_size(MPI_COMM_WORLD, &size_);
    }
    Environment(const Environment&) = delete;
    Environment& operator=(const Environment&) = delete;
    ~Environment() {
        std::string why;
        {
            std::lock_guard lock(detail::failure_mutex());
            why = detail::failure_slot();
        }
        if (!why.empty()) {
            std::fprintf(stderr,
                         "lockstep: rank %d: an MPI collective failed (%s); ending the MPI job with MPI_Abort so that "
                         "no rank waits for a silent one forever\n",
                         rank_, why.c_str());
            std::fflush(stderr);
            MPI_Abort(MPI_COMM_WORLD, 2);
        }
        int finalized = 0;
        MPI_Finalized(&finalized);
        if (!owner_ || finalized != 0) return;
        if (detail::aborted_somewhere().load()) {
            // A rank that failed may never reach MPI_Finalize (a replica left stuck): every rank
            // first meets the others in a nonblocking barrier polled against the deadline, and
            // finalizes only if all came; otherwise it ends the job, from this thread.
            MPI_Request barrier = MPI_REQUEST_NULL;
            MPI_Ibarrier(MPI_COMM_WORLD, &barrier);
            const auto until = std::chrono::steady_clock::now() + finalize_timeout_;
            int done = 0;
            while (MPI_Test(&barrier, &done, MPI_STATUS_IGNORE) == MPI_SUCCESS && done == 0 &&
                   std::chrono::steady_clock::now() < until)
                std::this_thread::sleep_for(std::chrono::milliseconds(1));
            if (done == 0) {
                std::fprintf(stderr,
                             "lockstep: rank %d: after a rank aborted, not every rank reached the end within %lld ms "
                             "(a rank that failed is stuck); ending the MPI job with MPI_Abort\n",
                             rank_, static_cast<long long>(finalize_timeout_.count()));
                std::fflush(stderr);
                MPI_Abort(MPI_COMM_WORLD, 2);
            }
        }
        MPI_Finalize();
    }

    //! How long MPI_Finalize may take after a rank aborted (default 60 s).
    void set_finalize_timeout(std::chrono::milliseconds t) noexcept { finalize_timeout_ = t; }

    //! This process's rank in MPI_COMM_WORLD, and the number of processes.
    int rank() const noexcept { return rank_; }
    int size() const noexcept { return size_; }

private:
    void check_level(int provided, const char* what) {
        // One thread per process makes the collectives; an abort may come from another thread.
        if (provided < MPI_THREAD_MULTIPLE) {
            if (owner_) MPI_Finalize();
            throw UsageError(std::string(what) + " thread level " + std::to_string(provided) +
                             ", below MPI_THREAD_MULTIPLE, which lockstep needs (a failing replica thread tells the "
                             "other processes); initialize MPI with MPI_Init_thread(..., MPI_THREAD_MULTIPLE, ...) "
                             "or let lockstep::mpi::Environment do it");
        }
    }
    bool owner_ = false;
    int rank_ = 0, size_ = 1;
    std::chrono::milliseconds finalize_timeout_{60000};
};

}  // namespace lockstep::mpi

namespace lockstep::comm {

// Note [MPI collectives]
// Every collective of an MpiCommunicator is two steps, both point to point with nonblocking MPI
// calls polled against a deadline (MPI's blocking collectives cannot be abandoned):
// 1. The tag: every rank sends its collective's tag (site, kind, type, count, root) to every
//    other rank and receives theirs, so every rank holds all tags and all throw the same
//    `CollectiveMismatch` when they differ. A rank whose tag does not arrive in time is named
//    in the `Timeout`. While waiting, every rank also polls for abort messages: `abort()` (a
//    replica of any rank failed) sends one to every rank, and they throw `CollectiveAborted`
//    naming the failed rank.
// 2. The data, summed in rank order by the rank that owns it, as the host group does (Note
//    [deterministic host all-reduce]): for small payloads every rank receives every operand and
//    sums them all (b0 + b1 + ...); for large ones rank r receives slice r of every rank, sums it
//    and sends the sum back to all. Each element is summed once, in one fixed order, so every
//    rank holds the same bits, which are those of a HostGroup of the same size, whatever MPI
//    library runs underneath.
// An all-reduce of at most `folded_limit` bytes (one that goes whole to every rank) makes the
// two steps one: its payload travels in the tag's message, every rank checks the tags and then
// sums the operands it received, so each of a SyncBatchNorm layer's collectives across processes
// waits for one message exchange, not two. A rank at a collective without a payload sends its tag alone in the
// same kind of message, so a mismatch between any two collectives is still found in the tags.
// A communicator that timed out or was aborted stays failed: later calls throw at once.

//! Collectives between the processes of an MPI communicator (one `MpiCommunicator` per process;
//! host buffers). Needs `mpi::Environment` (or MPI initialized at MPI_THREAD_MULTIPLE).
class MpiCommunicator final : public TypedCollectives<MpiCommunicator> {
    using clock = std::chrono::steady_clock;

public:
    //! A communicator over a duplicate of `comm` (its messages never mix with the program's own).
    explicit MpiCommunicator(MPI_Comm comm = MPI_COMM_WORLD,
                             std::chrono::milliseconds timeout = AbortableBarrier::default_timeout)
        : timeout_(timeout) {
        int initialized = 0;
        MPI_Initialized(&initialized);
        LOCKSTEP_CHECK_AS(UsageError, initialized != 0,
                          "MpiCommunicator before MPI_Init; make a lockstep::mpi::Environment first");
        MPI_Comm_dup(comm, &comm_);
        MPI_Comm_rank(comm_, &rank_);
        MPI_Comm_size(comm_, &size_);
    }
    MpiCommunicator(const MpiCommunicator&) = delete;
    MpiCommunicator& operator=(const MpiCommunicator&) = delete;
    ~MpiCommunicator() override {
        int finalized = 0;
        MPI_Finalized(&finalized);
        if (finalized == 0) {  // an abort message nobody read still bounds MPI_Finalize (mpi::Environment)
            try {
                std::string text;
                int source = -1;
                (void)peer_aborted(text, source);
            } catch (...) {
            }
        }
        if (finalized == 0 && failure_.empty()) MPI_Comm_free(&comm_);
    }

    int rank() const noexcept override { return rank_; }
    int size() const noexcept override { return size_; }
    std::uint64_t collective_count() const noexcept override { return count_; }
    void set_timeout(std::chrono::milliseconds t) noexcept { timeout_ = t; }
    std::chrono::milliseconds timeout() const noexcept { return timeout_; }

    using TypedCollectives::all_reduce_sum;
    using TypedCollectives::broadcast;
    void barrier(CollectiveSite site) override {
        ++count_;
        agree(CollectiveTag{site, CollectiveKind::barrier, DType::none, 0, -1});
    }

    //! Host-memory conveniences.
    void barrier() { barrier(CollectiveSite::user()); }
    template <Reducible T>
    void all_reduce_sum(std::span<T> data, CollectiveSite site = CollectiveSite::user()) {
        reduce(DeviceSpan<T>::host(data), site);
    }
    template <Reducible T>
    void broadcast(std::span<T> data, int root, CollectiveSite site = CollectiveSite::user()) {
        bcast(DeviceSpan<T>::host(data), root, site);
    }

    //! Tells every other rank that this one failed (`reason`), from any thread: their current or
    //! next collective throws `CollectiveAborted` naming this rank. This rank's own collectives
    //! throw from now on.
    void abort(const std::string& reason) noexcept {
        std::lock_guard lock(abort_mutex_);
        if (aborted_.load(std::memory_order_relaxed)) return;
        abort_text_ = reason.substr(0, 400);  // written once, before the flag that publishes it
        aborted_.store(true, std::memory_order_release);
        mpi::detail::aborted_somewhere() = true;
        std::vector<MPI_Request> sends;
        for (int r = 0; r < size_; ++r) {
            if (r == rank_) continue;
            sends.emplace_back();
            MPI_Isend(abort_text_.data(), static_cast<int>(abort_text_.size()), MPI_CHAR, r, tag_abort, comm_, &sends.back());
        }
        // Small messages go eagerly; give them a moment, then leave them to MPI.
        const auto until = clock::now() + std::chrono::seconds(1);
        int done = 0;
        while (!sends.empty() && clock::now() < until) {
            MPI_Testall(static_cast<int>(sends.size()), sends.data(), &done, MPI_STATUSES_IGNORE);
            if (done != 0) return;
            std::this_thread::yield();
        }
        for (auto& r : sends)
            if (r != MPI_REQUEST_NULL) MPI_Request_free(&r);
    }

    //! Checks that every rank reached the same collective (`tag`), as each collective does first
    //! (step 1 of Note [MPI collectives]): all ranks throw the same `CollectiveMismatch` when they
    //! did not, `CollectiveAborted` when a rank failed, `Timeout` naming the silent ranks. For a
    //! collective whose data moves elsewhere (NCCL across processes).
    void agree(const CollectiveTag& tag) { agree(tag, nullptr, 0); }

    //! Payloads of at most this many bytes travel with the tag (Note [MPI collectives]).
    static constexpr std::size_t folded_limit = 16384;

    //! Payloads of at most this many elements times the ranks go whole to every rank (step 2 of
    //! Note [MPI collectives]); larger ones by slices.
    static constexpr std::size_t whole_limit = std::size_t{1} << 16;

    //! From any thread: throws `CollectiveAborted` naming the failed rank once another rank's
    //! abort message has arrived (a replica's wait on its GPU consults this while it polls).
    void check_peers() {
        std::string text;
        int source = -1;
        if (peer_aborted(text, source)) throw CollectiveAborted(text, source);
    }

    //! From any thread: whether a failure reached this rank from elsewhere (another rank's abort
    //! message, or a peer that never answered), as opposed to one of this rank's own.
    bool peer_failed() const noexcept { return peer_failed_.load(std::memory_order_acquire); }

    //! Why this communicator failed (empty while it works).
    const std::string& failure() const noexcept { return failure_; }

private:
    friend class TypedCollectives<MpiCommunicator>;

    using Wire = std::array<std::int64_t, 7>;
    static constexpr std::size_t slot_bytes = sizeof(Wire) + folded_limit;  // one rank's message: tag, payload

    // agree(tag), sending `bytes` of `payload` (at most folded_limit) in the tag's message; rank
    // r's payload is then in wire_, slot r, after its tag.
    void agree(const CollectiveTag& tag, const void* payload, std::size_t bytes) {
        check_usable();
        if (size_ == 1) return;
        const Wire mine{static_cast<std::int64_t>(tag.site.kind),
                        static_cast<std::int64_t>(tag.site.id),
                        static_cast<std::int64_t>(tag.site.part),
                        static_cast<std::int64_t>(tag.kind),
                        static_cast<std::int64_t>(tag.dtype),
                        static_cast<std::int64_t>(tag.count),
                        tag.root};
        if (wire_.empty()) wire_.resize(static_cast<std::size_t>(size_) * slot_bytes / sizeof(std::int64_t));
        auto* slots = reinterpret_cast<std::byte*>(wire_.data());
        std::byte* own = slots + static_cast<std::size_t>(rank_) * slot_bytes;
        std::memcpy(own, mine.data(), sizeof(Wire));
        if (bytes != 0) std::memcpy(own + sizeof(Wire), payload, bytes);
        std::vector<MPI_Request> reqs;
        std::vector<int> who;
        for (int r = 0; r < size_; ++r) {
            if (r == rank_) continue;
            reqs.emplace_back();
            who.push_back(r);
            // Room for any peer's message: it may be at another collective, with another payload.
            MPI_Irecv(slots + static_cast<std::size_t>(r) * slot_bytes, static_cast<int>(slot_bytes), MPI_BYTE, r, tag_tag, comm_,
                      &reqs.back());
        }
        for (int r = 0; r < size_; ++r) {
            if (r == rank_) continue;
            reqs.emplace_back();
            who.push_back(-1 - r);
            MPI_Isend(own, static_cast<int>(sizeof(Wire) + bytes), MPI_BYTE, r, tag_tag, comm_, &reqs.back());
        }
        wait_all(reqs, who, tag.str());
        std::vector<Wire> all(static_cast<std::size_t>(size_));
        for (std::size_t r = 0; r < all.size(); ++r) std::memcpy(all[r].data(), slots + r * slot_bytes, sizeof(Wire));
        const auto decode = [](const Wire& w) {
            CollectiveTag t;
            t.site = CollectiveSite{static_cast<CollectiveSite::Kind>(w[0]), static_cast<std::uint64_t>(w[1]),
                                    static_cast<std::uint32_t>(w[2])};
            t.kind = static_cast<CollectiveKind>(w[3]);
            t.dtype = static_cast<DType>(w[4]);
            t.count = static_cast<std::uint64_t>(w[5]);
            t.root = static_cast<std::int32_t>(w[6]);
            return t;
        };
        for (int r = 1; r < size_; ++r) {
            if (all[static_cast<std::size_t>(r)] != all[0]) [[unlikely]]
                throw CollectiveMismatch("processes reached different collectives: MPI rank 0 reached " + decode(all[0]).str() +
                                         " but MPI rank " + std::to_string(r) + " reached " +
                                         decode(all[static_cast<std::size_t>(r)]).str() +
                                         "; every process must run the same layers in the same order on tensors of the "
                                         "same size, with the same replica count");
        }
    }

    static constexpr int tag_tag = 101, tag_data = 102, tag_gather = 103, tag_abort = 104;

    template <class T>
    static MPI_Datatype mpi_type() {
        if constexpr (std::is_same_v<T, float>)
            return MPI_FLOAT;
        else if constexpr (std::is_same_v<T, double>)
            return MPI_DOUBLE;
        else
            return MPI_INT64_T;
    }

    template <class T>
    static void check(const DeviceSpan<T>& data, const char* what) {
        check_buffer(data, what, Device::Kind::host, -1, "an MpiCommunicator", "use NCCL for device buffers");
        LOCKSTEP_CHECK_AS(UsageError, data.size <= static_cast<std::size_t>(INT32_MAX), what, " of ", data.size,
                          " elements: one MPI message holds at most 2^31 - 1; split the buffer");
    }

    void check_usable() const {
        if (!failure_.empty()) throw CollectiveAborted("this MPI communicator failed earlier: " + failure_);
        if (aborted_.load(std::memory_order_acquire))
            throw CollectiveAborted("this rank aborted its MPI communicator: " + abort_text_);
    }

    // Waits for `reqs` until the deadline, polling for abort messages; `who[i]` is the peer of
    // request i, negative (-1 - peer) for a send. Throws Timeout naming the peers whose messages
    // did not arrive.
    void wait_all(std::vector<MPI_Request>& reqs, const std::vector<int>& who, const std::string& what) {
        const auto deadline = clock::now() + timeout_;
        std::vector<int> index(reqs.size());
        for (std::uint64_t spin = 0;; ++spin) {
            int done = 0;
            MPI_Testsome(static_cast<int>(reqs.size()), reqs.data(), &done, index.data(), MPI_STATUSES_IGNORE);
            if (done == MPI_UNDEFINED) return;  // every request has finished (and is MPI_REQUEST_NULL)
            poll_abort(reqs);
            if (clock::now() >= deadline) {
                std::vector<int> missing;
                for (std::size_t i = 0; i < reqs.size(); ++i)
                    if (reqs[i] != MPI_REQUEST_NULL && who[i] >= 0) missing.push_back(who[i]);
                if (missing.empty())  // only sends are left: the peers that never took them
                    for (std::size_t i = 0; i < reqs.size(); ++i)
                        if (reqs[i] != MPI_REQUEST_NULL) missing.push_back(-1 - who[i]);
                std::sort(missing.begin(), missing.end());
                missing.erase(std::unique(missing.begin(), missing.end()), missing.end());
                std::string silent;
                for (const int r : missing) silent += (silent.empty() ? " " : ", ") + std::to_string(r);
                const int first = missing.empty() ? -1 : missing.front();
                cancel(reqs);
                peer_failed_.store(true, std::memory_order_release);
                fail("MPI rank " + std::to_string(rank_) + " waited " + std::to_string(timeout_.count()) + " ms in " + what +
                     " for rank(s)" + silent +
                     " that never answered (a rank is stuck, skipped a collective or died; raise "
                     "the timeout if the step is legitimately that slow)");
                detail_note();
                throw Timeout(failure_, first);
            }
            // MPI progresses a transfer only inside its calls: poll without sleeping for a while
            // (a long message moves in fragments), then let other threads run between polls.
            if (spin > 100000)
                std::this_thread::sleep_for(std::chrono::microseconds(20));
            else if ((spin & 63) == 63)
                std::this_thread::yield();
        }
    }

    // Any thread: whether another rank's abort message has arrived (`text`, `source`: what it
    // said, who sent it). The message is taken with a matched probe, so two threads never both
    // receive it, and kept, so every thread that polls later sees the same.
    bool peer_aborted(std::string& text, int& source) {
        std::lock_guard lock(peer_mutex_);
        if (peer_failure_.empty()) {
            int flag = 0;
            MPI_Message message;
            MPI_Status status;
            MPI_Improbe(MPI_ANY_SOURCE, tag_abort, comm_, &flag, &message, &status);
            if (flag == 0) return false;
            int len = 0;
            MPI_Get_count(&status, MPI_CHAR, &len);
            std::string got(static_cast<std::size_t>(std::max(len, 0)), '\0');
            MPI_Mrecv(got.data(), len, MPI_CHAR, &message, MPI_STATUS_IGNORE);
            peer_source_ = status.MPI_SOURCE;
            peer_failure_ = "MPI rank " + std::to_string(peer_source_) + " failed: " + got;
            peer_failed_.store(true, std::memory_order_release);
            mpi::detail::aborted_somewhere() = true;
        }
        text = peer_failure_;
        source = peer_source_;
        return true;
    }

    // The collective's own thread: an abort message cancels `reqs` and fails the communicator.
    void poll_abort(std::vector<MPI_Request>& reqs) {
        std::string text;
        int source = -1;
        if (!peer_aborted(text, source)) return;
        cancel(reqs);
        fail(text);
        throw CollectiveAborted(failure_, source);
    }

    static void cancel(std::vector<MPI_Request>& reqs) noexcept {
        for (auto& r : reqs) {
            if (r == MPI_REQUEST_NULL) continue;
            MPI_Cancel(&r);
            MPI_Request_free(&r);
        }
    }

    void fail(std::string why) { failure_ = std::move(why); }
    void detail_note() const { mpi::detail::note_failure(failure_); }

    template <class T>
    void reduce(DeviceSpan<T> data, CollectiveSite site) {
        check(data, "all_reduce_sum");
        ++count_;
        const CollectiveTag tag{site, CollectiveKind::all_reduce_sum, dtype_of<T>(), data.size, -1};
        const auto n = static_cast<std::size_t>(size_);
        const auto me = static_cast<std::size_t>(rank_);
        std::vector<const T*> bufs(n);
        if (data.size * sizeof(T) <= folded_limit && data.size * n <= whole_limit) {  // the operands came with the tags
            agree(tag, data.data, data.size * sizeof(T));
            if (size_ == 1 || data.empty()) return;
            const auto* slots = reinterpret_cast<const std::byte*>(wire_.data());
            for (std::size_t r = 0; r < n; ++r)
                bufs[r] = r == me ? data.data : reinterpret_cast<const T*>(slots + r * slot_bytes + sizeof(Wire));
            sum_in_rank_order(bufs, data.data, 0, data.size);
            return;
        }
        agree(tag);
        if (size_ == 1) return;
        std::vector<MPI_Request> reqs;
        std::vector<int> who;
        const auto send = [&](T* p, std::size_t count, int peer, int tag) {
            if (count == 0) return;
            reqs.emplace_back();
            who.push_back(-1 - peer);
            MPI_Isend(p, static_cast<int>(count), mpi_type<T>(), peer, tag, comm_, &reqs.back());
        };
        const auto receive = [&](T* p, std::size_t count, int peer, int tag) {
            if (count == 0) return;
            reqs.emplace_back();
            who.push_back(peer);
            MPI_Irecv(p, static_cast<int>(count), mpi_type<T>(), peer, tag, comm_, &reqs.back());
        };
        // Operands arrive in this communicator's scratch buffer (kept between calls: no page
        // faults on fresh memory for every bucket); this rank's own operand is read in place, and
        // the sum is written over it (sum_in_rank_order reads each block before writing it).
        if (data.size * n <= whole_limit) {         // every rank sums every operand
            T* others = scratch<T>(data.size * n);  // slot r: rank r's operand (slot `me` unused)
            for (int r = 0; r < size_; ++r)
                if (r != rank_) receive(others + static_cast<std::size_t>(r) * data.size, data.size, r, tag_data);
            for (int r = 0; r < size_; ++r)
                if (r != rank_) send(data.data, data.size, r, tag_data);
            wait_all(reqs, who, "all_reduce_sum");
            for (std::size_t r = 0; r < n; ++r) bufs[r] = r == me ? data.data : others + r * data.size;
            sum_in_rank_order(bufs, data.data, 0, data.size);
            return;
        }
        // By slices: slice r of every rank goes to rank r, which sums it and sends the sum to all.
        std::vector<std::pair<std::size_t, std::size_t>> slices(n);
        for (int r = 0; r < size_; ++r) slices[static_cast<std::size_t>(r)] = HostCommunicator::slice(data.size, size_, r);
        const auto [lo, hi] = slices[me];
        const std::size_t len = hi - lo;
        T* parts = scratch<T>(len * n);  // slot r: rank r's part of this rank's slice (slot `me` unused)
        for (int r = 0; r < size_; ++r)
            if (r != rank_) receive(parts + static_cast<std::size_t>(r) * len, len, r, tag_data);
        for (int r = 0; r < size_; ++r) {
            const auto [rlo, rhi] = slices[static_cast<std::size_t>(r)];
            if (r != rank_) send(data.data + rlo, rhi - rlo, r, tag_data);
        }
        wait_all(reqs, who, "all_reduce_sum");
        reqs.clear(), who.clear();
        for (std::size_t r = 0; r < n; ++r) bufs[r] = r == me ? data.data + lo : parts + r * len;
        sum_in_rank_order(bufs, data.data + lo, 0, len);  // this rank's slice, summed in place
        for (int r = 0; r < size_; ++r) {
            const auto [rlo, rhi] = slices[static_cast<std::size_t>(r)];
            if (r != rank_) receive(data.data + rlo, rhi - rlo, r, tag_gather);
        }
        for (int r = 0; r < size_; ++r)
            if (r != rank_) send(data.data + lo, len, r, tag_gather);
        wait_all(reqs, who, "all_reduce_sum");
    }

    // `count` elements of scratch memory, reused by every collective of this communicator (one
    // thread at a time makes them).
    template <class T>
    T* scratch(std::size_t count) {
        const std::size_t bytes = count * sizeof(T);
        if (bytes > scratch_bytes_) {
            scratch_.reset(new std::byte[bytes]);  // aligned for any T the collectives move
            scratch_bytes_ = bytes;
        }
        return reinterpret_cast<T*>(scratch_.get());
    }

    template <class T>
    void bcast(DeviceSpan<T> data, int root, CollectiveSite site) {
        check(data, "broadcast");
        check_root(root, size_);
        ++count_;
        agree(CollectiveTag{site, CollectiveKind::broadcast, dtype_of<T>(), data.size, root});
        if (size_ == 1 || data.empty()) return;
        std::vector<MPI_Request> reqs;
        std::vector<int> who;
        if (rank_ == root) {
            for (int r = 0; r < size_; ++r) {
                if (r == root) continue;
                reqs.emplace_back();
                who.push_back(-1 - r);
                MPI_Isend(data.data, static_cast<int>(data.size), mpi_type<T>(), r, tag_data, comm_, &reqs.back());
            }
        } else {
            reqs.emplace_back();
            who.push_back(root);
            MPI_Irecv(data.data, static_cast<int>(data.size), mpi_type<T>(), root, tag_data, comm_, &reqs.back());
        }
        wait_all(reqs, who, "broadcast");
    }

    MPI_Comm comm_ = MPI_COMM_NULL;
    int rank_ = 0, size_ = 1;
    std::chrono::milliseconds timeout_;
    std::uint64_t count_ = 0;
    std::string failure_;
    std::mutex abort_mutex_;
    std::atomic<bool> aborted_{false};
    std::string abort_text_;
    std::unique_ptr<std::byte[]> scratch_;
    std::size_t scratch_bytes_ = 0;
    std::vector<std::int64_t> wire_;  // every rank's tag message (slot_bytes each), kept between calls
    std::mutex peer_mutex_;           // the abort message of another rank, taken by whichever thread polls first
    std::string peer_failure_;
    int peer_source_ = -1;
    std::atomic<bool> peer_failed_{false};
};

//! The processes of an MPI communicator as DataParallel's process group
//! (`DataParallelOptions::process_group`): one MpiCommunicator per channel, each over its own
//! duplicate of `comm`. Made by every process together (the duplicates are collective calls).
class MpiProcessGroup final : public ProcessGroup {
public:
    explicit MpiProcessGroup(MPI_Comm comm = MPI_COMM_WORLD,
                             std::chrono::milliseconds timeout = AbortableBarrier::default_timeout) {
        for (auto& c : channels_) c = std::make_unique<MpiCommunicator>(comm, timeout);
    }
    int rank() const override { return channels_[0]->rank(); }
    int size() const override { return channels_[0]->size(); }
    Collectives& channel(Channel c) override { return *channels_.at(static_cast<std::size_t>(c)); }
    MpiCommunicator& communicator(Channel c) { return *channels_.at(static_cast<std::size_t>(c)); }
    void abort(const std::string& reason) noexcept override {
        for (auto& c : channels_) c->abort(reason);
    }
    void agree(Channel c, const CollectiveTag& tag) override { communicator(c).agree(tag); }
    void check_peers() override {
        for (auto& c : channels_) c->check_peers();
    }
    std::chrono::milliseconds timeout() const noexcept override { return channels_[0]->timeout(); }
    bool peer_failed() const noexcept override {
        return std::any_of(channels_.begin(), channels_.end(), [](const auto& c) { return c->peer_failed(); });
    }
    void set_timeout(std::chrono::milliseconds t) noexcept {
        for (auto& c : channels_) c->set_timeout(t);
    }

private:
    std::array<std::unique_ptr<MpiCommunicator>, 3> channels_;
};

}  // namespace lockstep::comm
