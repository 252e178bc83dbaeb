// SPDX-License-Identifier: MIT
//! The residual example's options (main.cpp parses them; train.hpp trains by them).
#pragma once

#include <lockstep/core/backend.hpp>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace resnet {

struct Options {
    std::string data = "/usr/share/datasets/fashion-mnist";
    std::string backend = "host";  // host or cuda
    std::string devices;           // CUDA devices of the replicas, "0,1" or "0,0"
    int epochs = 8;
    int replicas = 2;
    std::int64_t batch = 128;
    std::int64_t width = 16;
    double lr = 3e-3;
    double weight_decay = 0.05;
    std::int64_t train_limit = 0, test_limit = 0;
    std::int64_t steps = 0;  // stop after this many steps (0: every epoch)
    std::uint64_t seed = 1;
    double expect_accuracy = 0;
    bool gate = false;    // a ChannelGate (a module of one's own) after each residual block
    std::string metrics;  // a JSON line per step: {"kind": "step", "step": s, "loss": l}
    bool progress = false;
    lockstep::Math math = lockstep::Math::pytorch_default;
    //! Where the training batches are stored (page-locked memory on CUDA: cuda_train.cu).
    std::function<std::shared_ptr<void>(std::size_t)> batch_memory = {};
};

//! Trains on host replicas (host_train.cpp) or on GPUs (cuda_train.cu, where the build has CUDA).
int train_host(const Options& o, const std::vector<lockstep::Device>& devices);
int train_cuda(const Options& o, const std::vector<lockstep::Device>& devices);
int cuda_device_count();

}  // namespace resnet
