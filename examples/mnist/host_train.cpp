// SPDX-License-Identifier: MIT
//! The MNIST example's host training: train.hpp instantiated for `lockstep::Host`, compiled once
//! for the example and for its build on the host CUDA device (tests/on_host_cuda).
#include <lockstep/host.hpp>

#include <memory>
#include <utility>
#include <vector>

#include "train.hpp"

int mnist_train_host(const mnist_example::Options& opt, const std::vector<lockstep::Device>& devices,
                     std::shared_ptr<lockstep::comm::ProcessGroup> procs) {
    return mnist_example::train<lockstep::Host>(opt, devices, std::move(procs));
}
