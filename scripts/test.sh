#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Builds lockstep and passes every test: the release build (CUDA parts compiled where nvcc is;
# GPU tests run where a GPU is, else report skipped), a ThreadSanitizer build of the concurrent
# parts and an AddressSanitizer + UBSan build of the whole suite. Installs missing Debian
# packages first. Usage: scripts/test.sh [release|tsan|asan]...   (default: all three)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh

presets=("$@")
((${#presets[@]})) || presets=(release tsan asan)
for preset in "${presets[@]}"; do
  echo "=== lockstep: ${preset} build and tests ==="
  cmake --preset "${preset}"
  cmake --build --preset "${preset}"
  ctest --preset "${preset}"
done
