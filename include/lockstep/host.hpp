// SPDX-License-Identifier: MIT
//! lockstep's umbrella header for the host backend (`Host`): its operations on OpenBLAS and the
//! host loops (oneDNN convolutions where lockstep was built with them). Link lockstep::host.
#pragma once

#include "lockstep/lockstep.hpp"
#include "lockstep/kernels/host_ops.hpp"
