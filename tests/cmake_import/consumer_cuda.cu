// SPDX-License-Identifier: MIT
//! Proves an installed lockstep's cuda component compiles and links; runs only where a GPU is.
#include <lockstep/cuda.cuh>

#include <cstdio>

static_assert(__cplusplus >= 202002L, "lockstep::cuda compiles CUDA sources as C++20");

int main() {
    if (lockstep::cuda::device_count() == 0) {
        std::puts("consumer_cuda: no GPU here; the cuda component compiled and linked");
        return 0;
    }
    lockstep::Tensor<float, lockstep::Cuda> t(lockstep::Shape{4}, lockstep::MemoryFormat::nchw, lockstep::Device::cuda(0));
    std::printf("consumer_cuda: allocated %lld floats on cuda:0\n", static_cast<long long>(t.numel()));
    return 0;
}
