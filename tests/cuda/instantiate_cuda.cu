// SPDX-License-Identifier: MIT
//! Compile-time proof that the layers, the losses, the optimizer, the MNIST network and
//! DataParallel are written once for both backends: everything here instantiates for `Cuda`
//! under nvcc. Generic code that touched tensor memory itself (span(), operator[]) would fail to
//! compile here, since a CUDA tensor's memory is not readable on the host. Built as an object
//! library in CI; nothing here runs.
#include <lockstep/cuda.cuh>
#include <lockstep/nn.hpp>
#include <lockstep/parallel.hpp>

#include <vector>

#include "../../examples/mnist/net.hpp"

template struct mnist::Net<lockstep::Cuda>;

namespace lockstep {

template class nn::Conv2d<Cuda>;
template class nn::Linear<Cuda>;
template class nn::SyncBatchNorm<Cuda>;
template class nn::ReLU<Cuda>;
template class nn::MaxPool2d<Cuda>;
template class nn::Flatten<Cuda>;
template class nn::Sgd<Cuda>;
template class nn::AvgPool2d<Cuda>;
template class nn::AdaptiveAvgPool2d<Cuda>;
template class nn::Dropout<Cuda>;
template class nn::LayerNorm<Cuda>;
template class nn::Identity<Cuda>;
using CudaBlock = nn::Sequential<nn::Conv2d<Cuda>, nn::SyncBatchNorm<Cuda>>;
template class nn::Residual<CudaBlock, CudaBlock>;
template class nn::Add<CudaBlock, nn::Identity<Cuda>>;
template class nn::Sequential<nn::Conv2d<Cuda>, nn::SyncBatchNorm<Cuda>, nn::ReLU<Cuda>, nn::MaxPool2d<Cuda>, nn::Flatten<Cuda>,
                              nn::Linear<Cuda>>;
template class DataParallel<mnist::Net<Cuda>>;

// The layers that keep their input's type take activations stored in bf16 on CUDA (Note
// [activation precision]); Sequential passes them on as they are.
static_assert(nn::HasActivationPath<nn::ReLU<Cuda>> && nn::HasActivationPath<nn::MaxPool2d<Cuda>> &&
              nn::HasActivationPath<nn::Flatten<Cuda>> && nn::HasActivationPath<nn::SyncBatchNorm<Cuda>>);

//! Calls what a CUDA training loop calls (never run).
void instantiate_cuda_training(nn::Generator& gen, const Tensor<float, Cuda>& x, const Tensor<float, Cuda>& y,
                               const std::vector<std::int64_t>& labels) {
    mnist::Net<Cuda> net(gen);
    nn::Context<Cuda> ctx;
    auto out = net.forward(ctx, x);
    (void)net.backward(ctx, out);
    DataParallel dp(net, std::vector<Device>{Device::cuda(0), Device::cuda(0)});
    nn::Sgd<Cuda> sgd({.lr = 0.1, .momentum = 0.9});
    (void)dp.train_step(x, labels, nn::SoftmaxCrossEntropy{}, sgd);
    dp.accumulate(x, labels, nn::SoftmaxCrossEntropy{});
    (void)dp.forward(x);
    dp.save("net.safetensors", sgd);
    dp.load("net.safetensors", sgd);
    nn::for_each_parameter(dp.module(), [](const std::string&, const nn::Parameter<Cuda>& p) { (void)p.value.to_host(); });

    nn::Sequential reg(nn::Linear<Cuda>(4, 8, true, gen), nn::ReLU<Cuda>(), nn::Linear<Cuda>(8, 2, true, gen));
    DataParallel rdp(reg, 2);
    (void)rdp.train_step(x, y, nn::MseLoss{}, sgd);
    // The kit for real models: a residual network with pooling and dropout, checked by gradcheck.
    nn::Sequential res(nn::Residual(CudaBlock(nn::Conv2d<Cuda>(1, 1, 3, {.padding = 1}, gen), nn::SyncBatchNorm<Cuda>(1))),
                       nn::Dropout<Cuda>(0.1, gen), nn::AdaptiveAvgPool2d<Cuda>(1), nn::Flatten<Cuda>(),
                       nn::Linear<Cuda>(1, 2, true, gen));
    (void)nn::gradcheck(res, x, {}, ctx);
    DataParallel resdp(res, 2);
    (void)resdp.train_step(x, labels, nn::SoftmaxCrossEntropy{}, sgd);
    nn::AdamW<Cuda> adamw({.lr = 1e-3}, {nn::no_decay_on_norms_and_biases()});
    adamw.set_lr(nn::OneCycleLR(0.1, 10).lr(3));
    (void)resdp.train_step(x, labels, nn::SoftmaxCrossEntropy{}, adamw);
    resdp.save("res.safetensors", adamw);
    resdp.load("res.safetensors", adamw);
    resdp.resync(adamw);
}

}  // namespace lockstep
