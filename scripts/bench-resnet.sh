#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# The residual example's training step on the CPU with lockstep (bench_train_step's
# BM_ResnetSteps: 2 host replicas, batch 128, AdamW) against the same network in PyTorch 2.x
# (bench/torch_resnet_reference.py, 2 threads), alternating the two `runs` times in one session,
# and prints the median ratio `vs_pytorch` (issue #45's goal: at least 1.3). PyTorch is the
# project's wheel (scripts/install-torch.sh). Not part of CI: it needs a quiet machine.
# Usage: scripts/bench-resnet.sh [runs]
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-3}
scripts/install-deps.sh
if [[ -z ${BENCH:-} ]]; then  # BENCH: an already built bench_train_step
  cmake --preset release >/dev/null
  cmake --build --preset release --target bench_train_step >/dev/null
fi
bench=${BENCH:-build/release/bench/bench_train_step}
prefix=$(scripts/install-torch.sh --print-prefix)
median() { printf '%s\n' "$@" | sed 's/k$/e3/' | sort -g | awk '{a[NR]=$1} END {printf "%.4g\n", (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2}'; }
ours=() theirs=() ratio=()
for ((i = 1; i <= runs; ++i)); do
  line=$("$bench" --benchmark_filter=BM_ResnetSteps --benchmark_format=console 2>/dev/null | grep BM_ResnetSteps)
  ours+=("$(grep -oE 'resnet_images_per_s_2=[0-9.]+k?' <<<"$line" | cut -d= -f2 | sed 's/k$/e3/')")
  theirs+=("$(PYTHONPATH=$prefix python3 bench/torch_resnet_reference.py --threads 2 | grep -oE 'images_per_s=[0-9.]+' | cut -d= -f2)")
  ratio+=("$(awk -v a="${ours[-1]}" -v b="${theirs[-1]}" 'BEGIN {print a / b}')")
  echo "run $i: lockstep 2 replicas ${ours[-1]} img/s, PyTorch (2 threads) ${theirs[-1]} img/s"
done
echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'), $(nproc) cores"
echo "median of $runs: lockstep $(median "${ours[@]}") img/s, PyTorch $(median "${theirs[@]}") img/s, vs_pytorch = $(median "${ratio[@]}")"
