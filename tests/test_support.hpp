// SPDX-License-Identifier: MIT
//! Helpers shared by lockstep's tests: random tensors, layout-aware indexing, error norms.
#pragma once

#include <lockstep/lockstep.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <vector>

namespace lockstep::test {

//! A number no other call returns (in practice): for unique temporary names, whatever the seed.
inline std::uint64_t unique_number() {
    static std::random_device rd;
    return (static_cast<std::uint64_t>(rd()) << 32) ^ rd();
}

//! A fresh seed per call, so every run draws new inputs; printed by CAPTURE where it matters.
inline std::uint64_t fresh_seed() {
    // LOCKSTEP_TEST_SEED=<the seed a failure printed> replays that run.
    if (const char* fixed = std::getenv("LOCKSTEP_TEST_SEED"); fixed != nullptr && *fixed != '\0')
        return std::strtoull(fixed, nullptr, 0);
    return unique_number();
}

//! A host tensor of shape `s` with values uniform in [lo, hi).
inline Tensor<float> random_tensor(Shape s, std::mt19937_64& gen, double lo = -1.0, double hi = 1.0) {
    Tensor<float> t(s);
    std::uniform_real_distribution<double> d(lo, hi);
    for (auto& v : t.span()) v = static_cast<float>(d(gen));
    return t;
}

//! Memory offset of logical element (n, c, p) of an (N, C, P) batch in `format`.
inline std::int64_t offset(std::int64_t n, std::int64_t c, std::int64_t p, std::int64_t C, std::int64_t P, MemoryFormat format) {
    return format == MemoryFormat::nhwc ? (n * P + p) * C + c : (n * C + c) * P + p;
}

//! Largest |a - b| divided by the largest |b| (or by `floor`, if larger): relative error of a
//! vector as a whole. `floor` is the size of the terms a result is computed from, for results
//! that cancel to nearly zero (a batch-norm dx over two samples, say).
template <class A, class B>
double rel_error(const A& a, const B& b, double floor = 0) {
    double diff = 0, scale = floor;
    for (std::size_t i = 0; i < b.size(); ++i) {
        diff = std::max(diff, std::abs(static_cast<double>(a[i]) - static_cast<double>(b[i])));
        scale = std::max(scale, std::abs(static_cast<double>(b[i])));
    }
    return scale == 0 ? diff : diff / scale;
}

//! Shard sizes of a global batch: "even", "uneven" or "empty" (one replica gets no rows).
inline std::vector<std::int64_t> shard_sizes(int world, const std::string& split) {
    std::vector<std::int64_t> s(static_cast<std::size_t>(world), 2);
    if (split == "uneven") {
        for (int r = 0; r < world; ++r) s[static_cast<std::size_t>(r)] = 1 + ((r + 1) % 3);
    } else if (split == "empty" && world > 1) {
        s[1] = 0;
        s[0] = 3;
    }
    return s;
}

}  // namespace lockstep::test
