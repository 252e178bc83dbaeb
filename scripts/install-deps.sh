#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Installs the Debian packages lockstep's build, tests, benchmarks and example need, only when
# one is missing (so a configured machine pays nothing), and libtorch for the torch component
# (scripts/install-torch.sh; LOCKSTEP_TORCH=OFF skips it). Needs root or sudo for apt-get.
set -euo pipefail

packages=(
  cmake g++ make pkg-config
  catch2                      # tests (Catch2 v2)
  libbenchmark-dev            # bench/
  libopenblas-dev             # CBLAS for the nn layers
  libdnnl-dev ocl-icd-opencl-dev opencl-c-headers  # oneDNN convolutions (its CMake package needs OpenCL)
  libopenmpi-dev openmpi-bin  # the mpi component
  zlib1g-dev                  # gzipped IDX files
  libcli11-dev                # example command line
  clang-14 libclang-rt-14-dev # fuzz targets (tests/fuzz): clang++-14 and its libFuzzer, ASan, UBSan
  nlohmann-json3-dev          # metrics and checkpoint headers
  dataset-fashion-mnist       # the example's default data
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if ((${#missing[@]} > 0)); then
  echo "lockstep: installing missing Debian packages: ${missing[*]}"
  sudo_cmd=()
  if ((EUID != 0)); then
    command -v sudo >/dev/null || { echo "lockstep: run as root or install sudo to install: ${missing[*]}" >&2; exit 1; }
    sudo_cmd=(sudo)
  fi
  export DEBIAN_FRONTEND=noninteractive
  "${sudo_cmd[@]}" apt-get update -qq
  "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# libtorch for the torch component (PyPI's wheel, project-local): LOCKSTEP_TORCH=OFF skips it.
if [[ ${LOCKSTEP_TORCH:-AUTO} != OFF ]]; then
  "$(dirname "$0")/install-torch.sh"
fi
