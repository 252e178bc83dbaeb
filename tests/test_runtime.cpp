// SPDX-License-Identifier: MIT
//! Tests of runtime/: ReplicaPool (persistent threads, failure handling) and AbortableBarrier.
#include <catch2/catch.hpp>

#include <lockstep/lockstep.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <set>
#include <stdexcept>
#include <thread>
#include <vector>

using namespace lockstep;
using namespace std::chrono_literals;
using clock_type = std::chrono::steady_clock;

TEST_CASE("ReplicaPool runs a job on every replica on persistent threads", "[runtime]") {
    const int n = GENERATE(1, 2, 3, 8);
    ReplicaPool pool(n);
    REQUIRE(pool.size() == n);
    std::vector<std::thread::id> first(static_cast<std::size_t>(n)), second(static_cast<std::size_t>(n));
    std::vector<int> ranks(static_cast<std::size_t>(n), -1);
    pool.run([&](int r) {
        first[static_cast<std::size_t>(r)] = std::this_thread::get_id();
        ranks[static_cast<std::size_t>(r)] = ReplicaPool::current_rank();
    });
    pool.run([&](int r) { second[static_cast<std::size_t>(r)] = std::this_thread::get_id(); });
    CHECK(first == second);  // same threads, no per-job creation
    CHECK(std::set<std::thread::id>(first.begin(), first.end()).size() == static_cast<std::size_t>(n));
    for (int r = 0; r < n; ++r) CHECK(ranks[static_cast<std::size_t>(r)] == r);
    CHECK(ReplicaPool::current_rank() == -1);
}

TEST_CASE("ReplicaPool rethrows the first failure with its rank and stays usable", "[runtime]") {
    ReplicaPool pool(4);
    try {
        pool.run([](int r) {
            if (r == 2) throw InvalidArgument("replica two is unhappy");
        });
        FAIL("no throw");
    } catch (const InvalidArgument& e) {
        CHECK(e.rank() == 2);
        CHECK(std::string(e.what()).find("replica two is unhappy") != std::string::npos);
    }
    // An exception of another type comes wrapped with its rank, the original nested inside.
    try {
        pool.run([](int r) {
            if (r == 0) throw std::out_of_range("foreign exception type");
        });
        FAIL("no throw");
    } catch (const ReplicaError& e) {
        CHECK(e.rank() == 0);
        CHECK(e.message() == "foreign exception type");
        CHECK_THROWS_AS(std::rethrow_if_nested(e), std::out_of_range);
    }
    std::atomic<int> count{0};
    pool.run([&](int) { ++count; });
    CHECK(count == 4);
}

TEST_CASE("ReplicaPool rejects bad use", "[runtime]") {
    CHECK_THROWS_AS(ReplicaPool(0), InvalidArgument);
    CHECK_THROWS_AS(ReplicaPool(-3), InvalidArgument);
    ReplicaPool pool(2);
    CHECK_THROWS_AS(pool.run([&](int) { pool.run([](int) {}); }), UsageError);
    CHECK_THROWS_AS(pool.attach(nullptr), InvalidArgument);
}

TEST_CASE("ReplicaPool rolls back when a thread fails to initialise", "[runtime]") {
    std::atomic<int> inits{0};
    CHECK_THROWS_WITH(ReplicaPool(4,
                                  [&](int r) {
                                      ++inits;
                                      if (r == 3) throw std::runtime_error("cannot bind device 3");
                                  }),
                      "[rank 3] cannot bind device 3");
    CHECK(inits == 4);  // every started thread ran and was joined (no detach, no leak under ASan)
}

#if defined(__linux__)
TEST_CASE("ReplicaPool binds each replica thread to a CPU of its own when asked or when CPUs match", "[runtime]") {
    const auto allowed = allowed_cpus();  // this thread's mask: the process's
    const int cpus = static_cast<int>(allowed.size());
    REQUIRE(cpus >= 1);
    // Each replica thread's own mask (no Catch assertion on those threads: Catch is not thread-safe).
    auto masks_of = [](ReplicaPool& pool) {
        std::vector<std::vector<int>> masks(static_cast<std::size_t>(pool.size()));
        pool.run([&](int r) { masks[static_cast<std::size_t>(r)] = allowed_cpus(); });
        return masks;
    };

    SECTION("spread: replica r alone on the r-th allowed CPU") {
        const int n = std::min(cpus, 2);
        ReplicaPool pool(n, {}, CpuBinding::spread);
        REQUIRE(pool.bound_cpus().size() == static_cast<std::size_t>(n));
        const auto masks = masks_of(pool);
        for (int r = 0; r < n; ++r) {
            CHECK(pool.bound_cpus()[static_cast<std::size_t>(r)] == allowed[static_cast<std::size_t>(r)]);
            CHECK(masks[static_cast<std::size_t>(r)] == std::vector<int>{allowed[static_cast<std::size_t>(r)]});
        }
        CHECK(allowed_cpus() == allowed);  // the caller is not bound
    }
    SECTION("automatic binds when the process has exactly one CPU per replica") {
        ReplicaPool pool(cpus);
        REQUIRE(pool.bound_cpus() == allowed);
        const auto masks = masks_of(pool);
        for (int r = 0; r < cpus; ++r)
            CHECK(masks[static_cast<std::size_t>(r)] == std::vector<int>{allowed[static_cast<std::size_t>(r)]});
    }
    SECTION("automatic leaves more replicas than CPUs, or fewer, to the OS") {
        for (int n : {cpus + 1, cpus - 1}) {
            if (n < 1) continue;
            ReplicaPool pool(n);
            CHECK(pool.bound_cpus().empty());
            for (const auto& mask : masks_of(pool)) CHECK(mask == allowed);
        }
    }
    SECTION("none never binds; spread with too few CPUs does not either") {
        ReplicaPool unbound(std::min(cpus, 2), {}, CpuBinding::none);
        CHECK(unbound.bound_cpus().empty());
        for (const auto& mask : masks_of(unbound)) CHECK(mask == allowed);
        ReplicaPool crowded(cpus + 1, {}, CpuBinding::spread);
        CHECK(crowded.bound_cpus().empty());
    }
}
#endif

