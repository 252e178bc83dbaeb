// SPDX-License-Identifier: MIT
//! The example network's two convolutions (conv1 1->32 and conv2 32->64, 3x3, padding 1, on 28 x 28)
//! forward and backward on one replica, through cuDNN (Note [cuDNN convolutions]) and through
//! im2col + cuBLAS, at batch 64, 256 and 1024, in strict fp32 and in PyTorch's default math.
//! Reports images/s and, for cuDNN, `vs_im2col`: its images/s over im2col's at the same batch and
//! math, measured in the same process; then bf16 (Note [precision], Note [activation precision]:
//! bf16 operands and bf16 activations between the two layers, as a training step under
//! Precision::bf16 runs them) on the engine a replica would use (cuDNN's bf16 configuration
//! where it is built in, else im2col + cuBLAS) and on im2col + cuBLAS: `vs_fp32`, the first's
//! images/s over PyTorch's default math on the replica's engine, and `vs_im2col` for bf16 through
//! cuDNN, in the same process. Prints "no GPU" and exits 0 where there is none; without cuDNN in
//! the build only the im2col engines run.
#include <benchmark/benchmark.h>

#include <lockstep/cuda.cuh>
#include <lockstep/nn.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <random>
#include <string>
#include <tuple>

#include "bench_util.hpp"

