// SPDX-License-Identifier: MIT
//! SyncBatchNorm training forward + backward on one GPU at world 1 (no all-reduce): the five
//! kernels of a step (statistics; normalize with the statistics' finish in its prologue; backward
//! sums; parameter gradients; dx written over x, as the layer does; Note [batch-norm kernels]) on
//! NCHW and NHWC tensors in fp32 and bf16, with gamma = 1, beta = 0 and running statistics tracked
//! (momentum 0.1). Counters, every ratio taken between figures measured in this process:
//! - GBps: effective bandwidth, 5 x tensor bytes (read x twice, write y, read dy, write dx) / step time;
//! - copy_GBps: (bytes read + bytes written) / time of a 16-byte-vectorized copy kernel over a
//!   tensor of the same size: the yardstick;
//! - vs_floor: the 5-pass floor (5 x tensor bytes / copy bandwidth) / step time;
//! - vs_cudnn, vs_cudnn_persistent: cuDNN's batch-norm training forward + backward time on the same
//!   tensor (CUDNN_BATCHNORM_SPATIAL; CUDNN_BATCHNORM_SPATIAL_PERSISTENT where cuDNN takes the case,
//!   else the label says what cuDNN answered) / step time. Built without cuDNN (no
//!   LOCKSTEP_BENCH_CUDNN), these two are absent.
//! Every timed run (a step, a copy, cuDNN's pair of calls) starts from a flushed L2, so no run finds
//! its tensors left in L2 by the one before (a network's previous layers would have evicted them),
//! and is timed by events on the replica's stream while a short device-side wait holds the stream,
//! so the host has enqueued the whole run before the device starts it. The three are alternated
//! iteration by iteration. After the run, the goals (stated for an H200) are printed beside the
//! figures, not asserted. Without a GPU the program says so and exits 0.
#include <benchmark/benchmark.h>

#include <lockstep/cuda.cuh>

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#if LOCKSTEP_BENCH_CUDNN
#include <cudnn.h>
#endif

#include <cstdint>
#include <cstdio>
#include <exception>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "bench_util.hpp"

