// SPDX-License-Identifier: MIT
//! How a checkpoint tensor is compared with PyTorch's in tests/golden (host and CUDA tests alike).
#pragma once

#include <lockstep/nn/checkpoint.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace lockstep::golden {

//! ||mine - theirs|| and ||theirs|| over the elements of two F32 or I64 checkpoint tensors of one
//! dtype and size, in fp64.
struct Distance {
    double diff = 0, norm = 0;
    //! Within 1e-4 of the reference's norm, or 1e-6 absolute for tensors that are zero in exact
    //! arithmetic (the conv bias's gradient and momentum cancel in the batch norm after it).
    bool close() const { return diff <= 1e-4 * norm + 1e-6; }
};

inline Distance distance(const nn::Checkpoint::Entry& mine, const nn::Checkpoint::Entry& theirs) {
    double diff = 0, norm = 0;
    for (std::size_t i = 0; i < mine.data.size(); i += mine.dtype == "F32" ? 4 : 8) {
        double a = 0, b = 0;
        if (mine.dtype == "F32") {
            float fa = 0, fb = 0;
            std::memcpy(&fa, mine.data.data() + i, 4);
            std::memcpy(&fb, theirs.data.data() + i, 4);
            a = fa, b = fb;
        } else {
            std::int64_t ia = 0, ib = 0;
            std::memcpy(&ia, mine.data.data() + i, 8);
            std::memcpy(&ib, theirs.data.data() + i, 8);
            a = static_cast<double>(ia), b = static_cast<double>(ib);
        }
        diff += (a - b) * (a - b);
        norm += b * b;
    }
    return {std::sqrt(diff), std::sqrt(norm)};
}

}  // namespace lockstep::golden
