#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Builds lockstep's main example, the MNIST conv-net trained data-parallel with SyncBatchNorm,
# and runs it (by default on Fashion-MNIST from Debian's dataset-fashion-mnist, 2 host replicas
# when there is no GPU). Installs missing Debian packages first. Arguments go to the example,
# e.g. scripts/run-example.sh --epochs 1 --replicas 2 --save model.safetensors
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
cmake --preset release >/dev/null
cmake --build --preset release --target mnist
exec build/release/examples/mnist "$@"
