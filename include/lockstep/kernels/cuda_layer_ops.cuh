// SPDX-License-Identifier: MIT
//! The CUDA backend's layer operations: fills and arithmetic over tensors, convolution and linear
//! layers (cuBLAS), activations, pooling, losses and SGD. Part of `kernels::Ops<Cuda>`.
#pragma once

#include <cstdint>
#include <span>

#include "lockstep/kernels/cuda_common.cuh"

namespace lockstep::kernels::cuda_ops {

//! The layer part of `Ops<Cuda>` (see Note [backend operations]); everything runs on `ex.stream`.
struct LayerOps {
    template <class T>
    static void fill(const Ex&, T_<T>&, T) { cuda::detail::not_implemented_yet("fill"); }

    static void scale(const Ex&, T_<float>&, double) { cuda::detail::not_implemented_yet("scale"); }

    template <class T>
    static void add(const Ex&, T_<T>&, const T_<T>&) {
        cuda::detail::not_implemented_yet("add");
    }

    static void add_sum_squares(const Ex&, const T_<float>&, T_<double>&, std::int64_t = 0) {
        cuda::detail::not_implemented_yet("add_sum_squares");
    }

    static void clip_to_norm(const Ex&, T_<float>&, const T_<double>&, double) {
        cuda::detail::not_implemented_yet("clip_to_norm");
    }

    // ---- layers -----------------------------------------------------------------------------

    struct ConvScratch {};

    static void conv2d_forward(const Ex&, const ConvGeometry&, const T_<float>&, const T_<float>&, const T_<float>*,
                               T_<float>&, ConvScratch&) {
        cuda::detail::not_implemented_yet("conv2d_forward");
    }
    static void conv2d_backward(const Ex&, const ConvGeometry&, const T_<float>&, const T_<float>&, const T_<float>&,
                                T_<float>&, T_<float>*, T_<float>&, ConvScratch&) {
        cuda::detail::not_implemented_yet("conv2d_backward");
    }
    static void linear_forward(const Ex&, const T_<float>&, const T_<float>&, const T_<float>*, T_<float>&, bool,
                               T_<std::uint8_t>*) {
        cuda::detail::not_implemented_yet("linear_forward");
    }
    static void linear_backward(const Ex&, const T_<float>&, const T_<float>&, const T_<std::uint8_t>*, const T_<float>&,
                                T_<float>&, T_<float>*, T_<float>&) {
        cuda::detail::not_implemented_yet("linear_backward");
    }
    static void relu_forward(const Ex&, T_<float>&, T_<std::uint8_t>*) { cuda::detail::not_implemented_yet("relu_forward"); }
    static void relu_backward(const Ex&, const T_<float>&, const T_<std::uint8_t>&, T_<float>&) {
        cuda::detail::not_implemented_yet("relu_backward");
    }
    static void maxpool_forward(const Ex&, const PoolGeometry&, const T_<float>&, T_<float>&, T_<std::int32_t>&) {
        cuda::detail::not_implemented_yet("maxpool_forward");
    }
    static void maxpool_backward(const Ex&, const PoolGeometry&, const T_<float>&, const T_<std::int32_t>&, T_<float>&) {
        cuda::detail::not_implemented_yet("maxpool_backward");
    }

    // ---- losses and optimizer -----------------------------------------------------------------

    static void softmax_cross_entropy(const Ex&, const T_<float>&, std::span<const std::int64_t>, double, T_<float>&,
                                      T_<double>&) {
        cuda::detail::not_implemented_yet("softmax_cross_entropy");
    }
    static void mse(const Ex&, const T_<float>&, const T_<float>&, double, T_<float>&, T_<double>&) {
        cuda::detail::not_implemented_yet("mse");
    }
    static void sgd_step(const Ex&, T_<float>&, const T_<float>&, T_<float>&, bool, const SgdUpdate&) {
        cuda::detail::not_implemented_yet("sgd_step");
    }

};

}  // namespace lockstep::kernels::cuda_ops
