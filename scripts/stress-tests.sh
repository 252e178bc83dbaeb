#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# The tests whose outcome depends on timing (labels runtime, comm, parallel and hostcuda: timeouts,
# stalls, watchdogs, replicas late on purpose) on a busy machine: each round runs them with two
# CPU-bound processes beside them, in the release and ThreadSanitizer builds (configured and
# built first where needed). CI's machine may be loaded like this; a test that passes only on an
# idle machine decides from wall-clock luck instead of events, and fails here.
# Usage: scripts/stress-tests.sh [release|tsan]...   (default: both)
# Environment: LOCKSTEP_STRESS_ROUNDS (default 3), LOCKSTEP_STRESS_HOGS (default 2).
set -euo pipefail
cd "$(dirname "$0")/.."

presets=("$@")
((${#presets[@]})) || presets=(release tsan)
rounds=${LOCKSTEP_STRESS_ROUNDS:-3}
hogs=${LOCKSTEP_STRESS_HOGS:-2}
labels='runtime|comm|parallel|hostcuda'

for preset in "${presets[@]}"; do
  echo "=== stress: ${preset} build ==="
  cmake --preset "${preset}" >/dev/null
  cmake --build --preset "${preset}"
done

pids=()
stop_hogs() {
  ((${#pids[@]})) && kill "${pids[@]}" 2>/dev/null || true
  wait 2>/dev/null || true
}
trap stop_hogs EXIT
for ((h = 0; h < hogs; ++h)); do
  (while :; do :; done) &
  pids+=($!)
done
echo "=== stress: ${hogs} CPU-bound processes beside the tests; load $(cut -d' ' -f1-3 /proc/loadavg) ==="

failed=0
for ((round = 1; round <= rounds; ++round)); do
  for preset in "${presets[@]}"; do
    echo "=== stress: round ${round}/${rounds}, ${preset}, labels ${labels}; load $(cut -d' ' -f1-3 /proc/loadavg) ==="
    if ! ctest --preset "${preset}" -L "${labels}"; then
      echo "=== stress: round ${round}, ${preset}: FAILED ==="
      failed=1
    fi
  done
done
((failed == 0)) && echo "=== stress: every round passed ==="
exit "${failed}"
