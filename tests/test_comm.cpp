// SPDX-License-Identifier: MIT
//! Tests of comm/: HostCommunicator collectives and the SharedTensor rendezvous (tags, aborts).
#include <catch2/catch.hpp>

#include <lockstep/lockstep.hpp>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "test_support.hpp"

using namespace lockstep;
using comm::CollectiveSite;
using comm::HostCommunicator;
using namespace std::chrono_literals;
using clock_type = std::chrono::steady_clock;

namespace {

template <class T>
std::vector<std::vector<T>> random_buffers(int world, std::size_t count, std::uint64_t seed) {
    std::mt19937_64 gen(seed);
    std::uniform_real_distribution<double> dist(-1.0, 1.0);
    std::vector<std::vector<T>> bufs(static_cast<std::size_t>(world), std::vector<T>(count));
    for (auto& b : bufs)
        for (auto& v : b) v = static_cast<T>(dist(gen));
    return bufs;
}

template <class T>
std::vector<std::vector<T>> all_reduce_on_pool(const std::vector<std::vector<T>>& inputs) {
    const int world = static_cast<int>(inputs.size());
    auto comms = HostCommunicator::create_group(world, 30s);
    ReplicaPool pool(world);
    auto bufs = inputs;
    pool.run([&](int r) { comms[static_cast<std::size_t>(r)].all_reduce_sum(std::span<T>(bufs[static_cast<std::size_t>(r)])); });
    return bufs;
}

}  // namespace

TEMPLATE_TEST_CASE("all_reduce_sum matches a reference sum and is bit-identical", "[comm]", float, double) {
    const int world = GENERATE(1, 2, 3, 4, 5, 6, 7, 8);
    const std::size_t count = GENERATE(std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{(1u << 20) + 3});
    const auto seed = test::fresh_seed();
    CAPTURE(world, count, seed);
    const auto inputs = random_buffers<TestType>(world, count, seed);
    const auto out = all_reduce_on_pool(inputs);
    const double tol = std::is_same_v<TestType, float> ? 1e-6 : 1e-14;
    std::size_t bad = 0;
    for (std::size_t i = 0; i < count; ++i) {
        double ref = 0.0;
        TestType rank_order = inputs[0][i];
        for (int r = 0; r < world; ++r) ref += static_cast<double>(inputs[static_cast<std::size_t>(r)][i]);
        for (int r = 1; r < world; ++r) rank_order += inputs[static_cast<std::size_t>(r)][i];
        bad += std::abs(static_cast<double>(out[0][i]) - ref) > tol * world;
        bad += std::memcmp(&out[0][i], &rank_order, sizeof(TestType)) != 0;  // summed in rank order
    }
    CHECK(bad == 0);
    for (int r = 1; r < world; ++r) CHECK(out[0] == out[static_cast<std::size_t>(r)]);  // bit-identical for finite values
    const auto again = all_reduce_on_pool(inputs);
    CHECK(again == out);  // run to run
}

TEST_CASE("broadcast and barrier reach every rank", "[comm]") {
    const int world = GENERATE(1, 3, 8);
    auto comms = HostCommunicator::create_group(world, 30s);
    ReplicaPool pool(world);
    std::vector<std::vector<double>> bufs(static_cast<std::size_t>(world), std::vector<double>(33));
    for (int r = 0; r < world; ++r)
        for (std::size_t i = 0; i < 33; ++i) bufs[static_cast<std::size_t>(r)][i] = r * 100.0 + static_cast<double>(i);
    const int root = world - 1;
    pool.run([&](int r) {
        comms[static_cast<std::size_t>(r)].barrier();
        comms[static_cast<std::size_t>(r)].broadcast(std::span<double>(bufs[static_cast<std::size_t>(r)]), root);
    });
    for (int r = 0; r < world; ++r)
        for (std::size_t i = 0; i < 33; ++i) CHECK(bufs[static_cast<std::size_t>(r)][i] == root * 100.0 + static_cast<double>(i));
    CHECK(comms[0].collective_count() == 2);
}

TEST_CASE("a span's part views its elements, and a part beyond it is a ShapeError", "[comm]") {
    Tensor<double> t(Shape{7});
    const DeviceSpan all(t);
    const auto part = all.subspan(2, 5);
    CHECK(part.data == t.data() + 2);
    CHECK(part.size == 5);
    CHECK(part.device == t.device());
    CHECK(all.subspan(7, 0).empty());
    CHECK_THROWS_AS(all.subspan(3, 5), ShapeError);
    CHECK_THROWS_AS(all.subspan(8, 0), ShapeError);
}

TEST_CASE("slices cover the buffer in 16-element granules", "[comm]") {
    for (std::size_t count : {0u, 1u, 15u, 16u, 17u, 1000u, 1025u}) {
        for (int n = 1; n <= 8; ++n) {
            std::size_t expected_lo = 0;
            for (int r = 0; r < n; ++r) {
                const auto [lo, hi] = HostCommunicator::slice(count, n, r);
                CHECK(lo == expected_lo);
                CHECK(hi >= lo);
                CHECK((lo % 16 == 0 || lo == count));
                expected_lo = hi;
            }
            CHECK(expected_lo == count);
        }
    }
}