namespace {

using namespace lockstep;

// images/s by (engine, math, batch); engine 0: im2col, 1: cuDNN, 2: bf16 on the replica's engine,
// 3: bf16 on im2col (2 and 3: math 1 only).
std::map<std::tuple<int, int, std::int64_t>, double> images_per_s;
// The batches whose bf16 convolutions (both layers) ran cuDNN's bf16 configuration.
std::map<std::int64_t, bool> bf16_on_cudnn;

// Whether both convolutions of the bench at `batch` ran through cuDNN in bf16 (not its fallback).
bool cudnn_ran_bf16([[maybe_unused]] const nn::Context<Cuda>& ctx, [[maybe_unused]] std::int64_t batch) {
#if LOCKSTEP_WITH_CUDNN
    if (ctx.exec.cudnn == nullptr) return false;
    bool all = true;
    for (const auto& [in, out] : {std::pair<std::int64_t, std::int64_t>{1, 32}, {32, 64}}) {
        const kernels::ConvGeometry g{
            .batch = batch, .in_channels = in, .height = 28, .width = 28, .out_channels = out, .kernel = 3, .padding = 1};
        kernels::cuda_ops::CudnnConvolutions::Choice ch;
        all = all &&
              kernels::cuda_ops::CudnnConvolutions::chosen(kernels::device::layer_kernels::ConvPlan(g), ctx.exec.math, ch,
                                                           Precision::bf16) &&
              ch.usable;
    }
    bf16_on_cudnn[batch] = all;
    return all;
#else
    return false;
#endif
}

void BM_CudaConv(benchmark::State& state) {
    const int engine = static_cast<int>(state.range(0));
    const Math math = state.range(1) == 0 ? Math::strict_fp32 : Math::pytorch_default;
    const std::int64_t batch = state.range(2);
    try {
        kernels::Ops<Cuda>::ReplicaResources res(Device::cuda(0));
        const auto entered = res.enter();
        nn::Context<Cuda> ctx;
        ctx.exec = res.execution();
        ctx.exec.math = math;
        if (engine == 0 || engine == 3) ctx.exec.cudnn = nullptr;
        const bool bf16 = engine >= 2;
        if (bf16) ctx.exec.precision = Precision::bf16;
        if (engine == 1 && ctx.exec.cudnn == nullptr) {
            state.SkipWithError("no cuDNN in this build (or LOCKSTEP_CUDNN=0)");
            return;
        }
        nn::Generator gen(1);
        nn::Conv2d<Cuda> conv1(1, 32, 3, {.padding = 1}, gen), conv2(32, 64, 3, {.padding = 1}, gen);
        Tensor<float, Host> xh(Shape{batch, 1, 28, 28});
        std::mt19937 rng(3);
        std::normal_distribution<float> d;
        for (float& v : xh.span()) v = d(rng);
        const auto x = xh.to<Cuda>(Device::cuda(0));
        Tensor<float, Host> dyh(Shape{batch, 64, 28, 28});
        for (float& v : dyh.span()) v = d(rng);
        const auto dy = dyh.to<Cuda>(Device::cuda(0));
        Tensor<BFloat16, Cuda> dy16(dy.shape(), dy.format(), dy.device(), uninitialized);
        kernels::Ops<Cuda>::to_bf16(ctx.exec, dy, dy16);
        const auto step = [&] {
            if (bf16) {  // activations in bf16 between the layers; the input fp32 (copied, as the fp32 step's)
                (void)conv2.forward(ctx, conv1.forward(ctx, Activation<Cuda>(Tensor<float, Cuda>(x))));
                (void)conv1.backward(ctx, conv2.backward(ctx, Activation<Cuda>::view_of(dy16)));
                return;
            }
            (void)conv2.forward(ctx, conv1.forward(ctx, x));
            (void)conv1.backward(ctx, conv2.backward(ctx, dy));
        };
        for (int i = 0; i < 3; ++i) step();  // warm-up: algorithms chosen, workspace grown
        kernels::Ops<Cuda>::wait(ctx.exec, "the warm-up");
        const auto t0 = std::chrono::steady_clock::now();
        for (auto _ : state) {
            step();
            kernels::Ops<Cuda>::wait(ctx.exec, "a convolution step");
        }
        const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        const double ips = static_cast<double>(batch) * static_cast<double>(state.iterations()) / std::max(secs, 1e-12);
        state.counters["images_per_s"] = ips;
        images_per_s[{engine, static_cast<int>(state.range(1)), batch}] = ips;
        if (engine == 1 && images_per_s.count({0, static_cast<int>(state.range(1)), batch}) != 0)
            state.counters["vs_im2col"] = ips / images_per_s[{0, static_cast<int>(state.range(1)), batch}];
        if (engine == 2) {  // over cuDNN's figure where it ran, else im2col's (found, never inserted)
            auto fp32 = images_per_s.find({1, 1, batch});
            if (fp32 == images_per_s.end()) fp32 = images_per_s.find({0, 1, batch});
            if (fp32 != images_per_s.end() && fp32->second > 0) state.counters["vs_fp32"] = ips / fp32->second;
            if (cudnn_ran_bf16(ctx, batch) && images_per_s.count({3, 1, batch}) != 0)
                state.counters["vs_im2col"] = ips / images_per_s[{3, 1, batch}];
        }
    } catch (const std::exception& e) {
        state.SkipWithError(e.what());
    }
}
// im2col before cuDNN at each (math, batch): vs_im2col divides by a figure of the same run.
BENCHMARK(BM_CudaConv)
    ->ArgNames({"cudnn", "tf32", "batch"})
    ->ArgsProduct({{0, 1}, {0, 1}, {64, 256, 1024}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
// bf16 after the fp32 runs they are divided by (their math mode does not matter): im2col first.
BENCHMARK(BM_CudaConv)
    ->ArgNames({"bf16", "tf32", "batch"})
    ->ArgsProduct({{3, 2}, {1}, {64, 256, 1024}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace

int main(int argc, char** argv) {
    if (const auto done = lockstep::bench::start_gpu_benchmark(lockstep::cuda::device_count(), &argc, argv)) return *done;
    benchmark::RunSpecifiedBenchmarks();
    benchmark::Shutdown();
    // "<label> batch B ratio ..." over the batches where both figures exist (the GPU check reports it).
    using Key = std::tuple<int, int, std::int64_t>;
    const auto ratio_line = [](const std::string& label, const auto& numerator, const auto& denominator) {
        std::string line = label + ":";
        bool any = false;
        for (const std::int64_t b : {64, 256, 1024}) {
            const auto n = images_per_s.find(numerator(b)), d = images_per_s.find(denominator(b));
            if (n == images_per_s.end() || d == images_per_s.end()) continue;
            char buf[64];
            std::snprintf(buf, sizeof buf, " batch %lld %.2f", static_cast<long long>(b), n->second / d->second);
            line += buf;
            any = true;
        }
        if (any) std::printf("%s\n", line.c_str());
    };
    // One line per math: cuDNN over im2col.
    for (int m = 0; m < 2; ++m)
        ratio_line(
            std::string("conv cuDNN vs im2col, ") + (m == 0 ? "strict_fp32" : "pytorch_default"),
            [m](std::int64_t b) {
                return Key{1, m, b};
            },
            [m](std::int64_t b) {
                return Key{0, m, b};
            });
    // bf16 products over PyTorch's default math on the replica's engine.
    ratio_line(
        "conv bf16 vs fp32 (pytorch_default, cuDNN where it ran)",
        [](std::int64_t b) {
            return Key{2, 1, b};
        },
        [](std::int64_t b) {
            return images_per_s.count({1, 1, b}) != 0 ? Key{1, 1, b} : Key{0, 1, b};
        });
    // bf16 through cuDNN over bf16 through im2col, at the batches where cuDNN ran both layers in bf16.
    if (images_per_s.count({1, 1, 64}) != 0) {
        ratio_line(
            "conv bf16 cuDNN vs bf16 im2col",
            [](std::int64_t b) {
                const auto ran = bf16_on_cudnn.find(b);
                return ran != bf16_on_cudnn.end() && ran->second ? Key{2, 1, b} : Key{-1, 1, b};  // -1: never measured
            },
            [](std::int64_t b) {
                return Key{3, 1, b};
            });
        for (const auto& [b, ran] : bf16_on_cudnn)
            if (!ran)
                std::printf("conv bf16 batch %lld: cuDNN had no deterministic bf16 algorithm, im2col ran\n",
                            static_cast<long long>(b));
    }
    if (images_per_s.count({1, 0, 64}) == 0 && images_per_s.count({1, 1, 64}) == 0)
        std::printf("conv cuDNN vs im2col: not run (no cuDNN in this build, or LOCKSTEP_CUDNN off)\n");
    return 0;
}
