// SPDX-License-Identifier: MIT
//! lockstep's DataParallel: replicas of a module, one per device, trained as one. Include it with
//! the umbrella of the backend it runs on: <lockstep/host.hpp> or <lockstep/cuda.cuh>.
#pragma once

#include "lockstep/lockstep.hpp"
#include "lockstep/nn.hpp"
#include "lockstep/parallel/data_parallel.hpp"
