// SPDX-License-Identifier: MIT
//! The MNIST example's CUDA backend: train.hpp's training instantiated for `lockstep::Cuda`,
//! compiled by nvcc and linked into the same `mnist` program as the host backend.
#include <lockstep/cuda.cuh>

#include <memory>
#include <utility>
#include <vector>

#include "train.hpp"

int mnist_train_cuda(const mnist_example::Options& opt, const std::vector<lockstep::Device>& devices,
                     std::shared_ptr<lockstep::comm::ProcessGroup> procs) {
    // Across processes (mpirun), NCCL spans them (Note [stream groups across processes]).
    return mnist_example::train<lockstep::Cuda>(opt, devices, std::move(procs));
}

int mnist_cuda_device_count() { return lockstep::cuda::device_count(); }
