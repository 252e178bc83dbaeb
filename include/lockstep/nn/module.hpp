// SPDX-License-Identifier: MIT
//! The `ModuleLike` concept and the walks over a module's named parameters and buffers.
#pragma once

#include <concepts>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "lockstep/core/activation.hpp"
#include "lockstep/core/backend.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/tensor.hpp"
#include "lockstep/nn/context.hpp"
#include "lockstep/nn/parameter.hpp"
#include "lockstep/nn/site.hpp"

namespace lockstep::nn {

// Note [module protocol]
// A module is a copyable value: copying it deep-copies its parameters and buffers (Tensor
// copies deep), which is how DataParallel clones replicas; nothing shared is copied, because
// the replica group a layer talks to comes in through the Context, not through the layer.
// A module says which backend it runs on (`using backend = B;`), runs
// `Tensor forward(const Context<B>&, Tensor x)` and `Tensor backward(const Context<B>&, const Tensor& dy)`,
// and lists what it holds with `template <class V> void visit(V&& v)`, calling
//   v.parameter("weight", weight_parameter);      // a Parameter<B>
//   v.buffer("running_mean", running_mean);       // a Tensor<float, B> or Tensor<int64_t, B>
//   v.module("conv1", conv1);                     // a child module (names compose: conv1.weight)
// Training or evaluation mode travels in the Context, so modules need no train()/eval() of
// their own; DataParallel::train()/eval() set it for every replica.
// A layer that makes collectives (SyncBatchNorm) also offers `set_layer_id(std::uint64_t)`, by which
// DataParallel numbers such layers by their place in the module (Note [layer ids] in nn/site.hpp).
// A module may also offer the activation protocol (forward and backward on `Activation<B>`, a
// tensor stored in fp32 or bf16; Note [activation precision]); nn::Sequential chains its children
// through it, so activations stay in bf16 between the layers that can take them.

namespace detail {

// The visitor a concept check is made with: accepts every call of the protocol.
struct ArchetypeVisitor {
    template <class P>
    void parameter(std::string_view, P&) {}
    template <class T>
    void buffer(std::string_view, T&) {}
    template <class M>
    void module(std::string_view, M&) {}
};

}  // namespace detail

template <class M>
concept HasBackend = requires {
    typename M::backend;
}
&&BackendTag<typename M::backend>;

template <class M>
concept HasForward = HasBackend<M> &&
    requires(M& m, const Context<typename M::backend>& ctx, Tensor<float, typename M::backend> x) {
    { m.forward(ctx, std::move(x)) } -> std::same_as<Tensor<float, typename M::backend>>;
};

template <class M>
concept HasBackward = HasBackend<M> &&
    requires(M& m, const Context<typename M::backend>& ctx, const Tensor<float, typename M::backend>& dy) {
    { m.backward(ctx, dy) } -> std::same_as<Tensor<float, typename M::backend>>;
};

//! The activation protocol's forward (Note [activation precision] in core/activation.hpp).
template <class M>
concept HasActivationForward = HasBackend<M> &&
    requires(M& m, const Context<typename M::backend>& ctx, Activation<typename M::backend> x) {
    { m.forward(ctx, std::move(x)) } -> std::same_as<Activation<typename M::backend>>;
};

//! The activation protocol's backward.
template <class M>
concept HasActivationBackward = HasBackend<M> &&
    requires(M& m, const Context<typename M::backend>& ctx, const Activation<typename M::backend>& dy) {
    { m.backward(ctx, dy) } -> std::same_as<Activation<typename M::backend>>;
};

//! A module that takes activations stored in fp32 or bf16, besides the fp32 protocol.
template <class M>
concept HasActivationPath = HasActivationForward<M> && HasActivationBackward<M>;

template <class M>
concept HasVisit = requires(M& m, detail::ArchetypeVisitor v) {
    m.visit(v);
};

//! What DataParallel needs of a user's model (see Note [module protocol]).
template <class M>
concept ModuleLike = std::copy_constructible<M> && HasBackend<M> && HasForward<M> && HasBackward<M> && HasVisit<M>;

//! Fails compilation with a message naming the first missing piece of the module protocol.
template <class M>
constexpr bool check_module() {
    static_assert(HasBackend<M>,
                  "lockstep: a module must declare its backend: add `using backend = B;` (lockstep::Host or lockstep::Cuda)");
    static_assert(HasForward<M>,
                  "lockstep: a module needs `Tensor<float, backend> forward(const "
                  "lockstep::nn::Context<backend>&, Tensor<float, backend> x)`");
    static_assert(HasBackward<M>,
                  "lockstep: a module needs `Tensor<float, backend> backward(const "
                  "lockstep::nn::Context<backend>&, const Tensor<float, backend>& dy)`");
    static_assert(HasVisit<M>,
                  "lockstep: a module needs `template <class V> void visit(V&& v)` calling v.parameter(name, p), "
                  "v.buffer(name, t) and v.module(name, child) for what it holds");
    static_assert(HasActivationForward<M> == HasActivationBackward<M>,
                  "lockstep: a module offers both halves of the activation protocol or neither: `Activation<backend> "
                  "forward(const Context<backend>&, Activation<backend>)` and `Activation<backend> backward(const "
                  "Context<backend>&, const Activation<backend>&)` (Note [activation precision])");
    static_assert(std::copy_constructible<M>,
                  "lockstep: a module must be copy-constructible (copies are the replicas); hold tensors by value");
    return true;
}

namespace detail {

inline std::string join(std::string_view prefix, std::string_view name) {
    if (prefix.empty()) return std::string(name);
    std::string s(prefix);
    s += '.';
    s += name;
    return s;
}

// Walks a module tree calling on_param(name, Parameter&) and on_buffer(name, tensor&); with
// `Const`, the callbacks get const references (a walk over a const module, for reading).
template <bool Const, class OnParam, class OnBuffer>
struct Walker {
    std::string prefix;
    OnParam& on_param;
    OnBuffer& on_buffer;

