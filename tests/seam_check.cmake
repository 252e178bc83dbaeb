# SPDX-License-Identifier: MIT
# Note [backend operations]: layers, losses, the optimizer and DataParallel reach tensor memory
# only through kernels::Ops<B>. This check fails on a file under include/lockstep/nn or
# include/lockstep/parallel that calls BLAS, a host SIMD kernel or memcpy itself, or takes any
# object's data() pointer, except on a line marked "// seam:" that says why (the checkpoint file's
# byte buffers). span() and operator[] on tensor data are caught by compiling that code for Cuda
# (tests/cuda/), where they are compile errors. Nor may they include any other kernels/ header
# (host_ops.hpp, host_dnnl.hpp, a .cuh, ...): only the seam, kernels/ops.hpp; the umbrellas
# <lockstep/host.hpp> and <lockstep/cuda.cuh> bring the implementations.
# Usage: cmake -DROOT=<source dir> -P seam_check.cmake
file(GLOB_RECURSE files "${ROOT}/include/lockstep/nn/*" "${ROOT}/include/lockstep/parallel/*")
set(found "")
foreach(f IN LISTS files)
  file(STRINGS "${f}" lines REGEX "cblas_|blas::|memcpy|memset|kernels::host::|kernels::simd|#include \"lockstep/kernels/|#include .*\\.cuh|\\.data\\(\\)")
  foreach(line IN LISTS lines)
    if(line MATCHES "// seam: " OR line MATCHES "(text|tmp|e\\.data)\\.data\\(\\)" OR line MATCHES "^#include \"lockstep/kernels/ops\\.hpp\"")
      continue()  # a marked host copy, the checkpoint file's own strings and byte vectors, or the seam
    endif()
    file(RELATIVE_PATH rel "${ROOT}" "${f}")
    string(APPEND found "\n  ${rel}: ${line}")
  endforeach()
endforeach()
list(LENGTH files count)
if(count LESS 10)
  message(FATAL_ERROR "found only ${count} files under nn/ and parallel/: is ROOT right?")
endif()
if(found)
  message(FATAL_ERROR "generic code touches tensor memory itself; call kernels::Ops<B> instead:${found}")
endif()
message(STATUS "${count} files under nn/ and parallel/ reach tensor memory only through kernels::Ops<B>")
