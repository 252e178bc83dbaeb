// SPDX-License-Identifier: MIT
//! Learning-rate schedules as functions of the step (or epoch): `nn::StepLR`,
//! `nn::CosineWithWarmup` and `nn::OneCycleLR`, each PyTorch's scheduler in closed form.
#pragma once

#include <cmath>
#include <cstdint>
#include <numbers>

#include "lockstep/core/error.hpp"

namespace lockstep::nn {

// Note [schedules]
// A schedule here is a pure function of the step: `optimizer.set_lr(schedule.lr(step))` before
// each step (or epoch) gives what PyTorch's scheduler gives after `step` calls of
// scheduler.step(). Nothing to save in a checkpoint beyond the step number, and every replica
// and process computes the same value. The tests compare each with PyTorch's own scheduler
// (tests/golden/make_optim_golden.py).

//! torch.optim.lr_scheduler.StepLR: base_lr * gamma^floor(epoch / step_size).
class StepLR {
public:
    StepLR(double base_lr, std::int64_t step_size, double gamma = 0.1) : base_(base_lr), size_(step_size), gamma_(gamma) {
        LOCKSTEP_CHECK(base_lr >= 0, "StepLR: base_lr must be >= 0, got ", base_lr);
        LOCKSTEP_CHECK(step_size > 0, "StepLR: step_size must be > 0, got ", step_size);
    }
    double lr(std::int64_t epoch) const { return base_ * std::pow(gamma_, static_cast<double>(epoch / size_)); }

private:
    double base_;
    std::int64_t size_;
    double gamma_;
};

//! A linear warm-up from start_factor * base_lr to base_lr over `warmup` steps, then cosine
//! annealing to min_lr at `total` steps: PyTorch's SequentialLR([LinearLR(start_factor, 1,
//! warmup), CosineAnnealingLR(total - warmup, min_lr)], milestones=[warmup]). Past `total` it
//! stays at min_lr (PyTorch's cosine would rise again).
class CosineWithWarmup {
public:
    CosineWithWarmup(double base_lr, std::int64_t warmup, std::int64_t total, double min_lr = 0.0, double start_factor = 0.01)
        : base_(base_lr), warmup_(warmup), total_(total), min_(min_lr), start_(start_factor) {
        LOCKSTEP_CHECK(base_lr >= 0 && min_lr >= 0, "CosineWithWarmup: learning rates must be >= 0, got ", base_lr, " and ",
                       min_lr);
        LOCKSTEP_CHECK(warmup >= 0 && total > warmup, "CosineWithWarmup: needs 0 <= warmup < total, got warmup ", warmup,
                       " and total ", total);
        LOCKSTEP_CHECK(start_factor > 0 && start_factor <= 1, "CosineWithWarmup: start_factor must lie in (0, 1], got ",
                       start_factor);
    }
    double lr(std::int64_t step) const {
        if (step < warmup_) return base_ * (start_ + (1.0 - start_) * static_cast<double>(step) / static_cast<double>(warmup_));
        if (step >= total_) return min_;
        const double t = static_cast<double>(step - warmup_) / static_cast<double>(total_ - warmup_);
        return min_ + (base_ - min_) * (1.0 + std::cos(std::numbers::pi * t)) / 2.0;
    }

private:
    double base_;
    std::int64_t warmup_, total_;
    double min_, start_;
};

struct OneCycleOptions {
    double pct_start = 0.3;         //!< the share of the steps spent rising
    double div_factor = 25.0;       //!< the first lr is max_lr / div_factor
    double final_div_factor = 1e4;  //!< the last is the first / final_div_factor
    double base_momentum = 0.85;    //!< the momentum (Adam's beta1) at max_lr
    double max_momentum = 0.95;     //!< and at the ends
};

//! torch.optim.lr_scheduler.OneCycleLR (two phases, cosine annealing): lr rises from max_lr /
//! div_factor to max_lr over pct_start of `total` steps, then falls to the first lr divided by
//! final_div_factor at the last step; momentum() moves the other way (cycle_momentum: set
//! Adam's beta1 or Sgd's momentum to it).
class OneCycleLR {
public:
    OneCycleLR(double max_lr, std::int64_t total, OneCycleOptions o = {}) : max_(max_lr), total_(total), o_(o) {
        LOCKSTEP_CHECK(max_lr >= 0, "OneCycleLR: max_lr must be >= 0, got ", max_lr);
        LOCKSTEP_CHECK(total > 1, "OneCycleLR: needs more than one step, got ", total);
        LOCKSTEP_CHECK(o.pct_start > 0 && o.pct_start < 1, "OneCycleLR: pct_start must lie in (0, 1), got ", o.pct_start);
        LOCKSTEP_CHECK(o.div_factor > 0 && o.final_div_factor > 0, "OneCycleLR: the division factors must be > 0");
    }
    double lr(std::int64_t step) const {
        const double first = max_ / o_.div_factor;
        return phase(step, first, max_, max_, first / o_.final_div_factor);
    }
    double momentum(std::int64_t step) const {
        return phase(step, o_.max_momentum, o_.base_momentum, o_.base_momentum, o_.max_momentum);
    }

private:
    static double anneal(double start, double end, double pct) {
        return end + (start - end) / 2.0 * (std::cos(std::numbers::pi * pct) + 1.0);
    }
    // PyTorch's phases: the first ends at step pct_start * total - 1, the second at total - 1.
    double phase(std::int64_t step, double a0, double a1, double b0, double b1) const {
        const double s = static_cast<double>(step);
        const double end1 = o_.pct_start * static_cast<double>(total_) - 1.0, end2 = static_cast<double>(total_) - 1.0;
        if (s <= end1) return anneal(a0, a1, s / end1);
        return anneal(b0, b1, (s - end1) / (end2 - end1));
    }

    double max_;
    std::int64_t total_;
    OneCycleOptions o_;
};

}  // namespace lockstep::nn
