// SPDX-License-Identifier: MIT
//! `nn::Adam` and `nn::AdamW` (torch.optim.Adam and AdamW), with parameter groups.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "lockstep/core/error.hpp"
#include "lockstep/core/tensor.hpp"
#include "lockstep/kernels/ops.hpp"
#include "lockstep/nn/bucket_layout.hpp"
#include "lockstep/nn/context.hpp"
#include "lockstep/nn/module.hpp"

namespace lockstep::nn {

struct AdamOptions {
    double lr = 1e-3;
    double beta1 = 0.9, beta2 = 0.999;
    double eps = 1e-8;
    //! Adam: an L2 term added to the gradient; AdamW: decoupled, the parameter scaled by 1 - lr wd.
    double weight_decay = 0.0;
    //! AdamW's decoupled weight decay (nn::AdamW sets it).
    bool decoupled = false;
};

//! Parameters that take their own hyper-parameters (torch.optim's param_groups, chosen by name and
//! shape instead of listed): the first group whose `matches` accepts a parameter is its group.
struct ParamGroup {
    std::function<bool(const std::string& name, const Shape& shape)> matches;
    //! The group's weight decay; the optimizer's when unset.
    std::optional<double> weight_decay;
    //! The group's learning rate as a multiple of the optimizer's (so a schedule moves every group).
    double lr_scale = 1.0;
};

//! The usual group: no weight decay on biases and normalization weights (every parameter of at
//! most one dimension), as `p.ndim <= 1` picks them in PyTorch recipes.
inline ParamGroup no_decay_on_norms_and_biases() {
    return {[](const std::string&, const Shape& s) { return s.rank() <= 1; }, 0.0, 1.0};
}

// Note [Adam state]
// Each replica keeps, per parameter, exp_avg and exp_avg_sq (tensors on its device, made at the
// parameter's first step) and its step count (on the host: the bias corrections are scalars of
// the launch, computed in fp64 as PyTorch computes them). A checkpoint holds them under PyTorch's
// names, "<parameter>.exp_avg", ".exp_avg_sq" and ".step" (a float32 scalar, as PyTorch's
// state_dict has it). A frozen parameter (Parameter::frozen) is skipped and its step does not
// advance, as PyTorch skips a parameter without a gradient. One call of Ops::adam_step_many per
// group of parameters sharing their hyper-parameters and step: one launch per 32 tensors on CUDA.
// Under captured steps (DataParallelOptions::graphs) the update runs eagerly after the captured
// forward and backward (it has no graph_key: its scalars change every step).

//! torch.optim.Adam (and AdamW with `decoupled`): per element, in PyTorch's order,
//!   AdamW: w *= 1 - lr wd;  Adam: g += wd w;
//!   m = beta1 m + (1 - beta1) g;  v = beta2 v + (1 - beta2) g^2;
//!   w -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps).
//! Every replica keeps its own state and, fed identical gradients, computes identical bits.
template <BackendTag B = Host>
class Adam {
    using K = kernels::Ops<B>;

public:
    using backend = B;

    explicit Adam(AdamOptions options = {}, std::vector<ParamGroup> groups = {}) : options_(options), groups_(std::move(groups)) {
        check(options.lr, options.weight_decay, "");
        LOCKSTEP_CHECK(options.beta1 >= 0 && options.beta1 < 1 && options.beta2 >= 0 && options.beta2 < 1,
                       "Adam: betas must lie in [0, 1), got (", options.beta1, ", ", options.beta2, ")");
        LOCKSTEP_CHECK(options.eps >= 0, "Adam: eps must be >= 0, got ", options.eps);
        for (std::size_t g = 0; g < groups_.size(); ++g) {
            LOCKSTEP_CHECK(static_cast<bool>(groups_[g].matches), "Adam: parameter group ", g, " has no `matches` function");
            check(groups_[g].lr_scale, groups_[g].weight_decay.value_or(0.0), " of parameter group " + std::to_string(g));
        }
    }

    const AdamOptions& options() const noexcept { return options_; }
    //! The learning rate of every group (times its lr_scale) from the next step: what a schedule sets.
    void set_lr(double lr) {
        LOCKSTEP_CHECK(lr >= 0, "Adam: learning rate must be >= 0, got ", lr);
        options_.lr = lr;
    }
    //! beta1 from the next step (nn::OneCycleLR cycles it as PyTorch's cycle_momentum does).
    void set_beta1(double beta1) {
        LOCKSTEP_CHECK(beta1 >= 0 && beta1 < 1, "Adam: beta1 must lie in [0, 1), got ", beta1);
        options_.beta1 = beta1;
    }

    //! Makes room for `replicas` states; called before a parallel region, never inside one.
    void prepare(int replicas, const BucketLayout& = {}) {
        if (static_cast<int>(states_.size()) < replicas) states_.resize(static_cast<std::size_t>(replicas));
    }

