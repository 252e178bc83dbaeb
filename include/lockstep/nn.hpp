// SPDX-License-Identifier: MIT
//! lockstep's layer kit and DataParallel for the host backend (needs CBLAS and nlohmann-json).
#pragma once

#include "lockstep/lockstep.hpp"
#include "lockstep/nn/activation.hpp"
#include "lockstep/nn/checkpoint.hpp"
#include "lockstep/nn/context.hpp"
#include "lockstep/nn/conv2d.hpp"
#include "lockstep/nn/init.hpp"
#include "lockstep/nn/linear.hpp"
#include "lockstep/nn/loss.hpp"
#include "lockstep/nn/module.hpp"
#include "lockstep/nn/sequential.hpp"
#include "lockstep/nn/sgd.hpp"
#include "lockstep/nn/sync_batch_norm.hpp"
#include "lockstep/parallel/data_parallel.hpp"
