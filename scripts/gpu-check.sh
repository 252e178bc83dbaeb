#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# The one command for a GPU machine. Two halves:
#
#   scripts/gpu-check.sh --prepare   on the development machine (Debian 12): gathers into
#                                    .gpu-check/ (ignored by git, at most 48 MiB) what a bare GPU
#                                    machine lacks: the Debian packages the build needs, as .deb
#                                    files, and the Fashion-MNIST files.
#   scripts/gpu-check.sh             on the GPU machine (CUDA toolkit, cmake, python3; no Debian dev
#                                    packages, no network): unpacks the .debs into a local prefix,
#                                    builds Release for the GPU's architecture, runs every `gpu`
#                                    test, compute-sanitizer memcheck and racecheck on them, the
#                                    example (10 steps at 1 and 4 replicas on one GPU, one epoch at 4
#                                    against the host backend's epoch), the CUDA benchmarks and
#                                    PyTorch's BatchNorm2d on the same shapes, and prints one table
#                                    last. Logs go to build/gpu-check/logs (and to $OUT when set).
#
# NCCL and cuDNN come from python3's nvidia-nccl-cu13 and nvidia-cudnn-cu13 wheels (PyTorch's).
# GPU_CHECK_BUDGET (seconds, default 270) bounds the whole run: steps that would start after it
# are reported "not run (time)".
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

start=$(date +%s)
budget=${GPU_CHECK_BUDGET:-270}
build="$root/build/gpu-check"
logs="$build/logs"
prefix="$carry/prefix"
mkdir -p "$logs"
summary="$logs/summary.tsv"  # step <TAB> result <TAB> detail
: >"$summary"
# Each row also goes to $OUT at once, so a run cut short by the machine's limit keeps what it did.
row() {
  printf '%s\t%s\t%s\n' "$1" "$2" "${3:-}" >>"$summary"
  if [[ -n ${OUT:-} && -d ${OUT:-} ]]; then cp "$summary" "$OUT/gpu-check-summary.tsv" 2>/dev/null || true; fi
}
in_time() { (($(date +%s) - start < budget)); }
# A step's timeout: its own cap, or what is left of the budget (at least 10 s).
cap() { local left=$((budget - ($(date +%s) - start))); ((left < 10)) && left=10; echo $((left < $1 ? left : $1)); }
# Kernels load when CUDA starts, not at first launch (a lazy load can wait on a spinning NCCL kernel).
export CUDA_MODULE_LOADING=EAGER
finish() {
  python3 - "$summary" <<'EOF'
import sys
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1]) if l.strip()]
w0 = max([len(r[0]) for r in rows] + [4]); w1 = max([len(r[1]) for r in rows] + [6])
print("\n== gpu-check ==")
print(f"{'step':<{w0}}  {'result':<{w1}}  detail")
for r in rows:
    print(f"{r[0]:<{w0}}  {r[1]:<{w1}}  {r[2] if len(r) > 2 else ''}")
EOF
  if [[ -n ${OUT:-} && -d ${OUT:-} ]]; then cp -r "$logs" "$OUT/gpu-check-logs" 2>/dev/null || true; fi
}
trap finish EXIT

# ---- the machine ----------------------------------------------------------------------------------
command -v nvidia-smi >/dev/null || { row machine FAIL "no nvidia-smi: not a GPU machine"; exit 1; }
gpu=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1)
gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '. ')
[[ $arch =~ ^[0-9]+$ ]] || arch=90
row machine ok "$gpus x $gpu, sm_$arch, $(date -u +%Y-%m-%d)"

# ---- the packages, unpacked into a local prefix ---------------------------------------------------
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
  fi || { row packages FAIL "cannot unpack $(basename "$deb")"; exit 1; }
done
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

