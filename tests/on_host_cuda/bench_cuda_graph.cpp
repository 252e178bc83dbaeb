// SPDX-License-Identifier: MIT
//! bench/bench_cuda_graph.cu, the same source, built by the host compiler against the host CUDA
//! device: the example network's step captured and replayed there (its figures mean nothing here).
#include "../../bench/bench_cuda_graph.cu"
