// SPDX-License-Identifier: MIT
//! The residual example's CUDA backend: train.hpp's training instantiated for `lockstep::Cuda`,
//! compiled by nvcc and linked into the same `resnet` program as the host backend.
#include <lockstep/cuda.cuh>

#include <vector>

#include "train.hpp"

int resnet::train_cuda(const Options& o, const std::vector<lockstep::Device>& devices) {
    Options on_gpu = o;
    on_gpu.batch_memory = lockstep::cuda::pinned_batch_memory();  // batches copied to the GPU from page-locked memory
    return train<lockstep::Cuda>(on_gpu, devices);
}

int resnet::cuda_device_count() { return lockstep::cuda::device_count(); }
