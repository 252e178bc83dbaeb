// SPDX-License-Identifier: MIT
//! Seeded random initialization with PyTorch's defaults for conv and linear layers.
#pragma once

#include <cmath>
#include <cstdint>
#include <random>

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

//! PyTorch's default for conv and linear layers: weights Kaiming-uniform with a = sqrt(5) and
//! biases uniform, both of which come to U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
inline void fan_in_uniform(Tensor<float, Host>& t, std::int64_t fan_in, Generator& gen) {
    const double bound = fan_in > 0 ? 1.0 / std::sqrt(static_cast<double>(fan_in)) : 0.0;
    for (auto& v : t.span()) v = gen.uniform(-bound, bound);
}

}  // namespace lockstep::nn
