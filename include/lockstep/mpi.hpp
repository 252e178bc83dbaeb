// SPDX-License-Identifier: MIT
//! lockstep's umbrella header for collectives across processes (component `lockstep::mpi`: needs
//! an MPI library, Open MPI 4.1 tested): `mpi::Environment` and `comm::MpiCommunicator`.
#pragma once

#include "lockstep/lockstep.hpp"
#include "lockstep/comm/mpi_communicator.hpp"
