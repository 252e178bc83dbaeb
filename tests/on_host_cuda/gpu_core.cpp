// SPDX-License-Identifier: MIT
//! tests/gpu/test_gpu_core.cu, the same source, built by the host compiler against the host CUDA device.
#include "../gpu/test_gpu_core.cu"
