// SPDX-License-Identifier: MIT
//! lockstep's umbrella header for the host backend. Reaches no CUDA header.
#pragma once

#include "lockstep/core/activation.hpp"
#include "lockstep/core/backend.hpp"
#include "lockstep/core/bfloat16.hpp"
#include "lockstep/core/config.hpp"
#include "lockstep/core/device_span.hpp"
#include "lockstep/core/device_watch.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/shape.hpp"
#include "lockstep/core/tensor.hpp"
#include "lockstep/runtime/abortable_barrier.hpp"
#include "lockstep/runtime/replica_pool.hpp"
#include "lockstep/comm/collective_tag.hpp"
#include "lockstep/comm/collectives.hpp"
#include "lockstep/comm/shared_tensor.hpp"
#include "lockstep/comm/host_communicator.hpp"
#include "lockstep/comm/group.hpp"
