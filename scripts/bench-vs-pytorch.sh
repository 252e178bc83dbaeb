#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Trains the example network on the CPU with lockstep (bench_train_step: 1 and 2 host replicas,
# batch 64) and with PyTorch (bench/torch_cpu_reference.py, 2 threads), alternating the two three
# times on the same machine, and prints the medians and their ratio `vs_pytorch` (2 replicas over
# PyTorch). PYTHON names the interpreter (default /usr/bin/python3, Debian's python3-torch).
# Not part of CI: it needs PyTorch and a quiet machine. Usage: scripts/bench-vs-pytorch.sh [runs]
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-/usr/bin/python3}
runs=${1:-3}
if ! torch_version=$("$python" -c 'import torch; print(torch.__version__)' 2>/dev/null); then
  echo "bench-vs-pytorch: $python has no PyTorch; install Debian's python3-torch or set PYTHON to an interpreter that has torch" >&2
  exit 1
fi
scripts/install-deps.sh
cmake --preset release >/dev/null
cmake --build --preset release --target bench_train_step >/dev/null
bench=build/release/bench/bench_train_step

ours1=() ours2=() scaling=() ceiling=() theirs=()
for ((i = 1; i <= runs; ++i)); do
  line=$("$bench" --benchmark_filter=Scaling --benchmark_format=console 2>/dev/null | grep BM_TrainStepScaling)
  ours1+=("$(grep -oE 'images_per_s_1=[0-9.]+k?' <<<"$line" | cut -d= -f2)")
  ours2+=("$(grep -oE 'images_per_s_2=[0-9.]+k?' <<<"$line" | cut -d= -f2)")
  scaling+=("$(grep -oE 'scaling=[0-9.]+' <<<"$line" | cut -d= -f2)")
  ceiling+=("$(grep -oE 'vs_gemm_ceiling=[0-9.]+' <<<"$line" | cut -d= -f2)")
  theirs+=("$("$python" bench/torch_cpu_reference.py --threads 2 | grep -oE 'images_per_s=[0-9.]+' | cut -d= -f2)")
  echo "run $i: lockstep 1 replica ${ours1[-1]} img/s, 2 replicas ${ours2[-1]} img/s; PyTorch ${torch_version} (2 threads) ${theirs[-1]} img/s"
done

median() { printf '%s\n' "$@" | sed 's/k$/e3/' | sort -g | awk '{a[NR]=$1} END {printf "%.4g\n", (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2}'; }
m1=$(median "${ours1[@]}") m2=$(median "${ours2[@]}") mt=$(median "${theirs[@]}")
echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'), $(nproc) cores"
echo "median of $runs: lockstep 1 replica ${m1} img/s, 2 replicas ${m2} img/s (scaling $(median "${scaling[@]}"), vs_gemm_ceiling $(median "${ceiling[@]}")); PyTorch ${torch_version} ${mt} img/s"
awk -v a="$m2" -v b="$mt" 'BEGIN {printf "vs_pytorch = %.2f\n", a / b}'
