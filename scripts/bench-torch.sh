#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# lockstep::torch against libtorch and PyTorch on this CPU: alternates bench_torch_train_step
# (single module, lockstep with 1 and 2 replicas, per-call replication) and PyTorch DDP in Python
# (bench/torch_ddp_reference.py, gloo, 2 processes) three times at batches 64 and 256, and prints
# the medians of the ratios: vs_clone_each (goal >= 1.5), vs_ddp (goal >= 1.0), overhead over one
# libtorch module at batch 256 (goal < 0.10), and vs_unsynced: lockstep's 2 replicas against 2
# modules on 2 threads that exchange nothing, the ceiling of any in-process data parallelism.
# Not part of CI: it needs a quiet machine.
# Usage: scripts/bench-torch.sh [runs]
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-3}
scripts/install-deps.sh
if [[ -z ${BENCH:-} ]]; then  # BENCH: an already built bench_torch_train_step
  cmake --preset release >/dev/null
  cmake --build --preset release --target bench_torch_train_step >/dev/null
fi
bench=${BENCH:-build/release/bench/bench_torch_train_step}
prefix=$(scripts/install-torch.sh --print-prefix)
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {printf "%.3g\n", (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2}'; }
counter() { grep -oE "$1=-?[0-9.]+[kmu]?" <<<"$2" | head -1 | cut -d= -f2 | sed 's/k$/e3/; s/m$/e-3/; s/u$/e-6/'; }
for batch in 64 256; do
  clone=() ddp=() overhead=() single=() unsynced=()
  for ((i = 1; i <= runs; ++i)); do
    line=$("$bench" --benchmark_filter="BM_TorchSteps/$batch/" --benchmark_format=console 2>/dev/null | grep BM_TorchSteps)
    ours=$(counter images_per_s_lockstep2 "$line")
    theirs=$(PYTHONPATH=$prefix python3 bench/torch_ddp_reference.py --batch "$batch" 2>/dev/null | grep -oE 'images_per_s=[0-9.]+' | cut -d= -f2)
    clone+=("$(counter vs_clone_each "$line")")
    single+=("$(counter vs_single "$line")")
    unsynced+=("$(counter vs_unsynced "$line")")
    overhead+=("$(counter overhead "$line")")
    ddp+=("$(awk -v a="$ours" -v b="$theirs" 'BEGIN {print a / b}')")
    echo "batch $batch run $i: lockstep 2 replicas ${ours} img/s, PyTorch DDP ${theirs} img/s; $line"
  done
  echo "batch $batch, median of $runs: vs_clone_each $(median "${clone[@]}"), vs_ddp $(median "${ddp[@]}"), vs_single $(median "${single[@]}"), vs_unsynced $(median "${unsynced[@]}"), overhead (1 replica vs one module) $(median "${overhead[@]}")"
done
echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'), $(nproc) cores"
