// SPDX-License-Identifier: MIT
//! Compile-time proof that NCCL across processes builds: `<lockstep/cuda.cuh>` and
//! `<lockstep/mpi.hpp>` together under nvcc, and a CUDA replica group spanning an MPI process
//! group (Note [stream groups across processes]). DataParallel on CUDA over a process group is
//! the MNIST example's CUDA training (examples/mnist/cuda_train.cu, built with nvcc where MPI is),
//! so it is not instantiated a second time here. Built as an object library in CI; nothing here
//! runs (no GPU and no several GPUs here). The group's logic runs in the host tests,
//! tests/test_stream_group.cpp ("across processes").
#include <lockstep/cuda.cuh>
#include <lockstep/mpi.hpp>

#include <chrono>
#include <memory>
#include <vector>

namespace lockstep {

//! What a multi-process CUDA training loop builds (never run).
void instantiate_cuda_across_processes() {
    mpi::Environment env;
    auto procs = std::make_shared<comm::MpiProcessGroup>(MPI_COMM_WORLD, std::chrono::seconds(30));
    comm::CudaGroup group({Device::cuda(0)}, std::chrono::seconds(30), procs, comm::ProcessGroup::layer);
    (void)group;
}

// Every member of the NCCL replica group, as DataParallel across processes uses it.
template class comm::StreamGroup<comm::NcclApi>;

}  // namespace lockstep
