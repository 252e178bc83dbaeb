// SPDX-License-Identifier: MIT
//! bench/bench_cuda_allreduce.cu, the same source, built by the host compiler against the host CUDA
//! device: the device-local group's all-reduce, its device calls alone and the bare kernel (its
//! figures mean nothing here).
#include "../../bench/bench_cuda_allreduce.cu"
