// SPDX-License-Identifier: MIT
//! No unbounded wait and no anonymous failure (issue #14, item 7): a replica stuck outside any
//! collective cannot hold a call past the group's timeout, a `Timeout` names the replica that was
//! stuck (not the one that waited for it), and an exception that is not lockstep's own reaches the
//! caller with the rank that threw it.
#include <catch2/catch.hpp>

#include <lockstep/nn.hpp>
#include <lockstep/host.hpp>
#include <lockstep/parallel.hpp>

#include <atomic>
#include <chrono>
#include <cmath>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

using namespace lockstep;
using namespace std::chrono_literals;
using clock_type = std::chrono::steady_clock;
using Catch::Matchers::Contains;

namespace {

using Mlp = nn::Sequential<nn::Linear<>, nn::ReLU<>, nn::Linear<>>;

Mlp make_mlp() {
    nn::Generator g(11);
    return Mlp(nn::Linear<>(4, 8, true, g), nn::ReLU<>(), nn::Linear<>(8, 3, true, g));
}

// What the test tells the replicas of a `Sticky` model; the prototype and its replicas share it.
struct Hold {
    std::atomic<bool> stuck{false};    // replica 1 blocks in forward, outside any collective
    std::atomic<bool> release{false};  // ... until this is set
    std::atomic<bool> fail{false};     // replica 1 throws a std::runtime_error in forward
    std::atomic<int> late_ms{0};       // replica 1 sleeps this long in forward, once its peers are in backward
    std::atomic<int> in_backward{0};   // replicas other than 1 that entered backward this step
};

struct Sticky {
    using backend = Host;
    Mlp net;
    std::shared_ptr<Hold> hold = std::make_shared<Hold>();

    Tensor<float> forward(const nn::Context<>& ctx, Tensor<float> x) {
        if (ctx.rank == 1 && hold->fail) throw std::runtime_error("replica 1's layer failed");
        if (ctx.rank == 1 && hold->late_ms > 0) {
            // Late from the moment its peers wait for it (they wait in backward, for the gradient
            // all-reduce), whatever the machine's load made of the time before: an event, not luck.
            const auto cap = clock_type::now() + 10s;  // peers that never get there: the test fails, slowly
            while (hold->in_backward.load() < ctx.world - 1 && clock_type::now() < cap) std::this_thread::sleep_for(1ms);
            std::this_thread::sleep_for(std::chrono::milliseconds(hold->late_ms.load()));
        }
        if (ctx.rank == 1 && hold->stuck) {
            // As a replica spinning in an allocator after a peer failed. Capped, so that a library
            // that waits for it makes the test fail slowly instead of hanging it.
            const auto cap = clock_type::now() + 5s;
            while (!hold->release && clock_type::now() < cap) std::this_thread::sleep_for(1ms);
        }
        return net.forward(ctx, std::move(x));
    }
    Tensor<float> backward(const nn::Context<>& ctx, const Tensor<float>& dy) {
        if (ctx.rank != 1) hold->in_backward.fetch_add(1);
        return net.backward(ctx, dy);
    }
    template <class V>
    void visit(V&& v) {
        v.module("net", net);
    }
};

struct Batch {
    Tensor<float> x{Shape{6, 4}};
    std::vector<std::int64_t> labels{0, 1, 2, 0, 1, 2};
    Batch() {
        float v = 0.1f;
        for (auto& e : x.span()) e = (v += 0.37f) - 1.0f;
    }
};

double ms_since(clock_type::time_point t0) { return std::chrono::duration<double, std::milli>(clock_type::now() - t0).count(); }

}  // namespace