    template <class T>
    using ref = std::conditional_t<Const, const T&, T&>;

    template <class P>
    void parameter(std::string_view name, P& p) {
        on_param(join(prefix, name), static_cast<ref<P>>(p));
    }
    template <class T>
    void buffer(std::string_view name, T& t) {
        on_buffer(join(prefix, name), static_cast<ref<T>>(t));
    }
    template <class M>
    void module(std::string_view name, M& child) {
        Walker sub{join(prefix, name), on_param, on_buffer};
        child.visit(sub);
    }
};

}  // namespace detail

//! Calls `on_param(name, Parameter&)` for every parameter and `on_buffer(name, Tensor&)` for
//! every buffer, depth first in the order the modules list them, with dotted PyTorch names. On a
//! const module the callbacks get const references.
template <class M, class OnParam, class OnBuffer>
void walk(M& module, OnParam&& on_param, OnBuffer&& on_buffer, std::string_view prefix = {}) {
    using Plain = std::remove_const_t<M>;
    detail::Walker<std::is_const_v<M>, std::remove_reference_t<OnParam>, std::remove_reference_t<OnBuffer>> w{
        std::string(prefix), on_param, on_buffer};
    // `visit` only lists members; the walker hands them on as const when the module is const.
    const_cast<Plain&>(module).visit(w);
}

namespace detail {

// Gives each module that communicates (one with `set_layer_id`) the next id, depth first.
struct LayerNumbering {
    std::uint64_t next = placed_layer_ids;
    template <class P>
    void parameter(std::string_view, P&) {}
    template <class T>
    void buffer(std::string_view, T&) {}
    template <class M>
    void module(std::string_view, M& child) {
        number(child);
    }
    template <class M>
    void number(M& m) {
        if constexpr (requires { m.set_layer_id(std::uint64_t{}); }) m.set_layer_id(next++);
        m.visit(*this);
    }
};

}  // namespace detail

//! Gives every layer of `module` that communicates an id by its place in the module tree (depth
//! first, in the order `visit` lists the modules), the same on every process that builds the same
//! model whatever else it built (Note [layer ids]). DataParallel does this to each replica.
template <class M>
void number_layers(M& module) {
    detail::LayerNumbering n;
    n.number(module);
}

//! Calls `f(name, Parameter&)` for every parameter (const references on a const module).
template <class M, class F>
void for_each_parameter(M& module, F&& f) {
    walk(module, f, [](const std::string&, auto&) {});
}

//! Calls `f(name, tensor&)` for every buffer (float or int64 tensors).
template <class M, class F>
void for_each_buffer(M& module, F&& f) {
    const auto no_parameter = [](const std::string&, auto&) {};
    walk(module, no_parameter, f);
}

//! A replica of `module` on `device`: a deep copy (a module is a copyable value, see Note [module
//! protocol]) whose every parameter, gradient and buffer is then placed on `device`.
template <class M>
M clone(const M& module, Device device) {
    static_assert(check_module<M>());
    using B = typename M::backend;
    LOCKSTEP_CHECK_AS(DeviceMismatch, device.kind == device_kind_of<B>(), "cannot clone a ", B::name, " module onto device ",
                      device);
    M copy(module);
    const auto place = [&](auto& t) {
        if (t.device() != device) t = t.template to<B>(device);
    };
    walk(
        copy,
        [&](const std::string&, auto& p) {
            place(p.value);
            place(p.grad);
        },
        [&](const std::string&, auto& t) { place(t); });
    return copy;
}

//! Sets every parameter's gradient to zero.
template <class M>
void zero_grad(M& module) {
    for_each_parameter(module, [](const std::string&, auto& p) { p.grad.zero(); });
}

//! What a captured step of `module` depends on besides its input (Note [graphs] in
//! core/cuda_graph.cuh): the number of parameters, and for every parameter its value's and
//! gradient's shape and address, and for every buffer its shape and address. Two calls give equal
//! signatures exactly when nothing a capture recorded of the module has changed: a parameter
//! replaced, resized or moved gives another. Compared whole, never hashed alone.
template <class M>
std::vector<std::int64_t> structure_signature(const M& m) {
    std::vector<std::int64_t> sig{0};
    const auto add = [&](const auto& t) {
        sig.push_back(static_cast<std::int64_t>(t.rank()));
        for (std::int64_t d = 0; d < t.rank(); ++d) sig.push_back(t.dim(d));
        const void* where = t.data();  // seam: the address as an identity, never read through
        sig.push_back(static_cast<std::int64_t>(reinterpret_cast<std::uintptr_t>(where)));
    };
    walk(
        m,
        [&](const std::string&, const auto& p) {
            ++sig[0];
            add(p.value);
            add(p.grad);
        },
        [&](const std::string&, const auto& t) { add(t); });
    return sig;
}

//! Number of trainable values.
template <class M>
std::int64_t parameter_count(const M& module) {
    std::int64_t n = 0;
    for_each_parameter(module, [&](const std::string&, auto& p) { n += p.numel(); });
    return n;
}

}  // namespace lockstep::nn