# ---- build ------------------------------------------------------------------------------------------
cuda_flags=(); [[ -n $cudnn_lib ]] && cuda_flags=(-DLOCKSTEP_CUDNN_INCLUDE_DIR="$nvidia/cudnn/include" -DLOCKSTEP_CUDNN_LIBRARY="$cudnn_lib")
nccl_flags=(); [[ -n $nccl_lib ]] && nccl_flags=(-DNCCL_INCLUDE_DIR="$nvidia/nccl/include" -DNCCL_LIBRARY="$nccl_lib")
generator=(); command -v ninja >/dev/null && generator=(-G Ninja)
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
targets=(test_gpu_core test_gpu_bn_math test_gpu_layers test_gpu_data_parallel mnist bench_cuda_batch_norm
         bench_cuda_train_step bench_cuda_allreduce)
if ! cmake -S "$root" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="$arch" \
      -DCMAKE_CUDA_COMPILER="$nvcc" -DLOCKSTEP_CUDA=ON -DLOCKSTEP_DNNL=OFF -DLOCKSTEP_MPI=OFF \
      -DCMAKE_PREFIX_PATH="$prefix/usr;$lib/cmake" -DCMAKE_LIBRARY_PATH="$blas_dir;$lib" \
      -DCMAKE_CXX_FLAGS="-isystem $prefix/usr/include/x86_64-linux-gnu/openblas-pthread" \
      -DCMAKE_CUDA_FLAGS="-isystem $prefix/usr/include/x86_64-linux-gnu/openblas-pthread" \
      -DZLIB_INCLUDE_DIR="$prefix/usr/include" -DZLIB_LIBRARY="$zlib" "${nccl_flags[@]}" "${cuda_flags[@]}" \
      >"$logs/configure.log" 2>&1; then
  row build FAIL "configure failed: $(tail -3 "$logs/configure.log" | tr '\n' ' ')"
  exit 1
fi
if ! cmake --build "$build" -j "$(nproc)" --target "${targets[@]}" >"$logs/build.log" 2>&1; then
  row build FAIL "$(grep -m2 -E 'error' "$logs/build.log" | tr '\n' ' ')"
  exit 1
fi
row build ok "Release, sm_$arch, $(( $(date +%s) - start )) s so far"

# ---- GPU tests -------------------------------------------------------------------------------------
gpu_tests=(test_gpu_core test_gpu_bn_math test_gpu_layers test_gpu_data_parallel)
for t in "${gpu_tests[@]}"; do
  exe="$build/tests/$t"
  limit=$(cap 240)
  timeout "$limit" "$exe" >"$logs/$t.log" 2>&1
  rc=$?
  case $rc in
    0) row "$t" pass "$(grep -c '^ok' "$logs/$t.log") checks" ;;
    77) row "$t" skipped "no GPU seen by the test" ;;
    124) row "$t" FAIL "timed out after $limit s" ;;
    *) row "$t" FAIL "exit $rc: $(grep -m2 '^FAIL' "$logs/$t.log" | tr '\n' ' ')" ;;
  esac
done

# ---- compute-sanitizer -----------------------------------------------------------------------------
sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
for tool in memcheck racecheck; do
  for t in test_gpu_core test_gpu_layers test_gpu_data_parallel; do
    name="$tool $t"
    if [[ -z $sanitizer ]]; then row "$name" unavailable "no compute-sanitizer"; continue; fi
    if ! in_time; then row "$name" "not run" "time budget"; continue; fi
    # The tests' timing bounds are relaxed under the sanitizer, which slows everything.
    LOCKSTEP_TEST_RELAXED_TIMING=1 timeout "$(cap 120)" "$sanitizer" --tool "$tool" --error-exitcode 9 "$build/tests/$t" \
      >"$logs/$tool-$t.log" 2>&1
    rc=$?
    errors=$(grep -oE 'ERROR SUMMARY: [0-9]+' "$logs/$tool-$t.log" | grep -oE '[0-9]+' | tail -1)
    if grep -qiE 'device not supported|not supported on this|unable to (attach|initialize)|no supported device' \
         "$logs/$tool-$t.log"; then
      row "$name" unavailable "$(grep -m1 -iE 'not supported|unable to' "$logs/$tool-$t.log" | cut -c1-100)"
    elif [[ $rc -eq 0 && ${errors:-0} -eq 0 ]] && grep -q 'ERROR SUMMARY' "$logs/$tool-$t.log"; then row "$name" pass "0 errors"
    elif [[ -n $errors && $errors -gt 0 ]]; then row "$name" FAIL "$errors errors (logs/$tool-$t.log)"
    elif [[ $rc -eq 124 ]]; then row "$name" "not run" "over 120 s under the sanitizer"
    elif [[ $rc -eq 77 ]]; then row "$name" skipped "no GPU seen by the test"
    else row "$name" unavailable "exit $rc: $(grep -m1 -iE 'error|unable|not supported' "$logs/$tool-$t.log" | cut -c1-100)"
    fi
  done
