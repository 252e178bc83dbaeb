// SPDX-License-Identifier: MIT
//! The grid emulator's memory model and the one barrier placement of the drivers (Note [the
//! emulator's memory model], Note [one barrier placement]): small kernels written wrong in one
//! way each, and the reduce driver run with one fence or barrier taken out, must end the process
//! with the emulator's message (each in a child process); the same kernels written right, and
//! the driver as it is, must pass.
#include <catch2/catch.hpp>

#include <lockstep/kernels/device/grid.cuh>

#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdint>
#include <functional>
#include <regex>
#include <string>
#include <vector>

namespace dev = lockstep::kernels::device;
using dev::Where;

namespace {

// ---- a death test: the child's stderr and how it ended -------------------------------------

struct Death {
    bool aborted = false;
    std::string stderr_text;
};

//! Runs `f` in a child process with its stderr captured; whether it ended by SIGABRT.
Death run_in_child(const std::function<void()>& f) {
    int fds[2];
    REQUIRE(::pipe(fds) == 0);
    const pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
        // Catch2's handler would report the abort as this test's failure: the child dies plainly.
        std::signal(SIGABRT, SIG_DFL);
        ::close(fds[0]);
        ::dup2(fds[1], 2);
        f();
        ::_exit(0);
    }
    ::close(fds[1]);
    Death d;
    char buf[512];
    for (ssize_t n; (n = ::read(fds[0], buf, sizeof buf)) > 0;) d.stderr_text.append(buf, static_cast<std::size_t>(n));
    ::close(fds[0]);
    int status = 0;
    REQUIRE(::waitpid(pid, &status, 0) == pid);
    d.aborted = WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT;
    return d;
}

void require_abort(const std::function<void()>& f, const std::string& pattern) {
    const Death d = run_in_child(f);
    INFO("the child's stderr: " << d.stderr_text);
    REQUIRE(d.aborted);
    REQUIRE(std::regex_search(d.stderr_text, std::regex(pattern)));
}

// ---- purpose-built kernels -------------------------------------------------------------------

constexpr int threads = 64;

struct Acc {
    double v = 0;
    LOCKSTEP_HD Acc operator+(const Acc& o) const { return {v + o.v}; }
};

struct SumParams {
    const float* x = nullptr;
    int n = 0;
    Acc* partials = nullptr;
    unsigned int* counters = nullptr;
    double* out = nullptr;  // one per lane
    int gather_from = 0;    // the first partial the gather reads: 0 reads them all; 1 reads one past the last
};

//! out[lane] = the sum of x[i] with i % Lanes == lane, reduced as the library's kernels are.
template <int Lanes>
struct LaneSum {
    using Params = SumParams;
    using Value = Acc;
    static constexpr int threads = ::threads, lanes = Lanes, rows = threads / Lanes;
    LOCKSTEP_HD static Value accumulate(const Params& p, const Where& w) {
        double s = 0;
        const int lane = w.t % lanes, row = w.t / lanes;
        for (int i = (w.bx * rows + row) * lanes + lane; i < p.n; i += w.gx * threads) s += p.x[i];
        return {s};
    }
    LOCKSTEP_HD static void store_partial(const Params& p, const Where& w, int lane, const Value& v) {
        dev::store(p.partials + w.bx * lanes + lane, v);
    }
    LOCKSTEP_HD static unsigned int* counter(const Params& p, const Where&) { return p.counters; }
    LOCKSTEP_HD static Value gather(const Params& p, const Where& w, int lane, int row) {
        double s = 0;
        for (int i = row + p.gather_from; i < w.gx + p.gather_from; i += rows)
            s += dev::load_other_block(&p.partials[i * lanes + lane].v);
        return {s};
    }
    LOCKSTEP_HD static void finish(const Params& p, const Where&, int lane, const Value& total) {
        dev::store(p.out + lane, total.v);
    }
};

struct CopyParams {
    const float* x = nullptr;
    float* y = nullptr;
    int n = 0;
    bool all_to_one = false;  // every thread stores y[0] (two blocks write one element)
    bool read_next = false;   // each thread reads the next block's element of y (a race)
};

//! y = x, a thread an element; wrong in the ways `CopyParams` asks for.
struct Copy {
    using Params = CopyParams;
    static constexpr int threads = ::threads;
    LOCKSTEP_HD static void run(const Params& p, const Where& w) {
        const int i = w.bx * threads + w.t;
        if (i >= p.n) return;
        dev::store_pack<1>(p.all_to_one ? p.y : p.y + i, dev::Pack<float, 1>{{p.x[i]}});
        if (p.read_next) (void)dev::load_other_block(p.y + (i + threads) % p.n);
    }
};

//! A reducing kernel's inputs and outputs, host side.
template <int Lanes>
struct SumCase {
    std::vector<float> x;
    std::vector<Acc> partials;
    std::vector<unsigned int> counters{0};
    std::vector<double> out = std::vector<double>(Lanes, 0.0);
    dev::Grid grid;
    SumParams p;
    explicit SumCase(int blocks, int gather_from = 0)
        : x(static_cast<std::size_t>(blocks) * threads * 3), partials(static_cast<std::size_t>(blocks + 1) * Lanes) {
        for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i % 7) - 2.5f;
        grid = {blocks, 1, threads};
        p = {x.data(), static_cast<int>(x.size()), partials.data(), counters.data(), out.data(), gather_from};
    }
    double expected(int lane) const {
        double s = 0;
        for (std::size_t i = static_cast<std::size_t>(lane); i < x.size(); i += Lanes) s += x[i];
        return s;
    }
};

