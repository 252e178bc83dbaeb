// SPDX-License-Identifier: MIT
//! The recording double of a stream group's device calls (comm::StreamGroup's Api) on the host:
//! every call logged with its thread, streams that run nothing, and a blocking rank-order "NCCL"
//! that does the arithmetic, so that a DataParallel over it equals one over the host group. Used
//! by tests/test_stream_group.cpp and the torch component's tests.
#pragma once

#include <lockstep/comm/stream_group.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace lockstep_test::stream_double {

using namespace lockstep;
using namespace std::chrono_literals;
using clock_type = std::chrono::steady_clock;

struct Call {
    std::string op;
    int group = -1;  // the communicators' group (init order), for communicator calls
    int rank = -1;
    long stream = 0;
    long event = 0;
    std::size_t count = 0;
    int root = -1;
    bool blocking = false;  // an init: of blocking communicators
    std::thread::id thread = std::this_thread::get_id();
    clock_type::time_point when = clock_type::now();
};

// A blocking, rank-order "NCCL" of one set of communicators: the last rank to enqueue sums every
// rank's buffer in rank order (as the host group does) and writes them all.
struct Round {
    int group = 0;
    int n = 0;
    std::mutex m;
    std::condition_variable cv;
    std::vector<void*> bufs;
    int arrived = 0;
    std::uint64_t generation = 0;
    bool aborted = false;
};

struct TestComm {
    std::shared_ptr<Round> round;
    int rank = -1;
};

struct Log {
    std::mutex m;
    std::vector<Call> calls;
    std::atomic<long> next_id{1};
    int groups = 0;

    void add(Call c) {
        std::lock_guard lock(m);
        calls.push_back(std::move(c));
    }
    std::vector<Call> snapshot() {
        std::lock_guard lock(m);
        return calls;
    }
    void clear() {
        std::lock_guard lock(m);
        calls.clear();
    }
};

inline Log& log_of_calls() {
    static Log l;
    return l;
}

template <class T>
void sum_in_rank_order(const std::vector<void*>& bufs, std::size_t count) {
    for (std::size_t i = 0; i < count; ++i) {
        T acc = static_cast<T*>(bufs[0])[i];
        for (std::size_t r = 1; r < bufs.size(); ++r) acc += static_cast<T*>(bufs[r])[i];
        for (void* b : bufs) static_cast<T*>(b)[i] = acc;
    }
}

inline void sum_as(comm::DType t, const std::vector<void*>& bufs, std::size_t count) {
    if (t == comm::DType::f32)
        sum_in_rank_order<float>(bufs, count);
    else if (t == comm::DType::f64)
        sum_in_rank_order<double>(bufs, count);
    else
        throw std::logic_error("an all-reduce of a type the group does not sum");
}

inline std::size_t size_of(comm::DType t) { return t == comm::DType::f32 ? 4 : 8; }

struct RecordingApi {
    using backend = Host;
    using Stream = long;
    using Event = long;
    using Comm = TestComm;
    using tp = clock_type::time_point;

    static int device_count() { return 4; }

    // One compute stream per thread: a replica's two groups bind the same one.
    static Stream compute_stream(const Execution<Host>&, int) {
        thread_local long id = 0;
        if (id == 0) id = log_of_calls().next_id++;
        log_of_calls().add({.op = "compute_stream", .stream = id});
        return id;
    }
    static void watch(Execution<Host>&, DeviceWatch*, std::chrono::milliseconds) {}
    static Stream make_stream(int) {
        const long id = log_of_calls().next_id++;
        log_of_calls().add({.op = "make_stream", .stream = id});
        return id;
    }
    static void destroy_stream(int, Stream s, tp) noexcept { log_of_calls().add({.op = "destroy_stream", .stream = s}); }
    using StreamToken = int;
    static StreamToken stream_token(const Execution<Host>&) { return 0; }
    // Its streams run nothing; a test makes them read busy, as a stuck kernel's would.
    static std::atomic<bool>& streams_busy() {
        static std::atomic<bool> busy{false};
        return busy;
    }
    static bool idle(int, Stream, StreamToken, tp) noexcept { return !streams_busy().load(); }
    static Event make_event(int) { return log_of_calls().next_id++; }
    static void destroy_event(int, Event) noexcept {}
    static void record(Event e, Stream s) { log_of_calls().add({.op = "record", .stream = s, .event = e}); }
    static void wait(Stream s, Event e) { log_of_calls().add({.op = "wait", .stream = s, .event = e}); }

    // Unique ids name rounds: communicators made from one id (by one group, or by the groups of
    // several "processes") meet in one round.
    // The machine of the calling "process" (as_processes gives each its own unless told otherwise).
    static int& test_machine() {
        thread_local int m = 0;
        return m;
    }
    // A GPU's identity: its machine's and its number there.
    static std::uint64_t device_key(int device) {
        return static_cast<std::uint64_t>(test_machine()) * 1000 + static_cast<std::uint64_t>(device);
    }

