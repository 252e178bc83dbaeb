// SPDX-License-Identifier: MIT
//! tests/gpu/test_gpu_data_parallel.cu, the same source, built by the host compiler against the host CUDA device.
#include "../gpu/test_gpu_data_parallel.cu"
