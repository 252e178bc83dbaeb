// SPDX-License-Identifier: MIT
//! DataParallel across processes (label mpi): P processes x L replicas each, every process passing
//! only its rows of the global batch, against a DataParallel of P x L replicas in one process
//! (computed by every process itself). Prints "PASS rank R: ..." / "FAIL rank R: ..." lines for
//! tests/mpi/run.cmake. Scenarios (argv[1]):
//!   train L        3 steps on uneven batches: with L = 1 losses and every parameter and buffer
//!                  are bit-identical to one process with P replicas; otherwise (another grouping
//!                  adds in another order) losses to 1e-4 and parameters per tensor to 5e-3
//!                  normwise. Every process holds the same bits. A checkpoint is written once by
//!                  process 0 and loaded by all; an unwritable path fails on every process with
//!                  one message.
//!   replicas       process r runs r + 1 replicas: every process refuses, with the same message
//!   throw          2 replicas per process; global rank 3 (process 1's replica 1) throws in
//!                  backward: every process's step fails within the timeout, naming global rank 3
#include <lockstep/mpi.hpp>
#include <lockstep/nn.hpp>
#include <lockstep/host.hpp>
#include <lockstep/parallel.hpp>

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "mpi_test_support.hpp"

using namespace lockstep;
using namespace std::chrono_literals;

