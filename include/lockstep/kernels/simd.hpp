// SPDX-License-Identifier: MIT
//! Which vector ISA the host kernels run: detected once, capped by `LOCKSTEP_SIMD`, settable.
#pragma once

#include <atomic>
#include <cstdlib>
#include <optional>
#include <string_view>

#include "lockstep/core/error.hpp"

// Runtime dispatch needs GCC/Clang's per-function target attribute and x86-64; elsewhere (AArch64,
// or host code that nvcc compiles) the kernels use the baseline vectors: NEON / SSE2 width.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(__CUDACC__) && \
    !defined(LOCKSTEP_NO_SIMD_DISPATCH)
#define LOCKSTEP_SIMD_X86 1
#else
#define LOCKSTEP_SIMD_X86 0
#endif

namespace lockstep::kernels::simd {

// Note [simd levels]
// Host kernels are compiled for three vector widths and one is chosen per call:
//   baseline  4 floats (SSE2 on x86-64, NEON on AArch64): what every build can run;
//   avx2      8 floats with FMA;
//   avx512   16 floats (AVX-512 F/VL/BW/DQ).
// `active()` starts as AVX2 where the CPU has it (else baseline), or as the level the environment
// variable LOCKSTEP_SIMD=baseline|avx2|avx512 names (read once), capped at what the CPU runs.
// AVX-512 is opt-in: the passes are bound by memory traffic, where wider vectors buy nothing, and
// some CPUs lower their clock while running it. Results differ
// between levels by float rounding only (sums are grouped by width); all replicas of a process use
// the same level, so they stay bit-identical. Tests pin each level in turn with `set_active`.

enum class Level { baseline = 0, avx2 = 1, avx512 = 2 };

inline constexpr std::string_view to_string(Level level) {
    switch (level) {
        case Level::avx2: return "avx2";
        case Level::avx512: return "avx512";
        default: return "baseline";
    }
}

//! The widest level this CPU runs (baseline where dispatch is compiled out).
inline Level supported() noexcept {
#if LOCKSTEP_SIMD_X86
    static const Level level = [] {
        __builtin_cpu_init();
        if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512dq"))
            return Level::avx512;
        if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Level::avx2;
        return Level::baseline;
    }();
    return level;
#else
    return Level::baseline;
#endif
}

//! The level named "baseline", "avx2" or "avx512"; nullopt for any other name.
inline std::optional<Level> parse(std::string_view name) noexcept {
    for (const Level level : {Level::baseline, Level::avx2, Level::avx512})
        if (name == to_string(level)) return level;
    return std::nullopt;
}

namespace detail {
inline Level cap(Level wanted) noexcept {
    return static_cast<int>(wanted) < static_cast<int>(supported()) ? wanted : supported();
}
inline std::atomic<int>& active_slot() {
    static std::atomic<int> slot = [] {
        const char* env = std::getenv("LOCKSTEP_SIMD");
        if (env == nullptr || *env == '\0') return static_cast<int>(cap(Level::avx2));
        const auto level = parse(env);
        LOCKSTEP_CHECK(level.has_value(), "LOCKSTEP_SIMD=", env,
                       " names no SIMD level: set it to baseline, avx2 or avx512, or unset it");
        return static_cast<int>(cap(*level));
    }();
    return slot;
}
}  // namespace detail

//! The level the host kernels use now.
inline Level active() { return static_cast<Level>(detail::active_slot().load(std::memory_order_relaxed)); }

//! Makes the kernels use `wanted`, or the widest supported level below it; returns the level set.
//! Change it only while no kernel runs (replicas would otherwise mix levels within a step).
inline Level set_active(Level wanted) {
    const Level level = detail::cap(wanted);
    detail::active_slot().store(static_cast<int>(level), std::memory_order_relaxed);
    return level;
}

}  // namespace lockstep::kernels::simd