TEST_CASE("a replica that throws before, inside or after a collective never hangs its peers", "[comm]") {
    const int world = GENERATE(2, 4);
    const int where = GENERATE(0, 1, 2);  // 0: before, 1: between the two collectives, 2: after both
    CAPTURE(world, where);
    auto comms = HostCommunicator::create_group(world, 60s);  // far longer than the 1 s we allow
    ReplicaPool pool(world);
    pool.attach(comms[0].group_ptr());
    std::vector<std::vector<float>> bufs(static_cast<std::size_t>(world), std::vector<float>(1000, 1.0f));
    const int bad = world - 1;
    const auto t0 = clock_type::now();
    try {
        pool.run([&](int r) {
            auto& c = comms[static_cast<std::size_t>(r)];
            auto buf = std::span<float>(bufs[static_cast<std::size_t>(r)]);
            if (r == bad && where == 0) throw std::runtime_error("failed before");
            c.all_reduce_sum(buf);
            if (r == bad && where == 1) throw std::runtime_error("failed inside the step");
            c.all_reduce_sum(buf, CollectiveSite::user(1));
            if (r == bad && where == 2) throw std::runtime_error("failed after");
        });
        FAIL("no throw");
    } catch (const ReplicaError& e) {  // the root cause with its rank, not a peer's CollectiveAborted
        CHECK(e.rank() == bad);
        CHECK(e.message().rfind("failed", 0) == 0);
    }
    CHECK(clock_type::now() - t0 < 1s);
    // The next job runs normally on the same pool and group.
    for (auto& b : bufs) std::fill(b.begin(), b.end(), 1.0f);
    pool.run(
        [&](int r) { comms[static_cast<std::size_t>(r)].all_reduce_sum(std::span<float>(bufs[static_cast<std::size_t>(r)])); });
    for (auto& b : bufs) CHECK(b[999] == static_cast<float>(world));
}

TEST_CASE("peers of a failed replica see CollectiveAborted naming it", "[comm]") {
    auto comms = HostCommunicator::create_group(3, 60s);
    ReplicaPool pool(3);
    pool.attach(comms[0].group_ptr());
    std::vector<std::string> seen(3);
    CHECK_THROWS_AS(pool.run([&](int r) {
        if (r == 1) throw InvalidArgument("bad shard");
        try {
            comms[static_cast<std::size_t>(r)].barrier();
        } catch (const CollectiveAborted& e) {
            seen[static_cast<std::size_t>(r)] = e.what();
            throw;
        }
    }),
                    InvalidArgument);
    CHECK(seen[0].find("rank 1 failed: bad shard") != std::string::npos);
    CHECK(seen[2].find("rank 1 failed: bad shard") != std::string::npos);
}

TEST_CASE("mismatched collectives throw CollectiveMismatch on every replica", "[comm]") {
    auto comms = HostCommunicator::create_group(3, 60s);
    ReplicaPool pool(3);
    pool.attach(comms[0].group_ptr());
    std::atomic<int> mismatches{0};
    std::vector<std::string> messages(3);  // Catch assertions are not thread-safe: check after the job
    std::vector<std::vector<double>> bufs{std::vector<double>(8), std::vector<double>(8), std::vector<double>(9)};
    SECTION("different element counts (a tensor of the wrong size)") {
        CHECK_THROWS_AS(pool.run([&](int r) {
            try {
                comms[static_cast<std::size_t>(r)].all_reduce_sum(std::span<double>(bufs[static_cast<std::size_t>(r)]));
            } catch (const CollectiveMismatch& e) {
                ++mismatches;
                messages[static_cast<std::size_t>(r)] = e.what();
                throw;
            }
        }),
                        CollectiveMismatch);
        for (const auto& m : messages) CHECK(m.find("all_reduce_sum<double>[9]") != std::string::npos);
    }
    SECTION("different call sites") {
        CHECK_THROWS_AS(pool.run([&](int r) {
            try {
                comms[static_cast<std::size_t>(r)].all_reduce_sum(std::span<double>(bufs[0].data(), 8),
                                                                  CollectiveSite::layer(7, r == 0 ? 0 : 1));
            } catch (const CollectiveMismatch&) {
                ++mismatches;
                throw;
            }
        }),
                        CollectiveMismatch);
    }
    SECTION("different kinds") {
        CHECK_THROWS_AS(pool.run([&](int r) {
            try {
                if (r == 2)
                    comms[2].barrier();
                else
                    comms[static_cast<std::size_t>(r)].all_reduce_sum(std::span<double>(bufs[static_cast<std::size_t>(r)]));
            } catch (const CollectiveMismatch&) {
                ++mismatches;
                throw;
            }
        }),
                        CollectiveMismatch);
    }
    CHECK(mismatches == 3);
    pool.run([&](int r) { comms[static_cast<std::size_t>(r)].barrier(); });  // usable again
}

