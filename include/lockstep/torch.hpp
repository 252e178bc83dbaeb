// SPDX-License-Identifier: MIT
//! lockstep for libtorch: DataParallel and SyncBatchNorm for any torch::nn::Module, and
//! safetensors checkpoints PyTorch reads. CMake: find_package(lockstep COMPONENTS torch), target
//! lockstep::torch (it finds Torch through its own CMake package).
#pragma once

#include "lockstep/torch/checkpoint.hpp"
#include "lockstep/torch/data_parallel.hpp"
#include "lockstep/torch/sync_batch_norm.hpp"