    //! One update of `module`'s parameters with the state of replica `ctx.local_rank`.
    template <class M>
    void step(const Context<B>& ctx, M& module) {
        const int rank = ctx.local_rank;
        LOCKSTEP_CHECK_AS(UsageError, rank >= 0 && rank < static_cast<int>(states_.size()), "Adam::step for replica ", rank,
                          " without prepare(", rank + 1, ")");
        // Parameters in visit order, with their group and state made where missing; the entries
        // are sized first, so the pointers taken below stay valid.
        auto& entries = entries_of(rank, module);
        std::size_t i = 0;
        std::map<std::pair<int, std::int64_t>, std::vector<kernels::AdamTensors<B>>> batches;  // (group, step) -> entries
        for_each_parameter(module, [&](const std::string& name, Parameter<B>& p) {
            auto& e = entries[i++];
            if (e.name != name) {
                e.name = name;
                e.group = group_of(name, p.shape());
            }
            if (p.frozen) return;
            if (e.exp_avg.numel() != p.numel()) {
                e.exp_avg = Tensor<float, B>(p.shape(), MemoryFormat::nchw, p.value.device());  // zero
                e.exp_avg_sq = Tensor<float, B>(p.shape(), MemoryFormat::nchw, p.value.device());
                e.step = 0;
            }
            ++e.step;
            batches[{e.group, e.step}].push_back({&p.value, &p.grad, &e.exp_avg, &e.exp_avg_sq});
        });
        for (const auto& [key, items] : batches) {
            const auto [group, step] = key;
            const double lr = options_.lr * (group < 0 ? 1.0 : groups_[static_cast<std::size_t>(group)].lr_scale);
            const double wd = group < 0 ? options_.weight_decay
                                        : groups_[static_cast<std::size_t>(group)].weight_decay.value_or(options_.weight_decay);
            K::adam_step_many(
                ctx.exec, items,
                kernels::AdamUpdate::at(lr, options_.beta1, options_.beta2, options_.eps, wd, options_.decoupled, step));
        }
    }

    //! Calls `f(name, state, parameter)` for replica `rank`'s "<parameter>.exp_avg" and
    //! "<parameter>.exp_avg_sq" of every parameter (Note [optimizer protocol]).
    template <class M, class F>
    void visit_state(int rank, M& module, F&& f) {
        auto& entries = entries_of(rank, module);
        std::size_t i = 0;
        for_each_parameter(module, [&](const std::string& name, const Parameter<B>& p) {
            auto& e = entries[i++];
            f(name + ".exp_avg", e.exp_avg, p);
            f(name + ".exp_avg_sq", e.exp_avg_sq, p);
        });
    }

    //! Calls `f(name, count)` for replica `rank`'s "<parameter>.step" of every parameter: the
    //! steps it has taken (Note [Adam state]).
    template <class M, class F>
    void visit_counters(int rank, M& module, F&& f) {
        auto& entries = entries_of(rank, module);
        std::size_t i = 0;
        for_each_parameter(module, [&](const std::string& name, const Parameter<B>&) { f(name + ".step", entries[i++].step); });
    }

private:
    struct Entry {
        std::string name;
        int group = -1;  // -1: the optimizer's own options
        Tensor<float, B> exp_avg, exp_avg_sq;
        std::int64_t step = 0;
    };
    struct State {
        std::vector<Entry> entries;  // visit order
    };

    static void check(double lr, double wd, const std::string& where) {
        LOCKSTEP_CHECK(lr >= 0, "Adam: learning rate", where, " must be >= 0, got ", lr);
        LOCKSTEP_CHECK(wd >= 0, "Adam: weight decay", where, " must be >= 0, got ", wd);
    }

    int group_of(const std::string& name, const Shape& shape) const {
        for (std::size_t g = 0; g < groups_.size(); ++g)
            if (groups_[g].matches(name, shape)) return static_cast<int>(g);
        return -1;
    }

    template <class M>
    std::vector<Entry>& entries_of(int rank, M& module) {
        prepare(rank + 1);
        auto& entries = states_[static_cast<std::size_t>(rank)].entries;
        std::size_t count = 0;
        for_each_parameter(module, [&](const std::string&, const Parameter<B>&) { ++count; });
        if (entries.size() < count) entries.resize(count);
        return entries;
    }

    AdamOptions options_;
    std::vector<ParamGroup> groups_;
    std::vector<State> states_;
};

Adam(AdamOptions)->Adam<Host>;

Adam(AdamOptions, std::vector<ParamGroup>)->Adam<Host>;

struct AdamWOptions {
    double lr = 1e-3;
    double beta1 = 0.9, beta2 = 0.999;
    double eps = 1e-8;
    double weight_decay = 1e-2;
};

//! torch.optim.AdamW: Adam with decoupled weight decay (default 0.01).
template <BackendTag B = Host>
class AdamW : public Adam<B> {
public:
    explicit AdamW(AdamWOptions o = {}, std::vector<ParamGroup> groups = {})
        : Adam<B>(
              {.lr = o.lr, .beta1 = o.beta1, .beta2 = o.beta2, .eps = o.eps, .weight_decay = o.weight_decay, .decoupled = true},
              std::move(groups)) {}
};

AdamW()->AdamW<Host>;
AdamW(AdamWOptions)->AdamW<Host>;
AdamW(AdamWOptions, std::vector<ParamGroup>)->AdamW<Host>;

}  // namespace lockstep::nn
