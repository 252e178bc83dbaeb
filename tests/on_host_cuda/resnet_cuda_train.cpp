// SPDX-License-Identifier: MIT
//! The residual example's CUDA backend (examples/resnet/cuda_train.cu), the same source, built by
//! the host compiler against the host CUDA device.
#include "../../examples/resnet/cuda_train.cu"
