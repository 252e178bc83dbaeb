// SPDX-License-Identifier: MIT
//! lockstep's umbrella header for the CUDA backend (needs nvcc, CUDA 13, NCCL, cuBLAS, CUB).
#pragma once

#include "lockstep/lockstep.hpp"
#include "lockstep/core/cuda_graph.cuh"
#include "lockstep/core/cuda_runtime.cuh"
#include "lockstep/kernels/cuda_ops.cuh"
#include "lockstep/comm/cuda_group.cuh"