done

# ---- the example --------------------------------------------------------------------------------------
mnist="$build/examples/mnist"
data="$carry/data"
common=(--data "$data" --seed 7 --no-shuffle --batch 64 --quiet)
if in_time; then
  timeout "$(cap 150)" "$mnist" "${common[@]}" --backend cuda --devices 0 --steps 10 --metrics "$logs/r1.jsonl" >"$logs/mnist-r1.log" 2>&1 &&
    timeout "$(cap 150)" "$mnist" "${common[@]}" --backend cuda --devices 0,0,0,0 --steps 10 --metrics "$logs/r4.jsonl" >"$logs/mnist-r4.log" 2>&1
  if [[ $? -ne 0 ]]; then row "example 10 steps, 1 vs 4 replicas" FAIL "$(tail -1 "$logs"/mnist-r*.log | tr '\n' ' ')"
  else
    verdict=$(python3 - "$logs/r1.jsonl" "$logs/r4.jsonl" <<'EOF'
import json, sys
a = [json.loads(l)["loss"] for l in open(sys.argv[1]) if '"step"' in l]
b = [json.loads(l)["loss"] for l in open(sys.argv[2]) if '"step"' in l]
worst = max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b)) if a and len(a) == len(b) else float("inf")
print(("pass" if worst <= 1e-4 else "FAIL") + f"\tworst relative loss difference {worst:.2e} over {len(a)} steps (allowed 1e-4)")
EOF
)
    row "example 10 steps, 1 vs 4 replicas" "${verdict%%$'\t'*}" "${verdict#*$'\t'}"
  fi
else row "example 10 steps, 1 vs 4 replicas" "not run" "time budget"; fi

if in_time; then
  timeout "$(cap 150)" "$mnist" --data "$data" --seed 7 --epochs 1 --quiet --backend cuda --devices 0,0,0,0 >"$logs/mnist-epoch-cuda.log" 2>&1 &
  cuda_pid=$!
  timeout "$(cap 150)" "$mnist" --data "$data" --seed 7 --epochs 1 --quiet --backend host --replicas 4 >"$logs/mnist-epoch-host.log" 2>&1
  host_rc=$?
  wait $cuda_pid
  cuda_rc=$?
  acc_c=$(grep -oE 'test accuracy [0-9.]+' "$logs/mnist-epoch-cuda.log" | grep -oE '[0-9.]+$')
  acc_h=$(grep -oE 'test accuracy [0-9.]+' "$logs/mnist-epoch-host.log" | grep -oE '[0-9.]+$')
  ips_c=$(grep -oE '[0-9]+ img/s' "$logs/mnist-epoch-cuda.log" | tail -1)
  if [[ $cuda_rc -ne 0 || $host_rc -ne 0 || -z $acc_c || -z $acc_h ]]; then
    row "example 1 epoch, 4 replicas" FAIL "cuda exit $cuda_rc, host exit $host_rc: $(tail -1 "$logs/mnist-epoch-cuda.log")"
  else
    ok=$(python3 -c "print('pass' if abs($acc_c - $acc_h) <= 0.005 else 'FAIL')")
    row "example 1 epoch, 4 replicas" "$ok" "accuracy cuda $acc_c vs host $acc_h (within 0.005); $ips_c on cuda"
  fi
