// SPDX-License-Identifier: MIT
//! The residual example's host training: train.hpp instantiated for `lockstep::Host`, compiled once
//! for the example and for its build on the host CUDA device (tests/on_host_cuda).
#include <lockstep/host.hpp>

#include <vector>

#include "train.hpp"

int resnet::train_host(const Options& o, const std::vector<lockstep::Device>& devices) {
    return train<lockstep::Host>(o, devices);
}
