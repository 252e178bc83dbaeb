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

    Parameter() = default;
    explicit Parameter(Shape shape, Device device = Device{device_kind_of<B>(), 0})
        : value(shape, MemoryFormat::nchw, device), grad(shape, MemoryFormat::nchw, device) {}

    const Shape& shape() const noexcept { return value.shape(); }
    std::int64_t numel() const noexcept { return value.numel(); }
};

}  // namespace lockstep::nn
