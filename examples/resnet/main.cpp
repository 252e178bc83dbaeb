// SPDX-License-Identifier: MIT
//! A small residual network trained data-parallel on Fashion-MNIST with the kit for real models:
//! residual blocks with SyncBatchNorm, a global average pool, AdamW without weight decay on norms
//! and biases, a cosine schedule with warm-up, and lockstep::data's loader; `--gate` adds a module
//! of one's own written with the tensor operations; `--backend cuda` trains on GPUs where the build
//! has the CUDA backend (examples/resnet/README.md).
#include <CLI/CLI.hpp>
#include <lockstep/host.hpp>
#include <unistd.h>

#include <cstdio>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "options.hpp"

namespace {

using lockstep::Device;

// The replicas' devices: --replicas host threads, or one CUDA device per entry of --devices
// (every visible GPU, one replica each, when it is not given).
std::vector<Device> plan(const resnet::Options& o) {
    if (o.backend == "host") {
        if (!o.devices.empty())
            throw lockstep::UsageError(
                "--devices names CUDA devices, but this run trains on the host; count host replicas "
                "with --replicas N");
        return lockstep::kernels::Ops<lockstep::Host>::default_devices(o.replicas);
    }
#if !defined(LOCKSTEP_EXAMPLE_CUDA)
    throw lockstep::UsageError(
        "--backend cuda: this build has no CUDA backend (nvcc and NCCL were not found when it was "
        "configured); use --backend host");
#else
    const int gpus = resnet::cuda_device_count();
    if (gpus == 0) throw lockstep::DeviceMismatch("--backend cuda: no GPU is visible here; use --backend host");
    std::vector<Device> devices;
    if (o.devices.empty()) {
        for (int d = 0; d < gpus; ++d) devices.push_back(Device::cuda(d));
        return devices;
    }
    std::stringstream list(o.devices);
    std::string item;
    while (std::getline(list, item, ',')) {
        int d = -1;
        try {
            std::size_t used = 0;
            d = std::stoi(item, &used);
            if (used != item.size()) d = -1;
        } catch (const std::exception&) {
        }
        if (d < 0) throw lockstep::UsageError("--devices: expected GPU indices separated by commas, such as 0,1 or 0,0");
        if (d >= gpus)
            throw lockstep::DeviceMismatch("--devices: there is no GPU cuda:" + std::to_string(d) + " here; " +
                                           std::to_string(gpus) + " visible");
        devices.push_back(Device::cuda(d));
    }
    if (devices.empty()) throw lockstep::UsageError("--devices: expected GPU indices separated by commas, such as 0,1 or 0,0");
    return devices;
#endif
}

}  // namespace

int main(int argc, char** argv) {
    resnet::Options o;
    o.progress = ::isatty(2) != 0;
    CLI::App app{"lockstep: a residual network on Fashion-MNIST, data-parallel on host replicas or GPUs"};
    app.add_option("--data", o.data, "directory of the IDX files (gzipped or not)");
    app.add_option("--backend", o.backend, "host or cuda")->check(CLI::IsMember({"host", "cuda"}));
    app.add_option("--devices", o.devices, "CUDA devices of the replicas, such as 0,1 (default: every GPU)");
    app.add_option("--epochs", o.epochs, "epochs")->check(CLI::PositiveNumber);
    app.add_option("--replicas", o.replicas, "host replicas (threads)")->check(CLI::PositiveNumber);
    app.add_option("--batch", o.batch, "global batch")->check(CLI::PositiveNumber);
    app.add_option("--width", o.width, "channels of the first stage (the others: 2x and 4x)")->check(CLI::PositiveNumber);
    app.add_option("--lr", o.lr, "AdamW's peak learning rate (cosine schedule, warm-up over half an epoch)");
    app.add_option("--weight-decay", o.weight_decay, "AdamW's weight decay (none on norms and biases)");
    app.add_option("--train-limit", o.train_limit, "train on the first N images only");
    app.add_option("--test-limit", o.test_limit, "test on the first N images only");
    app.add_option("--steps", o.steps, "stop after N steps (default: every epoch)");
    app.add_option("--seed", o.seed, "initialization and data order");
    app.add_option("--expect-accuracy", o.expect_accuracy, "exit 1 below this test accuracy");
    app.add_flag("--gate", o.gate, "a channel gate (a module written with the tensor operations) after each block");
    app.add_option("--metrics", o.metrics, "write each step's loss to this file, one JSON line per step");
    const std::map<std::string, lockstep::Math> maths{{"pytorch_default", lockstep::Math::pytorch_default},
                                                      {"strict_fp32", lockstep::Math::strict_fp32},
                                                      {"tf32", lockstep::Math::tf32}};
    std::string math = "pytorch_default";
    app.add_option("--math", math, "how CUDA convolutions may round: pytorch_default, strict_fp32 or tf32")
        ->check(CLI::IsMember({"pytorch_default", "strict_fp32", "tf32"}));
    app.add_flag("--progress,!--no-progress", o.progress, "a progress bar on stderr (default: when it is a terminal)");
    CLI11_PARSE(app, argc, argv);
    o.math = maths.at(math);
    try {
        const auto devices = plan(o);
#if defined(LOCKSTEP_EXAMPLE_CUDA)
        if (o.backend == "cuda") return resnet::train_cuda(o, devices);
#endif
        return resnet::train_host(o, devices);
    } catch (const std::exception& e) {
        std::fprintf(stderr, "resnet: %s\n", e.what());
        return 2;
    }
}