TEST_CASE("A replica stuck outside any collective cannot hold train_step past the timeout, and the object refuses later calls",
          "[runtime]") {
    Sticky proto{make_mlp()};
    const auto hold = proto.hold;
    auto dp = std::make_unique<DataParallel<Sticky>>(proto, 3, DataParallelOptions{.timeout = 200ms});
    nn::Sgd sgd({.lr = 0.1});
    const Batch b;
    REQUIRE(std::isfinite(dp->train_step(b.x, b.labels, nn::SoftmaxCrossEntropy{}, sgd).loss));

    hold->stuck = true;
    auto t0 = clock_type::now();
    bool threw = false, nested_names_it = false;
    try {
        dp->train_step(b.x, b.labels, nn::SoftmaxCrossEntropy{}, sgd);
    } catch (const Timeout& e) {
        threw = true;
        INFO(e.what());
        CHECK(e.rank() == 1);  // the replica that was stuck, not one that waited for it
        CHECK_THAT(e.what(), Contains("replica 1 did not finish within 200 ms"));
        // The first failure (a peer's collective timing out on rank 1) is nested inside.
        try {
            std::rethrow_if_nested(e);
        } catch (const Timeout& inner) {
            nested_names_it = inner.rank() == 1;
        } catch (...) {
        }
    }
    // The peers' collectives time out after 200 ms; the call gives up on rank 1 200 ms later.
    const double first_ms = ms_since(t0);
    CHECK(threw);
    CHECK(nested_names_it);
    CHECK(first_ms < 1500);

    // Replica 1's thread still runs the step: every later call refuses, at once, naming it.
    t0 = clock_type::now();
    threw = false;
    try {
        dp->train_step(b.x, b.labels, nn::SoftmaxCrossEntropy{}, sgd);
    } catch (const Timeout& e) {
        threw = true;
        INFO(e.what());
        CHECK(e.rank() == 1);
        CHECK_THAT(e.what(), Contains("replica 1") && Contains("make a new DataParallel"));
    }
    CHECK(threw);
    CHECK(ms_since(t0) < 100);
    CHECK_THROWS_AS(dp->forward(b.x), Timeout);
    CHECK_THROWS_AS(dp->checkpoint(), Timeout);

    // The destructor waits a bounded time for the stuck thread, then leaves it behind.
    t0 = clock_type::now();
    dp.reset();
    CHECK(ms_since(t0) < 1500);
    // Once it wakes, the abandoned thread unwinds on its own and lets go of the replicas (their
    // copies of `hold`): the state it used was its own, not the caller's or the destroyed object's.
    hold->release = true;
    const auto cap = clock_type::now() + 5s;
    while (hold.use_count() > 2 && clock_type::now() < cap) std::this_thread::sleep_for(2ms);
    CHECK(hold.use_count() == 2);  // `proto` and `hold`
}

// Issue 43: under load (2 cores, load average 4-6) the peers used to reach their wait so late
// that replica 1 (sleeping from its own forward) came back before they timed out. Replica 1 now
// sleeps from the moment both peers are in backward, where they wait for it, for 1.5 timeouts:
// the peers time out half a timeout before it comes back, and the call's grace (a timeout after
// the first failure) ends half a timeout after; scheduling delays below that cannot flip it.
TEST_CASE("A replica late past the timeout but back within the grace fails the step with a Timeout naming it, and no more",
          "[runtime]") {
    Sticky proto{make_mlp()};
    DataParallel<Sticky> dp(proto, 3, {.timeout = 1000ms});
    nn::Sgd sgd({.lr = 0.1});
    const Batch b;
    proto.hold->late_ms = 1500;  // after the peers wait: they time out at 1000 ms, the call would give up at 2000 ms
    const auto t0 = clock_type::now();
    bool threw = false;
    try {
        dp.train_step(b.x, b.labels, nn::SoftmaxCrossEntropy{}, sgd);
    } catch (const ReplicaStuck&) {
        FAIL("gave up on a replica that came back in time");
    } catch (const Timeout& e) {
        threw = true;
        INFO(e.what());
        CHECK(e.rank() == 1);  // the late replica, not a peer that waited for it
        CHECK_THAT(e.what(), Contains("ranks that never arrived: 1"));
    }
    CHECK(threw);
    const double waited = ms_since(t0);
    CHECK(waited >= 1500);  // the call waited for replica 1 to come back
    CHECK(waited < 5000);
    proto.hold->late_ms = 0;
    CHECK(std::isfinite(dp.train_step(b.x, b.labels, nn::SoftmaxCrossEntropy{}, sgd).loss));  // still usable
}

TEST_CASE("A barrier's Timeout is attributed to the replica that never arrived, not to the one that waited", "[runtime]") {
    SECTION("the barrier itself") {
        AbortableBarrier barrier(2, 50ms);
        try {
            barrier.arrive_and_wait(0);  // rank 1 never comes
            FAIL("no throw");
        } catch (const Timeout& e) {
            CHECK(e.rank() == 1);
            CHECK_THAT(e.what(), Contains("ranks that never arrived: 1"));
        }
    }
    SECTION("through a pool, whose replicas 0 and 1 waited") {
        AbortableBarrier barrier(3, 100ms);
        ReplicaPool pool(3);
        try {
            pool.run([&](int r) {
                if (r == 2) return;  // never arrives
                barrier.arrive_and_wait(r);
            });
            FAIL("no throw");
        } catch (const Timeout& e) {
            CHECK(e.rank() == 2);
            CHECK(std::string(e.what()).rfind("[rank 2] barrier timed out", 0) == 0);
        }
    }
}

