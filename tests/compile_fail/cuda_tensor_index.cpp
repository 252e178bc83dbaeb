// SPDX-License-Identifier: MIT
//! Must NOT compile: element access on a CUDA tensor, with an error that says what to do.
#include <lockstep/lockstep.hpp>

void set_first(lockstep::Tensor<float, lockstep::Cuda>& t) { t[0] = 1.0f; }
