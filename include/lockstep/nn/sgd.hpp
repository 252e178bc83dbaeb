// SPDX-License-Identifier: MIT
//! `nn::Sgd`: stochastic gradient descent with momentum, PyTorch semantics, one state per replica.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "lockstep/core/error.hpp"
#include "lockstep/core/tensor.hpp"
#include "lockstep/nn/checkpoint.hpp"
#include "lockstep/nn/module.hpp"

namespace lockstep::nn {

struct SgdOptions {
    double lr = 0.01;
    double momentum = 0.0;
    double dampening = 0.0;
    double weight_decay = 0.0;
    bool nesterov = false;
};

//! SGD as torch.optim.SGD: g = grad + wd * p; v = mu * v + (1 - dampening) * g (v = g on the
//! first step); g = nesterov ? g + mu * v : v; p -= lr * g. Every replica keeps its own momentum
//! buffers and, fed identical gradients, computes identical bits.
class Sgd {
public:
    explicit Sgd(SgdOptions options = {}) : options_(options) {
        LOCKSTEP_CHECK(options.lr >= 0, "Sgd: learning rate must be >= 0, got ", options.lr);
        LOCKSTEP_CHECK(options.momentum >= 0, "Sgd: momentum must be >= 0, got ", options.momentum);
        LOCKSTEP_CHECK(options.weight_decay >= 0, "Sgd: weight decay must be >= 0, got ", options.weight_decay);
        LOCKSTEP_CHECK(!options.nesterov || (options.momentum > 0 && options.dampening == 0),
                       "Sgd: Nesterov momentum requires a momentum and zero dampening");
    }

    const SgdOptions& options() const noexcept { return options_; }
    void set_lr(double lr) { options_.lr = lr; }

    //! Makes room for `replicas` states; called before a parallel region, never inside one.
    void prepare(int replicas) {
        if (static_cast<int>(states_.size()) < replicas) states_.resize(static_cast<std::size_t>(replicas));
    }

    //! One update of `module`'s parameters with the state of replica `rank`.
    template <class M>
    void step(int rank, M& module) {
        LOCKSTEP_CHECK_AS(UsageError, rank >= 0 && rank < static_cast<int>(states_.size()), "Sgd::step for replica ", rank,
                          " without prepare(", rank + 1, ")");
        auto& state = states_[static_cast<std::size_t>(rank)];
        std::size_t i = 0;
        const float lr = static_cast<float>(options_.lr), mu = static_cast<float>(options_.momentum),
                    damp = static_cast<float>(1.0 - options_.dampening), wd = static_cast<float>(options_.weight_decay);
        for_each_parameter(module, [&](const std::string&, auto& p) {
            if (state.buffers.size() <= i) state.buffers.emplace_back();
            auto& buf = state.buffers[i++];
            float* w = p.value.data();
            const float* grad = p.grad.data();
            const std::int64_t n = p.numel();
            if (mu == 0.0f) {
                for (std::int64_t k = 0; k < n; ++k) w[k] -= lr * (grad[k] + wd * w[k]);
                return;
            }
            const bool first = buf.numel() != n;
            if (first) buf = Tensor<float, Host>(p.value.shape(), MemoryFormat::nchw, p.value.device(), uninitialized);
            float* v = buf.data();
            for (std::int64_t k = 0; k < n; ++k) {
                const float g = grad[k] + wd * w[k];
                v[k] = first ? g : mu * v[k] + damp * g;
                w[k] -= lr * (options_.nesterov ? g + mu * v[k] : v[k]);
            }
        });
    }

    //! Replica `rank`'s momentum buffers in parameter order (empty before its first step).
    std::vector<Tensor<float, Host>>& momentum_buffers(int rank) { return states_.at(static_cast<std::size_t>(rank)).buffers; }

    //! Puts replica `rank`'s momentum buffers into `ck` as "<prefix>.<parameter>.momentum_buffer".
    template <class M>
    void save_state(Checkpoint& ck, M& module, int rank = 0, const std::string& prefix = "optimizer") {
        auto& bufs = momentum_buffers(rank);
        std::size_t i = 0;
        for_each_parameter(module, [&](const std::string& name, auto&) {
            if (i < bufs.size() && bufs[i].numel() > 0) ck.put(state_key(prefix, name), bufs[i]);
            ++i;
        });
    }

    //! Gives every one of `replicas` replicas the momentum buffers stored by `save_state`.
    template <class M>
    void load_state(const Checkpoint& ck, M& module, int replicas, const std::string& prefix = "optimizer") {
        prepare(replicas);
        for (int r = 0; r < replicas; ++r) {
            auto& bufs = states_[static_cast<std::size_t>(r)].buffers;
            bufs.clear();
            for_each_parameter(module, [&](const std::string& name, auto& p) {
                const std::string key = state_key(prefix, name);
                bufs.emplace_back();
                if (!ck.contains(key)) return;  // that parameter has not been stepped yet
                bufs.back() = Tensor<float, Host>(p.value.shape());
                ck.get(key, bufs.back());
            });
        }
    }

private:
    static std::string state_key(const std::string& prefix, const std::string& parameter) {
        return prefix + "." + parameter + ".momentum_buffer";
    }

    struct State {
        std::vector<Tensor<float, Host>> buffers;
    };
    SgdOptions options_;
    std::vector<State> states_;
};

}  // namespace lockstep::nn
