// SPDX-License-Identifier: MIT
//! Seeded random initialization with PyTorch's defaults for conv and linear layers.
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include "lockstep/core/tensor.hpp"

namespace lockstep::nn {

//! The random source layers draw their initial values from. Seed it for reproducible models.
class Generator {
public:
    explicit Generator(std::uint64_t seed = 0) : engine_(seed) {}
    void seed(std::uint64_t s) { engine_.seed(s); }
    //! Uniform in [lo, hi).
    float uniform(double lo, double hi) { return static_cast<float>(std::uniform_real_distribution<double>(lo, hi)(engine_)); }
    std::mt19937_64& engine() noexcept { return engine_; }

private:
    std::mt19937_64 engine_;
};

//! The generator layers use when none is passed (seed 0 unless `manual_seed` changes it).
inline Generator& default_generator() {
    static Generator g(0);
    return g;
}
inline void manual_seed(std::uint64_t seed) { default_generator().seed(seed); }

//! Sets `t` to `values` (memory order), drawn or computed on the host: initial values are made on
//! the host on every backend, so a model starts from the same numbers wherever it lives.
template <BackendTag B>
void assign_host_values(Tensor<float, B>& t, const std::vector<float>& values) {
    t.copy_from(make_tensor<float>(t.shape(), std::span<const float>(values), t.format()));
}

//! Sets every element of `t` to `value`.
template <BackendTag B>
void fill_value(Tensor<float, B>& t, float value) {
    assign_host_values(t, std::vector<float>(static_cast<std::size_t>(t.numel()), value));
}

//! PyTorch's default for conv and linear layers: weights Kaiming-uniform with a = sqrt(5) and
//! biases uniform, both of which come to U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
template <BackendTag B>
void fan_in_uniform(Tensor<float, B>& t, std::int64_t fan_in, Generator& gen) {
    const double bound = fan_in > 0 ? 1.0 / std::sqrt(static_cast<double>(fan_in)) : 0.0;
    std::vector<float> values(static_cast<std::size_t>(t.numel()));
    for (auto& v : values) v = gen.uniform(-bound, bound);
    assign_host_values(t, values);
}

}  // namespace lockstep::nn
