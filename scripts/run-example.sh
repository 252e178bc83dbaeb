#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Builds lockstep's main example and runs it. Installs missing Debian packages first.
# Arguments are passed to the example.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
cmake --preset release >/dev/null
cmake --build --preset release --target hello_replicas
exec build/release/examples/hello_replicas "$@"