TEST_CASE("An exception that is not lockstep's reaches the caller with the rank that threw it, the original nested",
          "[runtime]") {
    SECTION("ReplicaPool") {
        ReplicaPool pool(3);
        bool typed = false;
        try {
            pool.run([](int r) {
                if (r == 1) throw std::out_of_range("index 7 is past the end");
            });
        } catch (const Error& e) {
            typed = true;
            CHECK(e.rank() == 1);
            CHECK(e.message() == "index 7 is past the end");  // the original message, unchanged
            CHECK(std::string(e.what()) == "[rank 1] index 7 is past the end");
            CHECK_THROWS_AS(std::rethrow_if_nested(e), std::out_of_range);
        } catch (...) {
        }
        CHECK(typed);
        typed = false;
        try {
            pool.run([](int r) {
                if (r == 2) throw 42;  // not even a std::exception
            });
        } catch (const Error& e) {
            typed = true;
            CHECK(e.rank() == 2);
            CHECK_THROWS_AS(std::rethrow_if_nested(e), int);
        } catch (...) {
        }
        CHECK(typed);
        std::atomic<int> ran{0};
        pool.run([&](int) { ++ran; });  // still usable
        CHECK(ran == 3);
    }
    SECTION("DataParallel::train_step") {
        Sticky proto{make_mlp()};
        DataParallel<Sticky> dp(proto, 3, {.timeout = 60s});
        nn::Sgd sgd({.lr = 0.1});
        const Batch b;
        proto.hold->fail = true;
        bool typed = false;
        try {
            dp.train_step(b.x, b.labels, nn::SoftmaxCrossEntropy{}, sgd);
        } catch (const Error& e) {
            typed = true;
            CHECK(e.rank() == 1);
            CHECK(std::string(e.what()) == "[rank 1] replica 1's layer failed");
        } catch (...) {
        }
        CHECK(typed);
        proto.hold->fail = false;
        CHECK(std::isfinite(dp.train_step(b.x, b.labels, nn::SoftmaxCrossEntropy{}, sgd).loss));
    }
}

TEST_CASE("ReplicaPool gives up on a stuck replica the timeout after a peer failed, and refuses later jobs", "[runtime]") {
    auto pool = std::make_unique<ReplicaPool>(3);
    pool->set_timeout(150ms);
    CHECK(pool->timeout() == 150ms);
    // The job owns what it touches (Note [stuck replicas]): `release` is captured by value.
    auto release = std::make_shared<std::atomic<bool>>(false);
    const auto t0 = clock_type::now();
    bool threw = false;
    try {
        pool->run([release](int r) {
            if (r == 0) throw InvalidArgument("replica 0 failed first");
            if (r == 1) std::this_thread::sleep_for(30ms);  // finishes after rank 0 failed
            if (r == 2)
                while (!*release) std::this_thread::sleep_for(1ms);
        });
    } catch (const ReplicaStuck& e) {
        threw = true;
        INFO(e.what());
        CHECK(e.rank() == 2);
        CHECK(e.stuck_ranks() == std::vector<int>{2});
        CHECK_THAT(e.what(),
                   Contains("replica 2 did not finish within 150 ms after rank 0 failed: [rank 0] replica 0 failed first"));
        CHECK_THROWS_AS(std::rethrow_if_nested(e), InvalidArgument);  // the first failure, nested
    }
    CHECK(threw);
    CHECK(ms_since(t0) < 1000);
    CHECK_FALSE(pool->usable());
    CHECK(pool->stuck_ranks() == std::vector<int>{2});
    CHECK_THROWS_AS(pool->run([](int) {}), ReplicaStuck);
    CHECK_THROWS_WITH(pool->check_usable("my loop"), Contains("my loop: unusable since an earlier call gave up on replica 2"));
    // It comes back: the pool stays unusable, and the destructor joins every thread at once.
    *release = true;
    const auto cap = clock_type::now() + 5s;
    while (release.use_count() > 1 && clock_type::now() < cap) std::this_thread::sleep_for(1ms);
    CHECK_THROWS_AS(pool->run([](int) {}), ReplicaStuck);
    const auto t1 = clock_type::now();
    pool.reset();
    CHECK(ms_since(t1) < 100);
}

