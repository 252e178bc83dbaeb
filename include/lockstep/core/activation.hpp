// SPDX-License-Identifier: MIT
//! `Activation<B>`: a tensor between two layers, stored in fp32 or in bf16.
#pragma once

#include <utility>
#include <variant>

#include "lockstep/core/backend.hpp"
#include "lockstep/core/bfloat16.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/tensor.hpp"

namespace lockstep {

// Note [activation precision]
// Under DataParallelOptions::precision = bf16 the tensors that flow between layers may be stored
// in bf16, as PyTorch's autocast(bfloat16) stores the outputs of convolutions and linear layers:
// half the bytes for every layer that reads or writes them. Which type a tensor has is known only
// at run time (the precision is an option), so a layer that can take either offers, beside the
// fp32 protocol of Note [module protocol], the activation protocol:
//   Activation<B> forward(const Context<B>&, Activation<B> x);
//   Activation<B> backward(const Context<B>&, const Activation<B>& dy);
// with these rules, which lockstep's layers keep and nn::Sequential (or nn::ActivationTrail, for a
// hand-written chain) keeps for any children:
// - a gradient has its value's type: dy arrives in the type the layer's forward returned (a
//   layer given the other type converts it first), and backward returns dx in the type its
//   forward was given;
// - a layer that makes new activations (convolution, linear) outputs bf16 under Precision::bf16
//   and fp32 otherwise (a bf16 input widened);
// - a layer that keeps its input's type (ReLU, pooling, Flatten, batch norm) computes in fp32 and
//   rounds once where its output is bf16 (selections such as ReLU's and pooling's are exact);
// - where a layer offers only the fp32 protocol, Sequential widens its bf16 input (exactly) and
//   rounds its dx back to bf16; the layer's output stays fp32.
// Sequential's own fp32 protocol widens its last output, so the loss, DataParallel's step and
// every caller of `forward(ctx, Tensor<float, B>)` see fp32 as before; with no layer that outputs
// bf16 every bit is what the fp32 protocol alone gives.

//! A tensor between layers: fp32, or bf16 storage with fp32 arithmetic (Note [activation precision]).
template <BackendTag B>
class Activation {
public:
    using backend = B;

    Activation() = default;
    explicit Activation(Tensor<float, B> t) : t_(std::move(t)) {}
    explicit Activation(Tensor<BFloat16, B> t) : t_(std::move(t)) {}

    //! A view of `t`'s memory, for reading only: pass it only where it is taken by const reference
    //! (a backward's dy), never to a forward, which may write its input in place or keep it. The
    //! caller keeps `t` alive and unchanged while the view lives; a copy of the view owns its memory.
    template <class T>
    static Activation view_of(const Tensor<T, B>& t) {
        return Activation(Tensor<T, B>::view(const_cast<T*>(t.data()), t.shape(), t.device(), t.format()));
    }

    Precision precision() const noexcept { return t_.index() == 0 ? Precision::fp32 : Precision::bf16; }
    bool is_fp32() const noexcept { return t_.index() == 0; }

    const Shape& shape() const noexcept {
        return std::visit([](const auto& t) -> const Shape& { return t.shape(); }, t_);
    }
    MemoryFormat format() const noexcept {
        return std::visit([](const auto& t) { return t.format(); }, t_);
    }
    const Device& device() const noexcept {
        return std::visit([](const auto& t) -> const Device& { return t.device(); }, t_);
    }
    int rank() const noexcept { return shape().rank(); }
    std::int64_t dim(int i) const { return shape()[i]; }
    std::int64_t numel() const noexcept { return shape().numel(); }

    //! The tensor, of the type `T` (float or bfloat16) it holds; UsageError for the other type.
    template <class T>
    Tensor<T, B>& get() {
        check<T>();
        return std::get<Tensor<T, B>>(t_);
    }
    template <class T>
    const Tensor<T, B>& get() const {
        check<T>();
        return std::get<Tensor<T, B>>(t_);
    }
    //! The tensor moved out.
    template <class T>
    Tensor<T, B> take() && {
        check<T>();
        return std::move(std::get<Tensor<T, B>>(t_));
    }

    //! `f(tensor)` on the tensor it holds, of whichever type (a layer's dispatch on the type).
    template <class F>
    decltype(auto) visit(F&& f) {
        return std::visit(std::forward<F>(f), t_);
    }
    template <class F>
    decltype(auto) visit(F&& f) const {
        return std::visit(std::forward<F>(f), t_);
    }

    //! Same storage, new logical shape (as Tensor::reshaped).
    Activation reshaped(Shape s) && {
        return std::visit([&](auto& t) { return Activation(std::move(t).reshaped(s)); }, t_);
    }

private:
    template <class T>
    void check() const {
        static_assert(std::same_as<T, float> || std::same_as<T, BFloat16>, "an Activation holds float or BFloat16");
        constexpr Precision wanted = std::same_as<T, float> ? Precision::fp32 : Precision::bf16;
        LOCKSTEP_CHECK_AS(UsageError, precision() == wanted, "an activation of shape ", shape(), " is stored in ",
                          to_string(precision()), ", not ", to_string(wanted),
                          "; convert it first (nn::converted) or branch on precision()");
    }

    std::variant<Tensor<float, B>, Tensor<BFloat16, B>> t_;
};

}  // namespace lockstep
