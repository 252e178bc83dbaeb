// SPDX-License-Identifier: MIT
//! The MNIST example's CUDA backend (examples/mnist/cuda_train.cu), the same source, built by the
//! host compiler against the host CUDA device.
#include "../../examples/mnist/cuda_train.cu"