namespace {

using lockstep::test::mpi::expect;

using Net = nn::Sequential<nn::Conv2d<>, nn::SyncBatchNorm<>, nn::ReLU<>, nn::MaxPool2d<>, nn::Flatten<>, nn::Linear<>>;

Net make_net() {
    nn::Generator g(5);
    return Net(nn::Conv2d<>(2, 4, 3, {.padding = 1}, g), nn::SyncBatchNorm<>(4), nn::ReLU<>(), nn::MaxPool2d<>(2),
               nn::Flatten<>(), nn::Linear<>(4 * 4 * 4, 5, true, g));
}

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

// Rows [begin, begin + count) of a batch.
Batch rows(const Batch& b, std::int64_t begin, std::int64_t count) {
    Batch out{Tensor<float>(Shape{count, 2, 8, 8}), {}};
    const std::int64_t per = 2 * 8 * 8;
    std::memcpy(out.x.data(), b.x.data() + begin * per, static_cast<std::size_t>(count * per) * sizeof(float));
    out.labels.assign(b.labels.begin() + begin, b.labels.begin() + begin + count);
    return out;
}

std::vector<std::vector<float>> tensors_of(const Net& m) {
    std::vector<std::vector<float>> out;
    nn::walk(
        m, [&](const std::string&, const auto& p) { out.emplace_back(p.value.span().begin(), p.value.span().end()); },
        [&](const std::string&, const auto& t) {
            std::vector<float> v;
            for (auto e : t.span()) v.push_back(static_cast<float>(e));
            out.push_back(std::move(v));
        });
    return out;
}

double rel_norm(const std::vector<float>& a, const std::vector<float>& b) {
    double d = 0, n = 0;
    for (std::size_t i = 0; i < a.size(); ++i) {
        d += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
        n += static_cast<double>(b[i]) * b[i];
    }
    return n == 0 ? std::sqrt(d) : std::sqrt(d / n);
}

const std::vector<std::int64_t> batch_sizes = {7, 12, 9};

int train(comm::MpiProcessGroup& world, int L) {
    const int P = world.size(), p = world.rank();
    // The reference: one process, P x L replicas, the whole batches.
    std::vector<double> want_losses;
    std::vector<std::vector<float>> want;
    {
        DataParallel<Net> one(make_net(), P * L);
        nn::Sgd<> sgd({.lr = 0.05, .momentum = 0.9});
        for (std::size_t s = 0; s < batch_sizes.size(); ++s) {
            const auto b = make_batch(batch_sizes[s], 50 + s);
            want_losses.push_back(one.train_step(b.x, b.labels, nn::SoftmaxCrossEntropy{}, sgd).loss);
        }
        want = tensors_of(one.module());
    }
    DataParallelOptions o;
    o.process_group = std::shared_ptr<comm::ProcessGroup>(&world, [](comm::ProcessGroup*) {});
    o.timeout = 20s;
    DataParallel<Net> dp(make_net(), L, o);
    nn::Sgd<> sgd({.lr = 0.05, .momentum = 0.9});
    double worst_loss = 0;
    bool exact = true;
    for (std::size_t s = 0; s < batch_sizes.size(); ++s) {
        const auto b = make_batch(batch_sizes[s], 50 + s);
        const auto all = parallel::shard_ranges(batch_sizes[s], P * L);  // this process's rows: its global ranks'
        const std::int64_t begin = all[static_cast<std::size_t>(p * L)].begin;
        const std::int64_t end =
            all[static_cast<std::size_t>(p * L + L - 1)].begin + all[static_cast<std::size_t>(p * L + L - 1)].count;
        const auto mine = rows(b, begin, end - begin);
        const double got = dp.train_step(mine.x, mine.labels, nn::SoftmaxCrossEntropy{}, sgd).loss;
        exact &= got == want_losses[s];
        worst_loss = std::max(worst_loss, std::abs(got - want_losses[s]) / std::abs(want_losses[s]));
    }
    const auto got = tensors_of(dp.module());
    double worst = 0;
    bool same_bits = got.size() == want.size();
    for (std::size_t i = 0; i < got.size() && same_bits; ++i) {
        worst = std::max(worst, rel_norm(got[i], want[i]));
        same_bits &= std::memcmp(got[i].data(), want[i].data(), got[i].size() * sizeof(float)) == 0;
    }
    const std::string shape = std::to_string(P) + " processes x " + std::to_string(L) + " replicas";
    if (L == 1) {
        expect(exact, shape + ": per-step losses bit-identical to one process with " + std::to_string(P) + " replicas");
        expect(same_bits, shape + ": parameters and buffers bit-identical to one process");
    } else {
        expect(worst_loss <= 1e-4, shape + ": per-step losses within 1e-4 of one process (" + std::to_string(worst_loss) + ")");
        expect(worst <= 5e-3, shape + ": parameters per tensor within 5e-3 of one process (" + std::to_string(worst) + ")");
    }
    // Every process holds process 0's bits.
    std::vector<double> flat;
    for (const auto& t : got) flat.insert(flat.end(), t.begin(), t.end());
    std::vector<double> first = flat;
    world.communicator(comm::ProcessGroup::control).broadcast(std::span<double>(first), 0);
    expect(std::memcmp(first.data(), flat.data(), flat.size() * sizeof(double)) == 0, "every process holds the same bits");
    // A checkpoint: process 0 writes, every process loads it.
    const std::string dir = "/tmp/lockstep-mpi-test-" + std::to_string(::getppid());
    if (p == 0) std::filesystem::create_directories(dir);
    world.communicator(comm::ProcessGroup::control).barrier();
    dp.save(dir + "/dp.safetensors", sgd);
    const bool loaded = nn::Checkpoint::load(dir + "/dp.safetensors").contains("0.weight");
    expect(loaded, "the checkpoint process 0 wrote loads on every process");
    std::string message;
    try {
        dp.save(dir + "/no-such-dir/dp.safetensors");
    } catch (const IoError& e) {
        message = e.what();
    }
    expect(message.find("no-such-dir") != std::string::npos,
           "an unwritable checkpoint fails on every process (" + message.substr(0, 90) + ")");
    world.communicator(comm::ProcessGroup::control).barrier();
    if (p == 0) std::filesystem::remove_all(dir);
    return 0;
}

// Net whose backward throws on global rank 3.
struct Failing {
    using backend = Host;
    Net net = make_net();
    Tensor<float> forward(const nn::Context<>& ctx, Tensor<float> x) { return net.forward(ctx, std::move(x)); }
    Tensor<float> backward(const nn::Context<>& ctx, const Tensor<float>& dy) {
        if (ctx.rank == 3) throw std::runtime_error("global rank 3 failed in backward");
        return net.backward(ctx, dy);
    }
    template <class V>
    void visit(V&& v) {
        v.module("net", net);
    }
};

int throws(comm::MpiProcessGroup& world) {
    DataParallelOptions o;
    o.process_group = std::shared_ptr<comm::ProcessGroup>(&world, [](comm::ProcessGroup*) {});
    o.timeout = 10s;
    DataParallel<Failing> dp(Failing{}, 2, o);
    nn::Sgd<> sgd({.lr = 0.05});
    const auto b = make_batch(4 * world.size(), 3);
    const auto mine = rows(b, 4 * world.rank(), 4);
    const auto t0 = std::chrono::steady_clock::now();
    std::string message;
    try {
        (void)dp.train_step(mine.x, mine.labels, nn::SoftmaxCrossEntropy{}, sgd);
    } catch (const std::exception& e) {
        message = e.what();
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    expect(message.find("global rank 3") != std::string::npos && s < 5.0,
           "a replica that throws fails the step on every process in " + std::to_string(s) + " s, naming global rank 3 (" +
               message.substr(0, 140) + ")");
    return 0;
}

int replicas(comm::MpiProcessGroup& world) {
    DataParallelOptions o;
    o.process_group = std::shared_ptr<comm::ProcessGroup>(&world, [](comm::ProcessGroup*) {});
    std::string message;
    try {
        DataParallel<Net> dp(make_net(), world.rank() + 1, o);
    } catch (const UsageError& e) {
        message = e.what();
    }
    expect(message.find("they run different replica counts (1, 2, by process)") != std::string::npos,
           "processes with different replica counts all refuse (" + message.substr(0, 80) + ")");
    return 0;
}

}  // namespace

int main(int argc, char** argv) {
    mpi::Environment env(&argc, &argv);
    lockstep::test::mpi::rank() = env.rank();
    const std::string what = argc > 1 ? argv[1] : "train";
    try {
        comm::MpiProcessGroup world(MPI_COMM_WORLD, 20s);
        if (what == "train")
            train(world, argc > 2 ? std::stoi(argv[2]) : 1);
        else if (what == "replicas")
            replicas(world);
        else if (what == "throw")
            throws(world);
        else
            expect(false, "unknown scenario " + what);
    } catch (const std::exception& e) {
        expect(false, std::string("unexpected exception: ") + e.what());
    }
    return lockstep::test::mpi::failures() == 0 ? 0 : 1;
}