TEST_CASE("ReplicaPool never waits forever: with no failure, the others have the timeout after the first finished", "[runtime]") {
    auto pool = std::make_unique<ReplicaPool>(3, ReplicaPool::ThreadInit{}, CpuBinding::automatic, 150ms);
    CHECK(pool->timeout() == 150ms);
    CHECK_THROWS_AS(pool->set_timeout(0ms), InvalidArgument);
    // A replica slower than the others, but within the timeout, is waited for.
    std::atomic<int> ran{0};
    pool->run([&](int r) {
        if (r == 1) std::this_thread::sleep_for(30ms);
        ++ran;
    });
    CHECK(ran == 3);

    auto release = std::make_shared<std::atomic<bool>>(false);
    const auto t0 = clock_type::now();
    bool threw = false;
    try {
        pool->run([release](int r) {
            if (r == 1)
                while (!*release) std::this_thread::sleep_for(1ms);
        });
    } catch (const ReplicaStuck& e) {
        threw = true;
        INFO(e.what());
        CHECK(e.rank() == 1);
        CHECK_THAT(e.what(), Contains("replica 1 did not finish within 150 ms after rank") && Contains("finished"));
        bool nested = false;
        try {
            std::rethrow_if_nested(e);
        } catch (...) {
            nested = true;
        }
        CHECK_FALSE(nested);  // nothing failed before
    }
    CHECK(threw);
    CHECK(ms_since(t0) < 1000);
    // Destroyed while replica 1 is still stuck: a bounded wait (the timeout), then it is left behind.
    const auto t1 = clock_type::now();
    pool.reset();
    const double destroy_ms = ms_since(t1);
    CHECK(destroy_ms >= 100);
    CHECK(destroy_ms < 1000);
    // The abandoned thread still holds its job, and finishes it when it can.
    CHECK(release.use_count() == 2);
    *release = true;
    const auto cap = clock_type::now() + 5s;
    while (release.use_count() > 1 && clock_type::now() < cap) std::this_thread::sleep_for(1ms);
    CHECK(release.use_count() == 1);
}

TEST_CASE("ReplicaPool's constructor gives up on a ThreadInit that does not return", "[runtime]") {
    auto release = std::make_shared<std::atomic<bool>>(false);
    const auto t0 = clock_type::now();
    try {
        ReplicaPool pool(
            2,
            [release](int r) {
                if (r == 1)
                    while (!*release) std::this_thread::sleep_for(1ms);
            },
            CpuBinding::none, 100ms);
        FAIL("no throw");
    } catch (const ReplicaStuck& e) {
        CHECK(e.rank() == 1);
        CHECK_THAT(e.what(), Contains("replica 1 did not finish starting (its ThreadInit) within 100 ms"));
    }
    CHECK(ms_since(t0) < 1000);
    *release = true;
    const auto cap = clock_type::now() + 5s;
    while (release.use_count() > 1 && clock_type::now() < cap) std::this_thread::sleep_for(1ms);
    CHECK(release.use_count() == 1);
}

TEST_CASE("DataParallel::forward on a model without collectives does not wait forever for a stuck replica", "[runtime]") {
    Sticky proto{make_mlp()};
    const auto hold = proto.hold;
    auto dp = std::make_unique<DataParallel<Sticky>>(proto, 2, DataParallelOptions{.timeout = 150ms});
    const Batch b;
    std::atomic<int> visited{0};
    const auto visit = [&visited](Sticky&, nn::Context<>&) { ++visited; };
    dp->parallel_apply(visit);                                               // a const lvalue: referenced
    dp->parallel_apply([&visited](Sticky&, nn::Context<>&) { ++visited; });  // a temporary: the job owns it
    CHECK(visited == 4);
    hold->stuck = true;
    const auto t0 = clock_type::now();
    try {
        dp->forward(b.x);
        FAIL("no throw");
    } catch (const ReplicaStuck& e) {
        CHECK(e.stuck_ranks() == std::vector<int>{1});
        CHECK_THAT(e.what(), Contains("replica 1 did not finish within 150 ms after rank 0 finished"));
    }
    CHECK(ms_since(t0) < 1000);
    CHECK_THROWS_AS(dp->parallel_apply([](Sticky&, nn::Context<>&) {}), ReplicaStuck);
    CHECK_THROWS_AS(dp->resync(), ReplicaStuck);
    CHECK_THROWS_AS(dp->load(nn::Checkpoint()), ReplicaStuck);
    hold->release = true;  // it comes back within the destructor's wait: joined, nothing left behind
    dp.reset();
    CHECK(hold.use_count() == 2);  // `proto` and `hold`: the replicas are gone
}
