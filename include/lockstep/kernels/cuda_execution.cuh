// SPDX-License-Identifier: MIT
//! `Execution<Cuda>`, the CUDA backend's part of a replica's execution context (Note [execution
//! context]): the replica's device, stream, cuBLAS handle and workspace, the reducing kernels'
//! scratch, and what its host waits on the device need.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <memory>

#include "lockstep/core/backend.hpp"
#include "lockstep/core/device_watch.hpp"
#include "lockstep/kernels/device/grid.cuh"

namespace lockstep {

namespace cuda {
class PinnedScalars;  // core/cuda_runtime.cuh: a captured step's scalars on the host
}  // namespace cuda

namespace kernels::cuda_ops {
class LayerWorkspace;     // cuda_layer_run.cuh: Note [one layer workspace]
class CudnnConvolutions;  // cuda_cudnn.cuh: Note [cuDNN convolutions]
}  // namespace kernels::cuda_ops

//! Made by `kernels::Ops<Cuda>::ReplicaResources::execution()`; copies share the handles.
template <>
struct Execution<Cuda> {
    int device = -1;                         // the replica's CUDA ordinal
    cudaStream_t stream = nullptr;           // its compute stream
    std::weak_ptr<const void> stream_owner;  // expires with the stream (Note [current stream])
    cublasHandle_t blas = nullptr;           // its cuBLAS handle, bound to `stream`
    void* workspace = nullptr;               // cuBLAS workspace on `device`
    std::size_t workspace_bytes = 0;
    // The reducing kernels' scratch on `device` (Note [one scratch layout]): zeroed tickets that
    // every kernel leaves zeroed again, then the partials.
    kernels::device::Scratch scratch;
    // The buffers of its convolutions, one allocation every layer shares (Note [one layer workspace]).
    kernels::cuda_ops::LayerWorkspace* layer_workspace = nullptr;
    // Its cuDNN handle and descriptors where lockstep was built with cuDNN, else null; null runs
    // every convolution as im2col + cuBLAS (Note [cuDNN convolutions]).
    kernels::cuda_ops::CudnnConvolutions* cudnn = nullptr;
    // Host waits for the device (a step's scalars): an event recorded on `stream`, polled until
    // `waits.timeout()` passes, consulting the replica's groups (`waits`) meanwhile.
    cudaEvent_t done_event = nullptr;
    // Recorded after a call's copies of the caller's input; the call returns only once it has
    // completed, so the caller may then free or refill its input.
    cudaEvent_t inputs_read_event = nullptr;
    // Pinned host memory its captured steps copy their scalars into (Note [captured steps]).
    cuda::PinnedScalars* scalars = nullptr;
    DeviceWaits waits;
    // How its convolutions and linear layers may round (Note [math modes] in core/backend.hpp).
    Math math = Math::pytorch_default;
    // What its convolutions and linear layers round their products' inputs to (Note [precision]).
    Precision precision = Precision::fp32;
};

}  // namespace lockstep
