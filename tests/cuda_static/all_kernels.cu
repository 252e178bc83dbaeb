// SPDX-License-Identifier: MIT
//! The static gate's translation unit (CTest label `cuda-static`, see CMakeLists.txt here):
//! instantiates every CUDA kernel of lockstep, for every storage type, layout and vector width,
//! so that ptxas sees each `__global__` function once per architecture (sm_75 to sm_120) and
//! scripts/check-kernel-resources.py can check its registers against its `__launch_bounds__`
//! budget, that it uses no local memory, and that its packs are vector accesses. Compiled to an
//! object file only; nothing here runs.
//!
//! Kernels are instantiated through the operations that launch them, never one by one: every
//! operation chooses its kernel (layout, vector width) at run time, so calling it once for each
//! storage type instantiates every variant it may launch, and a kernel added to an operation later
//! is in the gate without touching this file.
//!
//! The layer kernels (elementwise, pooling, im2col/col2im, losses, SGD, sums of squares) are
//! instantiated through `kernels::Ops<Cuda>`, which launches all of them. A layer operation whose
//! signature changes is changed here too (the gate does not compile otherwise, and fails: it
//! never passes by checking less).
#include <cstdint>
#include <span>

#include <lockstep/kernels/device/bn_passes.cuh>
#include <lockstep/kernels/device/launch.cuh>
// Ops<Cuda> without <lockstep/cuda.cuh>'s communicators: the gate needs the toolkit's headers only.
#include <lockstep/comm/cuda_group.cuh>
#include <lockstep/kernels/cuda_ops.cuh>