namespace {

using namespace lockstep;
namespace bn_kernels = kernels::device::bn_kernels;
using Resources = kernels::Ops<Cuda>::ReplicaResources;

// ---- the process's device resources (made in main once a GPU is known to exist) ----------------

std::unique_ptr<Resources> resources;

#if LOCKSTEP_BENCH_CUDNN
//! Throws when a cuDNN call fails.
void cudnn_check(cudnnStatus_t s, const char* what) {
    if (s != CUDNN_STATUS_SUCCESS) throw std::runtime_error(std::string(what) + ": " + cudnnGetErrorString(s));
}

//! One cuDNN handle for the process, bound to the replica's stream.
struct Cudnn {
    cudnnHandle_t handle = nullptr;
    explicit Cudnn(cudaStream_t stream) {
        cudnn_check(cudnnCreate(&handle), "cudnnCreate");
        cudnn_check(cudnnSetStream(handle, stream), "cudnnSetStream");
    }
    Cudnn(const Cudnn&) = delete;
    Cudnn& operator=(const Cudnn&) = delete;
    ~Cudnn() { (void)cudnnDestroy(handle); }
};
std::unique_ptr<Cudnn> cudnn;
std::string cudnn_unavailable = "cuDNN not initialized";
#endif

// ---- device helpers: the copy kernel, the L2 flush, the stream hold, event timing ---------------

constexpr int copy_threads = 256;
constexpr int copy_unroll = 4;

//! dst = src in 16-byte vectors, `copy_unroll` loads in flight per thread before its stores.
__global__ void __launch_bounds__(copy_threads)
    copy_kernel(const uint4* __restrict__ src, uint4* __restrict__ dst, std::int64_t vectors) {
    const std::int64_t base = static_cast<std::int64_t>(blockIdx.x) * copy_threads * copy_unroll + threadIdx.x;
    uint4 v[copy_unroll];
#pragma unroll
    for (int k = 0; k < copy_unroll; ++k) {
        const std::int64_t i = base + static_cast<std::int64_t>(k) * copy_threads;
        if (i < vectors) v[k] = src[i];
    }
#pragma unroll
    for (int k = 0; k < copy_unroll; ++k) {
        const std::int64_t i = base + static_cast<std::int64_t>(k) * copy_threads;
        if (i < vectors) dst[i] = v[k];
    }
}

//! One thread waits `ns` nanoseconds of device time (bounded by the global timer), holding the
//! stream while the host enqueues the run timed after it.
__global__ void hold_kernel(unsigned long long ns) {
    unsigned long long start = 0, now = 0;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        __nanosleep(1000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
}

constexpr unsigned long long hold_ns = 100'000;

//! A pair of timing events on one stream; `wait` is the bench's only wait for the device.
class Timer {
public:
    Timer() {
        LOCKSTEP_CUDA_CHECK(cudaEventCreate(&start_));
        LOCKSTEP_CUDA_CHECK(cudaEventCreate(&stop_));
    }
    Timer(const Timer&) = delete;
    Timer& operator=(const Timer&) = delete;
    ~Timer() {
        (void)cudaEventDestroy(start_);
        (void)cudaEventDestroy(stop_);
    }
    void start(cudaStream_t s) { LOCKSTEP_CUDA_CHECK(cudaEventRecord(start_, s)); }
    //! Seconds from `start` to now on `s`, once the device gets there.
    double stop(cudaStream_t s) {
        LOCKSTEP_CUDA_CHECK(cudaEventRecord(stop_, s));
        LOCKSTEP_CUDA_CHECK(cudaEventSynchronize(stop_));
        float ms = 0;
        LOCKSTEP_CUDA_CHECK(cudaEventElapsedTime(&ms, start_, stop_));
        return static_cast<double>(ms) * 1e-3;
    }
    //! Waits until everything enqueued on `s` so far has run (and reports its errors).
    void drain(cudaStream_t s) {
        LOCKSTEP_CUDA_CHECK(cudaEventRecord(stop_, s));
        LOCKSTEP_CUDA_CHECK(cudaEventSynchronize(stop_));
        LOCKSTEP_CUDA_CHECK(cudaGetLastError());
    }

private:
    cudaEvent_t start_ = nullptr, stop_ = nullptr;
};

// ---- the cases --------------------------------------------------------------------------------

//! A benchmark case: (N, C, H = W), layout, storage type.
struct Args {
    std::int64_t N = 0, C = 0, HW = 0;
    bool nhwc = false, bf16 = false;
    bool operator==(const Args&) const = default;
    std::int64_t numel() const { return N * C * HW * HW; }
    bool shape_is(std::int64_t n, std::int64_t c, std::int64_t hw) const { return N == n && C == c && HW == hw; }
    std::string str() const {
        return "(" + std::to_string(N) + ", " + std::to_string(C) + ", " + std::to_string(HW) + ", " + std::to_string(HW) + ") " +
               (nhwc ? "NHWC" : "NCHW") + " " + (bf16 ? "bf16" : "fp32");
    }
};

//! The goals of a case (0: none): only the four large shapes have them.
struct Goals {
    double vs_floor = 0, vs_cudnn = 0;
};

//! The goals of `a`, where the normalize pass takes the L2 path (x in half the L2) or not.
Goals goals_of(const Args& a, bool l2_path) {
    const bool l2_shape = a.shape_is(64, 128, 28);
    if (!l2_shape && !a.shape_is(256, 64, 56) && !a.shape_is(128, 256, 28) && !a.shape_is(256, 1024, 7))
        return {};  // launch-bound: reported only
    Goals g;
    g.vs_floor = l2_shape && l2_path ? 0.75 : 0.55;
    if (!a.nhwc && !a.bf16) g.vs_cudnn = 1.0;
    return g;
}

//! Standard normal x and dy, made once per shape (consecutive cases share a shape, in any
//! layout and type) and kept until the shape changes.
struct HostData {
    std::int64_t numel = -1;
    std::vector<float> x, dy;
};

const HostData& host_data(std::int64_t numel) {
    static HostData data;
    if (data.numel != numel) {
        data = HostData{};
        std::mt19937 gen(1);
        std::normal_distribution<float> dist;
        data.x.resize(static_cast<std::size_t>(numel));
        data.dy.resize(static_cast<std::size_t>(numel));
        for (auto& v : data.x) v = dist(gen);
        for (auto& v : data.dy) v = dist(gen);
        data.numel = numel;
    }
    return data;
}

//! The times of one iteration, in seconds (negative: not measured).
struct Sample {
    double ours = 0, copy = 0, cudnn = -1, persistent = -1;
};

class Workload {
public:
    virtual ~Workload() = default;
    virtual Sample measure() = 0;
    virtual std::size_t tensor_bytes() const = 0;
    virtual bool l2_path() const = 0;
    virtual bool dx_l2_path() const = 0;
    virtual bool has_cudnn() const = 0;
    virtual bool has_persistent() const = 0;
    virtual std::string cudnn_note() const = 0;
};

template <class T>
Tensor<T, Cuda> device_tensor(std::int64_t n) {
    return Tensor<T, Cuda>(Shape{n}, MemoryFormat::nchw, Device::cuda(resources->device), uninitialized);
}

template <class T>
void upload(Tensor<T, Cuda>& dst, const std::vector<T>& src, cudaStream_t s) {
    LOCKSTEP_CUDA_CHECK(cudaMemcpyAsync(dst.data(), src.data(), src.size() * sizeof(T), cudaMemcpyHostToDevice, s));
}

template <class T>
std::vector<T> converted(const std::vector<float>& v) {
    if constexpr (std::is_same_v<T, float>) {
        return v;
    } else {
        std::vector<T> out(v.size());
        for (std::size_t i = 0; i < v.size(); ++i) out[i] = kernels::device::from_float<T>(v[i]);
        return out;
    }
}

//! One case's tensors and the three timed runs: the step, the copy, cuDNN.
template <class T>
class Case final : public Workload {
public:
    explicit Case(const Args& a) : args_(a), ex_(resources->execution()) {
        const std::int64_t n = a.numel(), C = a.C;
        g_.batch = a.N;
        g_.channels = C;
        g_.inner = a.HW * a.HW;
        g_.channels_last = a.nhwc;
        info_ = kernels::cuda_ops::device_info(ex_.device);
        LOCKSTEP_CHECK(tensor_bytes() % sizeof(uint4) == 0, "the copy kernel needs a whole number of 16-byte vectors");
        const cudaStream_t s = ex_.stream;
        const Device dev = Device::cuda(ex_.device);
        x_ = device_tensor<T>(n);
        y_ = device_tensor<T>(n);
        dy_ = device_tensor<T>(n);
        a_ = device_tensor<T>(n);
        b_ = device_tensor<T>(n);
        {
            const HostData& h = host_data(n);
            upload(x_, converted<T>(h.x), s);
            upload(dy_, converted<T>(h.dy), s);
        }
        const std::vector<float> ones(static_cast<std::size_t>(C), 1.0f);
        const auto zeros_f = [&](std::int64_t k) { return Tensor<float, Cuda>(Shape{k}, MemoryFormat::nchw, dev); };
        weight_ = device_tensor<float>(C);
        upload(weight_, ones, s);
        bias_ = zeros_f(C);
        running_mean_ = zeros_f(C);
        running_var_ = device_tensor<float>(C);
        upload(running_var_, ones, s);
        weight_grad_ = zeros_f(C);
        bias_grad_ = zeros_f(C);
        shift_ = zeros_f(C);
        folded_ = zeros_f(4 * C);
        forward_payload_ = Tensor<double, Cuda>(Shape{3 * C + 1}, MemoryFormat::nchw, dev);
        backward_payload_ = Tensor<double, Cuda>(Shape{2 * C}, MemoryFormat::nchw, dev);
        stats_ = Tensor<double, Cuda>(Shape{2 * C + 1}, MemoryFormat::nchw, dev);
        batches_ = Tensor<std::int64_t, Cuda>(Shape{1}, MemoryFormat::nchw, dev);
        flush_bytes_ = 2 * static_cast<std::size_t>(info_.l2_bytes);
        flush_ = device_tensor<unsigned char>(static_cast<std::int64_t>(flush_bytes_));
#if LOCKSTEP_BENCH_CUDNN
        setup_cudnn();
#endif
        timer_.drain(s);
        for (int i = 0; i < 3; ++i) (void)measure();  // warm up: modules loaded, pool and caches settled
    }

    ~Case() override {
        try {
            timer_.drain(ex_.stream);  // nothing in flight uses the tensors freed after this
        } catch (...) {
        }
#if LOCKSTEP_BENCH_CUDNN
        if (x_desc_ != nullptr) (void)cudnnDestroyTensorDescriptor(x_desc_);
        if (bn_desc_ != nullptr) (void)cudnnDestroyTensorDescriptor(bn_desc_);
#endif
    }

    std::size_t tensor_bytes() const override { return static_cast<std::size_t>(args_.numel()) * sizeof(T); }
    bool l2_path() const override { return 2 * static_cast<std::int64_t>(tensor_bytes()) <= info_.l2_bytes; }
    bool dx_l2_path() const override { return 3 * static_cast<std::int64_t>(tensor_bytes()) <= info_.l2_bytes; }
    bool has_cudnn() const override { return spatial_ok_; }
    bool has_persistent() const override { return persistent_ok_; }
    std::string cudnn_note() const override { return cudnn_note_; }

    Sample measure() override {
        Sample s;
        s.ours = timed([&] { step(); });
        s.copy = timed([&] { copy(); });
#if LOCKSTEP_BENCH_CUDNN
        if (spatial_ok_) s.cudnn = timed([&] { cudnn_check(cudnn_step(CUDNN_BATCHNORM_SPATIAL), "cuDNN batch norm"); });
        if (persistent_ok_)
            s.persistent = timed([&] { cudnn_check(cudnn_step(CUDNN_BATCHNORM_SPATIAL_PERSISTENT), "cuDNN batch norm"); });
#endif
        return s;
    }

private:
    //! Flushes L2, holds the stream, then times `work` on it.
    template <class F>
    double timed(F&& work) {
        const cudaStream_t s = ex_.stream;
        flush_value_ = (flush_value_ + 1) & 0xff;
        LOCKSTEP_CUDA_CHECK(cudaMemsetAsync(flush_.data(), flush_value_, flush_bytes_, s));
        hold_kernel<<<1, 1, 0, s>>>(hold_ns);
        LOCKSTEP_CUDA_CHECK(cudaGetLastError());
        timer_.start(s);
        work();
        return timer_.stop(s);
    }

    //! The six kernels of a training step at world 1; y becomes the next step's x, as a network
    //! hands its activations on (normalized data again, since gamma = 1 and beta = 0).
    void step() {
        kernels::device::DeviceRun run{ex_.stream, info_, kernels::cuda_ops::scratch(ex_)};
        bn_kernels::local_stats(run, x_.data(), g_, forward_payload_.data(), shift_.data());
        bn_kernels::centre(run, g_, shift_.data(), forward_payload_.data());
        bn_kernels::FinishRequest finish;
        finish.payload = forward_payload_.data();
        finish.running_mean = running_mean_.data();
        finish.running_var = running_var_.data();
        finish.num_batches_tracked = batches_.data();
        finish.eps = 1e-5;
        finish.momentum = 0.1;
        bn_kernels::forward_normalize(run, x_.data(), y_.data(), g_, &finish, weight_.data(), bias_.data(), stats_.data(),
                                      folded_.data(), /*relu=*/false);
        bn_kernels::backward_sums(run, x_.data(), dy_.data(), /*relu=*/false, g_, folded_.data(), backward_payload_.data());
        bn_kernels::param_grads(run, g_.channels, backward_payload_.data(), stats_.data(), weight_grad_.data(),
                                bias_grad_.data());
        bn_kernels::backward_dx(run, x_.data(), dy_.data(), /*relu=*/false, x_.data(), g_, backward_payload_.data(),
                                stats_.data(), folded_.data(), weight_.data());
        std::swap(x_, y_);
    }

    //! dy into a scratch tensor through the copy kernel.
    void copy() {
        const auto vectors = static_cast<std::int64_t>(tensor_bytes() / sizeof(uint4));
        const std::int64_t per_block = std::int64_t{copy_threads} * copy_unroll;
        const auto blocks = static_cast<unsigned int>((vectors + per_block - 1) / per_block);
        copy_kernel<<<blocks, copy_threads, 0, ex_.stream>>>(reinterpret_cast<const uint4*>(dy_.data()),
                                                             reinterpret_cast<uint4*>(a_.data()), vectors);
        LOCKSTEP_CUDA_CHECK(cudaGetLastError());
    }

#if LOCKSTEP_BENCH_CUDNN
    void setup_cudnn() {
        if (!cudnn) {
            cudnn_note_ = "cuDNN: " + cudnn_unavailable;
            return;
        }
        const std::int64_t C = args_.C;
        const Device dev = Device::cuda(ex_.device);
        const auto dim = [](std::int64_t v) { return static_cast<int>(v); };
        cudnn_check(cudnnCreateTensorDescriptor(&x_desc_), "cudnnCreateTensorDescriptor");
        cudnn_check(cudnnCreateTensorDescriptor(&bn_desc_), "cudnnCreateTensorDescriptor");
        const cudnnStatus_t set = cudnnSetTensor4dDescriptor(x_desc_, args_.nhwc ? CUDNN_TENSOR_NHWC : CUDNN_TENSOR_NCHW,
                                                             args_.bf16 ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_FLOAT, dim(args_.N),
                                                             dim(C), dim(args_.HW), dim(args_.HW));
        const cudnnStatus_t derived =
            set == CUDNN_STATUS_SUCCESS ? cudnnDeriveBNTensorDescriptor(bn_desc_, x_desc_, CUDNN_BATCHNORM_SPATIAL) : set;
        if (derived != CUDNN_STATUS_SUCCESS) {
            cudnn_note_ = std::string("cuDNN: ") + cudnnGetErrorString(derived);
            return;
        }
        const std::vector<float> ones(static_cast<std::size_t>(C), 1.0f);
        const auto zeros_f = [&] { return Tensor<float, Cuda>(Shape{C}, MemoryFormat::nchw, dev); };
        scale_ = device_tensor<float>(C);
        upload(scale_, ones, ex_.stream);
        cudnn_bias_ = zeros_f();
        cudnn_running_mean_ = zeros_f();
        cudnn_running_var_ = device_tensor<float>(C);
        upload(cudnn_running_var_, ones, ex_.stream);
        save_mean_ = zeros_f();
        save_invstd_ = zeros_f();
        dscale_ = zeros_f();
        dbias_ = zeros_f();
        // Each mode is tried once: cuDNN answers NOT_SUPPORTED (or another status) for a case it does not take.
        const cudnnStatus_t spatial = cudnn_step(CUDNN_BATCHNORM_SPATIAL);
        const cudnnStatus_t persistent = cudnn_step(CUDNN_BATCHNORM_SPATIAL_PERSISTENT);
        timer_.drain(ex_.stream);
        spatial_ok_ = spatial == CUDNN_STATUS_SUCCESS;
        persistent_ok_ = persistent == CUDNN_STATUS_SUCCESS;
        if (!spatial_ok_) cudnn_note_ = std::string("cuDNN spatial: ") + cudnnGetErrorString(spatial);
        if (!persistent_ok_)
            cudnn_note_ += std::string(cudnn_note_.empty() ? "" : ", ") + "cuDNN persistent: " + cudnnGetErrorString(persistent);
    }

    //! cuDNN's training forward (y into a scratch tensor) and backward (dx into another), in `mode`.
    cudnnStatus_t cudnn_step(cudnnBatchNormMode_t mode) {
        const float one = 1.0f, zero = 0.0f;
        const cudnnStatus_t fwd = cudnnBatchNormalizationForwardTraining(
            cudnn->handle, mode, &one, &zero, x_desc_, x_.data(), x_desc_, a_.data(), bn_desc_, scale_.data(), cudnn_bias_.data(),
            0.1, cudnn_running_mean_.data(), cudnn_running_var_.data(), 1e-5, save_mean_.data(), save_invstd_.data());
        if (fwd != CUDNN_STATUS_SUCCESS) return fwd;
        // Parameter gradients accumulate (beta 1), as the step's do.
        return cudnnBatchNormalizationBackward(cudnn->handle, mode, &one, &zero, &one, &one, x_desc_, x_.data(), x_desc_,
                                               dy_.data(), x_desc_, b_.data(), bn_desc_, scale_.data(), dscale_.data(),
                                               dbias_.data(), 1e-5, save_mean_.data(), save_invstd_.data());
    }

    cudnnTensorDescriptor_t x_desc_ = nullptr, bn_desc_ = nullptr;
    Tensor<float, Cuda> scale_, cudnn_bias_, cudnn_running_mean_, cudnn_running_var_, save_mean_, save_invstd_, dscale_, dbias_;
#endif

    Args args_;
    Execution<Cuda> ex_;
    kernels::device::DeviceInfo info_;
    kernels::BnGeometry g_;
    Timer timer_;
    Tensor<T, Cuda> x_, y_, dy_, a_, b_;  // a_, b_: the copy's and cuDNN's outputs
    Tensor<float, Cuda> weight_, bias_, running_mean_, running_var_, weight_grad_, bias_grad_, shift_, folded_;
    Tensor<double, Cuda> forward_payload_, backward_payload_, stats_;
    Tensor<std::int64_t, Cuda> batches_;
    Tensor<unsigned char, Cuda> flush_;
    std::size_t flush_bytes_ = 0;
    int flush_value_ = 0;
    bool spatial_ok_ = false, persistent_ok_ = false;
#if LOCKSTEP_BENCH_CUDNN
    std::string cudnn_note_;
#else
    std::string cudnn_note_ = "built without cuDNN";
#endif
};

// Google Benchmark calls a case's function several times while it settles the iteration count:
// the case's tensors are kept between those calls and freed when the next case begins.
std::unique_ptr<Workload> current;
Args current_args;

Workload& workload(const Args& a) {
    if (!current || !(current_args == a)) {
        current.reset();
        if (a.bf16)
            current = std::make_unique<Case<__nv_bfloat16>>(a);
        else
            current = std::make_unique<Case<float>>(a);
        current_args = a;
    }
    return *current;
}

//! A case's reported figures, for the goal table printed after the run (the last run of a case wins).
struct Result {
    Args args;
    bool l2_path = false;
    double vs_floor = 0, vs_cudnn = -1;
};
std::vector<Result> results;

void record(const Result& r) {
    for (auto& old : results)
        if (old.args == r.args) {
            old = r;
            return;
        }
    results.push_back(r);
}

void BM_CudaBatchNorm(benchmark::State& state) {
    Args a;
    a.N = state.range(0);
    a.C = state.range(1);
    a.HW = state.range(2);
    a.nhwc = state.range(3) != 0;
    a.bf16 = state.range(4) != 0;
    try {
        Workload& w = workload(a);
        double ours = 0, copy = 0, cudnn_s = 0, persistent = 0;
        for (auto _ : state) {
            const Sample s = w.measure();
            state.SetIterationTime(s.ours);
            ours += s.ours;
            copy += s.copy;
            cudnn_s += s.cudnn;
            persistent += s.persistent;
        }
        const auto bytes = static_cast<double>(w.tensor_bytes());
        const auto n = static_cast<double>(state.iterations());
        const double bw = 5.0 * bytes * n / ours;
        const double copy_bw = 2.0 * bytes * n / copy;
        Result r{a, w.l2_path(), bw / copy_bw, -1};
        state.SetBytesProcessed(static_cast<std::int64_t>(5 * w.tensor_bytes()) * state.iterations());
        state.counters["GBps"] = bw / 1e9;
        state.counters["copy_GBps"] = copy_bw / 1e9;
        state.counters["vs_floor"] = r.vs_floor;
        if (w.has_cudnn()) {
            r.vs_cudnn = cudnn_s / ours;
            state.counters["vs_cudnn"] = r.vs_cudnn;
        }
        if (w.has_persistent()) state.counters["vs_cudnn_persistent"] = persistent / ours;
        std::string label = std::string(a.bf16 ? "bf16" : "fp32") + (a.nhwc ? " NHWC" : " NCHW");
        if (w.l2_path()) label += w.dx_l2_path() ? ", L2 path (normalize, dx)" : ", L2 path (normalize)";
        if (goals_of(a, r.l2_path).vs_floor == 0) label += ", launch-bound: no goal";
        if (!w.cudnn_note().empty()) label += ", " + w.cudnn_note();
        state.SetLabel(label);
        record(r);
    } catch (const std::exception& e) {
        state.SkipWithError(e.what());
        current.reset();
    }
}

// (N, C, H = W, layout 0 = NCHW 1 = NHWC, storage 0 = fp32 1 = bf16), shape by shape: the first
// two are launch-bound and reported only; the goals apply to the last four. 7 x 7 planes (a
// ResNet's last stage) are no whole number of vectors: NCHW takes windows (Note [channels-first
// windows]).
BENCHMARK(BM_CudaBatchNorm)
    ->ArgNames({"N", "C", "HW", "nhwc", "bf16"})
    ->ArgsProduct({{64}, {64}, {28}, {0, 1}, {0, 1}})
    ->ArgsProduct({{32}, {256}, {14}, {0, 1}, {0, 1}})
    ->ArgsProduct({{64}, {128}, {28}, {0, 1}, {0, 1}})
    ->ArgsProduct({{256}, {64}, {56}, {0, 1}, {0, 1}})
    ->ArgsProduct({{128}, {256}, {28}, {0, 1}, {0, 1}})
    ->ArgsProduct({{256}, {1024}, {7}, {0, 1}, {0, 1}})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

//! The goal table: each case with goals, its figures and whether they meet them (not asserted).
void print_goals(const std::string& device) {
    bool header = false;
    for (const Result& r : results) {
        const Goals g = goals_of(r.args, r.l2_path);
        if (g.vs_floor == 0) continue;
        if (!header) {
            std::printf("\nGoals (stated for an H200; this run: %s). Printed, not asserted:\n", device.c_str());
            header = true;
        }
        std::printf("  %-28s vs_floor %.3f (goal >= %.2f%s): %s", r.args.str().c_str(), r.vs_floor, g.vs_floor,
                    g.vs_floor > 0.55 ? ", L2 path" : "", r.vs_floor >= g.vs_floor ? "met" : "NOT met");
        if (g.vs_cudnn > 0) {
            if (r.vs_cudnn < 0)
                std::printf("; vs_cudnn not measured");
            else
                std::printf("; vs_cudnn %.3f (goal >= %.2f): %s", r.vs_cudnn, g.vs_cudnn,
                            r.vs_cudnn >= g.vs_cudnn ? "met" : "NOT met");
        }
        std::printf("\n");
    }
}

}  // namespace

int main(int argc, char** argv) {
    if (const auto done = lockstep::bench::start_gpu_benchmark(lockstep::cuda::device_count(), &argc, argv)) return *done;
    std::string device = "GPU 0";
    try {
        resources = std::make_unique<Resources>(lockstep::Device::cuda(0));
        resources->bind_thread();
        cudaDeviceProp prop{};
        LOCKSTEP_CUDA_CHECK(cudaGetDeviceProperties(&prop, resources->device));
        const auto info = lockstep::kernels::cuda_ops::device_info(resources->device);
        device = prop.name;
        benchmark::AddCustomContext("gpu", device + ", " + std::to_string(info.multiprocessors) + " SMs, L2 " +
                                               std::to_string(info.l2_bytes >> 20) + " MiB");
#if LOCKSTEP_BENCH_CUDNN
        try {
            cudnn = std::make_unique<Cudnn>(resources->stream.get());
            benchmark::AddCustomContext("cudnn", std::to_string(cudnnGetVersion()));
        } catch (const std::exception& e) {
            cudnn_unavailable = e.what();
            benchmark::AddCustomContext("cudnn", "unavailable: " + cudnn_unavailable);
        }
#else
        benchmark::AddCustomContext("cudnn", "not built (cuDNN not found at configure time)");
#endif
    } catch (const std::exception& e) {
        std::fprintf(stderr, "bench_cuda_batch_norm: %s\n", e.what());
        return 1;
    }
    benchmark::RunSpecifiedBenchmarks();
    current.reset();
#if LOCKSTEP_BENCH_CUDNN
    cudnn.reset();
#endif
    print_goals(device);
    resources.reset();
    benchmark::Shutdown();
    return 0;
}
