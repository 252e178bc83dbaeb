// SPDX-License-Identifier: MIT
//! bench/bench_cuda_conv.cu, the same source, built by the host compiler against the host CUDA
//! device: the example's convolutions through each engine and in bf16 (its figures mean nothing here).
#include "../../bench/bench_cuda_conv.cu"
