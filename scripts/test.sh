#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Builds lockstep and passes every test: the release build (CUDA parts compiled where nvcc is;
# GPU tests run where a GPU is, else report skipped), a ThreadSanitizer build of the concurrent
# parts, an AddressSanitizer + UBSan build of the whole suite and the fuzz targets' corpus replay
# and short fixed-seed runs (scripts/fuzz.sh replay, clang-14). Installs missing Debian packages
# first. Usage: scripts/test.sh [release|tsan|asan|fuzz]...   (default: all four)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh

presets=("$@")
((${#presets[@]})) || presets=(release tsan asan fuzz)
for preset in "${presets[@]}"; do
  if [[ $preset == fuzz ]]; then  # not a CMake preset: its own clang project (tests/fuzz)
    scripts/fuzz.sh replay
    continue
  fi
  echo "=== lockstep: ${preset} build and tests ==="
  configure=()
  if [[ $preset == release ]]; then
    # No GPU here (CI): the CUDA programs are compile checks (LOCKSTEP_CUDA_COMPILE_CHECK in
    # CMakeLists.txt); with one they are built to run.
    if nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
      configure=(-DLOCKSTEP_CUDA_COMPILE_CHECK=OFF)
    else
      configure=(-DLOCKSTEP_CUDA_COMPILE_CHECK=ON)
    fi
  fi
  cmake --preset "${preset}" "${configure[@]}"
  cmake --build --preset "${preset}"
  ctest --preset "${preset}"
done