// ---- the reduce driver with one fence or barrier taken out -----------------------------------

struct Mutation {
    bool release_fence = true;  // the fence after the partial's store, before the ticket
    bool acquire_fence = true;  // the fence after the ticket, before the gather
    int dropped_sync = -1;      // the block's barrier (0: before the ticket, 1: after it) not made
};

//! The emulator's block, less what `Mutation` takes out: as if the driver were written without it.
template <class Value>
struct MutatedBlock : dev::detail::EmulatedBlock<Value> {
    using Base = dev::detail::EmulatedBlock<Value>;
    using Base::Base;
    Mutation m;
    bool ticketed = false;
    int syncs = 0;
    void start(int bx, int by) {
        Base::start(bx, by);
        ticketed = false, syncs = 0;
    }
    void fence(const Where& w) {
        if (ticketed ? m.acquire_fence : m.release_fence) Base::fence(w);
    }
    bool ticket(const Where& w, unsigned int* counter, int blocks) {
        ticketed = true;
        return Base::ticket(w, counter, blocks);
    }
    void sync() {
        if (syncs++ != m.dropped_sync) Base::sync();
    }
};

//! dev::emulate_reduce with the driver mutated.
template <class K>
void emulate_mutated(const typename K::Params& p, const dev::Grid& g, const Mutation& m) {
    dev::emulated::Launch launch(g.x * g.y, g.x, true);
    std::vector<int> blocks, order;
    std::vector<typename K::Value> values(static_cast<std::size_t>(K::threads));
    MutatedBlock<typename K::Value> block(launch.memory(), g, K::threads, K::lanes, values, order);
    block.m = m;
    for (const int b : dev::detail::shuffled(g.x * g.y, blocks)) {
        block.start(b % g.x, b / g.x);
        dev::reduce_block<K>(p, block);
    }
}

}  // namespace

TEST_CASE("emulated reductions written right pass the memory model, through the driver and its harness") {
    for (const int blocks : {1, 2, 7, 33}) {
        SumCase<1> one(blocks);
        dev::emulate_reduce<LaneSum<1>>(one.p, one.grid);
        REQUIRE(one.out[0] == one.expected(0));
        REQUIRE(one.counters[0] == 0u);
        SumCase<4> four(blocks);
        emulate_mutated<LaneSum<4>>(four.p, four.grid, Mutation{});
        for (int lane = 0; lane < 4; ++lane) REQUIRE(four.out[static_cast<std::size_t>(lane)] == four.expected(lane));
    }
    // The map kernel written right: a store per element, no reads of another block's.
    std::vector<float> x(1000, 1.5f), y(1000, 0.0f);
    dev::emulate_map<Copy>(CopyParams{x.data(), y.data(), 1000}, dev::Grid{16, 1, threads});
    REQUIRE(y == x);
}

TEST_CASE("the emulator ends a launch in which two blocks store one element") {
    require_abort(
        [] {
            std::vector<float> x(200, 1.0f), y(200, 0.0f);
            dev::emulate_map<Copy>(CopyParams{x.data(), y.data(), 200, true, false}, dev::Grid{4, 1, threads});
        },
        "lockstep: blocks \\(\\d+, 0\\) and \\(\\d+, 0\\) of one emulated launch both write the byte at");
}

TEST_CASE("the emulator ends a launch that reads another block's store it was not given") {
    require_abort(
        [] {
            std::vector<float> x(200, 1.0f), y(200, 0.0f);
            dev::emulate_map<Copy>(CopyParams{x.data(), y.data(), 200, false, true}, dev::Grid{4, 1, threads});
        },
        "of an emulated launch reads (a byte that no block wrote in this launch|another block's store that was not published)");
}

TEST_CASE("the emulator ends a reduction that gathers a partial no block stored") {
    require_abort(
        [] {
            SumCase<1> c(5, 1);
            dev::emulate_reduce<LaneSum<1>>(c.p, c.grid);
        },
        "reads a byte that no block wrote in this launch \\(a store missing\\?\\)");
}

TEST_CASE("the reduce driver without its fence before the ticket fails in the emulator") {
    require_abort(
        [] {
            SumCase<1> c(6);
            emulate_mutated<LaneSum<1>>(c.p, c.grid, Mutation{false, true, -1});
        },
        "reads another block's store that was not published: no fence after the store before that block's ticket");
}

TEST_CASE("the reduce driver without its fence before the gather fails in the emulator") {
    require_abort(
        [] {
            SumCase<1> c(6);
            emulate_mutated<LaneSum<1>>(c.p, c.grid, Mutation{true, false, -1});
        },
        "reads another block's store without a fence after taking its own ticket");
}

TEST_CASE("the reduce driver without its barrier before the ticket fails in the emulator where lanes store partials") {
    require_abort(
        [] {
            SumCase<4> c(6);
            emulate_mutated<LaneSum<4>>(c.p, c.grid, Mutation{true, true, 0});
        },
        "reads another block's store that was not published");
}

TEST_CASE("the reduce driver without its barrier after the ticket fails in the emulator") {
    require_abort(
        [] {
            SumCase<1> c(3);
            emulate_mutated<LaneSum<1>>(c.p, c.grid, Mutation{true, true, 1});
        },
        "reads the shared flag one thread wrote with no barrier between");
}