TEST_CASE("collectives reject bad input with a typed error", "[comm]") {
    auto comms = HostCommunicator::create_group(1);
    CHECK_THROWS_WITH(comms[0].all_reduce_sum(std::span<float>(static_cast<float*>(nullptr), 4)), Catch::Contains("null buffer"));
    std::vector<float> v(4);
    CHECK_THROWS_AS(comms[0].broadcast(std::span<float>(v), 3), InvalidArgument);
    CHECK_THROWS_AS(HostCommunicator::create_group(0), InvalidArgument);
    CHECK_THROWS_AS(HostCommunicator::create_group(2, 0ms), InvalidArgument);
    CHECK_THROWS_AS(HostCommunicator(nullptr, 0), InvalidArgument);
    CHECK_THROWS_AS(HostCommunicator(comms[0].group_ptr(), 1), InvalidArgument);
}

TEST_CASE("a replica that never reaches a collective times out naming it", "[comm]") {
    auto comms = HostCommunicator::create_group(3, 200ms);
    ReplicaPool pool(3);
    pool.attach(comms[0].group_ptr());
    const auto t0 = clock_type::now();
    CHECK_THROWS_WITH(pool.run([&](int r) {
        if (r != 2) comms[static_cast<std::size_t>(r)].barrier();
    }),
                      Catch::Contains("ranks that never arrived: 2"));
    CHECK(clock_type::now() - t0 < 1s);
}

TEST_CASE("collective tags describe themselves for error messages", "[comm]") {
    using comm::CollectiveKind;
    using comm::CollectiveTag;
    using comm::DType;
    CHECK(CollectiveTag{CollectiveSite::layer(7, 0), CollectiveKind::all_reduce_sum, DType::f64, 129, -1}.str() ==
          "all_reduce_sum<double>[129] at layer 7 (forward)");
    CHECK(CollectiveTag{CollectiveSite::broadcast(3), CollectiveKind::broadcast, DType::f32, 10, 2}.str() ==
          "broadcast<float>[10] from root 2 at broadcast of tensor 3");
    CHECK(CollectiveTag{CollectiveSite::bucket(3), CollectiveKind::phase, DType::f32, 10, 1}.str() ==
          "phase<float>[10] step 1 at gradient bucket 3");
    CHECK(CollectiveTag{CollectiveSite::commit(), CollectiveKind::barrier, DType::none, 0, -1}.str() ==
          "barrier at the commit barrier");
    CHECK(CollectiveTag{CollectiveSite::user(), CollectiveKind::barrier, DType::none, 0, -1}.str() == "barrier at user site 0");
    // Sites of different kinds never compare equal, whatever their numbers.
    CHECK(CollectiveSite::bucket(1) != CollectiveSite::broadcast(1));
    CHECK(CollectiveSite::layer(1, 0) != CollectiveSite::layer(1, 1));
    CHECK(CollectiveSite::commit(0) != CollectiveSite::commit(1));
}

TEST_CASE("a replica group is reached through one interface, on device-tagged buffers", "[comm]") {
    comm::HostGroup group({Device::host(0), Device::host(1), Device::host(2)}, 30s);
    REQUIRE(group.size() == 3);
    ReplicaPool pool(3);
    pool.attach(group.abortable());
    std::vector<Tensor<double>> t;
    for (int r = 0; r < 3; ++r) t.push_back(make_tensor<double>(Shape{5}, std::vector<double>(5, r + 1.0)));
    std::vector<Tensor<std::int64_t>> counters;
    for (int r = 0; r < 3; ++r) counters.push_back(make_tensor<std::int64_t>(Shape{1}, std::vector<std::int64_t>{10 * r}));
    pool.run([&](int r) {
        comm::Collectives& c = group.communicator(r);  // what a layer holds: no communicator type in sight
        c.all_reduce_sum(DeviceSpan(t[static_cast<std::size_t>(r)]), CollectiveSite::layer(1, 0));
        c.broadcast(DeviceSpan(counters[static_cast<std::size_t>(r)]), 2, CollectiveSite::broadcast(0));
        c.barrier(CollectiveSite::commit());
    });
    for (int r = 0; r < 3; ++r) {
        for (std::int64_t i = 0; i < 5; ++i) CHECK(t[static_cast<std::size_t>(r)][i] == 6.0);
        CHECK(counters[static_cast<std::size_t>(r)][0] == 20);
        CHECK(group.communicator(r).collective_count() == 3);
    }
    // A buffer on a GPU is not host memory: refused before any rank waits.
    std::vector<float> v(4);
    CHECK_THROWS_AS(
        group.communicator(0).all_reduce_sum(DeviceSpan<float>(v.data(), v.size(), Device::cuda(0)), CollectiveSite::user()),
        DeviceMismatch);
    CHECK_THROWS_WITH(comm::HostGroup({Device::host(0), Device::cuda(1)}), Catch::Contains("cannot hold device cuda:1"));
}
