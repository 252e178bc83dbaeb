// SPDX-License-Identifier: MIT
//! lockstep's layer kit: layers, losses, SGD, modules and checkpoints, for any backend (needs
//! nlohmann-json). A backend's operations come with its own umbrella: <lockstep/host.hpp>
//! (OpenBLAS) or <lockstep/cuda.cuh>; DataParallel with <lockstep/parallel.hpp>.
#pragma once

#include "lockstep/lockstep.hpp"
#include "lockstep/nn/activation.hpp"
#include "lockstep/nn/adam.hpp"
#include "lockstep/nn/activation_precision.hpp"
#include "lockstep/nn/checkpoint.hpp"
#include "lockstep/nn/composition.hpp"
#include "lockstep/nn/context.hpp"
#include "lockstep/nn/conv2d.hpp"
#include "lockstep/nn/dropout.hpp"
#include "lockstep/nn/gradcheck.hpp"
#include "lockstep/nn/init.hpp"
#include "lockstep/nn/layer_norm.hpp"
#include "lockstep/nn/linear.hpp"
#include "lockstep/nn/loss.hpp"
#include "lockstep/nn/module.hpp"
#include "lockstep/nn/pooling.hpp"
#include "lockstep/nn/schedule.hpp"
#include "lockstep/nn/sequential.hpp"
#include "lockstep/nn/sgd.hpp"
#include "lockstep/nn/sync_batch_norm.hpp"
#include "lockstep/nn/tensor_ops.hpp"
