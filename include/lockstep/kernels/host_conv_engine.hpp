// SPDX-License-Identifier: MIT
//! The hook through which a convolution library built into the program (oneDNN, host_dnnl.hpp)
//! serves the host backend's convolutions, and `FreshOnCopy`, the per-layer state it keeps.
#pragma once

#include <cstdint>
#include <memory>

#include "lockstep/kernels/ops.hpp"

namespace lockstep::kernels::detail {

//! State a layer keeps for itself alone: a copy of the layer (a replica) starts without it. Holds
//! one object of a type chosen at first use, so the layer's layout is the same in every
//! translation unit whatever each one builds in.
class FreshOnCopy {
public:
    FreshOnCopy() = default;
    FreshOnCopy(const FreshOnCopy&) {}
    FreshOnCopy& operator=(const FreshOnCopy&) {
        held_.reset();
        return *this;
    }
    FreshOnCopy(FreshOnCopy&&) noexcept = default;
    FreshOnCopy& operator=(FreshOnCopy&&) noexcept = default;

    template <class T>
    T& get() {
        if (!held_) held_ = std::shared_ptr<void>(new T(), [](void* p) { delete static_cast<T*>(p); });
        return *static_cast<T*>(held_.get());
    }

private:
    std::shared_ptr<void> held_;
};

// Note [convolution engine hook]
// Whether oneDNN serves host convolutions must not depend on which translation unit a layer's
// code was compiled in: nvcc compiles the host backend too, without oneDNN's headers, and inline
// functions with different bodies in different units would break the one-definition rule (the
// linker keeps one of them). So the host operations call through these pointers, the same code in
// every unit, and host_dnnl.hpp fills them in when any unit of the program includes it.

//! A convolution library's entry points; each returns false for a shape it declines (the im2col
//! path, or OpenBLAS, runs instead).
struct HostConvEngine {
    bool (*forward)(FreshOnCopy& state, const ConvGeometry& g, const float* x, const float* weight, const float* bias,
                    float* y) = nullptr;
    bool (*backward)(FreshOnCopy& state, const ConvGeometry& g, const float* x, const float* dy, const float* weight,
                     float* weight_grad, float* bias_grad, float* dx) = nullptr;
    //! Run once on each replica thread (oneDNN: one OpenMP thread there).
    void (*enter_thread)() = nullptr;
    //! C = op(A) op(B) + beta C, row-major float (as blas::gemm, alpha 1): the linear layers'
    //! products (Note [oneDNN matmul for linear layers]).
    bool (*gemm)(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, const float* a, std::int64_t lda,
                 const float* b, std::int64_t ldb, float beta, float* c, std::int64_t ldc) = nullptr;
};

inline HostConvEngine& host_conv_engine() {
    static HostConvEngine engine;
    return engine;
}

}  // namespace lockstep::kernels::detail
