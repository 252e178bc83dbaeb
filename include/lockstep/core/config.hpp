// SPDX-License-Identifier: MIT
//! Compiler portability: the `LOCKSTEP_HD` annotation that lets one function serve host and device.
#pragma once

#if defined(__CUDACC__)
#define LOCKSTEP_HD __host__ __device__
#define LOCKSTEP_HOST_ONLY __host__
#else
#define LOCKSTEP_HD
#define LOCKSTEP_HOST_ONLY
#endif

#if defined(__GNUC__) || defined(__clang__)
#define LOCKSTEP_RESTRICT __restrict__
#else
#define LOCKSTEP_RESTRICT
#endif
