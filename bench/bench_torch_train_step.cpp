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
//!              on 2 persistent threads, their gradients summed into the module, one optimizer step.
//!   unsynced   (d) the ceiling of 2 replicas in one process: two modules on 2 persistent threads,
//!              each on its half with its own optimizer, nothing exchanged.
//! Each variant sets its threads' intra-op counts once, before its warm-up step.
//! BM_TorchSteps/<batch> runs the five alternately, and its counters are the ratios
//! vs_clone_each (lockstep2 / clone_each), vs_single (lockstep2 / single), vs_unsynced
//! (lockstep2 / unsynced), and `overhead`.
//! PyTorch DDP in Python is (b): scripts/bench-torch.sh alternates this program with
//! bench/torch_ddp_reference.py.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
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
int half_cpus() { return std::max(1, cpus() / 2); }

// The calling thread's intra-op threads, set only when they change: libtorch's setter also drops
// oneDNN's primitive cache, which would tax every step of whichever variant called it per step.
void use_threads(int n) {
    if (at::get_num_threads() != n) at::set_num_threads(n);
}

// Persistent threads (as lockstep's replica threads are) that run the baselines, each thread with
// `intra_op` intra-op threads: the main thread only times, for every variant alike.
class Team {
public:
    Team(int size, int intra_op) : size_(size), intra_op_(intra_op) {
        for (int r = 0; r < size; ++r) threads_.emplace_back([this, r] { loop(r); });
    }
    ~Team() {
        {
            std::lock_guard<std::mutex> lock(m_);
            stop_ = true;
        }
        cv_.notify_all();
        for (auto& t : threads_) t.join();
    }
    void run(const std::function<void(int)>& job) {
        std::unique_lock<std::mutex> lock(m_);
        job_ = &job;
        done_ = 0;
        ++generation_;
        cv_.notify_all();
        cv_.wait(lock, [&] { return done_ == size_; });
    }

private:
    void loop(int r) {
        std::uint64_t seen = 0;
        for (;;) {
            std::unique_lock<std::mutex> lock(m_);
            cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
            if (stop_) return;
            seen = generation_;
            const auto* job = job_;
            lock.unlock();
            use_threads(intra_op_);
            (*job)(r);
            lock.lock();
            if (++done_ == size_) cv_.notify_all();
        }
    }
    const int size_;
    const int intra_op_;
    std::vector<std::thread> threads_;
    std::mutex m_;
    std::condition_variable cv_;
    const std::function<void(int)>* job_ = nullptr;
    std::uint64_t generation_ = 0;
    int done_ = 0;
    bool stop_ = false;
};

struct Batch {
    torch::Tensor x, y;
    explicit Batch(std::int64_t n) : x(torch::rand({n, 1, 28, 28})), y(torch::randint(0, 10, {n})) {}
};

// The calling thread runs with `threads` intra-op threads, set before the warm-up step.
template <class F>
double seconds_per_step(int threads, F&& step, int steps) {
    use_threads(threads);
    step();  // warm-up
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < steps; ++i) step();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / steps;
}

void BM_TorchSteps(benchmark::State& state) {
    const std::int64_t batch = state.range(0);
    const int steps = static_cast<int>(state.range(1));
    const Batch data(batch);
    const auto xs = data.x.chunk(2), ys = data.y.chunk(2);
    torch::manual_seed(1);
    // (c): the whole batch, every CPU, on one persistent thread.
    Team solo(1, cpus());
    Net single;
    auto single_opt = sgd(*single);
    const std::function<void(int)> single_step = [&](int) {
        single_opt->zero_grad();
        cross_entropy(single->forward(data.x), data.y).backward();
        single_opt->step();
    };
    const auto run_single = [&] { solo.run(single_step); };
    // (a): replicate per call, run the replicas on two threads, sum their gradients, step once.
    Team pair(2, half_cpus());
    Net master;
    auto master_opt = sgd(*master);
    std::vector<std::shared_ptr<NetImpl>> replicas(2);
    const std::function<void(int)> clone_half = [&](int r) {
        (cross_entropy(replicas[r]->forward(xs[r]), ys[r]) * (static_cast<double>(xs[r].size(0)) / batch)).backward();
    };
    const auto run_clone_each = [&] {
        master_opt->zero_grad();
        for (int r = 0; r < 2; ++r) replicas[r] = std::dynamic_pointer_cast<NetImpl>(master->clone());
        pair.run(clone_half);
        torch::NoGradGuard no_grad;
        auto params = master->parameters();
        for (std::size_t i = 0; i < params.size(); ++i)
            params[i].mutable_grad() = replicas[0]->parameters()[i].grad() + replicas[1]->parameters()[i].grad();
        master_opt->step();
    };
    // (d), the ceiling of 2 replicas: two modules on the two threads, each on its half with its own
    // optimizer, nothing exchanged (each SyncBatchNorm alone normalizes its own half).
    Net halves[2] = {Net(), Net()};
    std::unique_ptr<torch::optim::Optimizer> half_opts[2] = {sgd(*halves[0]), sgd(*halves[1])};
    const std::function<void(int)> unsynced_half = [&](int r) {
        half_opts[r]->zero_grad();
        cross_entropy(halves[r]->forward(xs[r]), ys[r]).backward();
        half_opts[r]->step();
    };
    const auto run_unsynced = [&] { pair.run(unsynced_half); };
    lockstep::torch::Options follow_caller;
    follow_caller.intra_op_threads = -1;  // the caller's count, set by seconds_per_step
    Net proto;
    lockstep::torch::DataParallel one(proto, 1, sgd, follow_caller);
    lockstep::torch::DataParallel two(proto, 2, sgd, follow_caller);
    const auto run_one = [&] { one.train_step(data.x, data.y, cross_entropy); };
    const auto run_two = [&] { two.train_step(data.x, data.y, cross_entropy); };
    double t_single = 0, t_one = 0, t_two = 0, t_clone = 0, t_unsynced = 0;
    for (auto _ : state) {
        t_single = seconds_per_step(cpus(), run_single, steps);
        t_one = seconds_per_step(cpus(), run_one, steps);
        t_two = seconds_per_step(half_cpus(), run_two, steps);
        t_clone = seconds_per_step(half_cpus(), run_clone_each, steps);
        t_unsynced = seconds_per_step(half_cpus(), run_unsynced, steps);
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