namespace lockstep::cuda_static {

namespace bk = kernels::device::bn_kernels;
using kernels::BnGeometry;
using kernels::device::DeviceRun;

// ---- batch norm: every pass, for fp32, fp16 and bf16 storage -----------------------------------
// Each tensor pass dispatches to channels-last and channels-first in windows of every width (16,
// 8 and 4 bytes, and one element: Note [channels-first windows]); the per-channel kernels (centring, finish count, eval
// constants, parameter gradients) have no storage type.
template <class T>
void batch_norm_kernels(DeviceRun& run, const BnGeometry& g, T* x, T* dy, std::uint8_t* /*no ReLU mask*/, double* payload,
                        double* stats, float* folded, float* running, std::int64_t* count) {
    bk::local_stats(run, x, g, payload, folded);
    bk::FinishRequest finish;
    finish.payload = payload;
    finish.running_mean = running;
    finish.running_var = running;
    finish.num_batches_tracked = count;
    bk::forward_normalize(run, x, x, g, &finish, folded, folded, stats, folded, true);
    bk::backward_sums(run, x, dy, true, g, folded, payload);
    bk::backward_dx(run, x, dy, true, x, g, payload, stats, folded, folded);
}

void all_batch_norm_kernels(DeviceRun& run, const BnGeometry& g, void* data, std::uint8_t* mask, double* payload, double* stats,
                            float* folded, float* running, std::int64_t* count) {
    batch_norm_kernels(run, g, static_cast<float*>(data), static_cast<float*>(data), mask, payload, stats, folded, running,
                       count);
    batch_norm_kernels(run, g, static_cast<__half*>(data), static_cast<__half*>(data), mask, payload, stats, folded, running,
                       count);
    batch_norm_kernels(run, g, static_cast<__nv_bfloat16*>(data), static_cast<__nv_bfloat16*>(data), mask, payload, stats, folded,
                       running, count);
    bk::centre(run, g, folded, payload);
    bk::eval_constants(run, g.channels, running, running, 1e-5, folded, folded, stats, folded);
    bk::param_grads(run, g.channels, payload, stats, folded, folded);
}

// ---- layers, losses, optimizer: every operation of Ops<Cuda> that may launch a kernel ----------
// The tensors are references (never made, never read): only the calls' instantiations matter.
using Ops = kernels::Ops<Cuda>;
template <class T>
using T_ = Tensor<T, Cuda>;

// The products' bf16 rounding (Note [precision]) is in every convolution's and linear layer's GEMM.
void all_layer_kernels(const Execution<Cuda>& ex, T_<float>& f, T_<double>& d, T_<std::uint8_t>& mask, T_<std::int32_t>& index,
                       T_<std::uint16_t>& bf16, std::span<const std::int64_t> labels, Ops::ConvScratch& scratch) {
    Ops::fill(ex, f, 0.0f);
    Ops::to_bf16(ex, f, bf16);
    Ops::from_bf16(ex, bf16, f);
    Ops::fill(ex, d, 0.0);
    Ops::scale(ex, f, 0.5);
    Ops::add(ex, f, f);
    Ops::add(ex, d, d);
    Ops::add_sum_squares(ex, f, d, 0);
    Ops::clip_to_norm(ex, f, d, 1.0);
    for (const bool channels_last : {false, true}) {
        kernels::ConvGeometry g;
        g.channels_last = channels_last;
        Ops::conv2d_forward(ex, g, f, f, &f, f, scratch);
        Ops::conv2d_forward(ex, g, f, f, nullptr, f, scratch);
        Ops::conv2d_backward(ex, g, f, f, f, f, &f, f, scratch);
        Ops::conv2d_backward(ex, g, f, f, f, f, nullptr, f, scratch);
    }
    Ops::linear_forward(ex, f, f, &f, f, true, &mask);
    Ops::linear_forward(ex, f, f, nullptr, f, false, nullptr);
    Ops::linear_backward(ex, f, f, &mask, f, f, &f, f);
    Ops::linear_backward(ex, f, f, nullptr, f, f, nullptr, f);
    Ops::relu_forward(ex, f, &mask);
    Ops::relu_forward(ex, f, nullptr);
    Ops::relu_backward(ex, f, mask, f);
    const kernels::PoolGeometry pool;
    Ops::maxpool_forward(ex, pool, f, f, index);
    Ops::maxpool_backward(ex, pool, f, index, f);
    const kernels::AvgPoolGeometry avg;
    Ops::avgpool_forward(ex, avg, f, f);
    Ops::avgpool_backward(ex, avg, f, f);
    Ops::dropout_forward(ex, f, kernels::DropoutDraw{}, mask);
    Ops::dropout_backward(ex, f, mask, kernels::DropoutDraw{}, f);
    Ops::layer_norm_forward(ex, f, 1, &f, &f, 1e-5, f, f, f);
    Ops::layer_norm_backward(ex, f, f, 1, &f, f, f, f, &f, &f);
    Ops::softmax_cross_entropy(ex, f, labels, 1.0, f, d);
    // The public tensor operations (nn/tensor_ops.hpp).
    T_<std::int64_t> i64;
    Ops::axpby(ex, 1.0f, f, 1.0f, f, f);
    Ops::multiply(ex, f, f, f);
    Ops::reduce(ex, kernels::ReduceGeometry{}, f, f);
    Ops::broadcast(ex, kernels::BroadcastGeometry{}, f, f);
    Ops::softmax_forward(ex, kernels::LineGeometry{}, f, f);
    Ops::softmax_backward(ex, kernels::LineGeometry{}, f, f, f);
    Ops::argmax(ex, kernels::LineGeometry{}, f, i64);
    Ops::place(ex, kernels::PlaceGeometry{}, f, f);
    Ops::take(ex, kernels::PlaceGeometry{}, f, f);
    Ops::mse(ex, f, f, 1.0, f, d);
    Ops::sgd_step(ex, f, f, f, true, kernels::SgdUpdate{});
    Ops::sgd_step(ex, f, f, f, false, kernels::SgdUpdate{});
    const kernels::SgdTensors<Cuda> sgd[] = {{&f, &f, &f, true}};
    Ops::sgd_step_many(ex, sgd, kernels::SgdUpdate{});
    const kernels::AdamTensors<Cuda> adam[] = {{&f, &f, &f, &f}};
    Ops::adam_step_many(ex, adam, kernels::AdamUpdate{});
    const kernels::CopyPiece<Cuda> pieces[] = {{&f, 0, &f, 0, 1}};
    Ops::copy_many(ex, pieces);
}

// ---- convolution and linear layers with bf16 activations (Note [activation precision]) ---------
// Every combination of input and gradient types the typed forms take (im2col from a bf16 input,
// the bias on bf16 storage, per-channel sums of a bf16 dy, a bf16 gradient added widened).
void all_bf16_layer_kernels(const Execution<Cuda>& ex, T_<float>& f, T_<BFloat16>& h, T_<std::uint8_t>& mask,
                            Ops::ConvScratch& scratch) {
    const kernels::ConvGeometry g;
    Ops::conv2d_forward(ex, g, f, f, &f, h, scratch);
    Ops::conv2d_forward(ex, g, h, f, &f, h, scratch);
    Ops::conv2d_backward(ex, g, f, h, f, f, &f, f, scratch);
    Ops::conv2d_backward(ex, g, h, f, f, f, &f, h, scratch);
    Ops::conv2d_backward(ex, g, h, h, f, f, &f, h, scratch);
    Ops::linear_forward(ex, f, f, &f, h, true, &mask);
    Ops::linear_forward(ex, h, f, &f, h, false, nullptr);
    Ops::linear_backward(ex, f, h, &mask, f, f, &f, f);
    Ops::linear_backward(ex, h, f, nullptr, f, f, &f, h);
    Ops::linear_backward(ex, h, h, &mask, f, f, &f, h);
}

// ---- ReLU and max pooling in bfloat16 storage (Note [activation storage]) -----------------------
void all_bf16_activation_kernels(DeviceRun& run, __nv_bfloat16* h, float* f, std::uint8_t* mask, std::int32_t* index) {
    namespace lk = kernels::device::layer_kernels;
    lk::bias_act(run, h, 1, 1, 1, f, false, mask);  // cuDNN's bf16 output and its bias (Note [cuDNN convolutions])
    lk::add_widened(run, f, h, 1);
    lk::channel_sums(run, h, 1, 1, 1, f);
    lk::relu_forward(run, h, mask, 1);
    lk::relu_backward(run, h, mask, h, 1);
    const kernels::PoolGeometry pool;
    lk::maxpool_forward(run, pool, h, h, index);
    lk::maxpool_backward(run, pool, h, index, h);
}

// ---- the device-local all-reduce of replicas sharing a GPU (comm::CudaGroup's local mode) -------
void all_group_kernels(std::span<void* const> buffers) {
    comm::NcclApi::rank_sum(0, nullptr, buffers, 1, comm::DType::f32);
    comm::NcclApi::rank_sum(0, nullptr, buffers, 1, comm::DType::f64);
    comm::NcclApi::rank_sum(0, nullptr, buffers, 1, comm::DType::f16);
    comm::NcclApi::rank_sum(0, nullptr, buffers, 1, comm::DType::bf16);
}

}  // namespace lockstep::cuda_static
