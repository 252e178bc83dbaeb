// SPDX-License-Identifier: MIT
//! Must NOT compile: a CUDA tensor's memory is not readable on the host, and the error says how
//! to read it. (Generic code that reads tensor memory itself fails the same way for Cuda.)
#include <lockstep/lockstep.hpp>

float first(const lockstep::Tensor<float, lockstep::Cuda>& t) { return t.span()[0]; }