else row "example 1 epoch, 4 replicas" "not run" "time budget"; fi

# ---- benchmarks -----------------------------------------------------------------------------------------
bench="$build/bench"
if in_time; then
  timeout "$(cap 90)" "$bench/bench_cuda_train_step" --benchmark_min_time=1 >"$logs/bench_cuda_train_step.log" 2>&1
  for n in 1 4; do
    ips=$(grep -E "replicas:$n/" "$logs/bench_cuda_train_step.log" | grep -oE 'images_per_s=[0-9.]+[kM]?' | head -1)
    row "images/s, $n replica(s) on cuda:0" "${ips:+measured}" "${ips:-see logs/bench_cuda_train_step.log}"
  done
  ws=$(grep -m1 '^weak_scaling 4' "$logs/bench_cuda_train_step.log")
  row "weak scaling" measured "${ws:-not reported}"
else row "images/s" "not run" "time budget"; fi
if in_time; then
  timeout "$(cap 90)" "$bench/bench_cuda_allreduce" --benchmark_min_time=0.5 >"$logs/bench_cuda_allreduce.log" 2>&1
  row "rendezvous_overhead" measured "$(grep -m1 'rendezvous_overhead at 129' "$logs/bench_cuda_allreduce.log" || echo 'see logs')"
else row "rendezvous_overhead" "not run" "time budget"; fi
if in_time; then
  timeout "$(cap 90)" "$bench/bench_cuda_batch_norm" --benchmark_min_time=0.2 --benchmark_format=json --benchmark_out="$logs/bn.json" \
    >"$logs/bench_cuda_batch_norm.log" 2>&1
  timeout "$(cap 60)" python3 "$root/bench/torch_cuda_batch_norm.py" >"$logs/torch_bn.jsonl" 2>"$logs/torch_bn.err"
  python3 - "$logs/bn.json" "$logs/torch_bn.jsonl" >>"$summary" <<'EOF'
import json, re, sys
try:
    runs = json.load(open(sys.argv[1]))["benchmarks"]
except Exception as e:
    print(f"SyncBN benchmark\tFAIL\tno results ({e})"); sys.exit(0)
torch = {}
try:
    for l in open(sys.argv[2]):
        r = json.loads(l)
        if r.get("ms"): torch[(r["N"], r["C"], r["HW"], r["nhwc"], r["bf16"])] = (r["ms"], r["torch"])
except OSError:
    pass
for b in runs:
    if b.get("run_type") == "aggregate" or "error_occurred" in b: continue
    m = re.search(r"N:(\d+)/C:(\d+)/HW:(\d+)/nhwc:(\d)/bf16:(\d)", b["name"])
    if not m: continue
    key = tuple(int(v) for v in m.groups())
    ms = b["real_time"] * {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}[b["time_unit"]]
    parts = [f"vs_floor {b.get('vs_floor', 0):.2f}"]
    if "vs_cudnn" in b: parts.append(f"vs_cudnn {b['vs_cudnn']:.2f}")
    if key in torch: parts.append(f"vs_torch {torch[key][0] / ms:.2f} (torch {torch[key][1]})")
    layout = ("NHWC" if key[3] else "NCHW") + (" bf16" if key[4] else " fp32")
    print(f"SyncBN {key[0]}x{key[1]}x{key[2]}x{key[2]} {layout}\tmeasured\t{ms:.3f} ms; " + ", ".join(parts))
EOF
else row "SyncBN benchmark" "not run" "time budget"; fi

verdict=ok
grep -qP '\t(skipped|not run|unavailable)\t' "$summary" && verdict=incomplete
grep -qP '\tFAIL\t' "$summary" && verdict=FAIL
row total "$verdict" "$(( $(date +%s) - start )) s "
grep -qP '\tFAIL\t' "$summary" && exit 1
exit 0
