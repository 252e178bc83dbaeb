#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Provides libtorch (PyTorch's C++ library and its CMake package, TorchConfig.cmake) for the
# lockstep::torch component, from PyPI's torch wheel, into a project-local folder:
#   .deps/torch-<version>/torch/share/cmake   (cmake/lockstepTorch.cmake looks there)
# The wheel is built for CUDA and runs on the CPU; of its NVIDIA dependencies it loads only the
# few installed here without their own dependencies (NCCL, NVSHMEM, cuSPARSELt, cuFile); the
# rest come from the CUDA toolkit. The pure-Python packages `import torch` needs are installed
# beside it, so the tests that read lockstep's files from Python run with PYTHONPATH set to the
# folder. Nothing is installed when the folder is complete. LOCKSTEP_TORCH_VERSION overrides the
# version. Usage: scripts/install-torch.sh [--print-prefix]
set -euo pipefail
cd "$(dirname "$0")/.."
version=${LOCKSTEP_TORCH_VERSION:-2.15.0}
dest=.deps/torch-${version}
if [[ ${1:-} == --print-prefix ]]; then
  echo "$PWD/$dest"
  exit 0
fi
[[ -f $dest/.complete ]] && exit 0

python=${PYTHON:-python3}
if ! "$python" -m pip --version >/dev/null 2>&1; then
  echo "lockstep: install-torch needs pip for $python (Debian: apt-get install python3-pip)" >&2
  exit 1
fi
echo "lockstep: installing libtorch ${version} (PyPI's torch wheel) into ${dest}"
rm -rf "${dest}.partial"
mkdir -p .deps
# The NVIDIA wheels' versions are those torch ${version} names (its Requires-Dist).
"$python" -m pip install --quiet --disable-pip-version-check --no-deps --target "${dest}.partial" \
  "torch==${version}" nvidia-nccl-cu13==2.30.7 nvidia-nvshmem-cu13==3.7.2 nvidia-cusparselt-cu13==0.8.1 nvidia-cufile \
  filelock "typing-extensions>=4.13" "sympy>=1.13.3" mpmath "networkx>=2.5.1" jinja2 markupsafe "fsspec>=0.8.5" \
  "setuptools>=77.0.3" numpy
touch "${dest}.partial/.complete"
rm -rf "$dest"
mv "${dest}.partial" "$dest"
