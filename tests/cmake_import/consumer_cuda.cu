// SPDX-License-Identifier: MIT
//! Proves an installed lockstep's cuda component, with the layer kit and DataParallel, compiles
//! and links without the host component (no BLAS); runs a step only where a GPU is.
#include <lockstep/cuda.cuh>
#include <lockstep/nn.hpp>
#include <lockstep/parallel.hpp>

#include <cstdio>
#include <vector>

static_assert(__cplusplus >= 202002L, "lockstep::cuda compiles CUDA sources as C++20");

using Net = lockstep::nn::Sequential<lockstep::nn::Linear<lockstep::Cuda>, lockstep::nn::ReLU<lockstep::Cuda>,
                                     lockstep::nn::Linear<lockstep::Cuda>>;

int main() {
    if (lockstep::cuda::device_count() == 0) {
        std::puts("consumer_cuda: no GPU here; the cuda and nn components compiled and linked");
        return 0;
    }
    lockstep::nn::Generator g(1);
    Net net(lockstep::nn::Linear<lockstep::Cuda>(4, 8, true, g), lockstep::nn::ReLU<lockstep::Cuda>(),
            lockstep::nn::Linear<lockstep::Cuda>(8, 3, true, g));
    lockstep::DataParallel<Net> dp(net, std::vector<lockstep::Device>{lockstep::Device::cuda(0)});
    lockstep::nn::Sgd<lockstep::Cuda> sgd({.lr = 0.1});
    lockstep::Tensor<float> x(lockstep::Shape{6, 4});
    const std::vector<std::int64_t> labels{0, 1, 2, 0, 1, 2};
    const double loss =
        dp.train_step(x.to<lockstep::Cuda>(lockstep::Device::cuda(0)), labels, lockstep::nn::SoftmaxCrossEntropy{}, sgd).loss;
    std::printf("consumer_cuda: one DataParallel step on cuda:0, loss %g\n", loss);
    return loss > 0 ? 0 : 1;
}
