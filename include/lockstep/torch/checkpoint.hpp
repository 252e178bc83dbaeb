// SPDX-License-Identifier: MIT
//! Checkpoints of libtorch modules as safetensors files PyTorch reads (Note [libtorch checkpoints]).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "lockstep/core/error.hpp"
#include "lockstep/nn/checkpoint.hpp"

namespace lockstep::torch {

// Note [libtorch checkpoints]
// A module's parameters and buffers are stored under their state_dict names ("layer1.0.weight",
// "bn.running_mean", "bn.num_batches_tracked"), float32 as F32 and int64 as I64, row-major, in
// lockstep's safetensors writer (nn::Checkpoint: written to a temporary file, synced and renamed,
// so a crash leaves the old file or the new one). PyTorch in Python reads it with
// safetensors.torch.load_file, or by hand (an 8-byte header length, a JSON header, the bytes), and
// load_state_dict puts it into the same architecture; tests/torch/load_in_pytorch.py does that
// in CI. Tensors of other dtypes are refused (NotImplemented): convert them first.

namespace detail {

template <class F>
void each_state(const ::torch::nn::Module& module, F&& f) {
    for (const auto& item : module.named_parameters(true))
        if (item.value().defined()) f(item.key(), item.value());
    for (const auto& item : module.named_buffers(true))
        if (item.value().defined()) f(item.key(), item.value());
}

inline const char* dtype_name(const at::Tensor& t, const std::string& name) {
    if (t.scalar_type() == at::kFloat) return "F32";
    if (t.scalar_type() == at::kLong) return "I64";
    throw NotImplemented("checkpoint tensor '" + name + "' is of dtype " + std::string(c10::toString(t.scalar_type())) +
                         "; lockstep's checkpoints hold float32 and int64 tensors: convert it first");
}

}  // namespace detail

//! `module`'s parameters and buffers by their state_dict names.
inline nn::Checkpoint checkpoint(const ::torch::nn::Module& module) {
    nn::Checkpoint ck;
    detail::each_state(module, [&](const std::string& name, const at::Tensor& t) {
        const char* dtype = detail::dtype_name(t, name);
        const auto host = t.detach().to(at::kCPU).contiguous();
        const auto* bytes = static_cast<const unsigned char*>(host.data_ptr());
        ck.put_bytes(name, dtype, host.sizes().vec(),
                     std::span<const unsigned char>(bytes, static_cast<std::size_t>(host.numel()) * host.element_size()));
    });
    ck.metadata["format"] = "pt";
    return ck;
}

//! Throws IoError unless `ck` holds exactly `module`'s tensors, with their dtypes and shapes.
inline void check_fits(const nn::Checkpoint& ck, const ::torch::nn::Module& module) {
    std::vector<std::string> seen;
    detail::each_state(module, [&](const std::string& name, const at::Tensor& t) {
        if (!ck.contains(name)) throw IoError(ck.label() + " has no tensor '" + name + "', which the model holds");
        const auto& e = ck.at(name);
        const char* dtype = detail::dtype_name(t, name);
        if (e.dtype != dtype)
            throw IoError(ck.label() + " has tensor '" + name + "' of dtype " + e.dtype + " but the model's is " + dtype);
        if (e.shape != t.sizes().vec())
            throw IoError(ck.label() + " has tensor '" + name + "' of shape " + c10::str(at::IntArrayRef(e.shape)) +
                          " but the model's is " + c10::str(t.sizes()));
        seen.push_back(name);
    });
    for (const auto& name : ck.names())
        if (std::find(seen.begin(), seen.end(), name) == seen.end())
            throw IoError(ck.label() + " holds tensor '" + name + "', which the model does not: a checkpoint of another model?");
}

//! Copies `ck` into `module` (check_fits first).
inline void assign(const nn::Checkpoint& ck, ::torch::nn::Module& module) {
    ::torch::NoGradGuard no_grad;
    for (auto& item : module.named_parameters(true))
        if (item.value().defined()) {
            const auto& e = ck.at(item.key());
            item.value().copy_(at::from_blob(const_cast<unsigned char*>(e.data.data()), e.shape,  // seam: file bytes, read only
                                             item.value().options().device(at::kCPU).requires_grad(false)));
        }
    for (auto& item : module.named_buffers(true))
        if (item.value().defined()) {
            const auto& e = ck.at(item.key());
            item.value().copy_(
                at::from_blob(const_cast<unsigned char*>(e.data.data()), e.shape, item.value().options().device(at::kCPU)));
        }
}

//! Writes `module`'s state to `path` atomically.
inline nn::Checkpoint::SaveReport save(const ::torch::nn::Module& module, const std::string& path) {
    return checkpoint(module).save(path);
}

//! Reads `path` into `module`, checked whole first: nothing changes unless every tensor fits.
inline void load(::torch::nn::Module& module, const std::string& path) {
    const auto ck = nn::Checkpoint::load(path);
    check_fits(ck, module);
    assign(ck, module);
}

}  // namespace lockstep::torch
