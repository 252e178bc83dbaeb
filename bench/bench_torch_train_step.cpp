// SPDX-License-Identifier: MIT
//! One training step of the example network in libtorch (examples/torch_mnist/net.hpp: the seed's
//! conv-net with SyncBatchNorm, SGD with momentum), on the CPU, five ways, each benchmark reporting
//! images/s and its ratio to the others measured in the same process:
//!   single     (c) one libtorch module on the whole batch, every CPU for its intra-op threads;
//!   lockstep1  lockstep::torch::DataParallel with 1 replica (every CPU): what its hooks, buckets
//!              and rendezvous cost over (c), as `overhead` = 1 - lockstep1 / single;
//!   lockstep2  lockstep::torch::DataParallel with 2 replicas, CPUs / 2 threads each;
//!   clone_each (a) the nearest libtorch equivalent of torch::nn::parallel::data_parallel on 2
//!              CPU "devices" (which needs CUDA): the module replicated per call, the replicas run
//!              on 2 threads, their gradients summed into the module, one optimizer step.
//!   unsynced   the ceiling of 2 replicas in one process: two modules on 2 threads, each on its
//!              half with its own optimizer, nothing exchanged.
//! BM_TorchSteps/<batch> runs the five alternately, and its counters are the ratios
//! vs_clone_each (lockstep2 / clone_each), vs_single (lockstep2 / single), vs_unsynced
//! (lockstep2 / unsynced), and `overhead`.
//! PyTorch DDP in Python is (b): scripts/bench-torch.sh alternates this program with
//! bench/torch_ddp_reference.py.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <thread>
#include <vector>

#include "../examples/torch_mnist/net.hpp"

namespace {

using torch_mnist::Net;
using torch_mnist::NetImpl;

std::unique_ptr<torch::optim::Optimizer> sgd(torch::nn::Module& m) {
    return std::make_unique<torch::optim::SGD>(m.parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
}
torch::Tensor cross_entropy(const torch::Tensor& out, const torch::Tensor& y) {
    return torch::nn::functional::cross_entropy(out, y);
}
int cpus() { return std::max(1, static_cast<int>(std::thread::hardware_concurrency())); }

struct Batch {
    torch::Tensor x, y;
    explicit Batch(std::int64_t n) : x(torch::rand({n, 1, 28, 28})), y(torch::randint(0, 10, {n})) {}
};

template <class F>
double seconds_per_step(F&& step, int steps) {
    step();  // warm-up
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < steps; ++i) step();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / steps;
}

void BM_TorchSteps(benchmark::State& state) {
    const std::int64_t batch = state.range(0);
    const int steps = static_cast<int>(state.range(1));
    const Batch data(batch);
    torch::manual_seed(1);
    Net single;
    auto single_opt = sgd(*single);
    // (c): the whole batch, every CPU.
    const auto run_single = [&] {
        at::set_num_threads(cpus());
        single_opt->zero_grad();
        cross_entropy(single->forward(data.x), data.y).backward();
        single_opt->step();
    };
    // (a): replicate per call, run the replicas on threads, sum their gradients, step once.
    Net master;
    auto master_opt = sgd(*master);
    const auto run_clone_each = [&] {
        at::set_num_threads(std::max(1, cpus() / 2));
        master_opt->zero_grad();
        std::vector<std::shared_ptr<NetImpl>> replicas;
        for (int r = 0; r < 2; ++r) replicas.push_back(std::dynamic_pointer_cast<NetImpl>(master->clone()));
        const auto xs = data.x.chunk(2), ys = data.y.chunk(2);
        std::vector<std::thread> threads;
        for (int r = 0; r < 2; ++r)
            threads.emplace_back([&, r] {
                (cross_entropy(replicas[r]->forward(xs[r]), ys[r]) * (static_cast<double>(xs[r].size(0)) / batch)).backward();
            });
        for (auto& t : threads) t.join();
        torch::NoGradGuard no_grad;
        auto params = master->parameters();
        for (std::size_t i = 0; i < params.size(); ++i)
            params[i].mutable_grad() = replicas[0]->parameters()[i].grad() + replicas[1]->parameters()[i].grad();
        master_opt->step();
    };
    // The ceiling of 2 replicas: two modules on 2 threads, each on its half with its own optimizer,
    // nothing exchanged (each SyncBatchNorm alone normalizes its own half).
    Net halves[2] = {Net(), Net()};
    std::unique_ptr<torch::optim::Optimizer> half_opts[2] = {sgd(*halves[0]), sgd(*halves[1])};
    const auto run_unsynced = [&] {
        at::set_num_threads(std::max(1, cpus() / 2));
        const auto xs = data.x.chunk(2), ys = data.y.chunk(2);
        std::vector<std::thread> threads;
        for (int r = 0; r < 2; ++r)
            threads.emplace_back([&, r] {
                half_opts[r]->zero_grad();
                cross_entropy(halves[r]->forward(xs[r]), ys[r]).backward();
                half_opts[r]->step();
            });
        for (auto& t : threads) t.join();
    };
    lockstep::torch::Options one_cpu_each;
    one_cpu_each.intra_op_threads = -1;  // set per run below
    Net proto;
    lockstep::torch::DataParallel one(proto, 1, sgd, one_cpu_each);
    lockstep::torch::DataParallel two(proto, 2, sgd, one_cpu_each);
    const auto run_one = [&] {
        at::set_num_threads(cpus());
        one.train_step(data.x, data.y, cross_entropy);
    };
    const auto run_two = [&] {
        at::set_num_threads(std::max(1, cpus() / 2));
        two.train_step(data.x, data.y, cross_entropy);
    };
    double t_single = 0, t_one = 0, t_two = 0, t_clone = 0, t_unsynced = 0;
    for (auto _ : state) {
        t_single = seconds_per_step(run_single, steps);
        t_one = seconds_per_step(run_one, steps);
        t_two = seconds_per_step(run_two, steps);
        t_clone = seconds_per_step(run_clone_each, steps);
        t_unsynced = seconds_per_step(run_unsynced, steps);
    }
    const double b = static_cast<double>(batch);
    state.counters["images_per_s_single"] = b / t_single;
    state.counters["images_per_s_lockstep1"] = b / t_one;
    state.counters["images_per_s_lockstep2"] = b / t_two;
    state.counters["images_per_s_clone_each"] = b / t_clone;
    state.counters["images_per_s_unsynced"] = b / t_unsynced;
    state.counters["vs_unsynced"] = t_unsynced / t_two;
    state.counters["vs_clone_each"] = t_clone / t_two;
    state.counters["vs_single"] = t_single / t_two;
    state.counters["overhead"] = 1.0 - t_single / t_one;
}
BENCHMARK(BM_TorchSteps)->Args({64, 5})->Args({256, 3})->Iterations(1)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
