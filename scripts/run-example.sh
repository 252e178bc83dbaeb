#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Builds lockstep's main example, the MNIST conv-net trained data-parallel with SyncBatchNorm,
# and runs it (by default on Fashion-MNIST from Debian's dataset-fashion-mnist, 2 host replicas
# when there is no GPU). Installs missing Debian packages first. Arguments go to the example,
# e.g. scripts/run-example.sh --epochs 1 --replicas 2 --save model.safetensors
# --processes N (first) runs N processes under mpirun, each with the example's --replicas:
#   scripts/run-example.sh --processes 2 --replicas 1 --epochs 1
set -euo pipefail
cd "$(dirname "$0")/.."
processes=1
if [[ ${1:-} == --processes ]]; then
  [[ ${2:-} =~ ^[1-9][0-9]*$ ]] || { echo "run-example.sh: --processes takes a positive count" >&2; exit 2; }
  processes=$2
  shift 2
fi
scripts/install-deps.sh
# With a GPU, the CUDA training is built to run, even in a build folder that scripts/test.sh
# configured without one (LOCKSTEP_CUDA_COMPILE_CHECK in CMakeLists.txt).
configure=()
if nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then configure=(-DLOCKSTEP_CUDA_COMPILE_CHECK=OFF); fi
cmake --preset release "${configure[@]}" >/dev/null
cmake --build --preset release --target mnist
if ((processes == 1)); then
  exec build/release/examples/mnist "$@"
fi
# mpirun refuses root unless told; --oversubscribe lets a small machine run more processes than
# cores, --bind-to none keeps the replica threads free to spread.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
backend=(--backend host)  # the host unless the arguments choose
for arg in "$@"; do [[ $arg == --backend* ]] && backend=(); done
exec mpirun --oversubscribe --bind-to none -np "$processes" build/release/examples/mnist "${backend[@]}" "$@"
