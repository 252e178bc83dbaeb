// SPDX-License-Identifier: MIT
//! The stream group (comm/stream_group.hpp: the logic of comm::CudaGroup) driven through a
//! recording double of its device calls, on the host: the rendezvous comes before every enqueue,
//! every rank enqueues layer and bucket collectives in one order on its own thread and streams,
//! an abort reaches every communicator and the group is rebuilt, teardown finalizes before it
//! destroys. The double also does the arithmetic (a blocking rank-order "NCCL", and the
//! device-local kernel's sum), so DataParallel over it must equal DataParallel over HostGroup.
#include <catch2/catch.hpp>

#include <lockstep/comm/stream_group.hpp>
#include <lockstep/nn.hpp>
#include <lockstep/host.hpp>
#include <lockstep/parallel.hpp>

#include "stream_group_double.hpp"
#include "thread_processes.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>
#include <stdexcept>
#include <mutex>
#include <random>
#include <set>
#include <thread>
#include <vector>

using namespace lockstep;
using namespace std::chrono_literals;
using clock_type = std::chrono::steady_clock;

namespace {

using namespace lockstep_test::stream_double;

using Group = comm::StreamGroup<RecordingApi>;

std::vector<Device> hosts(std::initializer_list<int> ids) {
    std::vector<Device> d;
    for (int i : ids) d.push_back(Device::host(i));
    return d;
}

std::vector<Call> only(const std::vector<Call>& calls, std::initializer_list<const char*> ops) {
    std::vector<Call> out;
    for (const auto& c : calls)
        for (const char* op : ops)
            if (c.op == op) out.push_back(c);
    return out;
}

// Runs `body(rank, communicator)` on one thread per rank, each bound first; returns per-rank
// errors. With `abort_on_error`, a rank that throws aborts the group, as DataParallel's pool does.
template <class F>
std::vector<std::exception_ptr> on_threads(Group& g, F body, bool abort_on_error = false) {
    std::vector<std::exception_ptr> errors(static_cast<std::size_t>(g.size()));
    std::vector<std::thread> threads;
    for (int r = 0; r < g.size(); ++r)
        threads.emplace_back([&, r] {
            try {
                Execution<Host> ex;
                g.bind(r, ex);
                body(r, g.communicator(r));  // a Group::communicator_type&, also a comm::Collectives&
            } catch (const std::exception& e) {
                errors[static_cast<std::size_t>(r)] = std::current_exception();
                if (abort_on_error) g.abortable()->abort(e.what(), r);
            } catch (...) {
                errors[static_cast<std::size_t>(r)] = std::current_exception();
                if (abort_on_error) g.abortable()->abort("an exception that is not a std::exception", r);
            }
        });
    for (auto& t : threads) t.join();
    return errors;
}

// ---- a model to train ----------------------------------------------------------------------------

using Net = nn::Sequential<nn::Conv2d<>, nn::SyncBatchNorm<>, nn::ReLU<>, nn::MaxPool2d<>, nn::Flatten<>, nn::Linear<>>;

Net make_net() {
    nn::Generator g(5);
    return Net(nn::Conv2d<>(2, 4, 3, {.padding = 1}, g), nn::SyncBatchNorm<>(4), nn::ReLU<>(), nn::MaxPool2d<>(2),
               nn::Flatten<>(), nn::Linear<>(4 * 4 * 4, 5, true, g));
}

// Net whose backward throws on replica 1 while `fail` is set.
struct Failing {
    using backend = Host;
    Net net = make_net();
    std::shared_ptr<std::atomic<bool>> fail = std::make_shared<std::atomic<bool>>(false);
    Tensor<float> forward(const nn::Context<>& ctx, Tensor<float> x) { return net.forward(ctx, std::move(x)); }
    Tensor<float> backward(const nn::Context<>& ctx, const Tensor<float>& dy) {
        if (ctx.rank == 1 && *fail) throw std::runtime_error("replica 1's backward failed");
        return net.backward(ctx, dy);
    }
    template <class V>
    void visit(V&& v) {
        v.module("net", net);
    }
};

struct Batch {
    Tensor<float> x;
    std::vector<std::int64_t> labels;
};

Batch make_batch(std::int64_t n, std::uint64_t seed) {
    std::mt19937_64 gen(seed);
    std::normal_distribution<float> d(0.5f, 1.0f);
    std::uniform_int_distribution<std::int64_t> l(0, 4);
    Batch b{Tensor<float>(Shape{n, 2, 8, 8}), {}};
    for (auto& v : b.x.span()) v = d(gen);
    for (std::int64_t i = 0; i < n; ++i) b.labels.push_back(l(gen));
    return b;
}

template <class M>
std::vector<float> state_of(const M& m) {
    std::vector<float> v;
    nn::walk(
        m, [&](const std::string&, const auto& p) { v.insert(v.end(), p.value.span().begin(), p.value.span().end()); },
        [&](const std::string&, const auto& t) {
            for (auto e : t.span()) v.push_back(static_cast<float>(e));
        });
    return v;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

struct Trained {
    std::vector<double> losses;
    std::vector<float> state;
    bool replicas_identical = true;
};

// Trains `dp` for `steps` steps on batches of 7 (uneven shards over 3 replicas); across P
// processes, as process p, on this process's rows of each global batch.
template <class Dp>
Trained train(Dp& dp, int steps, int P = 1, int p = 0) {
    nn::Sgd<> sgd({.lr = 0.05, .momentum = 0.9});
    Trained out;
    const int L = dp.size();
    for (int s = 0; s < steps; ++s) {
        const auto b = make_batch(7, 100 + static_cast<std::uint64_t>(s));
        const auto shards = parallel::shard_ranges(7, P * L);
        const std::int64_t begin = shards[static_cast<std::size_t>(p * L)].begin;
        const auto& last = shards[static_cast<std::size_t>(p * L + L - 1)];
        const std::int64_t rows = last.begin + last.count - begin;
        Tensor<float> x(Shape{rows, 2, 8, 8});
        const std::int64_t per = 2 * 8 * 8;
        std::copy(b.x.span().begin() + begin * per, b.x.span().begin() + (begin + rows) * per, x.span().begin());
        const std::vector<std::int64_t> labels(b.labels.begin() + begin, b.labels.begin() + begin + rows);
        out.losses.push_back(dp.train_step(x, labels, nn::SoftmaxCrossEntropy{}, sgd).loss);
        for (int r = 1; r < L; ++r) out.replicas_identical &= same_bits(state_of(dp.replica(0)), state_of(dp.replica(r)));
    }
    out.state = state_of(dp.module());
    return out;
}

DataParallelOptions small_buckets() {
    DataParallelOptions o;
    o.bucket_bytes = 256;  // several buckets, so some are enqueued while backward still runs
    o.timeout = 5s;
    return o;
}

}  // namespace

TEST_CASE("stream group: no rank enqueues before every rank has reached the rendezvous", "[comm]") {
    log_of_calls().clear();
    Group g(hosts({0, 1, 2}), 5s);
    REQUIRE(g.mode() == comm::StreamGroupMode::peer);
    const auto t0 = clock_type::now();
    std::vector<std::vector<float>> data(3, std::vector<float>(37));
    const auto errors = on_threads(g, [&](int r, comm::Collectives& c) {
        for (std::size_t i = 0; i < 37; ++i)
            data[static_cast<std::size_t>(r)][i] = static_cast<float>(r + 1) * 0.5f + static_cast<float>(i);
        if (r == 2) std::this_thread::sleep_for(150ms);  // the late rank
        c.all_reduce_sum(DeviceSpan<float>(data[static_cast<std::size_t>(r)].data(), 37, Device::host(r)),
                         comm::CollectiveSite::user(1));
    });
    for (auto& e : errors) REQUIRE_FALSE(e);
    const auto enqueues = only(log_of_calls().snapshot(), {"all_reduce"});
    REQUIRE(enqueues.size() == 3);
    for (const auto& c : enqueues) CHECK(c.when - t0 >= 150ms);  // none enqueued while rank 2 was away
    for (int r = 0; r < 3; ++r)
        for (std::size_t i = 0; i < 37; ++i)
            REQUIRE(data[static_cast<std::size_t>(r)][i] == (0.5f + 1.0f) + 1.5f + 3.0f * static_cast<float>(i));
}

TEST_CASE("stream group: a collective mismatch is reported on every rank before any enqueue", "[comm]") {
    log_of_calls().clear();
    Group g(hosts({0, 1, 2}), 5s);
    std::vector<std::vector<double>> data(3, std::vector<double>(8, 1.0));
    const auto errors = on_threads(g, [&](int r, comm::Collectives& c) {
        const std::size_t n = r == 1 ? 7 : 8;  // rank 1 reaches a different collective
        c.all_reduce_sum(DeviceSpan<double>(data[static_cast<std::size_t>(r)].data(), n, Device::host(r)),
                         comm::CollectiveSite::user(2));
    });
    for (auto& e : errors) {
        REQUIRE(e);
        CHECK_THROWS_AS(std::rethrow_exception(e), CollectiveMismatch);
    }
    CHECK(only(log_of_calls().snapshot(), {"all_reduce", "broadcast", "rank_sum"}).empty());
}

TEST_CASE("stream group: 16-bit all-reduces carry their type in the tag, so fp16 against bf16 is a mismatch", "[comm]") {
    log_of_calls().clear();
    Group g(hosts({0, 1}), 5s);
    std::vector<std::vector<std::uint16_t>> data(2, std::vector<std::uint16_t>(6));
    const auto errors = on_threads(g, [&](int r, Group::communicator_type& c) {
        c.all_reduce_sum(DeviceSpan<std::uint16_t>(data[static_cast<std::size_t>(r)].data(), 6, Device::host(r)),
                         r == 0 ? comm::DType::f16 : comm::DType::bf16, comm::CollectiveSite::user(5));
    });
    for (auto& e : errors) {
        REQUIRE(e);
        CHECK_THROWS_WITH(std::rethrow_exception(e),
                          Catch::Contains("all_reduce_sum<half>[6]") && Catch::Contains("all_reduce_sum<bfloat16>[6]"));
    }
    CHECK(only(log_of_calls().snapshot(), {"all_reduce"}).empty());
}

TEST_CASE("stream group: a started all-reduce runs on the communication stream behind events both ways", "[comm]") {
    log_of_calls().clear();
    Group g(hosts({0, 1}), 5s);
    std::vector<std::vector<float>> data(2, std::vector<float>(5, 2.0f));
    std::map<int, std::thread::id> thread_of;
    std::mutex m;
    const auto errors = on_threads(g, [&](int r, comm::Collectives& c) {
        {
            std::lock_guard lock(m);
            thread_of[r] = std::this_thread::get_id();
        }
        c.start_all_reduce_sum(DeviceSpan<float>(data[static_cast<std::size_t>(r)].data(), 5, Device::host(r)),
                               comm::CollectiveSite::bucket(0));
        c.join();
    });
    for (auto& e : errors) REQUIRE_FALSE(e);
    const auto calls = log_of_calls().snapshot();
    for (int r = 0; r < 2; ++r) {
        std::vector<Call> mine;
        for (const auto& c : calls)
            if (c.thread == thread_of[r] && c.op != "make_stream" && c.op != "compute_stream") mine.push_back(c);
        long compute = 0, side = 0;
        for (const auto& c : calls)
            if (c.thread == thread_of[r] && c.op == "compute_stream") compute = c.stream;
        for (const auto& c : calls)
            if (c.thread == thread_of[r] && c.op == "make_stream") side = c.stream;
        REQUIRE(compute != 0);
        REQUIRE(side != 0);
        REQUIRE(mine.size() == 5);
        CHECK((mine[0].op == "record" && mine[0].stream == compute));                               // compute work so far
        CHECK((mine[1].op == "wait" && mine[1].stream == side && mine[1].event == mine[0].event));  // side waits for it
        CHECK((mine[2].op == "all_reduce" && mine[2].stream == side && mine[2].rank == r));
        CHECK((mine[3].op == "record" && mine[3].stream == side));                                     // the bucket is done
        CHECK((mine[4].op == "wait" && mine[4].stream == compute && mine[4].event == mine[3].event));  // join
    }
    for (auto& d : data)
        for (float v : d) CHECK(v == 4.0f);
}

// A started all-reduce that fails after its call was accepted onto the communication stream (a
// non-blocking communicator's settle throwing) still leaves its done event, so the join of the
// failed step orders the compute stream behind whatever the call left there.
TEST_CASE("stream group: a started all-reduce that fails once accepted is still joined", "[comm]") {
    log_of_calls().clear();
    RecordingApi::fail_accepted_rank() = 0;
    Group g(hosts({0, 1}), 5s);
    std::vector<std::vector<float>> data(2, std::vector<float>(5, 2.0f));
    std::map<int, std::thread::id> thread_of;
    std::mutex m;
    const auto errors = on_threads(
        g,
        [&](int r, comm::Collectives& c) {
            {
                std::lock_guard lock(m);
                thread_of[r] = std::this_thread::get_id();
            }
            try {
                c.start_all_reduce_sum(DeviceSpan<float>(data[static_cast<std::size_t>(r)].data(), 5, Device::host(r)),
                                       comm::CollectiveSite::bucket(0));
            } catch (...) {
                c.join();  // as a failed step's replica joins its started buckets
                throw;
            }
            c.join();
        },
        /*abort_on_error=*/true);
    RecordingApi::fail_accepted_rank() = -1;
    REQUIRE(errors[0]);
    CHECK_THROWS_AS(std::rethrow_exception(errors[0]), DeviceError);
    const auto calls = log_of_calls().snapshot();
    std::vector<Call> mine;
    long compute = 0;
    for (const auto& c : calls)
        if (c.thread == thread_of[0]) {
            if (c.op == "compute_stream") compute = c.stream;
            if (c.op == "record" || c.op == "wait" || c.op == "all_reduce") mine.push_back(c);
        }
    REQUIRE(compute != 0);
    REQUIRE(mine.size() == 5);
    CHECK(mine[2].op == "all_reduce");
    const long side = mine[2].stream;
    CHECK((mine[3].op == "record" && mine[3].stream == side));                                     // done, despite the throw
    CHECK((mine[4].op == "wait" && mine[4].stream == compute && mine[4].event == mine[3].event));  // the join
}

// A negative root once read as "all-reduce": a broadcast from -1 summed the buffers instead of
// failing. Both ends of the range are refused before anything is enqueued.
TEST_CASE("stream group: a broadcast root outside the group is refused, naming the ranks it takes", "[comm]") {
    for (const int root : {-1, 2}) {
        CAPTURE(root);
        log_of_calls().clear();
        Group g(hosts({0, 1}), 5s);
        std::vector<std::vector<float>> data(2, std::vector<float>(4, 1.0f));
        const auto errors = on_threads(g, [&](int r, comm::Collectives& c) {
            c.broadcast(DeviceSpan<float>(data[static_cast<std::size_t>(r)].data(), 4, Device::host(r)), root,
                        comm::CollectiveSite::user(5));
        });
        for (const auto& e : errors) {
            REQUIRE(e);
            CHECK_THROWS_WITH(std::rethrow_exception(e), Catch::Contains("pass a rank from 0 to 1"));
        }
        for (const auto& c : log_of_calls().snapshot()) CHECK(c.op != "broadcast");
        for (const auto& d : data) CHECK(d == std::vector<float>(4, 1.0f));
    }
}

TEST_CASE("stream group: replicas on one device sum in one rank-order kernel on rank 0's stream", "[comm]") {
    log_of_calls().clear();
    Group g(hosts({0, 0, 0}), 5s);
    REQUIRE(g.mode() == comm::StreamGroupMode::local);
    std::vector<std::vector<float>> data(3), broadcast(3);
    std::vector<std::thread::id> thread_of(3);
    const auto errors = on_threads(g, [&](int r, comm::Collectives& c) {  // no assertion here: Catch2 is single-threaded
        const auto ur = static_cast<std::size_t>(r);
        thread_of[ur] = std::this_thread::get_id();
        data[ur] = {0.1f * static_cast<float>(r + 1), 1e8f, -1e8f};
        c.all_reduce_sum(DeviceSpan<float>(data[ur].data(), 3, Device::host(0)), comm::CollectiveSite::user(3));
        broadcast[ur].assign(4, static_cast<float>(r));
        c.broadcast(DeviceSpan<float>(broadcast[ur].data(), 4, Device::host(0)), 2, comm::CollectiveSite::user(4));
    });
    for (auto& e : errors) REQUIRE_FALSE(e);
    for (const auto& b : broadcast) CHECK(b == std::vector<float>(4, 2.0f));
    const float expect = (0.1f + 0.2f) + 0.3f;  // rank order
    for (auto& d : data) CHECK(d[0] == expect);
    const auto calls = log_of_calls().snapshot();
    const auto sums = only(calls, {"rank_sum"});
    REQUIRE(sums.size() == 1);
    CHECK(sums[0].thread == thread_of[0]);
    CHECK(only(calls, {"copy"}).size() == 2);  // the broadcast: root 2 to ranks 0 and 1
    // Rank 0's stream waits for both peers' events before the kernel; each peer waits for rank 0's after.
    std::size_t kernel = 0;
    for (std::size_t i = 0; i < calls.size(); ++i)
        if (calls[i].op == "rank_sum") kernel = i;
    int waits_before = 0, waits_after = 0;
    for (std::size_t i = 0; i < calls.size(); ++i) {
        if (calls[i].op != "wait") continue;
        if (i < kernel && calls[i].thread == thread_of[0] && calls[i].stream == sums[0].stream) ++waits_before;
        if (i > kernel && calls[i].thread != thread_of[0]) ++waits_after;
    }
    CHECK(waits_before == 2);
    CHECK(waits_after >= 2);
    CHECK(only(calls, {"init", "all_reduce"}).empty());  // no communicator on one device
}

TEST_CASE("stream group: layouts it cannot serve are refused with the devices named", "[comm]") {
    CHECK_THROWS_WITH(Group(hosts({0, 0, 1}), 1s),
                      Catch::Contains("{host:0, host:0, host:1}") && Catch::Contains("not supported"));
    CHECK_THROWS_AS(Group(hosts({0, 0, 1}), 1s), NotImplemented);
    CHECK_THROWS_WITH(Group(hosts({0, 7}), 1s), Catch::Contains("no device host:7"));
    CHECK_THROWS_AS(Group(std::vector<Device>{Device::cuda(0)}, 1s), DeviceMismatch);
    CHECK(Group(hosts({3}), 1s).mode() == comm::StreamGroupMode::single);
    CHECK_THROWS_WITH(Group(std::vector<Device>(17, Device::host(0)), 1s), Catch::Contains("at most 16 replicas"));
}

TEST_CASE("stream group: DataParallel over it equals DataParallel over the host group, bit for bit", "[comm][parallel]") {
    const Net net = make_net();
    DataParallel<Net> reference(net, 3, small_buckets());
    const Trained want = train(reference, 3);
    for (const bool one_device : {false, true}) {
        DYNAMIC_SECTION((one_device ? "three replicas on one device" : "one replica per device")) {
            log_of_calls().clear();
            DataParallel<Net, Group> dp(net, one_device ? hosts({0, 0, 0}) : hosts({0, 1, 2}), small_buckets());
            const Trained got = train(dp, 3);
            CHECK(got.replicas_identical);
            REQUIRE(got.losses.size() == want.losses.size());
            for (std::size_t s = 0; s < got.losses.size(); ++s) CHECK(got.losses[s] == want.losses[s]);
            CHECK(same_bits(got.state, want.state));
            CHECK(dp.bucket_count() > 1);
        }
    }
}

TEST_CASE("stream group: every rank enqueues layer and bucket collectives in one order, on its own thread", "[comm][parallel]") {
    log_of_calls().clear();
    const Net net = make_net();
    DataParallel<Net, Group> dp(net, hosts({0, 1, 2}), small_buckets());
    log_of_calls().clear();
    train(dp, 2);
    const auto calls = only(log_of_calls().snapshot(), {"all_reduce", "broadcast"});
    std::map<int, std::vector<Call>> by_rank;
    for (const auto& c : calls) by_rank[c.rank].push_back(c);
    REQUIRE(by_rank.size() == 3);
    std::set<std::thread::id> threads;
    for (auto& [rank, seq] : by_rank) {
        REQUIRE(seq.size() == by_rank[0].size());
        for (std::size_t i = 0; i < seq.size(); ++i) {
            // The same collective (group, size) at the same position on every rank.
            CHECK(seq[i].group == by_rank[0][i].group);
            CHECK(seq[i].count == by_rank[0][i].count);
            CHECK(seq[i].thread == seq[0].thread);  // one thread per rank makes every call
        }
        threads.insert(seq[0].thread);
        CHECK(seq[0].thread != std::this_thread::get_id());
    }
    CHECK(threads.size() == 3);
    // Buckets (the gradient group) are enqueued while backward still runs: before SyncBatchNorm's
    // backward all-reduce (layer group) of the same step.
    const auto& seq = by_rank[0];
    const int layer_group = seq.front().group;  // the first collective of a step is SyncBatchNorm's forward
    bool bucket_then_layer = false;
    for (std::size_t i = 0; i + 1 < seq.size(); ++i)
        if (seq[i].group != layer_group && seq[i + 1].group == layer_group) bucket_then_layer = true;
    CHECK(bucket_then_layer);
    CHECK(dp.overlapped_buckets(0) > 0);
    // Layer collectives on the compute stream, buckets on another.
    std::set<long> layer_streams, bucket_streams;
    for (const auto& c : seq) (c.group == layer_group ? layer_streams : bucket_streams).insert(c.stream);
    CHECK(layer_streams.size() == 1);
    CHECK(bucket_streams.size() == 1);
    CHECK(*layer_streams.begin() != *bucket_streams.begin());
}

TEST_CASE("stream group: a replica that throws aborts every communicator, and the next step runs on new ones",
          "[comm][parallel]") {
    Failing model;
    log_of_calls().clear();
    DataParallel<Failing, Group> dp(model, hosts({0, 1, 2}), small_buckets());
    const auto inits_before = only(log_of_calls().snapshot(), {"init"}).size();
    REQUIRE(inits_before == 6);  // two groups of three
    nn::Sgd<> sgd({.lr = 0.05});
    const auto b = make_batch(6, 7);
    *dp.replica(0).fail = true;  // replicas share the flag with the prototype
    const auto t0 = clock_type::now();
    CHECK_THROWS_WITH(dp.train_step(b.x, b.labels, nn::SoftmaxCrossEntropy{}, sgd),
                      Catch::Contains("replica 1's backward failed"));
    CHECK(clock_type::now() - t0 < 2s);
    const auto calls = log_of_calls().snapshot();
    std::set<std::pair<int, int>> aborted;
    for (const auto& c : only(calls, {"abort"})) aborted.insert({c.group, c.rank});
    CHECK(aborted.size() == 6);                           // every communicator of both groups
    CHECK(only(calls, {"init"}).size() == inits_before);  // not rebuilt inside the failing call
    *dp.replica(0).fail = false;
    CHECK_NOTHROW(dp.train_step(b.x, b.labels, nn::SoftmaxCrossEntropy{}, sgd));
    CHECK(only(log_of_calls().snapshot(), {"init"}).size() == inits_before + 6);  // rebuilt by the next step
    // Within one process, blocking communicators (Note [blocking communicators]).
    for (const auto& c : only(log_of_calls().snapshot(), {"init"})) CHECK(c.blocking);
    CHECK(same_bits(state_of(dp.replica(0)), state_of(dp.replica(2))));
}

// A communicator's finalize waits for its work, a blocking one's without a deadline: teardown
// finalizes only once every rank's streams are idle; with one stuck (a kernel that never ends),
// it aborts them instead, within the group's timeout (Note [blocking communicators]).
TEST_CASE("stream group: teardown aborts instead of finalizing while a rank's stream is busy", "[comm][parallel]") {
    log_of_calls().clear();
    {
        const Net net = make_net();
        DataParallel<Net, Group> dp(net, hosts({0, 1}), small_buckets());
        train(dp, 1);
        log_of_calls().clear();
        RecordingApi::streams_busy() = true;
    }
    RecordingApi::streams_busy() = false;
    const auto calls = log_of_calls().snapshot();
    CHECK(only(calls, {"finalize", "destroy"}).empty());
    CHECK(only(calls, {"abort"}).size() == 4);  // both groups' two communicators
}

TEST_CASE("stream group: teardown finalizes every communicator, then destroys them, then the streams", "[comm][parallel]") {
    log_of_calls().clear();
    {
        const Net net = make_net();
        DataParallel<Net, Group> dp(net, hosts({0, 1}), small_buckets());
        train(dp, 1);
        log_of_calls().clear();
    }
    const auto calls = only(log_of_calls().snapshot(), {"finalize", "destroy", "destroy_stream"});
    REQUIRE(calls.size() == 12);  // per group: 2 finalize, 2 destroy, 2 streams
    for (int g = 0; g < 2; ++g) {
        const std::size_t o = static_cast<std::size_t>(g) * 6;
        CHECK(calls[o].op == "finalize");
        CHECK(calls[o + 1].op == "finalize");
        CHECK(calls[o + 2].op == "destroy");
        CHECK(calls[o + 3].op == "destroy");
        CHECK(calls[o + 4].op == "destroy_stream");
        CHECK(calls[o + 5].op == "destroy_stream");
        CHECK(calls[o].group == calls[o + 3].group);
    }
}

// ---- across processes ----------------------------------------------------------------------------
// "Processes" as threads of this one (thread_processes.hpp).

namespace {

using test::ThreadProcessGroup;

// Runs `body(p, process_group)` for every process on its own thread; returns per-process errors.
// Each process on a machine of its own, unless `one_machine`.
template <class F>
std::vector<std::exception_ptr> as_processes(int P, F body, bool one_machine = false) {
    return test::as_processes(P, std::move(body),
                              [one_machine](int p) { RecordingApi::test_machine() = one_machine ? 7 : 100 + p; });
}

// The ranks of the communicators made so far, by clique (the double's group of an init).
std::map<int, std::set<int>> ranks_by_clique() {
    std::map<int, std::set<int>> cliques;
    for (const auto& c : only(log_of_calls().snapshot(), {"init"})) {
        CHECK_FALSE(c.blocking);  // their init waits for other processes: non-blocking (Note [blocking communicators])
        cliques[c.group].insert(c.rank);
    }
    return cliques;
}

DataParallelOptions across(std::shared_ptr<comm::ProcessGroup> procs) {
    DataParallelOptions o = small_buckets();
    o.process_group = std::move(procs);
    return o;
}

}  // namespace

TEST_CASE("stream group across processes: 2 processes x 2 GPUs equal 4 GPUs in one process, bit for bit", "[comm][parallel]") {
    const Net net = make_net();
    DataParallel<Net> reference(net, 4, small_buckets());
    const Trained want = train(reference, 3);
    std::vector<Trained> got(2);
    log_of_calls().clear();
    const auto errors = as_processes(2, [&](int p, std::shared_ptr<comm::ProcessGroup> procs) {
        DataParallel<Net, Group> dp(net, hosts({0, 1}), across(procs));
        got[static_cast<std::size_t>(p)] = train(dp, 3, 2, p);
    });
    for (auto& e : errors) REQUIRE_FALSE(e);
    // One clique of 4 ranks per group, its ranks the global ones: 0, 1 from process 0, 2, 3 from process 1.
    const auto cliques = ranks_by_clique();
    REQUIRE(cliques.size() == 2);
    for (const auto& [group, ranks] : cliques) CHECK(ranks == std::set<int>{0, 1, 2, 3});
    for (const auto& g : got) {
        CHECK(g.replicas_identical);
        REQUIRE(g.losses.size() == want.losses.size());
        // The step's loss is summed per process, then over the processes: another order than one
        // process's four replicas, so its last bits may differ; the model's do not.
        for (std::size_t s = 0; s < g.losses.size(); ++s) CHECK(g.losses[s] == Approx(want.losses[s]).epsilon(1e-14));
        CHECK(same_bits(g.state, want.state));
    }
}

TEST_CASE("stream group across processes: replicas sharing a GPU sum locally, then over the processes", "[comm][parallel]") {
    // The same grouping as a host group across processes: (a0 + a1) + (a2 + a3), bit for bit.
    std::vector<Trained> want(2), got(2);
    const Net net = make_net();
    auto errors = as_processes(2, [&](int p, std::shared_ptr<comm::ProcessGroup> procs) {
        DataParallel<Net> dp(net, 2, across(procs));
        want[static_cast<std::size_t>(p)] = train(dp, 3, 2, p);
    });
    for (auto& e : errors) REQUIRE_FALSE(e);
    log_of_calls().clear();
    errors = as_processes(2, [&](int p, std::shared_ptr<comm::ProcessGroup> procs) {
        DataParallel<Net, Group> dp(net, hosts({0, 0}), across(procs));
        got[static_cast<std::size_t>(p)] = train(dp, 3, 2, p);
    });
    for (auto& e : errors) REQUIRE_FALSE(e);
    // Local rank 0 of each process alone holds a communicator, of the 2 processes.
    const auto cliques = ranks_by_clique();
    REQUIRE(cliques.size() == 2);
    for (const auto& [group, ranks] : cliques) CHECK(ranks == std::set<int>{0, 1});
    CHECK_FALSE(only(log_of_calls().snapshot(), {"rank_sum"}).empty());
    for (int p = 0; p < 2; ++p) {
        const auto& g = got[static_cast<std::size_t>(p)];
        const auto& w = want[static_cast<std::size_t>(p)];
        CHECK(g.replicas_identical);
        for (std::size_t s = 0; s < g.losses.size(); ++s) CHECK(g.losses[s] == w.losses[s]);
        CHECK(same_bits(g.state, w.state));
    }
    CHECK(same_bits(got[0].state, got[1].state));
}

TEST_CASE(
    "host group across processes: one replica per process adds as threads of one process, and different counts are refused alike",
    "[comm][parallel]") {
    const Net net = make_net();
    DataParallel<Net> reference(net, 2, small_buckets());
    const Trained want = train(reference, 3);
    std::vector<Trained> got(2);
    std::vector<int> global_sizes(2, 0);
    auto errors = as_processes(2, [&](int p, std::shared_ptr<comm::ProcessGroup> procs) {
        DataParallel<Net> dp(net, 1, across(procs));
        global_sizes[static_cast<std::size_t>(p)] = dp.global_size();  // checked here: Catch asserts on this thread only
        got[static_cast<std::size_t>(p)] = train(dp, 3, 2, p);
    });
    for (auto& e : errors) REQUIRE_FALSE(e);
    CHECK(global_sizes == std::vector<int>{2, 2});
    for (const auto& g : got) {
        for (std::size_t s = 0; s < g.losses.size(); ++s) CHECK(g.losses[s] == Approx(want.losses[s]).epsilon(1e-14));
        CHECK(same_bits(g.state, want.state));
    }
    errors = as_processes(
        2, [&](int p, std::shared_ptr<comm::ProcessGroup> procs) { DataParallel<Net> dp(net, p + 1, across(procs)); });
    for (auto& e : errors) {
        REQUIRE(e);
        CHECK_THROWS_WITH(std::rethrow_exception(e), Catch::Contains("they run different replica counts (1, 2, by process)"));
    }
    // Processes in different math modes would round differently (Note [math modes]): all refuse.
    errors = as_processes(2, [&](int p, std::shared_ptr<comm::ProcessGroup> procs) {
        auto o = across(procs);
        o.math = p == 0 ? Math::strict_fp32 : Math::tf32;
        DataParallel<Net> dp(net, 1, o);
    });
    for (auto& e : errors) {
        REQUIRE(e);
        CHECK_THROWS_WITH(std::rethrow_exception(e),
                          Catch::Contains("they run different math modes (strict_fp32/fp32/fp32, tf32/fp32/fp32, by process, "
                                          "math/precision/gradient_precision); give every process the same "
                                          "DataParallelOptions::math, ::precision and ::gradient_precision"));
    }
}

TEST_CASE("stream group across processes: a mismatch between processes is caught before any enqueue", "[comm]") {
    log_of_calls().clear();
    std::vector<std::vector<std::exception_ptr>> rank_errors(2);
    const auto errors = as_processes(2, [&](int p, std::shared_ptr<comm::ProcessGroup> procs) {
        Group g(hosts({0, 1}), 5s, procs, comm::ProcessGroup::gradients);
        std::vector<std::vector<float>> data(2, std::vector<float>(8, 1.0f));
        rank_errors[static_cast<std::size_t>(p)] = on_threads(
            g,
            [&](int r, comm::Collectives& c) {
                const std::size_t n = p == 1 ? 7 : 8;  // both replicas of process 1 agree with each other
                c.all_reduce_sum(DeviceSpan<float>(data[static_cast<std::size_t>(r)].data(), n, Device::host(r)),
                                 comm::CollectiveSite::user(3));
            },
            true);
    });
    for (auto& e : errors) REQUIRE_FALSE(e);
    for (int p = 0; p < 2; ++p) {
        const auto& e = rank_errors[static_cast<std::size_t>(p)];
        REQUIRE(e[0]);  // the leader: the processes' tags differ
        CHECK_THROWS_WITH(std::rethrow_exception(e[0]),
                          Catch::Contains("all_reduce_sum<float>[8]") && Catch::Contains("all_reduce_sum<float>[7]"));
        REQUIRE(e[1]);  // its peer: the group was aborted
        CHECK_THROWS_AS(std::rethrow_exception(e[1]), CollectiveAborted);
    }
    CHECK(only(log_of_calls().snapshot(), {"all_reduce", "broadcast", "rank_sum"}).empty());
}

TEST_CASE("stream group across processes: processes that lay out their replicas differently are refused alike", "[comm]") {
    const auto errors = as_processes(2, [&](int p, std::shared_ptr<comm::ProcessGroup> procs) {
        Group g(p == 0 ? hosts({0, 1}) : hosts({0, 0}), 5s, procs, comm::ProcessGroup::layer);
    });
    for (auto& e : errors) {
        REQUIRE(e);
        CHECK_THROWS_WITH(std::rethrow_exception(e),
                          Catch::Contains("differently (2 on as many GPUs, 2 on one GPU, by process)"));
    }
    const auto counts = as_processes(2, [&](int p, std::shared_ptr<comm::ProcessGroup> procs) {
        Group g(p == 0 ? hosts({0, 1}) : hosts({0, 1, 2}), 5s, procs, comm::ProcessGroup::layer);
    });
    for (auto& e : counts) {
        REQUIRE(e);
        CHECK_THROWS_WITH(std::rethrow_exception(e),
                          Catch::Contains("differently (2 on as many GPUs, 3 on as many GPUs, by process)"));
    }
    // Two processes of one machine on one GPU: NCCL would refuse it; refused by all, naming the GPU.
    const auto shared = as_processes(
        2,
        [&](int p, std::shared_ptr<comm::ProcessGroup> procs) {
            Group g(p == 0 ? hosts({0, 1}) : hosts({2, 1}), 5s, procs, comm::ProcessGroup::layer);
        },
        true);
    for (auto& e : shared) {
        REQUIRE(e);
        CHECK_THROWS_WITH(std::rethrow_exception(e),
                          Catch::Contains("processes 0 and 1 use the same GPU (this process's host:1"));
    }
    CHECK_FALSE(as_processes(
        2,
        [&](int p, std::shared_ptr<comm::ProcessGroup> procs) {  // GPUs of their own: fine
            Group g(p == 0 ? hosts({0, 1}) : hosts({2, 3}), 5s, procs, comm::ProcessGroup::layer);
        },
        true)[0]);
    // A layout one process refuses (a mix) is refused by every process alike, none left waiting.
    const auto t0 = clock_type::now();
    const auto mixed = as_processes(2, [&](int p, std::shared_ptr<comm::ProcessGroup> procs) {
        Group g(p == 0 ? hosts({0, 1}) : hosts({0, 0, 1}), 5s, procs, comm::ProcessGroup::layer);
    });
    CHECK(clock_type::now() - t0 < 2s);
    for (auto& e : mixed) {
        REQUIRE(e);
        CHECK_THROWS_WITH(std::rethrow_exception(e), Catch::Contains("process 1 of 2: replicas on {host:0, host:0, host:1}"));
    }
}

TEST_CASE("stream group across processes: a failing replica fails every process's step, naming its global rank",
          "[comm][parallel]") {
    Failing model;
    *model.fail = true;  // global rank 1 (process 0, replica 1) throws; every replica shares the flag
    std::vector<std::string> what(2);
    std::vector<char> later_failed(2, 0);  // not vector<bool>: each process writes its own element
    std::vector<clock_type::duration> took(2);
    std::atomic<int> first_done{0};
    const auto errors = as_processes(2, [&](int p, std::shared_ptr<comm::ProcessGroup> procs) {
        DataParallel<Failing, Group> dp(model, hosts({0, 1}), across(procs));
        nn::Sgd<> sgd({.lr = 0.05});
        const auto b = make_batch(4, 9);  // one row per global rank
        Tensor<float> x(Shape{2, 2, 8, 8});
        std::copy(b.x.span().begin() + p * 2 * 128, b.x.span().begin() + (p + 1) * 2 * 128, x.span().begin());
        const std::vector<std::int64_t> labels(b.labels.begin() + p * 2, b.labels.begin() + (p + 1) * 2);
        const auto t0 = clock_type::now();
        try {
            dp.train_step(x, labels, nn::SoftmaxCrossEntropy{}, sgd);
        } catch (const std::exception& e) {
            what[static_cast<std::size_t>(p)] = e.what();
        }
        took[static_cast<std::size_t>(p)] = clock_type::now() - t0;
        if (++first_done == 2) *model.fail = false;
        while (first_done.load() < 2) std::this_thread::yield();
        try {  // the group is not rebuilt across processes: the next step fails at once
            dp.train_step(x, labels, nn::SoftmaxCrossEntropy{}, sgd);
        } catch (const std::exception&) {
            later_failed[static_cast<std::size_t>(p)] = 1;
        }
    });
    for (auto& e : errors) REQUIRE_FALSE(e);
    CHECK_THAT(what[0], Catch::Contains("replica 1's backward failed"));
    CHECK_THAT(what[1],
               Catch::Contains("global rank 1 (process 0, replica 1)") && Catch::Contains("replica 1's backward failed"));
    for (int p = 0; p < 2; ++p) {
        CHECK(took[static_cast<std::size_t>(p)] < 2s);
        CHECK(later_failed[static_cast<std::size_t>(p)]);
    }
}

TEST_CASE("stream group across processes: a replica's wait on its GPU learns of another process's failure", "[comm]") {
    std::vector<std::string> seen(2);
    std::atomic<int> made{0};
    const auto errors = as_processes(2, [&](int p, std::shared_ptr<comm::ProcessGroup> procs) {
        Group g(hosts({0, 1}), 5s, procs, comm::ProcessGroup::layer);
        ++made;
        while (made.load() < 2) std::this_thread::yield();
        if (p == 1) {
            g.abortable()->abort("replica 0 ran out of memory", 0);
            return;
        }
        const auto until = clock_type::now() + 2s;
        while (clock_type::now() < until) {  // as cuda::poll_event consults the watch between polls
            try {
                g.communicator(1).poll();
            } catch (const CollectiveAborted& e) {
                seen[0] = e.what();
                break;
            }
            std::this_thread::sleep_for(1ms);
        }
    });
    for (auto& e : errors) REQUIRE_FALSE(e);
    CHECK_THAT(seen[0], Catch::Contains("global rank 2 (process 1, replica 0)") && Catch::Contains("ran out of memory"));
}

TEST_CASE("stream group across processes: a process passing on another's failure names no replica of its own", "[comm]") {
    std::vector<std::string> seen(3);
    std::atomic<int> step{0};
    const auto errors = as_processes(3, [&](int p, std::shared_ptr<comm::ProcessGroup> procs) {
        Group g(hosts({0, 1}), 5s, procs, comm::ProcessGroup::layer);
        const auto wait_for = [&](int s) {
            while (step.load() < s) std::this_thread::yield();
        };
        ++step;
        wait_for(3);
        if (p == 0) {  // replica 1 of process 0, global rank 1, fails
            g.abortable()->abort("replica 1 ran out of memory", 1);
            ++step;
            return;
        }
        wait_for(4);
        if (p == 1) {  // learns of it as a replica's wait would, and its pool aborts its group with the sender's rank
            try {
                g.communicator(0).poll();
            } catch (const CollectiveAborted& e) {
                seen[1] = e.what();
                g.abortable()->abort(e.message(), e.rank());
            }
            ++step;
            return;
        }
        wait_for(5);
        try {  // the newest abort is process 1's, passing process 0's on
            g.communicator(0).poll();
        } catch (const CollectiveAborted& e) {
            seen[2] = e.what();
        }
    });
    for (auto& e : errors) REQUIRE_FALSE(e);
    CHECK_THAT(seen[1], Catch::Contains("global rank 1 (process 0, replica 1)"));
    CHECK_THAT(seen[2], Catch::StartsWith("[rank 1] process 1 failed: process 1: "));  // no replica of process 1 named
    CHECK_THAT(seen[2], Catch::Contains("global rank 1 (process 0, replica 1)") && Catch::Contains("ran out of memory"));
    CHECK_THAT(seen[2], !Catch::Contains("(process 1, replica"));
}

TEST_CASE("stream group across processes: replicas waiting for their leader's exchange wait as long as the processes may",
          "[comm]") {
    // The group's own timeout is 200 ms; process 1 comes 500 ms late. Process 0's rank 0 waits for
    // it in agree (the process group's timeout), its rank 1 for rank 0: neither gives up, and no
    // local replica is blamed for a late process.
    std::vector<std::vector<std::exception_ptr>> rank_errors(2);
    std::vector<std::vector<std::vector<float>>> data(2, std::vector<std::vector<float>>(2, std::vector<float>(4, 1.0f)));
    const auto errors = as_processes(2, [&](int p, std::shared_ptr<comm::ProcessGroup> procs) {
        Group g(hosts({0, 1}), 200ms, procs, comm::ProcessGroup::layer);
        auto& mine = data[static_cast<std::size_t>(p)];
        if (p == 1) std::this_thread::sleep_for(500ms);
        rank_errors[static_cast<std::size_t>(p)] = on_threads(
            g,
            [&](int r, comm::Collectives& c) {
                c.all_reduce_sum(DeviceSpan<float>(mine[static_cast<std::size_t>(r)].data(), 4, Device::host(r)),
                                 comm::CollectiveSite::user(8));
            },
            true);
    });
    for (auto& e : errors) REQUIRE_FALSE(e);
    for (const auto& per_process : data)
        for (const auto& v : per_process) CHECK(v[0] == 4.0f);
    for (auto& per_process : rank_errors)
        for (auto& e : per_process) CHECK_FALSE(e);
}
