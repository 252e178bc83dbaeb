// SPDX-License-Identifier: MIT
//! `nn::gradcheck`: a module's backward against central finite differences of its forward, for
//! people writing custom modules.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "lockstep/core/tensor.hpp"
#include "lockstep/nn/context.hpp"
#include "lockstep/nn/module.hpp"

namespace lockstep::nn {

struct GradcheckOptions {
    //! The finite-difference step, added to and subtracted from one fp32 value at a time.
    double step = 1e-3;
    //! Largest error allowed: max |analytic - numeric| over a tensor, divided by the larger of
    //! the tensor's largest |numeric| and `floor` times the largest |numeric| of every tensor
    //! checked (so a gradient that is zero in exact arithmetic, a bias before a batch norm, is
    //! measured against the gradients' scale, not against its own rounding noise).
    double tolerance = 1e-2;
    double floor = 0.1;
    //! Seed of the random weights w of the scalar checked, L = sum(w * module(x)).
    std::uint64_t seed = 0;
    //! Check the parameters' gradients too (every element: 2 forwards each).
    bool parameters = true;
};

//! What gradcheck measured: the relative error of dx and of every parameter's gradient.
struct GradcheckResult {
    double tolerance = 0;
    double input_error = 0;
    std::vector<std::pair<std::string, double>> parameter_errors;

    bool passed() const {
        if (!(input_error <= tolerance)) return false;
        return std::all_of(parameter_errors.begin(), parameter_errors.end(),
                           [&](const auto& e) { return e.second <= tolerance; });
    }
    //! One line per tensor checked, its error and whether it passed.
    std::string report() const {
        std::ostringstream s;
        const auto line = [&](const std::string& what, double e) {
            s << (e <= tolerance ? "  ok    " : "  FAIL  ") << what << ": relative error " << e << " (tolerance " << tolerance
              << ")\n";
        };
        line("dx", input_error);
        for (const auto& [name, e] : parameter_errors) line("d " + name, e);
        return s.str();
    }
};

namespace detail {

inline double max_abs(const std::vector<double>& v) {
    double m = 0;
    for (const double x : v) m = std::max(m, std::abs(x));
    return m;
}

inline double relative_error(const std::vector<double>& analytic, const std::vector<double>& numeric, double floor) {
    double diff = 0;
    for (std::size_t i = 0; i < numeric.size(); ++i) {
        const double d = std::abs(analytic[i] - numeric[i]);
        diff = std::isnan(d) ? d : std::max(diff, d);
    }
    const double scale = std::max(max_abs(numeric), floor);
    return scale == 0 ? diff : diff / scale;
}

template <class B>
std::vector<double> host_values(const Tensor<float, B>& t) {
    const Tensor<float, Host> h = t.template to<Host>(Device::host());  // a host copy, read here
    return {h.span().begin(), h.span().end()};
}

}  // namespace detail

//! Checks `module`'s backward at `input` in training mode: L = sum(w * forward(x)) with fixed
//! random w, dL/dx and dL/dparameter from backward against central differences of L, evaluated
//! in fp64 from the module's fp32 outputs. Every evaluation runs on a fresh copy of `module`,
//! so state a forward changes (running statistics, a Dropout's call count) is the same for
//! each, and `module` itself is left as it was. `ctx` is the context the module runs in (on
//! CUDA, a replica's execution). A kink of the function (ReLU at 0, a max pooling tie) within
//! `step` of an input shows up as an error: keep inputs away from them.
template <class M>
GradcheckResult gradcheck(const M& module, const Tensor<float, typename M::backend>& input, GradcheckOptions options = {},
                          Context<typename M::backend> ctx = {}) {
    static_assert(check_module<M>());
    using B = typename M::backend;
    ctx.training = true;
    const Device device = input.device();
    const Tensor<float, Host> x0 = input.template to<Host>(Device::host());
    GradcheckResult result;
    result.tolerance = options.tolerance;

    // The analytic gradients.
    M analytic_copy = module;
    zero_grad(analytic_copy);
    const auto y = analytic_copy.forward(ctx, Tensor<float, B>(input));
    Tensor<float, Host> w(y.shape(), y.format());
    std::mt19937_64 rng(options.seed);
    std::uniform_real_distribution<double> dist(-1.0, 1.0);
    for (auto& v : w.span()) v = static_cast<float>(dist(rng));
    const std::vector<double> wd(w.span().begin(), w.span().end());
    const auto dx = detail::host_values(analytic_copy.backward(ctx, w.template to<B>(device)));

    const auto loss = [&](M& m, const Tensor<float, Host>& x) {
        const auto out = detail::host_values(m.forward(ctx, x.template to<B>(device)));
        double s = 0;
        for (std::size_t i = 0; i < out.size(); ++i) s += wd[i] * out[i];
        return s;
    };
    const float h = static_cast<float>(options.step);

    std::vector<double> numeric;
    for (std::int64_t i = 0; i < x0.numel(); ++i) {
        Tensor<float, Host> xp = x0, xm = x0;
        xp[i] += h;
        xm[i] -= h;
        M up = module, down = module;
        numeric.push_back((loss(up, xp) - loss(down, xm)) / (static_cast<double>(xp[i]) - xm[i]));
    }
    std::vector<std::vector<double>> analytic{dx}, numerics{numeric};
    std::vector<std::string> names{"dx"};

    if (options.parameters)
        for_each_parameter(analytic_copy, [&](const std::string& name, Parameter<B>& p) {
            names.push_back(name);
            analytic.push_back(detail::host_values(p.grad));
        });
    for (std::size_t k = 0; k + 1 < names.size(); ++k) {
        numeric.clear();
        const auto nudged = [&](std::int64_t i, float by) {
            M copy = module;
            std::size_t at = 0;
            double moved = 0;
            for_each_parameter(copy, [&](const std::string&, Parameter<B>& p) {
                if (at++ != k) return;
                Tensor<float, Host> v = p.value.template to<Host>(Device::host());
                const float before = v[i];
                v[i] += by;
                moved = static_cast<double>(v[i]) - before;
                p.value = v.template to<B>(p.value.device());
            });
            return std::pair{loss(copy, x0), moved};
        };
        for (std::int64_t i = 0; i < static_cast<std::int64_t>(analytic[k + 1].size()); ++i) {
            const auto [up, du] = nudged(i, h);
            const auto [down, dd] = nudged(i, -h);
            numeric.push_back((up - down) / (du - dd));
        }
        numerics.push_back(numeric);
    }
    double scale = 0;
    for (const auto& n : numerics) scale = std::max(scale, detail::max_abs(n));
    for (std::size_t k = 0; k < names.size(); ++k) {
        const double e = detail::relative_error(analytic[k], numerics[k], options.floor * scale);
        if (k == 0)
            result.input_error = e;
        else
            result.parameter_errors.emplace_back(names[k], e);
    }
    return result;
}

}  // namespace lockstep::nn
