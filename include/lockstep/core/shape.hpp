// SPDX-License-Identifier: MIT
//! `Shape` (up to 5 dimensions) and `MemoryFormat` (NCHW or NHWC order of a 4-D tensor in memory).
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <ostream>
#include <sstream>
#include <string>

#include "lockstep/core/error.hpp"

namespace lockstep {

//! Physical order of a 4-D tensor whose logical shape is always (N, C, H, W), as in PyTorch.
enum class MemoryFormat { nchw, nhwc };

inline const char* to_string(MemoryFormat f) { return f == MemoryFormat::nchw ? "NCHW" : "NHWC"; }

//! Logical extents of a tensor, outermost first. Rank 0 is a scalar of one element.
class Shape {
public:
    static constexpr int max_rank = 5;

    constexpr Shape() = default;
    Shape(std::initializer_list<std::int64_t> dims) {
        LOCKSTEP_CHECK(dims.size() <= max_rank, "a shape has at most ", max_rank, " dimensions, got ", dims.size());
        for (auto d : dims) {
            LOCKSTEP_CHECK(d >= 0, "shape extents must be non-negative, got ", d);
            dims_[rank_++] = d;
        }
    }

    int rank() const noexcept { return rank_; }
    std::int64_t operator[](int i) const {
        LOCKSTEP_CHECK(i >= 0 && i < rank_, "dimension ", i, " out of range for a shape of rank ", rank_);
        return dims_[i];
    }
    std::int64_t numel() const noexcept {
        std::int64_t n = 1;
        for (int i = 0; i < rank_; ++i) n *= dims_[i];
        return n;
    }
    //! The same shape with dimension `i` set to `extent` (used to size a shard).
    Shape with(int i, std::int64_t extent) const {
        LOCKSTEP_CHECK(i >= 0 && i < rank_, "dimension ", i, " out of range for a shape of rank ", rank_);
        LOCKSTEP_CHECK(extent >= 0, "shape extents must be non-negative, got ", extent);
        Shape s = *this;
        s.dims_[i] = extent;
        return s;
    }
    //! Elements per index of dimension 0 (the size of one sample).
    std::int64_t row_numel() const noexcept {
        std::int64_t n = 1;
        for (int i = 1; i < rank_; ++i) n *= dims_[i];
        return n;
    }

    friend bool operator==(const Shape& a, const Shape& b) noexcept {
        if (a.rank_ != b.rank_) return false;
        for (int i = 0; i < a.rank_; ++i)
            if (a.dims_[i] != b.dims_[i]) return false;
        return true;
    }
    friend std::ostream& operator<<(std::ostream& os, const Shape& s) {
        os << '(';
        for (int i = 0; i < s.rank_; ++i) os << (i ? ", " : "") << s.dims_[i];
        return os << ')';
    }
    std::string str() const {
        std::ostringstream os;
        os << *this;
        return os.str();
    }

private:
    std::array<std::int64_t, max_rank> dims_{};
    int rank_ = 0;
};

}  // namespace lockstep