TEST_CASE("AbortableBarrier synchronises repeatedly", "[runtime]") {
    const int n = GENERATE(1, 2, 5);
    AbortableBarrier barrier(n, 10s);
    ReplicaPool pool(n);
    std::vector<int> phase(static_cast<std::size_t>(n), 0);
    std::atomic<int> violations{0};
    pool.run([&](int r) {
        for (int k = 0; k < 200; ++k) {
            phase[static_cast<std::size_t>(r)] = k;
            barrier.arrive_and_wait(r);
            for (int q = 0; q < n; ++q)
                if (phase[static_cast<std::size_t>(q)] != k) ++violations;
            barrier.arrive_and_wait(r);
        }
    });
    CHECK(violations == 0);
}

// Note [barrier crossing]: a party that spun in vain parks; the last arriver must wake it. The last
// rank comes late at every phase (longer than the spin), so the others park every time: a lost
// wake-up would hold them until their 5 s timeout, past the 4 s the case allows (80 phases take
// about 200 ms). The written values check that each phase's writes are seen.
TEST_CASE("AbortableBarrier wakes parties that parked, phase after phase", "[runtime]") {
    const int n = GENERATE(2, 3);
    AbortableBarrier barrier(n, 5s);
    ReplicaPool pool(n);
    std::vector<int> value(static_cast<std::size_t>(n), -1);
    std::atomic<int> stale{0};
    const auto t0 = clock_type::now();
    pool.run([&](int r) {
        for (int k = 0; k < 40; ++k) {
            if (r == n - 1) std::this_thread::sleep_for(2ms);
            value[static_cast<std::size_t>(r)] = k;
            barrier.arrive_and_wait(r);
            for (int q = 0; q < n; ++q)
                if (value[static_cast<std::size_t>(q)] != k) ++stale;
            barrier.arrive_and_wait(r);
        }
    });
    CHECK(stale == 0);
    CHECK(clock_type::now() - t0 < 4s);
}

// A party arriving twice in one phase is a broken program: the barrier is aborted, naming it,
// and the party that waited is woken with the same error.
TEST_CASE("AbortableBarrier refuses a party that arrives twice in one phase", "[runtime]") {
    AbortableBarrier barrier(2, 10s);
    std::string waiter_error;
    std::thread waiter([&] {
        try {
            barrier.arrive_and_wait(1);
        } catch (const Error& e) {  // CollectiveAborted expected; anything else fails the checks below
            waiter_error = e.what();
        }
    });
    // Rank 1 again, from here (before or after the thread's arrival: either way the second one
    // is refused and the first is woken), must not complete the phase.
    std::this_thread::sleep_for(20ms);
    CHECK_THROWS_WITH(barrier.arrive_and_wait(1), Catch::Contains("rank 1 arrived twice at the same barrier phase"));
    waiter.join();
    CHECK(barrier.aborted());
    CHECK_THAT(waiter_error, Catch::Contains("rank 1 arrived twice"));
    barrier.reset();
    ReplicaPool pool(2);
    pool.run([&](int r) { barrier.arrive_and_wait(r); });  // usable again
}

TEST_CASE("AbortableBarrier timeout names the ranks that never arrived", "[runtime]") {
    AbortableBarrier barrier(4, 100ms);
    ReplicaPool pool(4);
    const auto t0 = clock_type::now();
    try {
        pool.run([&](int r) {
            if (r == 1 || r == 3) return;  // these never arrive
            barrier.arrive_and_wait(r);
        });
        FAIL("no throw");
    } catch (const Timeout& e) {
        const std::string what = e.what();
        CHECK(what.find("ranks that never arrived: 1, 3") != std::string::npos);
    }
    CHECK(clock_type::now() - t0 < 1s);
    CHECK(barrier.aborted());
    barrier.reset();
    CHECK_FALSE(barrier.aborted());
}

TEST_CASE("AbortableBarrier abort wakes every waiter", "[runtime]") {
    auto barrier = std::make_shared<AbortableBarrier>(3, 60s);
    ReplicaPool pool(3);
    pool.attach(barrier);
    const auto t0 = clock_type::now();
    try {
        pool.run([&](int r) {
            if (r == 2) {
                std::this_thread::sleep_for(20ms);
                throw std::runtime_error("replica 2 crashed");
            }
            barrier->arrive_and_wait(r);
        });
        FAIL("no throw");
    } catch (const ReplicaError& e) {
        CHECK(std::string(e.what()) == "[rank 2] replica 2 crashed");  // the root cause, not the peers' aborts
    }
    CHECK(clock_type::now() - t0 < 1s);
    // The pool reset the barrier: a normal job synchronises again.
    pool.run([&](int r) { barrier->arrive_and_wait(r); });
}

TEST_CASE("AbortableBarrier rejects bad arguments", "[runtime]") {
    CHECK_THROWS_AS(AbortableBarrier(0), InvalidArgument);
    CHECK_THROWS_WITH(AbortableBarrier(2, 0ms), Catch::Contains("timeout must be positive"));
    AbortableBarrier b(2, 1s);
    CHECK_THROWS_AS(b.arrive_and_wait(2), UsageError);
    CHECK_THROWS_AS(b.set_timeout(-5ms), InvalidArgument);
}
