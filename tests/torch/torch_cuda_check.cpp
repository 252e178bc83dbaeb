// SPDX-License-Identifier: MIT
// lockstep::torch on CUDA (issue #44; Note [libtorch CUDA replicas]). A program rather than a Catch
// test, so that scripts/gpu-check.sh can build it on a GPU machine against that machine's PyTorch:
//   1. SyncBatchNorm alone on cuda:0 against the CPU (contiguous and channels-last): output, input
//      and parameter gradients, running statistics;
//   2. three training steps of DataParallel with one replica per GPU (up to 2) against the plain
//      module on the CPU on the whole batch, replicas identical, evaluation output;
//   3. a replica that throws in its loss, or in backward (on libtorch's thread for the device),
//      fails the step, nothing is applied, and the next step runs.
// 2 and 3 run with the buckets all-reduced by NCCL (where the component has it: Note [libtorch
// NCCL buckets]) and through the host.
// Strict fp32 (no TF32) so that a GPU and a CPU agree within 1e-4. Exits 0 when every check holds,
// 1 when one fails, 77 when libtorch sees no CUDA device (ctest reports the test skipped).
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include "torch_models.hpp"

namespace {

namespace models = lockstep_test_torch;
namespace lt = lockstep::torch;

int failures = 0;

void check(bool ok, const std::string& what) {
    std::printf("%s: %s\n", ok ? "ok" : "FAIL", what.c_str());
    if (!ok) ++failures;
}

double relative(const at::Tensor& a, const at::Tensor& b) {
    const auto x = a.to(at::kCPU).to(at::kDouble), y = b.to(at::kCPU).to(at::kDouble);
    return (x - y).norm().item<double>() / std::max(y.norm().item<double>(), 1e-30);
}

std::shared_ptr<models::ResNetImpl> on_cpu(const models::ResNetImpl& m) {
    return std::dynamic_pointer_cast<models::ResNetImpl>(m.clone(::torch::kCPU));
}

void sync_batch_norm_alone(bool channels_last) {
    const std::string how = channels_last ? " (channels-last)" : "";
    ::torch::manual_seed(3);
    auto x = ::torch::randn({16, 8, 6, 6}) * 3.0 + 40.0;
    const auto dy = ::torch::randn({16, 8, 6, 6});
    if (channels_last) x = x.contiguous(at::MemoryFormat::ChannelsLast);
    lt::SyncBatchNorm cpu(::torch::nn::BatchNormOptions(8).momentum(0.3));
    {
        ::torch::NoGradGuard no_grad;
        cpu->weight.copy_(::torch::linspace(0.5, 2.0, 8));
        cpu->bias.copy_(::torch::linspace(-0.3, 0.3, 8));
    }
    auto gpu = std::dynamic_pointer_cast<lt::SyncBatchNormImpl>(cpu->clone(::torch::Device("cuda:0")));
    auto xc = x.clone().requires_grad_(true);
    auto xg = x.to(::torch::Device("cuda:0")).requires_grad_(true);
    const auto yc = cpu(xc);
    const auto yg = gpu->forward(xg);
    (yc * dy).sum().backward();
    (yg * dy.to(::torch::Device("cuda:0"))).sum().backward();
    check(yg.is_cuda() && relative(yg, yc) <= 1e-5, "SyncBatchNorm output on cuda:0 equals the CPU's" + how);
    check(relative(xg.grad(), xc.grad()) <= 1e-4, "SyncBatchNorm input gradient on cuda:0 equals the CPU's" + how);
    check(relative(gpu->weight.grad(), cpu->weight.grad()) <= 1e-4 && relative(gpu->bias.grad(), cpu->bias.grad()) <= 1e-4,
          "SyncBatchNorm weight and bias gradients on cuda:0 equal the CPU's" + how);
    check(relative(gpu->running_mean, cpu->running_mean) <= 1e-5 && relative(gpu->running_var, cpu->running_var) <= 1e-5,
          "SyncBatchNorm running statistics on cuda:0 equal the CPU's" + how);
}

// The transports a step runs with: NCCL where the component has it, and the host.
std::vector<bool> transports() { return lt::nccl_available() ? std::vector<bool>{true, false} : std::vector<bool>{false}; }

// One CUDA replica alone makes no NCCL call (the stream group's single mode: its events and
// waits only); the report says so.
void check_transport(const char* got, bool nccl, int replicas, const std::string& how) {
    check(std::string(got) == (nccl ? "nccl" : "host"), std::string("buckets all-reduced through ") + got +
                                                            (nccl && replicas == 1 ? " (one replica: no NCCL call)" : "") + how);
}

void training_steps(int replicas, bool nccl) {
    constexpr int steps = 3;
    constexpr std::int64_t batch = 11;
    const std::string how = " (" + std::to_string(replicas) + " CUDA replica" + (replicas > 1 ? "s, " : ", ") +
                            (nccl ? "NCCL" : "host") + " buckets)";
    ::torch::manual_seed(7);
    models::ResNet reference(6);
    auto reference_opt = models::sgd(*reference);
    for (int k = 0; k < steps; ++k) {
        reference_opt->zero_grad();
        models::cross_entropy(reference->forward(models::images(batch, 100 + k)), models::labels(batch, 100 + k)).backward();
        reference_opt->step();
    }
    ::torch::manual_seed(7);
    models::ResNet model(6);
    model->to(::torch::Device("cuda:0"));
    std::vector<::torch::Device> devices;
    for (int r = 0; r < replicas; ++r) devices.emplace_back(::torch::kCUDA, static_cast<c10::DeviceIndex>(r));
    lt::Options options;
    options.bucket_bytes = 2048;  // several buckets, launched from autograd's device thread
    options.nccl = nccl;
    lt::DataParallel dp(model, devices, models::sgd, options);
    check_transport(dp.gradient_transport(), nccl, replicas, how);
    for (int k = 0; k < steps; ++k)
        dp.train_step(models::images(batch, 100 + k), models::labels(batch, 100 + k), models::cross_entropy);
    const auto trained = on_cpu(*dp.module());
    std::string where;
    const double worst = models::worst_relative(*trained, *reference, &where);
    check(worst <= 1e-4, "3 steps equal the plain module's on the CPU" + how + ": worst tensor " + where + " at " +
                             std::to_string(worst));
    bool same = true;
    for (int r = 1; r < replicas; ++r) same = same && models::identical(*on_cpu(*dp.replica(r)), *trained);
    check(same, "replicas bit-identical after 3 steps" + how);
    check(replicas == 1 || dp.overlapped_buckets(0) > 0, "buckets all-reduced during backward" + how);
    dp.eval();
    reference->eval();
    const auto x = models::images(batch, 5);
    const auto out = dp.forward(x);
    check(out.is_cpu() && relative(out, reference->forward(x)) <= 1e-4, "evaluation output gathered on the CPU" + how);
}

// The identity, whose backward throws: it runs on autograd's thread for the device.
struct ThrowInBackward : ::torch::autograd::Function<ThrowInBackward> {
    static at::Tensor forward(::torch::autograd::AutogradContext*, const at::Tensor& x) { return x.clone(); }
    static ::torch::autograd::variable_list backward(::torch::autograd::AutogradContext*, ::torch::autograd::variable_list) {
        throw std::runtime_error("a backward that fails");
    }
};

void failing_replica(bool nccl) {
    const std::string how = nccl ? " (NCCL buckets)" : " (host buckets)";
    ::torch::manual_seed(7);
    models::ResNet model(6);
    model->to(::torch::Device("cuda:0"));
    lt::Options options;
    options.nccl = nccl;
    lt::DataParallel dp(model, std::vector<::torch::Device>{::torch::Device("cuda:0")}, models::sgd, options);
    check_transport(dp.gradient_transport(), nccl, 1, how);
    const auto before = on_cpu(*dp.module());
    const auto fails = [&](const lt::DataParallel<models::ResNetImpl>::Loss& loss, const std::string& message) {
        try {
            dp.train_step(models::images(8, 1), models::labels(8, 1), loss);
        } catch (const std::exception& e) {
            return std::string(e.what()).find(message) != std::string::npos;
        }
        return false;
    };
    check(fails([](const at::Tensor&, const at::Tensor&) -> at::Tensor { throw std::runtime_error("a loss that fails"); },
                "a loss that fails") &&
              models::identical(*on_cpu(*dp.module()), *before),
          "a failing loss fails the step and nothing is applied" + how);
    check(fails([](const at::Tensor& out, const at::Tensor& y) { return ThrowInBackward::apply(models::cross_entropy(out, y)); },
                "a backward that fails") &&
              models::identical(*on_cpu(*dp.module()), *before),
          "a backward that throws on autograd's device thread fails the step and nothing is applied" + how);
    dp.train_step(models::images(8, 2), models::labels(8, 2), models::cross_entropy);
    check(!models::identical(*on_cpu(*dp.module()), *before), "the next step trains" + how);
}

}  // namespace

int main() {
    const auto gpus = static_cast<int>(::torch::cuda::device_count());
    if (gpus == 0) {
        std::printf("libtorch sees no CUDA device: lockstep::torch's CUDA checks did not run\n");
        return 77;
    }
    at::globalContext().setAllowTF32CuDNN(false);
    at::globalContext().setAllowTF32CuBLAS(false);
    try {
        sync_batch_norm_alone(false);
        sync_batch_norm_alone(true);
        for (const bool nccl : transports()) {
            for (int replicas = 1; replicas <= std::min(gpus, 2); ++replicas) training_steps(replicas, nccl);
            failing_replica(nccl);
        }
    } catch (const std::exception& e) {
        std::printf("FAIL: threw %s\n", e.what());
        return 1;
    }
    std::printf("%d failed (%d CUDA device(s))\n", failures, gpus);
    return failures == 0 ? 0 : 1;
}
