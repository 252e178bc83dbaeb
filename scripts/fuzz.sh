#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# lockstep's libFuzzer targets (tests/fuzz): the safetensors reader (Checkpoint::load) and the
# MNIST example's IDX reader, plain and gzipped. Built with clang under ASan + UBSan in build/fuzz.
#
#   scripts/fuzz.sh replay                      build; replay each target's corpus in tests/fuzz/corpus
#                                               and a short fixed-seed run (-seed=1), a few seconds
#                                               each: what CI runs. Non-zero on any crash.
#   scripts/fuzz.sh run [SECONDS] [TARGET...]   build; fuzz with a random seed for SECONDS per target
#                                               (default 600; targets: safetensors idx). New inputs go
#                                               to build/fuzz/corpus/TARGET, crashes to build/fuzz/crashes.
#
# Environment: LOCKSTEP_FUZZ_CXX (default clang++-14), LOCKSTEP_FUZZ_ARGS (more libFuzzer flags for
# `run`, e.g. "-max_len=65536" or "-fork=2"), CMAKE_BUILD_PARALLEL_LEVEL (default 2).
# Nothing is ever written into tests/fuzz/corpus; moving a crash there is a deliberate step.
set -euo pipefail
cd "$(dirname "$0")/.."

build=build/fuzz
cxx=${LOCKSTEP_FUZZ_CXX:-clang++-14}
all_targets=(safetensors idx)
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}

usage() {
  sed -n '/^#   scripts/,/^# Nothing/p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

build_targets() {
  if ! command -v "$cxx" >/dev/null; then
    echo "lockstep: $cxx not found: run scripts/install-deps.sh (clang-14, libclang-rt-14-dev) or set LOCKSTEP_FUZZ_CXX" >&2
    exit 1
  fi
  cmake -S tests/fuzz -B "$build" -DCMAKE_CXX_COMPILER="$cxx" >/dev/null
  cmake --build "$build" --parallel "${CMAKE_BUILD_PARALLEL_LEVEL:-2}"
}

replay() {
  echo "=== lockstep: fuzz targets' build, corpus replay and fixed-seed runs (ASan + UBSan) ==="
  build_targets
  ctest --test-dir "$build" --output-on-failure --label-regex fuzz
}

run() {
  local seconds=${1:-600}
  [[ $seconds =~ ^[1-9][0-9]*$ ]] || { echo "lockstep: SECONDS must be a positive integer, not '$seconds'" >&2; usage; }
  shift || true
  local targets=("$@")
  ((${#targets[@]})) || targets=("${all_targets[@]}")
  local t
  for t in "${targets[@]}"; do
    [[ " ${all_targets[*]} " == *" $t "* ]] || { echo "lockstep: no fuzz target '$t' (targets: ${all_targets[*]})" >&2; exit 2; }
  done
  build_targets
  mkdir -p "$build/crashes"
  local before failed=()
  before=$(ls "$build/crashes")
  # shellcheck disable=SC2206  # LOCKSTEP_FUZZ_ARGS is a list of flags, split on purpose
  local extra=(${LOCKSTEP_FUZZ_ARGS:-})
  for t in "${targets[@]}"; do
    mkdir -p "$build/corpus/$t"
    echo "=== lockstep: fuzzing $t for ${seconds}s (new inputs: $build/corpus/$t) ==="
    # The first directory receives new inputs; the repository's corpus is only read.
    "$build/fuzz_$t" -max_len=4096 -timeout=10 -rss_limit_mb=2048 -max_total_time="$seconds" -print_final_stats=1 \
      -artifact_prefix="$build/crashes/$t-" "${extra[@]}" "$build/corpus/$t" "tests/fuzz/corpus/$t" || failed+=("$t")
  done
  local new
  new=$(comm -13 <(echo "$before") <(ls "$build/crashes") | sed "s|^|  $build/crashes/|")
  if ((${#failed[@]})) || [[ -n $new ]]; then
    cat >&2 <<MSG

lockstep: fuzzing found a problem in: ${failed[*]:-see below}
${new:-  (no crash file was written; see the output above)}
Reproduce one with: $build/fuzz_TARGET FILE  (TARGET is the file name's prefix)
Then move the file into tests/fuzz/corpus/TARGET/ under a name that says what it breaks (so every
replay runs it), and add a regression test in tests/ that feeds the same bytes to the reader.
MSG
    exit 1
  fi
  echo "lockstep: no crash; new corpus entries (not committed) are in $build/corpus"
}

case "${1:-}" in
  replay) shift; (($# == 0)) || usage; replay ;;
  run) shift; run "$@" ;;
  *) usage ;;
esac
