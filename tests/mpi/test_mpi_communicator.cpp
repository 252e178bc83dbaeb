// SPDX-License-Identifier: MIT
//! comm::MpiCommunicator under mpirun (label mpi). Every rank prints "PASS rank R: what" or
//! "FAIL rank R: what"; tests/mpi/run.cmake judges each rank's lines. Scenarios (argv[1]):
//!   collectives  all-reduce equals the host group's rank-order sum bit for bit on every rank
//!                (whole and sliced payloads, float and double), broadcasts, barriers, a tag
//!                mismatch thrown on every rank with the same message
//!   abort        rank 1 aborts instead of reaching a collective: the others throw
//!                CollectiveAborted naming rank 1 well within the timeout
//!   silent       the last rank skips a collective: the others throw Timeout naming it
//!   kill         rank 1 is killed (SIGKILL) before a collective: the others throw Timeout naming
//!                it (run with mpirun --enable-recovery, so mpirun does not kill them first)
#include <lockstep/mpi.hpp>

#include <csignal>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "mpi_test_support.hpp"

using namespace lockstep;
using namespace std::chrono_literals;

namespace {

using lockstep::test::mpi::expect;

// Rank r's operand: the same on every process, so each can compute the expected sum itself.
template <class T>
std::vector<T> operand(int r, std::size_t n) {
    std::mt19937_64 g(1000 + static_cast<std::uint64_t>(r));
    std::uniform_real_distribution<double> u(-1, 1);
    std::vector<T> v(n);
    for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<T>(u(g) * std::pow(10.0, static_cast<double>((r * 5 + i) % 9) - 4));
    return v;
}

template <class T>
void check_sum(comm::MpiCommunicator& c, std::size_t n) {
    auto mine = operand<T>(c.rank(), n);
    c.all_reduce_sum(std::span<T>(mine));
    // The host group's order: b0 + b1 + ... + b{n-1}, element by element.
    std::vector<T> want = operand<T>(0, n);
    for (int r = 1; r < c.size(); ++r) {
        const auto b = operand<T>(r, n);
        for (std::size_t i = 0; i < n; ++i) want[i] += b[i];
    }
    expect(std::memcmp(mine.data(), want.data(), n * sizeof(T)) == 0,
           "all_reduce_sum<" + std::string(sizeof(T) == 4 ? "float" : "double") + ">[" + std::to_string(n) +
               "] equals the rank-order sum bit for bit");
}

// Runs `f`, which every rank calls at a collective some rank reaches differently, and expects
// CollectiveMismatch with a message holding `wanted`.
template <class F>
void expect_mismatch(F&& f, const std::string& wanted, const std::string& what) {
    std::string message;
    try {
        f();
    } catch (const CollectiveMismatch& e) {
        message = e.what();
    }
    expect(message.find(wanted) != std::string::npos, what + " (" + message.substr(0, 60) + "...)");
}

int collectives(comm::MpiCommunicator& c) {
    // Payloads that travel with the tag (up to folded_limit bytes: 4096 floats, 2048 doubles),
    // whole and by slices.
    static_assert(comm::MpiCommunicator::folded_limit == 4096 * sizeof(float));
    for (const std::size_t n : {std::size_t{1}, std::size_t{129}, std::size_t{2048}, std::size_t{4096}, std::size_t{4097},
                                std::size_t{5000}, std::size_t{70001}}) {
        check_sum<float>(c, n);
        check_sum<double>(c, n);
    }
    std::vector<std::int64_t> v(9, c.rank() == 1 ? 77 : -1);
    c.broadcast(std::span<std::int64_t>(v), 1);
    expect(std::all_of(v.begin(), v.end(), [](std::int64_t x) { return x == 77; }), "broadcast<int64> from rank 1");
    std::vector<double> big(100000, c.rank() == 0 ? 2.5 : 0.0);
    c.broadcast(std::span<double>(big), 0);
    expect(std::all_of(big.begin(), big.end(), [](double x) { return x == 2.5; }), "broadcast<double> from rank 0");
    c.barrier();
    expect_mismatch(
        [&] {  // rank 1 reaches another collective
            std::vector<float> w(c.rank() == 1 ? 5 : 4, 1.0f);
            c.all_reduce_sum(std::span<float>(w), comm::CollectiveSite::user(7));
        },
        "MPI rank 0 reached all_reduce_sum<float>[4] at user site 7 but MPI rank 1 reached all_reduce_sum<float>[5]",
        "a tag mismatch throws CollectiveMismatch on every rank, naming both collectives");
    expect_mismatch(
        [&] {  // a payload that travels with its tag against one that does not
            std::vector<float> w(c.rank() == 1 ? 5000 : 4, 1.0f);
            c.all_reduce_sum(std::span<float>(w), comm::CollectiveSite::user(8));
        },
        "MPI rank 0 reached all_reduce_sum<float>[4] at user site 8 but MPI rank 1 reached all_reduce_sum<float>[5000]",
        "a mismatch between a small and a large all-reduce is found in the tags");
    c.agree(
        comm::CollectiveTag{comm::CollectiveSite::layer(4, 0), comm::CollectiveKind::all_reduce_sum, comm::DType::f32, 12, -1});
    expect(true, "agree() returns when every rank presents the same tag");
    expect_mismatch(
        [&] {  // the tag check alone, for collectives whose data NCCL moves
            c.agree(comm::CollectiveTag{comm::CollectiveSite::layer(4, 1), comm::CollectiveKind::all_reduce_sum, comm::DType::f32,
                                        c.rank() == 0 ? 12u : 13u, -1});
        },
        "all_reduce_sum<float>[12] at layer 4 (backward) but MPI rank 1 reached all_reduce_sum<float>[13]",
        "agree() throws CollectiveMismatch on every rank");
    check_sum<float>(c, 33);  // the communicator works after a mismatch
    expect(c.collective_count() == 20, "collective_count counts every call (" + std::to_string(c.collective_count()) + ")");
    return 0;
}

int aborted(comm::MpiCommunicator& c) {
    c.set_timeout(10s);
    if (c.rank() == 1) {
        c.abort("replica 0 of process 1 threw: out of memory");
        bool refused = false;
        try {
            c.barrier();
        } catch (const CollectiveAborted&) {
            refused = true;
        }
        expect(refused, "the aborting rank's own later collectives throw");
        return 0;
    }
    const auto t0 = std::chrono::steady_clock::now();
    std::string polled;
    int polled_who = -2;
    std::thread watcher([&] {  // as a replica's wait on its GPU consults the process group
        while (std::chrono::steady_clock::now() - t0 < 5s) {
            try {
                c.check_peers();
            } catch (const CollectiveAborted& e) {
                polled = e.what();
                polled_who = e.rank();
                return;
            }
            std::this_thread::sleep_for(1ms);
        }
    });
    watcher.join();
    expect(polled_who == 1 && polled.find("out of memory") != std::string::npos,
           "check_peers() on another thread learns of rank 1's abort (" + polled + ")");
    std::string message;
    int who = -2;
    try {  // the message check_peers took is kept: the collective fails the same way
        std::vector<float> w(16, 1.0f);
        c.all_reduce_sum(std::span<float>(w));
    } catch (const CollectiveAborted& e) {
        message = e.what();
        who = e.rank();
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    expect(who == 1 && message.find("out of memory") != std::string::npos && s < 5.0,
           "a peer's abort ends the collective with CollectiveAborted naming rank 1 in " + std::to_string(s) + " s (" + message +
               ")");
    return 0;
}

int silent(comm::MpiCommunicator& c) {
    c.set_timeout(700ms);
    const int last = c.size() - 1;
    if (c.rank() == last) {
        std::this_thread::sleep_for(1500ms);  // skips the collective the others wait in
        expect(true, "the silent rank stayed away");
        return 0;
    }
    std::string message;
    int who = -2;
    try {
        std::vector<double> w(8, 1.0);
        c.all_reduce_sum(std::span<double>(w));
    } catch (const Timeout& e) {
        message = e.what();
        who = e.rank();
    }
    expect(who == last && message.find("rank(s) " + std::to_string(last) + " that never answered") != std::string::npos,
           "Timeout names the silent rank " + std::to_string(last) + " (" + message.substr(0, 120) + ")");
    return 0;
}

int killed(comm::MpiCommunicator& c) {
    c.set_timeout(1500ms);
    c.barrier();  // everyone is up
    if (c.rank() == 1) std::raise(SIGKILL);
    std::string message;
    int who = -2;
    try {
        std::vector<float> w(8, 1.0f);
        c.all_reduce_sum(std::span<float>(w));
    } catch (const Timeout& e) {
        message = e.what();
        who = e.rank();
    }
    expect(who == 1, "a killed rank is named by the survivors' Timeout (" + message.substr(0, 120) + ")");
    return 0;
}

}  // namespace

int main(int argc, char** argv) {
    mpi::Environment env(&argc, &argv);
    lockstep::test::mpi::rank() = env.rank();
    const std::string what = argc > 1 ? argv[1] : "collectives";
    try {
        comm::MpiCommunicator c(MPI_COMM_WORLD, 20s);
        if (what == "collectives")
            collectives(c);
        else if (what == "abort")
            aborted(c);
        else if (what == "silent")
            silent(c);
        else if (what == "kill")
            killed(c);
        else
            expect(false, "unknown scenario " + what);
    } catch (const std::exception& e) {
        expect(false, std::string("unexpected exception: ") + e.what());
    }
    std::fflush(stdout);
    if (what == "silent") MPI_Barrier(MPI_COMM_WORLD);  // every rank has printed before ~Environment ends the job
    return lockstep::test::mpi::failures() == 0 ? 0 : 1;
}
