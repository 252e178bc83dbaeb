// SPDX-License-Identifier: MIT
//! `lockstep::BFloat16`: the 16-bit brain float as a storage type every backend can name.
#pragma once

#include <bit>
#include <cstdint>

namespace lockstep {

// Note [bfloat16 storage]
// An activation stored in bf16 (Note [activation precision]) is a `Tensor<BFloat16, B>`: the
// element is the upper half of an IEEE fp32 value (sign, 8 exponent bits, 7 significand bits),
// held as its bits. The type is the same on every backend, so layers written once name it; a
// backend's kernels read the storage as their own type (CUDA's __nv_bfloat16, which has the same
// size and bits). Converting:
// - `BFloat16::round(f)`: to nearest, ties to even, as CUDA's __float2bfloat16_rn and its
//   `cvt.rn.bf16.f32`; infinities stay infinities, values past the largest finite bf16 round to
//   infinity, subnormals round like any other value, and every NaN becomes the one NaN 0x7FFF
//   that CUDA's conversion gives, so the host and the device agree on every bit.
// - `widen()`: the fp32 value with those upper bits and zero below: exact.
// There is no arithmetic on the type: compute in fp32 and round once. (The name is not `bfloat16`:
// OpenBLAS's cblas.h declares a global `bfloat16`, which `using namespace lockstep` would make
// ambiguous.)

//! A bfloat16 value, held as its bits (Note [bfloat16 storage]).
struct BFloat16 {
    std::uint16_t bits = 0;

    //! `f` rounded to nearest, ties to even; every NaN to 0x7FFF.
    static constexpr BFloat16 round(float f) noexcept {
        const std::uint32_t x = std::bit_cast<std::uint32_t>(f);
        if ((x & 0x7fffffffu) > 0x7f800000u) return BFloat16{0x7fff};
        // Adding 0x7FFF plus the kept part's lowest bit carries into the kept half exactly when
        // the dropped half is above the tie, or at the tie with an odd kept half.
        const std::uint32_t rounded = x + 0x7fffu + ((x >> 16) & 1u);
        return BFloat16{static_cast<std::uint16_t>(rounded >> 16)};
    }
    //! The exact fp32 value.
    constexpr float widen() const noexcept { return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16); }

    //! Bitwise equality (so NaN == NaN of the same bits, and -0 != +0): what storage compares.
    friend constexpr bool operator==(BFloat16, BFloat16) noexcept = default;
};

static_assert(sizeof(BFloat16) == 2 && alignof(BFloat16) == 2, "a BFloat16 is 16 bits of storage");

}  // namespace lockstep
