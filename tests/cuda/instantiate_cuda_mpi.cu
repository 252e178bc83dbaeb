// SPDX-License-Identifier: MIT
//! Compile-time proof that NCCL across processes builds: `<lockstep/cuda.cuh>` and
//! `<lockstep/mpi.hpp>` together under nvcc, a CUDA replica group spanning an MPI process group
//! and DataParallel on CUDA over processes (Note [stream groups across processes]). Built as an
//! object library in CI; nothing here runs (no GPU and no several GPUs here). The group's logic
//! runs in the host tests, tests/test_stream_group.cpp ("across processes").
#include <lockstep/cuda.cuh>
#include <lockstep/mpi.hpp>
#include <lockstep/nn.hpp>
#include <lockstep/parallel.hpp>

#include <chrono>
#include <memory>
#include <vector>

#include "../../examples/mnist/net.hpp"

namespace lockstep {

//! What a multi-process CUDA training loop calls (never run).
void instantiate_cuda_across_processes(nn::Generator& gen, const Tensor<float, Cuda>& x,
                                       const std::vector<std::int64_t>& labels) {
    mpi::Environment env;
    auto procs = std::make_shared<comm::MpiProcessGroup>(MPI_COMM_WORLD, std::chrono::seconds(30));
    comm::CudaGroup group({Device::cuda(0)}, std::chrono::seconds(30), procs, comm::ProcessGroup::layer);
    mnist::Net<Cuda> net(gen);
    DataParallel dp(net, std::vector<Device>{Device::cuda(0), Device::cuda(1)}, {.process_group = procs});
    nn::Sgd<Cuda> sgd({.lr = 0.1, .momentum = 0.9});
    (void)dp.train_step(x, labels, nn::SoftmaxCrossEntropy{}, sgd);
    (void)dp.forward(x);
    dp.save(dp.checkpoint(sgd), "net.safetensors");
}

}  // namespace lockstep
