// SPDX-License-Identifier: MIT
//! The Catch2 main shared by every test executable (compiled once per build).
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>
