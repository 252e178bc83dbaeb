// SPDX-License-Identifier: MIT
//! Average pooling and dropout written once for both backends (`__host__ __device__` under nvcc):
//! the host loops and the CUDA kernels call these per element, so the two backends give the same
//! bits (Note [pooling and dropout per element]).
#pragma once

#include <cstdint>

#include "lockstep/core/config.hpp"

namespace lockstep::kernels {

// Note [pooling and dropout per element]
// Average pooling is written as one function per output element (forward) and one per input
// element (backward, a gather over the windows that hold it: no atomics, so the CUDA kernel is
// deterministic), each summing in fp32 in a fixed order; the host backend loops over the same
// functions. Windows are PyTorch's: AvgPool2d's start at o * stride and span the kernel (no
// padding, divisor kernel_h * kernel_w); AdaptiveAvgPool2d's span [floor(o H / OH),
// ceil((o + 1) H / OH)) and divide by their own size. Dropout draws element i's keep bit from a
// counter-based hash of (seed, key, i): no generator state to carry between threads or devices,
// the same mask on the host and on CUDA, a different one for every replica and call (the key).

//! Average pooling over an NCHW input: (N, C, H, W) -> (N, C, OH, OW).
struct AvgPoolGeometry {
    std::int64_t batch = 0, channels = 0, height = 0, width = 0;
    std::int64_t out_height = 1, out_width = 1;
    std::int64_t kernel_h = 1, kernel_w = 1, stride_h = 1, stride_w = 1;
    //! AdaptiveAvgPool2d's windows (the kernel and stride are then unused).
    bool adaptive = false;

    std::int64_t planes() const { return batch * channels; }
    std::int64_t in_numel() const { return planes() * height * width; }
    std::int64_t out_numel() const { return planes() * out_height * out_width; }
};

namespace pool {

//! Output o's window along one dimension of `in` values: [begin, end).
struct Span {
    std::int64_t begin, end;
};

LOCKSTEP_HD inline Span window(std::int64_t o, std::int64_t in, std::int64_t out, std::int64_t kernel, std::int64_t stride,
                               bool adaptive) {
    if (adaptive) return {o * in / out, ((o + 1) * in + out - 1) / out};
    return {o * stride, o * stride + kernel};
}

//! The outputs whose window holds input position i along one dimension: [begin, end).
LOCKSTEP_HD inline Span holders(std::int64_t i, std::int64_t in, std::int64_t out, std::int64_t kernel, std::int64_t stride,
                                bool adaptive) {
    if (adaptive) {
        // begin(o) <= i  <=>  o <= ceil((i + 1) out / in) - 1;  end(o) > i  <=>  o >= floor(i out / in).
        return {i * out / in, ((i + 1) * out + in - 1) / in};
    }
    // o stride <= i < o stride + kernel  <=>  ceil((i - kernel + 1) / stride) <= o <= floor(i / stride).
    const std::int64_t lo = i - kernel + 1 > 0 ? (i - kernel + stride) / stride : 0;
    const std::int64_t hi = i / stride + 1;
    return {lo, hi < out ? hi : out};
}

//! y[e] of output element e (plane-major, then rows, then columns): the fp32 sum of its window in
//! row order, divided by the window's size.
LOCKSTEP_HD inline float forward_at(const AvgPoolGeometry& g, const float* x, std::int64_t e) {
    const std::int64_t ow = e % g.out_width, q = e / g.out_width;
    const std::int64_t oh = q % g.out_height, plane = q / g.out_height;
    const Span r = window(oh, g.height, g.out_height, g.kernel_h, g.stride_h, g.adaptive);
    const Span c = window(ow, g.width, g.out_width, g.kernel_w, g.stride_w, g.adaptive);
    const float* src = x + plane * g.height * g.width;
    float sum = 0.0f;
    for (std::int64_t h = r.begin; h < r.end; ++h)
        for (std::int64_t w = c.begin; w < c.end; ++w) sum += src[h * g.width + w];
    return sum / static_cast<float>((r.end - r.begin) * (c.end - c.begin));
}

//! dx[e] of input element e: the sum over the windows holding it, in row order, of dy over the
//! window's size.
LOCKSTEP_HD inline float backward_at(const AvgPoolGeometry& g, const float* dy, std::int64_t e) {
    const std::int64_t w = e % g.width, q = e / g.width;
    const std::int64_t h = q % g.height, plane = q / g.height;
    const Span rows = holders(h, g.height, g.out_height, g.kernel_h, g.stride_h, g.adaptive);
    const Span cols = holders(w, g.width, g.out_width, g.kernel_w, g.stride_w, g.adaptive);
    const float* src = dy + plane * g.out_height * g.out_width;
    float sum = 0.0f;
    for (std::int64_t oh = rows.begin; oh < rows.end; ++oh) {
        const Span r = window(oh, g.height, g.out_height, g.kernel_h, g.stride_h, g.adaptive);
        if (h < r.begin || h >= r.end) continue;  // an adaptive bound one too wide
        for (std::int64_t ow = cols.begin; ow < cols.end; ++ow) {
            const Span c = window(ow, g.width, g.out_width, g.kernel_w, g.stride_w, g.adaptive);
            if (w < c.begin || w >= c.end) continue;
            sum += src[oh * g.out_width + ow] / static_cast<float>((r.end - r.begin) * (c.end - c.begin));
        }
    }
    return sum;
}

}  // namespace pool

//! A dropout draw: elements of a tensor are kept where `keep(seed, key, index)`; `threshold` is
//! p scaled to 2^24 (an element is dropped when its 24 random bits fall below it), `scale` is
//! 1 / (1 - p) in fp32, as PyTorch multiplies by.
struct DropoutDraw {
    std::uint64_t seed = 0;
    std::uint64_t key = 0;  // the replica and the call (nn::Dropout: Note [pooling and dropout per element])
    std::uint32_t threshold = 0;
    float scale = 1.0f;
};

namespace dropout {

//! SplitMix64's finalizer: a bijection of 64-bit words whose outputs pass statistical tests for
//! consecutive inputs.
LOCKSTEP_HD inline std::uint64_t mix(std::uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

//! Whether element `index` survives the draw.
LOCKSTEP_HD inline bool keep(const DropoutDraw& d, std::uint64_t index) {
    const std::uint64_t stream = mix(d.seed ^ mix(d.key + 0x9e3779b97f4a7c15ULL));
    const std::uint64_t bits = mix(stream + index * 0x9e3779b97f4a7c15ULL);
    return static_cast<std::uint32_t>(bits >> 40) >= d.threshold;
}

}  // namespace dropout

}  // namespace lockstep::kernels
