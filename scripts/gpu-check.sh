#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# The one command for a GPU machine. Two halves:
#
#   scripts/gpu-check.sh --prepare   on the development machine (Debian 12): gathers into
#                                    .gpu-check/ (ignored by git, at most 48 MiB) what a bare GPU
#                                    machine lacks: the Debian packages the build needs, as .deb
#                                    files, and the Fashion-MNIST files.
#   scripts/gpu-check.sh             on the GPU machine (CUDA toolkit, cmake, python3 with PyTorch's
#                                    wheels; no Debian dev packages, no network): unpacks the .debs
#                                    into a local prefix, builds Release with -lineinfo for the
#                                    GPU's architecture, then, cheap and decisive steps first:
#     1. the GPU tests: test_gpu_core, test_gpu_bn_math, test_gpu_layers, test_gpu_data_parallel
#        (each ends with "N passed, M failed"; the row quotes it);
#     2. the example, 200 steps in file order (--no-shuffle --seed 7, batch 64) at 1 and 4 replicas
#        on cuda:0 and at 8 host replicas (started in the background right after the build): the
#        first 10 losses of 1 vs 4 replicas agree to 1e-4, and each CUDA run's test accuracy is
#        within 0.005 of the host's (--test-limit 2000 where the example has that flag);
#    2b. lockstep::torch's CUDA replicas (tests/torch/torch_cuda_check.cpp), built against python3's
#        PyTorch (its libtorch and TorchConfig.cmake): SyncBatchNorm on the GPU against the CPU, 3
#        steps of CUDA replicas against the plain module on the CPU, a failing replica;
#     3. PyTorch parity: PyTorch writes an initial checkpoint, the example trains 3 steps from it
#        (--init; cuda 1 and 4 replicas, host 4 replicas) and PyTorch the same 3 steps on the same
#        GPU in strict FP32 (bench/torch_cuda_parity.py): worst relative parameter error <= 1e-3;
#     4. training speed: the example at batch 64, 256 and 1024 on cuda:0 against PyTorch's training
#        of the same network (bench/torch_cuda_train.py: defaults, strict FP32 and bf16 autocast, vs_torch), and
#        the example with --graphs (captured steps) at batch 64 against the same PyTorch figures,
#        the example with --precision bf16 at batch 256 against PyTorch's bf16 autocast and for 2
#        epochs (2 replicas on cuda:0, gradients all-reduced in bf16 too) to the example's accuracy
#        (>= 0.90),
#        bench_cuda_train_step (1, 2 and 4 replicas sharing cuda:0), bench_cuda_conv (the
#        example's convolutions through cuDNN against im2col + cuBLAS: vs_im2col; bf16 products
#        against fp32: vs_fp32), and
#        bench_cuda_graph (a captured step by hand and through DataParallel, vs_eager);
#     5. bench_cuda_batch_norm against cuDNN and PyTorch's BatchNorm2d
#        (bench/torch_cuda_batch_norm.py: vs_torch), and bench_cuda_allreduce;
#     6. the kernels' static gate for the GPU's own architecture (spills, local memory, vector
#        loads and stores in the PTX: figures nvcc gives without a GPU, for the table);
#     7. last, compute-sanitizer memcheck, racecheck, synccheck and initcheck on the four tests
#        (API errors made on purpose, by NCCL's probing or a test, are not reported:
#        --report-api-errors no), GPU_CHECK_SANITIZER_JOBS (default 8) at a time, while the
#        budget lasts.
#   It prints one table last. Every step has a row: one the budget could not fit says
#   "not run (budget)", one that needs PyTorch where python3 has none "not run (no torch)".
#
# Outputs, in $OUT when it is set (else in build/gpu-check): gpu-check-summary.tsv (step, result,
# detail; a header row; rewritten after every row, so a run cut short keeps what it did),
# gpu-check-summary.md (the same as a Markdown table, for README) and gpu-check-logs.tar.gz (every
# log; refreshed after every step and at exit). Logs also stay in build/gpu-check/logs.
#
# NCCL and cuDNN come from python3's nvidia-nccl-cu13 and nvidia-cudnn-cu13 wheels (PyTorch's).
# GPU_CHECK_BUDGET (seconds, default 480) bounds the whole run, the build included: a step starts
# only if what it needs is left, and every timeout is capped by what is left.
set -uo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
carry="$root/.gpu-check"
debs=(libopenblas0-pthread libopenblas-pthread-dev libgfortran5 catch2 libcli11-dev nlohmann-json3-dev zlib1g-dev
      libbenchmark-dev libbenchmark1debian)
data_dir=/usr/share/datasets/fashion-mnist
limit_bytes=$((48 << 20))

die() { echo "gpu-check: $*" >&2; exit 2; }