    using UniqueId = std::array<long, 2>;
    static UniqueId unique_id() { return {0x1d, log_of_calls().next_id++}; }

    static std::vector<Comm> init(const std::vector<int>& devices, const UniqueId& id, int first_rank, int ranks, tp,
                                  const std::atomic<bool>&, bool blocking) {
        static std::mutex registry_mutex;
        static std::map<UniqueId, std::shared_ptr<Round>> registry;
        std::shared_ptr<Round> round;
        {
            std::lock_guard lock(registry_mutex);
            auto& slot = registry[id];
            if (!slot) {
                slot = std::make_shared<Round>();
                slot->n = ranks;
                slot->bufs.resize(static_cast<std::size_t>(ranks));
                std::lock_guard log_lock(log_of_calls().m);
                slot->group = log_of_calls().groups++;
            }
            round = slot;
        }
        if (round->n != ranks) throw std::logic_error("test communicators of one id with different clique sizes");
        std::vector<Comm> comms;
        for (int r = 0; r < static_cast<int>(devices.size()); ++r) {
            comms.push_back({round, first_rank + r});
            log_of_calls().add({.op = "init", .group = round->group, .rank = first_rank + r, .blocking = blocking});
        }
        return comms;
    }

    // A test makes this rank's all-reduces fail after they were accepted onto the stream, as a
    // non-blocking communicator's settle may throw once NCCL took the call.
    static std::atomic<int>& fail_accepted_rank() {
        static std::atomic<int> rank{-1};
        return rank;
    }
    static void all_reduce(Comm c, void* buf, std::size_t count, comm::DType t, Stream s, tp deadline,
                           const std::atomic<bool>& stop) {
        log_of_calls().add({.op = "all_reduce", .group = c.round->group, .rank = c.rank, .stream = s, .count = count});
        if (c.rank == fail_accepted_rank().load()) throw DeviceError("test communicator: the accepted all-reduce failed");
        exchange(c, buf, count, t, -1, deadline, stop);
    }
    static void broadcast(Comm c, void* buf, std::size_t count, comm::DType t, int root, Stream s, tp deadline,
                          const std::atomic<bool>& stop) {
        log_of_calls().add(
            {.op = "broadcast", .group = c.round->group, .rank = c.rank, .stream = s, .count = count, .root = root});
        exchange(c, buf, count, t, root, deadline, stop);
    }
    static void check(Comm) {}
    static void abort(Comm c) noexcept {
        // Slow, as NCCL's may be: a call that returned before its helper finished shows here.
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        log_of_calls().add({.op = "abort", .group = c.round->group, .rank = c.rank});
        std::lock_guard lock(c.round->m);
        c.round->aborted = true;
        c.round->cv.notify_all();
    }
    static void finalize(std::span<const Comm> comms, tp) noexcept {
        for (const Comm& c : comms) log_of_calls().add({.op = "finalize", .group = c.round->group, .rank = c.rank});
    }
    static void destroy(Comm c) noexcept { log_of_calls().add({.op = "destroy", .group = c.round->group, .rank = c.rank}); }

    static void rank_sum(int, Stream s, std::span<void* const> buffers, std::size_t count, comm::DType t) {
        log_of_calls().add({.op = "rank_sum", .stream = s, .count = count});
        sum_as(t, std::vector<void*>(buffers.begin(), buffers.end()), count);
    }
    static void copy(int, Stream s, void* dst, const void* src, std::size_t bytes) {
        log_of_calls().add({.op = "copy", .stream = s, .count = bytes});
        std::memcpy(dst, src, bytes);
    }

private:
    static void exchange(Comm c, void* buf, std::size_t count, comm::DType t, int root, tp deadline,
                         const std::atomic<bool>& stop) {
        Round& rd = *c.round;
        std::unique_lock lock(rd.m);
        if (rd.aborted) throw CollectiveAborted("test communicator aborted");
        rd.bufs[static_cast<std::size_t>(c.rank)] = buf;
        if (++rd.arrived == rd.n) {
            if (root < 0)
                sum_as(t, rd.bufs, count);
            else
                for (int r = 0; r < rd.n; ++r)
                    if (r != root)
                        std::memcpy(rd.bufs[static_cast<std::size_t>(r)], rd.bufs[static_cast<std::size_t>(root)],
                                    count * size_of(t));
            rd.arrived = 0;
            ++rd.generation;
            rd.cv.notify_all();
            return;
        }
        const auto gen = rd.generation;
        const auto cap = std::min(deadline, clock_type::now() + 5s);
        while (rd.generation == gen && !rd.aborted && !stop.load())
            if (rd.cv.wait_until(lock, cap) == std::cv_status::timeout) throw Timeout("test communicator: a peer never enqueued");
        if (rd.generation == gen) throw CollectiveAborted("test communicator aborted");
    }
};

}  // namespace lockstep_test::stream_double
