// SPDX-License-Identifier: MIT
//! Images per second of the example network (mnist::Net<Cuda>, SGD with momentum) trained by
//! DataParallel at a fixed batch of 64 per replica, for 1, 2 and 4 replicas: weak scaling. The
//! replicas go to distinct GPUs where there are enough, else all to cuda:0 (sharing it: the figure
//! then shows what sharing costs, not scaling). Reports `weak_scaling`, images/s at
//! N replicas over N times images/s at 1 (goal >= 0.9 on N real GPUs). Prints "no GPU" and exits 0
//! where there is none.
#include <benchmark/benchmark.h>

#include <lockstep/cuda.cuh>
#include <lockstep/nn.hpp>
#include <lockstep/host.hpp>
#include <lockstep/parallel.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "../examples/mnist/net.hpp"

#include "bench_util.hpp"
#include "mnist_batch.hpp"

namespace {

using namespace lockstep;

int gpus = 0;
std::map<int, double> images_per_s;  // by replica count

void BM_CudaTrainStep(benchmark::State& state) {
    const int replicas = static_cast<int>(state.range(0));
    try {
        std::vector<Device> devices;
        // One replica per GPU where there are enough, else all on cuda:0 (a group takes no mix).
        for (int r = 0; r < replicas; ++r) devices.push_back(Device::cuda(replicas <= gpus ? r : 0));
        nn::Generator gen(1);
        DataParallel<mnist::Net<Cuda>> dp(mnist::Net<Cuda>(gen), devices);
        nn::Sgd<Cuda> sgd({.lr = 0.01, .momentum = 0.9});
        const std::int64_t batch = 64 * static_cast<std::int64_t>(replicas);
        const auto [x, labels] = lockstep::bench::mnist_batch<Cuda>(batch, devices[0]);
        for (int i = 0; i < 3; ++i) (void)dp.train_step(x, labels, nn::SoftmaxCrossEntropy{}, sgd);  // warm-up
        const auto t0 = std::chrono::steady_clock::now();
        for (auto _ : state) benchmark::DoNotOptimize(dp.train_step(x, labels, nn::SoftmaxCrossEntropy{}, sgd));
        const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        const double ips = static_cast<double>(batch) * static_cast<double>(state.iterations()) / std::max(secs, 1e-12);
        state.counters["images_per_s"] = ips;
        state.counters["gpus_used"] = std::min(replicas, gpus);
        images_per_s[replicas] = ips;
        if (replicas > 1 && images_per_s.count(1) != 0) state.counters["weak_scaling"] = ips / (replicas * images_per_s[1]);
    } catch (const std::exception& e) {
        state.SkipWithError(e.what());
    }
}
BENCHMARK(BM_CudaTrainStep)->ArgName("replicas")->Arg(1)->Arg(2)->Arg(4)->UseRealTime()->Unit(benchmark::kMillisecond);

}  // namespace

int main(int argc, char** argv) {
    gpus = lockstep::cuda::device_count();
    if (const auto done = lockstep::bench::start_gpu_benchmark(gpus, &argc, argv)) return *done;
    benchmark::AddCustomContext("gpus", std::to_string(gpus));
    benchmark::RunSpecifiedBenchmarks();
    benchmark::Shutdown();
    if (images_per_s.count(1) != 0)
        for (const auto& [n, ips] : images_per_s)
            if (n > 1)
                std::printf(
                    "weak_scaling %d replicas on %d GPU(s): %.3f (images/s %.0f vs %.0f at 1 replica; goal >= 0.9 on %d "
                    "real GPUs)\n",
                    n, std::min(n, gpus), ips / (n * images_per_s[1]), ips, images_per_s[1], n);
    return 0;
}
