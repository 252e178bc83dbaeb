// SPDX-License-Identifier: MIT
//! `nn::Parameter`: a trainable tensor with its gradient.
#pragma once

#include "lockstep/core/tensor.hpp"

namespace lockstep::nn {

//! A trainable tensor and the gradient backward accumulates into it (same shape, same device).
template <BackendTag B = Host>
struct Parameter {
    Tensor<float, B> value;
    Tensor<float, B> grad;
    //! Not trained: optimizers leave it as it is, and DataParallel does not warn that it received
    //! no gradient (Note [parameters without a gradient] in parallel/replica.hpp). Its gradient is
    //! still computed and all-reduced.
    bool frozen = false;

    Parameter() = default;
    //! Zero value and gradient on the calling thread's current device of the backend.
    explicit Parameter(Shape shape) : value(shape), grad(shape, MemoryFormat::nchw, value.device()) {}
    Parameter(Shape shape, Device device) : value(shape, MemoryFormat::nchw, device), grad(shape, MemoryFormat::nchw, device) {}

    const Shape& shape() const noexcept { return value.shape(); }
    std::int64_t numel() const noexcept { return value.numel(); }
};

}  // namespace lockstep::nn