if [[ ${1:-} == --prepare ]]; then
  [[ -d $data_dir ]] || die "no $data_dir: run scripts/install-deps.sh first (it installs dataset-fashion-mnist)"
  rm -rf "$carry"
  mkdir -p "$carry/debs" "$carry/data"
  if ! (cd "$carry/debs" && apt-get download -qq "${debs[@]}" 2>/dev/null); then
    # The package lists may be missing on a fresh machine.
    sudo_cmd=(); ((EUID == 0)) || sudo_cmd=(sudo)
    "${sudo_cmd[@]}" apt-get update -qq || die "apt-get update failed"
    (cd "$carry/debs" && apt-get download -qq "${debs[@]}") || die "apt-get download ${debs[*]} failed"
  fi
  cp "$data_dir"/*-ubyte* "$carry/data/" || die "copying the Fashion-MNIST files failed"
  bytes=$(du -sb "$carry" | cut -f1)
  ((bytes <= limit_bytes)) || die ".gpu-check holds $((bytes >> 20)) MiB, more than the 48 MiB a GPU machine's copy allows"
  echo "gpu-check: prepared $((bytes >> 20)) MiB in .gpu-check ($(ls "$carry/debs" | wc -l) packages, Fashion-MNIST);"
  echo "gpu-check: send the working tree with .gpu-check to the GPU machine and run scripts/gpu-check.sh there"
  exit 0
fi
[[ $# -eq 0 ]] || die "usage: scripts/gpu-check.sh [--prepare]"
[[ -d $carry/debs ]] || die "no .gpu-check/debs: run scripts/gpu-check.sh --prepare on the development machine first"

SECONDS=0
budget=${GPU_CHECK_BUDGET:-480}
[[ $budget =~ ^[0-9]+$ ]] || die "GPU_CHECK_BUDGET must be a number of seconds, got '$budget'"
san_jobs=${GPU_CHECK_SANITIZER_JOBS:-8}
[[ $san_jobs =~ ^[1-9][0-9]*$ ]] || die "GPU_CHECK_SANITIZER_JOBS must be a positive number, got '$san_jobs'"
reserve=6  # seconds kept for the table and the archive at the end
build="$root/build/gpu-check"
logs="$build/logs"
work="$build/work"  # checkpoints and other large files that stay out of the archive
prefix="$build/prefix"  # the unpacked .debs (not in .gpu-check, which must stay small to travel)
dest="$build"
[[ -n ${OUT:-} && -d ${OUT:-} ]] && dest=$OUT
rm -rf "$logs" "$work"
mkdir -p "$logs" "$work"
summary="$logs/gpu-check-summary.tsv"
printf 'step\tresult\tdetail\n' >"$summary"
summarize() { python3 "$root/scripts/gpu-check-summarize.py" "$@"; }
# Kernels load when CUDA starts, not at first launch (a lazy load can wait on a spinning NCCL kernel).
export CUDA_MODULE_LOADING=EAGER

# ---- rows, time, outputs ---------------------------------------------------------------------------
declare -A emitted=()
clean() {  # one line, single spaces, at most 400 characters
  local s=${1//[$'\t\r\n']/ }
  while [[ $s == *'  '* ]]; do s=${s//  / }; done
  s=${s# }
  s=${s% }
  printf '%s' "${s:0:400}"
}
publish() {  # the summary, and the same as a Markdown table, into $dest
  cp "$summary" "$build/.summary.tmp" && mv -f "$build/.summary.tmp" "$dest/gpu-check-summary.tsv"
  { printf '| step | result | detail |\n|---|---|---|\n'
    sed -e 1d -e 's/\\/\\\\/g' -e 's/|/\\|/g' -e 's/\t/ | /g' -e 's/^/| /' -e 's/$/ |/' "$summary"
  } >"$build/.summary.md.tmp" && mv -f "$build/.summary.md.tmp" "$dest/gpu-check-summary.md"
}
row() {
  local n r d
  n=$(clean "$1"); r=$(clean "$2"); d=$(clean "${3:-}")
  printf '%s\t%s\t%s\n' "$n" "$r" "$d" >>"$summary"
  emitted["$n"]=1
  printf 'gpu-check [%3d s] %s: %s%s\n' "$SECONDS" "$n" "$r" "${d:+ - $d}"
  publish
}
# judge ARGS...: the rows gpu-check-summarize.py ARGS prints ("step<TAB>result<TAB>detail"), read
# in this shell (not a pipeline's subshell), so that `emitted` remembers them.
judge() {
  local a b c
  while IFS=$'\t' read -r a b c; do [[ -n $a ]] && row "$a" "$b" "$c"; done < <(summarize "$@")
}
pack() {  # every log in one archive; logs over 1 MiB lose their middle if the archive would pass 15 MiB
  local tmp="$build/.logs.tar.gz" f
  tar -czf "$tmp" -C "$build" logs 2>/dev/null || return 0
  if (($(stat -c %s "$tmp") > (15 << 20))); then
    while IFS= read -r f; do
      { head -c 524288 "$f"; printf '\n[... cut by gpu-check.sh to fit the archive ...]\n'; tail -c 524288 "$f"; } >"$f.cut" &&
        mv -f "$f.cut" "$f"
    done < <(find "$logs" -type f -size +1M)
    tar -czf "$tmp" -C "$build" logs 2>/dev/null || return 0
  fi
  mv -f "$tmp" "$dest/gpu-check-logs.tar.gz"
}
left() { echo $((budget - reserve - SECONDS)); }
# limit CAP: sets `lim`, the seconds a command may run (its cap, or what is left of the budget if
# less), and `cut` (1 when the budget set it: a time-out then means "not run (budget)").
limit() {
  local l=$((budget - reserve - SECONDS))
  ((l < 1)) && l=1
  if ((l < $1)); then lim=$l; cut=1; else lim=$1; cut=0; fi
}
# capped CAP LOG CMD...: runs CMD under `limit CAP` with its output in LOG; sets `rc`. Waits in
# the background, so a signal to this script stops it at once.
bg_pids=()
capped() {
  limit "$1"
  local log=$2
  shift 2
  timeout -k 5 "$lim" "$@" >"$log" 2>&1 &
  local p=$!
  bg_pids+=("$p")
  wait "$p"
  rc=$?
}
# capped_py CAP OUT LOG SCRIPT ARGS...: a python3 script as `capped` runs a command, its standard
# output (JSON lines) in OUT and its messages in LOG; without CUDA_MODULE_LOADING=EAGER, with which
# PyTorch would load every kernel of libtorch as it starts.
capped_py() {
  limit "$1"
  local o=$2 e=$3
  shift 3
  timeout -k 5 "$lim" env -u CUDA_MODULE_LOADING PYTHONUNBUFFERED=1 python3 "$@" >"$o" 2>"$e" &
  local p=$!
  bg_pids+=("$p")
  wait "$p"
  rc=$?
}

# ---- the plan ---------------------------------------------------------------------------------------
gpu_tests=(test_gpu_core test_gpu_bn_math test_gpu_layers test_gpu_data_parallel)
sanitizer_tools=(memcheck racecheck synccheck initcheck)
declare -A sanitizer_cap=([memcheck]=150 [racecheck]=150 [synccheck]=120 [initcheck]=120)
sanitizer_rows=()
for tool in "${sanitizer_tools[@]}"; do for t in "${gpu_tests[@]}"; do sanitizer_rows+=("$tool $t"); done; done
# name | seconds it needs to be worth starting | function | the rows it reports when skipped (;)
plan=()
for t in "${gpu_tests[@]}"; do plan+=("$t|10|step_test|$t"); done
plan+=("example|25|step_example|example 10 steps, 1 vs 4 replicas;example accuracy vs host")
plan+=("torch|150|step_torch|lockstep::torch CUDA replicas")
plan+=("parity|30|step_parity|PyTorch parity, 3 steps")
plan+=("train|45|step_train|training img/s, batch 64;training img/s, batch 256;training img/s, batch 1024;training img/s, batch 64, graphs")
plan+=("bf16|60|step_bf16|training img/s, batch 256, bf16;bf16 accuracy, 2 epochs")
plan+=("train_step|15|step_train_step|bench_cuda_train_step")
plan+=("conv|15|step_conv|conv cuDNN vs im2col;conv bf16 vs fp32;conv bf16 cuDNN vs bf16 im2col")
plan+=("graph|15|step_graph|graph step vs eager;DataParallel graphs vs eager")
plan+=("syncbn|30|step_syncbn|SyncBN benchmark")
plan+=("allreduce|15|step_allreduce|rendezvous_overhead;NCCL blocking vs non-blocking")
plan+=("kernels|30|step_kernels|kernel spills and vector accesses")
plan+=("sanitizers|20|step_sanitizers|$(IFS=';'; echo "${sanitizer_rows[*]}")")
declare -A step_done=()
current=""
blocked=""
blocked_why=""

skip_rows() {  # RESULT DETAIL "row;row;...": a row for each not reported yet
  local r
  local -a names
  IFS=';' read -r -a names <<<"$3"
  for r in "${names[@]}"; do [[ -n ${emitted[$r]:-} ]] || row "$r" "$1" "$2"; done
}

finish() {
  local code=$?
  trap - EXIT
  local p entry name need fn names verdict
  for p in "${bg_pids[@]}"; do kill -TERM "$p" 2>/dev/null; done
  for entry in "${plan[@]}"; do
    IFS='|' read -r name need fn names <<<"$entry"
    [[ -n ${step_done[$name]:-} ]] && continue
    if [[ $entry == "$current" ]]; then skip_rows "not run (cut)" "the run was stopped while this step ran, at $SECONDS s" "$names"
    else skip_rows "not run (cut)" "the run was stopped (at $SECONDS s) before this step" "$names"; fi
  done
  verdict=$(summarize verdict "$summary" 2>/dev/null || echo FAIL)
  row total "$verdict" "$SECONDS s of the $budget s budget; logs in gpu-check-logs.tar.gz"
  summarize table "$summary"
  pack
  [[ $verdict == FAIL ]] && exit 1
  ((code > 1)) && exit "$code"
  exit 0
}
trap finish EXIT
trap 'exit 143' TERM INT HUP

# ---- the machine ----------------------------------------------------------------------------------
arch=90
if ! command -v nvidia-smi >/dev/null; then
  row machine FAIL "no nvidia-smi: not a GPU machine"
  blocked="no GPU"; blocked_why="no nvidia-smi on this machine"
else
  gpu=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1)
  gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
  arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '. ')
  [[ $arch =~ ^[0-9]+$ ]] || arch=90
  nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
  cuda_version=$("$nvcc" --version 2>/dev/null | grep -oE 'release [0-9.]+' | head -1)
  row machine ok "$gpus x $gpu, sm_$arch, CUDA ${cuda_version#release }, $(nproc) cores, $(date -u +%Y-%m-%d)"
fi

# ---- the packages, unpacked into a local prefix; PyTorch ----------------------------------------------
if [[ -z $blocked ]]; then
  # PyTorch and the data while the packages unpack and the build runs.
  (timeout 120 env -u CUDA_MODULE_LOADING python3 -c 'import sys, torch
print(torch.__version__, "CUDA", torch.version.cuda, "cuDNN", torch.backends.cudnn.version(), "GPU", torch.cuda.is_available())
sys.exit(0 if torch.cuda.is_available() else 3)' >"$logs/torch-check.log" 2>&1
   echo $? >"$work/torch-check.rc") &
  torch_check=$!
  bg_pids+=("$torch_check")
  data="$build/data"
  (rm -rf "$data" && mkdir -p "$data" &&
   for f in "$carry"/data/*-ubyte*; do
     b=$(basename "$f" .gz)
     if [[ $f == *.gz ]]; then gzip -dc "$f" >"$data/$b"; else cp "$f" "$data/$b"; fi || exit 1
   done) >"$logs/data.log" 2>&1 &
  data_job=$!
  rm -rf "$prefix" && mkdir -p "$prefix"
  for deb in "$carry"/debs/*.deb; do
    if command -v dpkg-deb >/dev/null; then
      dpkg-deb -x "$deb" "$prefix"
    else  # a .deb is an ar archive holding data.tar.xz
      python3 - "$deb" "$prefix" <<'EOF'
import io, sys, tarfile
blob = open(sys.argv[1], "rb").read()
assert blob[:8] == b"!<arch>\n", sys.argv[1] + ": not a .deb"
at = 8
while at < len(blob):
    name, size = blob[at:at + 16].decode().strip(), int(blob[at + 48:at + 58].decode().strip())
    at += 60
    if name.startswith("data.tar"):
        tarfile.open(fileobj=io.BytesIO(blob[at:at + size])).extractall(sys.argv[2])
    at += size + (size & 1)
EOF
    fi || { row packages FAIL "cannot unpack $(basename "$deb")"; blocked="packages"; blocked_why="a .deb did not unpack"; break; }
  done
fi
if [[ -z $blocked ]]; then
  lib="$prefix/usr/lib/x86_64-linux-gnu"
  blas_dir="$lib/openblas-pthread"
  ln -sf libopenblas.so.0 "$blas_dir/libopenblas.so"
  nvidia=$(python3 -c 'import nvidia, sys; print(list(nvidia.__path__)[0])' 2>/dev/null || true)
  nccl_lib=$(ls "$nvidia"/nccl/lib/libnccl.so* 2>/dev/null | head -1)
  cudnn_lib=$(ls "$nvidia"/cudnn/lib/libcudnn.so* 2>/dev/null | head -1)
  zlib=$(ldconfig -p 2>/dev/null | awk '/libz\.so\.1 .*x86-64/ {print $NF; exit}')
  [[ -n $zlib ]] || zlib=$(ls /lib/x86_64-linux-gnu/libz.so.1 /usr/lib/x86_64-linux-gnu/libz.so.1 2>/dev/null | head -1)
  export LD_LIBRARY_PATH="$blas_dir:$lib:${nccl_lib%/*}:${cudnn_lib%/*}:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
  row packages ok "$(ls "$carry"/debs/*.deb | wc -l) .debs; NCCL ${nccl_lib:-not found}; cuDNN ${cudnn_lib:-not found}"
fi

# ---- build ------------------------------------------------------------------------------------------
if [[ -z $blocked ]]; then
  cuda_flags=(); [[ -n $cudnn_lib ]] && cuda_flags=(-DLOCKSTEP_CUDNN_INCLUDE_DIR="$nvidia/cudnn/include" -DLOCKSTEP_CUDNN_LIBRARY="$cudnn_lib")
  nccl_flags=(); [[ -n $nccl_lib ]] && nccl_flags=(-DNCCL_INCLUDE_DIR="$nvidia/nccl/include" -DNCCL_LIBRARY="$nccl_lib")
  generator=(); command -v ninja >/dev/null && generator=(-G Ninja)
  targets=(test_gpu_core test_gpu_bn_math test_gpu_layers test_gpu_data_parallel mnist bench_cuda_batch_norm
           bench_cuda_train_step bench_cuda_allreduce bench_cuda_conv bench_cuda_graph)
  blas_inc="$prefix/usr/include/x86_64-linux-gnu/openblas-pthread"
  # Where the unpacked packages are, for this build and step 2b's (which puts PyTorch's CMake
  # folder before these).
  package_prefixes="$prefix/usr;$lib/cmake"
  package_flags=(-DCMAKE_LIBRARY_PATH="$blas_dir;$lib" -DCMAKE_CXX_FLAGS="-isystem $blas_inc"
                 -DZLIB_INCLUDE_DIR="$prefix/usr/include" -DZLIB_LIBRARY="$zlib")
  # -lineinfo: compute-sanitizer and the profilers name the file and line of a kernel's fault.
  capped 60 "$logs/configure.log" cmake -S "$root" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_CUDA_ARCHITECTURES="$arch" -DCMAKE_CUDA_COMPILER="$nvcc" -DLOCKSTEP_CUDA=ON -DLOCKSTEP_DNNL=OFF \
    -DLOCKSTEP_MPI=OFF -DCMAKE_PREFIX_PATH="$package_prefixes" "${package_flags[@]}" \
    -DCMAKE_CUDA_FLAGS="-isystem $blas_inc -lineinfo" "${nccl_flags[@]}" "${cuda_flags[@]}"
  if ((rc != 0)); then
    row build FAIL "configure failed (exit $rc): $(tail -3 "$logs/configure.log")"
    blocked="build failed"; blocked_why="see the build row"
  else
    capped 300 "$logs/build.log" cmake --build "$build" -j "$(nproc)" --target "${targets[@]}"
    if ((rc != 0)); then
      blocked="build failed"; blocked_why="see the build row"
      if ((rc == 124 || rc == 137)) && ((cut)); then
        row build "not run (budget)" "stopped after $lim s: the budget ran out"; blocked="budget"
      elif ((rc == 124 || rc == 137)); then row build FAIL "stopped after its $lim s cap"
      else row build FAIL "exit $rc: $(grep -m2 -E 'error' "$logs/build.log" || tail -2 "$logs/build.log")"; fi
    else
      row build ok "Release, -lineinfo, sm_$arch, done at $SECONDS s"
    fi
  fi
fi

mnist="$build/examples/mnist"
bench="$build/bench"
have_torch=0
torch_why="python3 has no PyTorch that sees the GPU"
if [[ -z $blocked ]]; then
  wait "$data_job" || data="$carry/data"  # the example reads gzipped files too
  wait "$torch_check"
  if [[ $(cat "$work/torch-check.rc" 2>/dev/null) == 0 ]]; then
    have_torch=1
    row PyTorch ok "$(tail -1 "$logs/torch-check.log")"
  else
    torch_why="python3 -c 'import torch' with a GPU failed: $(tail -1 "$logs/torch-check.log" 2>/dev/null)"
    row PyTorch "not run (no torch)" "$torch_why"
  fi
  # The example's flags: --test-limit shortens every evaluation (else the whole test set).
  if "$mnist" --help 2>/dev/null | grep -q -- '--test-limit'; then
    eval_acc=(--test-limit 2000); eval_small=(--test-limit 1000); acc_note="the first 2000 test images"
  else
    eval_acc=(--train-limit 12800); eval_small=(); acc_note="the whole test set (the example has no --test-limit)"
  fi
  # Step 2's host run (the slowest part of it) trains in the background from now on.
  ex_args=(--data "$data" --seed 7 --no-shuffle --batch 64 --steps 200 --quiet --math strict_fp32 "${eval_acc[@]}")
  limit 200
  host_cut=$cut
  nice -n 5 timeout -k 5 "$lim" "$mnist" "${ex_args[@]}" --backend host --replicas 8 \
    --metrics "$logs/example-host8.jsonl" >"$logs/example-host8.log" 2>&1 &
  host_job=$!
  bg_pids+=("$host_job")
fi

# ---- 1. the GPU tests ----------------------------------------------------------------------------------
step_test() {
  capped 90 "$logs/$1.log" "$build/tests/$1"
  judge test "$1" "$logs/$1.log" "$rc" "$lim" "$cut"
}

# ---- 2. the example: 1 vs 4 replicas, accuracy against the host ------------------------------------------
step_example() {
  local rc1 rc4 rch
  capped 60 "$logs/example-cuda1.log" "$mnist" "${ex_args[@]}" --backend cuda --devices 0 --metrics "$logs/example-cuda1.jsonl"
  rc1=$rc
  capped 60 "$logs/example-cuda4.log" "$mnist" "${ex_args[@]}" --backend cuda --devices 0,0,0,0 \
    --metrics "$logs/example-cuda4.jsonl"
  rc4=$rc
  wait "$host_job"
  rch=$?
  judge example --steps 10 --train-steps 200 --tol-loss 1e-4 --tol-acc 0.005 --cut "$host_cut" \
    --note "$acc_note; the host run has 8 replicas" \
    --run ref "cuda, 1 replica" "$logs/example-cuda1.jsonl" "$logs/example-cuda1.log" "$rc1" \
    --run judge "cuda, 4 replicas" "$logs/example-cuda4.jsonl" "$logs/example-cuda4.log" "$rc4" \
    --run host "host, 8 replicas" "$logs/example-host8.jsonl" "$logs/example-host8.log" "$rch"
}

# ---- 2b. lockstep::torch's CUDA replicas, built against python3's PyTorch ----------------------------------
step_torch() {
  local r="lockstep::torch CUDA replicas" tb="$build/torch" tcmake checks
  if ((!have_torch)); then row "$r" "not run (no torch)" "$torch_why"; return; fi
  tcmake=$(env -u CUDA_MODULE_LOADING python3 -c 'import torch.utils; print(torch.utils.cmake_prefix_path)' \
    2>"$logs/torch-cuda-prefix.log")
  if [[ -z $tcmake || ! -d $tcmake ]]; then
    row "$r" FAIL "python3's torch names no CMake folder (torch.utils.cmake_prefix_path): $(tail -1 "$logs/torch-cuda-prefix.log")"
    return
  fi
  # budget_cut RC WHAT: a row saying the budget stopped WHAT, when it did (the last `capped` was cut).
  budget_cut() {
    ((($1 == 124 || $1 == 137) && cut)) || return 1
    row "$r" "not run (budget)" "the budget ran out during the $2"
    return 0
  }
  capped 90 "$logs/torch-cuda-configure.log" cmake -S "$root" -B "$tb" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DLOCKSTEP_TORCH=ON -DLOCKSTEP_CUDA=OFF -DLOCKSTEP_DNNL=OFF -DLOCKSTEP_MPI=OFF -DLOCKSTEP_TEST_LABELS=torch \
    -DLOCKSTEP_BUILD_EXAMPLES=OFF -DLOCKSTEP_BUILD_BENCH=OFF -DCMAKE_CUDA_COMPILER="$nvcc" \
    -DCMAKE_PREFIX_PATH="$tcmake;$package_prefixes" "${package_flags[@]}"
  if ((rc != 0)); then
    budget_cut "$rc" configuration && return
    row "$r" FAIL "configure against PyTorch's libtorch ($tcmake) failed, exit $rc: $(grep -m1 -A2 'Error' "$logs/torch-cuda-configure.log" || tail -2 "$logs/torch-cuda-configure.log")"
    return
  fi
  capped 240 "$logs/torch-cuda-build.log" cmake --build "$tb" -j "$(nproc)" --target torch_cuda_check
  if ((rc != 0)); then
    budget_cut "$rc" build && return
    row "$r" FAIL "build exit $rc: $(grep -m2 -E 'error' "$logs/torch-cuda-build.log" || tail -2 "$logs/torch-cuda-build.log")"
    return
  fi
  capped 120 "$logs/torch-cuda-check.log" env -u CUDA_MODULE_LOADING "$tb/tests/torch_cuda_check"
  checks=$(grep -c '^ok:' "$logs/torch-cuda-check.log")
  case $rc in
    0) local buckets="host buckets only (configured without NCCL)"
       if grep -q 'through nccl (2 CUDA replicas' "$logs/torch-cuda-check.log"; then buckets="NCCL (2 GPUs) and host buckets"
       elif grep -q 'through nccl' "$logs/torch-cuda-check.log"; then
         buckets="host buckets, and NCCL's stream-ordered path on one GPU, which makes no NCCL call"
       fi
       row "$r" ok "$checks checks hold, $buckets: $(tail -1 "$logs/torch-cuda-check.log")" ;;
    77) row "$r" FAIL "the check's libtorch saw no GPU" ;;
    *) budget_cut "$rc" "check ($checks checks held)" ||
         row "$r" FAIL "exit $rc, $checks checks held: $(grep -m3 'FAIL' "$logs/torch-cuda-check.log" || tail -2 "$logs/torch-cuda-check.log")" ;;
  esac
}

# ---- 3. PyTorch parity ------------------------------------------------------------------------------------
step_parity() {
  if ((!have_torch)); then row "PyTorch parity, 3 steps" "not run (no torch)" "$torch_why"; return; fi
  local init="$work/parity-init.safetensors" rc1 rc4 rch host
  capped_py 60 "$logs/parity-init.log" "$logs/parity-init.err" "$root/bench/torch_cuda_parity.py" init --out "$init" --seed 7
  if ((rc != 0)); then row "PyTorch parity, 3 steps" FAIL "torch_cuda_parity.py init exit $rc: $(tail -1 "$logs/parity-init.err")"; return; fi
  local args=(--data "$data" --init "$init" --no-shuffle --seed 7 --batch 64 --lr 0.01 --momentum 0.9 --steps 3 --quiet --math strict_fp32
              "${eval_small[@]}")
  limit 60
  timeout -k 5 "$lim" "$mnist" "${args[@]}" --backend host --replicas 4 --save "$work/parity-host4.safetensors" \
    --metrics "$logs/parity-host4.jsonl" >"$logs/parity-host4.log" 2>&1 &
  host=$!
  bg_pids+=("$host")
  capped 60 "$logs/parity-cuda1.log" "$mnist" "${args[@]}" --backend cuda --devices 0 \
    --save "$work/parity-cuda1.safetensors" --metrics "$logs/parity-cuda1.jsonl"
  rc1=$rc
  capped 60 "$logs/parity-cuda4.log" "$mnist" "${args[@]}" --backend cuda --devices 0,0,0,0 \
    --save "$work/parity-cuda4.safetensors" --metrics "$logs/parity-cuda4.jsonl"
  rc4=$rc
  wait "$host"
  rch=$?
  capped_py 90 "$logs/parity.jsonl" "$logs/parity.log" "$root/bench/torch_cuda_parity.py" compare --data "$data" --init "$init" --batch 64 --steps 3 \
    --fp64 --run "cuda, 1 replica" "$work/parity-cuda1.safetensors" "$logs/parity-cuda1.jsonl" \
    --run "cuda, 4 replicas" "$work/parity-cuda4.safetensors" "$logs/parity-cuda4.jsonl" \
    --run "host, 4 replicas" "$work/parity-host4.safetensors" "$logs/parity-host4.jsonl"
  judge parity "$logs/parity.jsonl" "$logs/parity.log" "$rc" --steps 3 --cut "$cut" --limit "$lim" \
    --example "cuda, 1 replica" "$logs/parity-cuda1.log" "$rc1" \
    --example "cuda, 4 replicas" "$logs/parity-cuda4.log" "$rc4" \
    --example "host, 4 replicas" "$logs/parity-host4.log" "$rch"
}

# ---- 4. training speed against PyTorch --------------------------------------------------------------------
step_train() {
  local b steps spec=() torch_args=()
  declare -A steps_at=([64]=120 [256]=60 [1024]=30)
  for b in 64 256 1024; do
    steps=${steps_at[$b]}
    capped 45 "$logs/train-b$b.log" "$mnist" --data "$data" --seed 7 --no-shuffle --batch "$b" --steps "$steps" --quiet \
      "${eval_small[@]}" --backend cuda --devices 0 --math pytorch_default --metrics "$logs/train-b$b.jsonl"
    spec+=(--lockstep "$b" "$logs/train-b$b.jsonl" "$logs/train-b$b.log" "$rc")
    torch_args+=(--lockstep "$b=$logs/train-b$b.jsonl")
  done
  # Captured steps (--graphs) at batch 64, where launches bound PyTorch: goal >= 3x its images/s.
  capped 45 "$logs/train-graphs-b64.log" "$mnist" --data "$data" --seed 7 --no-shuffle --batch 64 --steps 120 --quiet \
    "${eval_small[@]}" --backend cuda --devices 0 --math pytorch_default --graphs --metrics "$logs/train-graphs-b64.jsonl"
  spec+=(--graphs 64 "$logs/train-graphs-b64.jsonl" "$logs/train-graphs-b64.log" "$rc")
  if ((have_torch)); then
    capped_py 120 "$logs/torch_train.jsonl" "$logs/torch_train.log" "$root/bench/torch_cuda_train.py" --batches 64,256,1024 --modes default,strict,bf16 \
      --min-time 0.5 "${torch_args[@]}"
    judge train --torch "$logs/torch_train.jsonl" "$logs/torch_train.log" "$rc" "${spec[@]}"
  else
    judge train "${spec[@]}"
  fi
}

# bf16 products (--precision bf16, Note [precision]): images/s at batch 256 against PyTorch's bf16
# autocast (step_train's figures; goal >= 1), and 2 epochs at batch 64 to the example's accuracy
# (goal >= 0.90 on Fashion-MNIST) with 2 replicas on cuda:0 whose gradients are all-reduced in bf16.
step_bf16() {
  local spec=(--cut 0)
  capped 45 "$logs/train-bf16-b256.log" "$mnist" --data "$data" --seed 7 --no-shuffle --batch 256 --steps 60 --quiet \
    "${eval_small[@]}" --backend cuda --devices 0 --precision bf16 --metrics "$logs/train-bf16-b256.jsonl"
  spec+=(--train 256 "$logs/train-bf16-b256.jsonl" "$logs/train-bf16-b256.log" "$rc")
  ((cut)) && spec[1]=1
  # Two replicas sharing cuda:0 with the gradients all-reduced in bf16 too (the device-local sum).
  capped 90 "$logs/bf16-2-epochs.log" "$mnist" --data "$data" --seed 7 --batch 64 --epochs 2 --quiet \
    --backend cuda --devices 0,0 --precision bf16 --gradient-precision bf16 --metrics "$logs/bf16-2-epochs.jsonl"
  spec+=(--accuracy "$logs/bf16-2-epochs.log" "$rc")
  ((cut)) && spec[1]=1
  if ((have_torch)) && [[ -s $logs/torch_train.jsonl ]]; then
    judge bf16 --torch "$logs/torch_train.jsonl" "$logs/torch_train.log" 0 "${spec[@]}"
  else
    judge bf16 "${spec[@]}"
  fi
}

step_train_step() {
  capped 60 "$logs/bench_cuda_train_step.log" "$bench/bench_cuda_train_step" --benchmark_min_time=0.5
  judge train-step "$logs/bench_cuda_train_step.log" "$rc" --cut "$cut"
}

# The example's convolutions through cuDNN against im2col + cuBLAS, in one process (vs_im2col).
step_conv() {
  capped 60 "$logs/bench_cuda_conv.log" "$bench/bench_cuda_conv" --benchmark_min_time=0.2
  local lines
  lines=$(grep '^conv cuDNN vs im2col' "$logs/bench_cuda_conv.log" | tr '\n' ';')
  if [[ $lines == *"not run"* ]]; then row "conv cuDNN vs im2col" "not run (no cuDNN)" "${lines%;}"
  elif [[ -n $lines ]]; then row "conv cuDNN vs im2col" measured "${lines%;}"
  elif ((rc == 124 || rc == 137)) && ((cut)); then row "conv cuDNN vs im2col" "not run (budget)" "stopped after $lim s"
  else row "conv cuDNN vs im2col" FAIL "exit $rc: $(tail -1 "$logs/bench_cuda_conv.log")"; fi
  # bf16 products (Note [precision]) over PyTorch's default math on the same engine.
  lines=$(grep '^conv bf16 vs fp32' "$logs/bench_cuda_conv.log" | tr '\n' ';')
  if [[ -n $lines ]]; then row "conv bf16 vs fp32" measured "${lines%;}"
  elif ((rc == 124 || rc == 137)) && ((cut)); then row "conv bf16 vs fp32" "not run (budget)" "stopped after $lim s"
  else row "conv bf16 vs fp32" FAIL "exit $rc: $(tail -1 "$logs/bench_cuda_conv.log")"; fi
  # bf16 through cuDNN's bf16 configuration over bf16 through im2col + cuBLAS (Note [cuDNN convolutions]).
  lines=$(grep '^conv bf16 cuDNN vs bf16 im2col' "$logs/bench_cuda_conv.log" | tr '\n' ';')
  if [[ -n $lines ]]; then row "conv bf16 cuDNN vs bf16 im2col" measured "${lines%;}"
  elif grep -q '^conv cuDNN vs im2col: not run' "$logs/bench_cuda_conv.log"; then
    row "conv bf16 cuDNN vs bf16 im2col" "not run (no cuDNN)" "-"
  elif ((rc == 124 || rc == 137)) && ((cut)); then row "conv bf16 cuDNN vs bf16 im2col" "not run (budget)" "stopped after $lim s"
  else row "conv bf16 cuDNN vs bf16 im2col" FAIL "exit $rc: $(tail -1 "$logs/bench_cuda_conv.log")"; fi
}

# The example network's forward and backward, eager and as one captured CUDA graph, in one process
# (vs_eager; cpu_per_gpu: host CPU time to enqueue a step over its GPU time, goal < 0.1 for the graph);
# then DataParallel::train_step of the same network, eager and with DataParallelOptions::graphs.
step_graph() {
  capped 60 "$logs/bench_cuda_graph.log" "$bench/bench_cuda_graph" --benchmark_min_time=0.2
  local lines what
  for what in "graph step vs eager" "DataParallel graphs vs eager"; do
    lines=$(grep "^$what" "$logs/bench_cuda_graph.log" | tr '\n' ';')
    if [[ -n $lines && $lines != *"not run"* ]]; then row "$what" measured "${lines%;}"
    elif ((rc == 124 || rc == 137)) && ((cut)); then row "$what" "not run (budget)" "stopped after $lim s"
    else row "$what" FAIL "exit $rc: ${lines:-$(tail -1 "$logs/bench_cuda_graph.log")}"; fi
  done
}

# ---- the kernels' static figures on this GPU's architecture --------------------------------------------
# The static gate (tests/cuda_static) for sm_$arch alone: every kernel compiled with ptxas's
# -warn-spills,-warn-lmem-usage,-Werror, its registers against its launch bounds, and in the PTX
# its vector loads and stores (check-kernel-resources.py's table: vst/vld per kernel of width > 1).
# The row gives the counts (gpu-check-summarize.py kernels); the table is in the logs.
step_kernels() {
  local includes
  includes="$root/include|$(dirname "$(dirname "$nvcc")")/include"
  capped 90 "$logs/kernel-gate.log" cmake -DNVCC="$nvcc" -DPYTHON=python3 \
    -DSCRIPT="$root/scripts/check-kernel-resources.py" -DARCHS="$arch" -DINCLUDES="$includes" -DMODE=gate \
    -DSOURCE="$root/tests/cuda_static/all_kernels.cu" -DWORK="$build/kernel-gate" -P "$root/tests/cuda_static/gate.cmake"
  judge kernels "$logs/kernel-gate.log" "$rc" "$arch" "$cut"
}

# ---- 5. SyncBatchNorm, all-reduce ---------------------------------------------------------------------------
step_syncbn() {
  # 24 cases (6 shapes x layouts x types), each alternating our step, a copy and cuDNN from a
  # flushed L2, most of an iteration's wall time untimed (flushes, cuDNN's NHWC runs): 0.1 s of
  # timed steps a case takes about 0.6 of the first run's 20 cases at 0.2 s, and the cap is 120 s
  # (a time-out loses every figure: the JSON is written at the end).
  capped 120 "$logs/bench_cuda_batch_norm.log" "$bench/bench_cuda_batch_norm" --benchmark_min_time=0.1 \
    --benchmark_format=json --benchmark_out="$logs/bench_cuda_batch_norm.json"
  local brc=$rc
  if ((have_torch)); then
    capped_py 60 "$logs/torch_bn.jsonl" "$logs/torch_bn.log" "$root/bench/torch_cuda_batch_norm.py"
    if ((rc == 124 || rc == 137)) && ((cut)); then row "SyncBN vs PyTorch" "not run (budget)" "stopped after $lim s"
    elif ((rc != 0)); then row "SyncBN vs PyTorch" FAIL "torch_cuda_batch_norm.py exit $rc: $(tail -1 "$logs/torch_bn.log")"; fi
  else
    : >"$logs/torch_bn.jsonl"
    row "SyncBN vs PyTorch" "not run (no torch)" "$torch_why"
  fi
  if ((brc == 124 || brc == 137)) && [[ ! -s $logs/bench_cuda_batch_norm.json ]]; then
    row "SyncBN benchmark" "$( ((cut)) && echo 'not run (budget)' || echo FAIL)" "stopped after its time limit"
    return
  fi
  judge syncbn "$logs/bench_cuda_batch_norm.json" "$logs/torch_bn.jsonl"
}

step_allreduce() {
  capped 45 "$logs/bench_cuda_allreduce.log" "$bench/bench_cuda_allreduce" --benchmark_min_time=0.5
  local line split launch
  line=$(grep -m1 'rendezvous_overhead at 129' "$logs/bench_cuda_allreduce.log")
  # One GPU: the device-local group; its overhead split into stream events and host rendezvous.
  split=$(grep -m1 'device-local split at 129' "$logs/bench_cuda_allreduce.log")
  # Blocking against non-blocking NCCL communicators (Note [blocking communicators]).
  launch=$(grep -m1 'NCCL eager collectives per second' "$logs/bench_cuda_allreduce.log")
  if [[ -n $launch ]]; then row "NCCL blocking vs non-blocking" measured "$launch"
  elif ((rc == 124 || rc == 137)) && ((cut)); then row "NCCL blocking vs non-blocking" "not run (budget)" "stopped after $lim s"
  else row "NCCL blocking vs non-blocking" FAIL "no line: $(tail -1 "$logs/bench_cuda_allreduce.log")"; fi
  if [[ -n $line ]]; then row rendezvous_overhead measured "$line${split:+; $split}"
  elif ((rc == 124 || rc == 137)) && ((cut)); then row rendezvous_overhead "not run (budget)" "stopped after $lim s"
  else row rendezvous_overhead FAIL "exit $rc: $(tail -1 "$logs/bench_cuda_allreduce.log")"; fi
}

# ---- 6. compute-sanitizer, several at a time, while the budget lasts -------------------------------------
step_sanitizers() {
  local sanitizer n=${#sanitizer_rows[@]} next=0 out=0 running=0 i tool t san_need=20
  sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
  if [[ -z $sanitizer ]]; then
    skip_rows unavailable "no compute-sanitizer" "$(IFS=';'; echo "${sanitizer_rows[*]}")"
    return
  fi
  local help opts=(--error-exitcode 9)
  help=$("$sanitizer" --help 2>&1)
  # Only kernel errors count: NCCL's probing and the tests' own deliberate API errors are not bugs.
  grep -q -- '--report-api-errors' <<<"$help" && opts+=(--report-api-errors no)
  grep -q -- '--print-limit' <<<"$help" && opts+=(--print-limit 100)
  "$sanitizer" --version >"$logs/compute-sanitizer-version.log" 2>&1
  local -a pid=() state=() lims=() cuts=() rcs=()
  while ((out < n)); do
    while ((next < n && running < san_jobs)); do
      if (($(left) < san_need)); then state[next]=skip; ((++next)); continue; fi
      tool=${sanitizer_rows[next]%% *}
      t=${sanitizer_rows[next]#* }
      limit "${sanitizer_cap[$tool]}"
      LOCKSTEP_TEST_RELAXED_TIMING=1 timeout -k 5 "$lim" "$sanitizer" --tool "$tool" "${opts[@]}" "$build/tests/$t" \
        >"$logs/$tool-$t.log" 2>&1 &
      pid[next]=$!
      bg_pids+=("${pid[next]}")
      lims[next]=$lim
      cuts[next]=$cut
      state[next]=run
      ((++running, ++next))
    done
    for ((i = out; i < next; ++i)); do
      if [[ ${state[i]} == run ]] && ! kill -0 "${pid[i]}" 2>/dev/null; then
        wait "${pid[i]}"
        rcs[i]=$?
        state[i]=finished
        ((--running))
      fi
    done
    while ((out < next)) && [[ ${state[out]} == finished || ${state[out]} == skip ]]; do
      tool=${sanitizer_rows[out]%% *}
      t=${sanitizer_rows[out]#* }
      if [[ ${state[out]} == skip ]]; then
        row "${sanitizer_rows[out]}" "not run (budget)" \
          "not started: $((budget - SECONDS)) s of the $budget s budget were left, a sanitizer run needs about $san_need s"
      else
        judge sanitizer "$tool" "$t" "$logs/$tool-$t.log" "${rcs[out]}" "${lims[out]}" "${cuts[out]}"
      fi
      ((++out))
    done
    ((out < n && running > 0)) && sleep 1
  done
}

# ---- run the plan -------------------------------------------------------------------------------------------
for entry in "${plan[@]}"; do
  IFS='|' read -r name need fn names <<<"$entry"
  if [[ -n $blocked ]]; then
    skip_rows "not run ($blocked)" "$blocked_why" "$names"
  elif (($(left) < need)); then
    skip_rows "not run (budget)" "$((budget - SECONDS)) s of the $budget s budget were left; this step needs about $need s" "$names"
    [[ $name == example ]] && kill -TERM "$host_job" 2>/dev/null  # its host run is of no use now
  else
    current=$entry
    "$fn" "$name"
    current=""
  fi
  step_done[$name]=1
  pack
done
[[ -n ${host_job:-} ]] && kill -TERM "$host_job" 2>/dev/null  # if step 2 never ran
exit 0
