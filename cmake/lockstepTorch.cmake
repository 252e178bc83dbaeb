# SPDX-License-Identifier: MIT
# lockstep_find_torch(): finds libtorch through its own CMake package (TorchConfig.cmake) and sets,
# in the caller's scope,
#   LOCKSTEP_TORCH_FOUND      whether it was found
#   LOCKSTEP_TORCH_VERSION    its version
#   LOCKSTEP_TORCH_LIBRARIES  what a program links (TORCH_LIBRARIES)
#   LOCKSTEP_TORCH_LINK_OPTIONS
#     where libtorch comes from PyPI's wheel, the folders of the NVIDIA libraries the wheel loads
#     (nvidia/*/lib beside torch/), as a run path that applies to libtorch's own dependencies
#     (DT_RPATH: libtorch_cuda.so has none of its own) and as the link-time path for them
#   LOCKSTEP_TORCH_PYTHONPATH the folder holding the wheel's torch Python package, if any
#   LOCKSTEP_TORCH_CUDA       whether libtorch is a CUDA build
#   LOCKSTEP_TORCH_NCCL_ROOT  where libtorch comes from PyPI's wheel, the NCCL wheel it loads
# The search runs in a function, so what Torch's package sets (CUDA flags among them) stays out of
# the caller's scope; its imported targets are the directory's. A project-local install made by
# scripts/install-torch.sh (.deps/torch-*/torch/share/cmake under `hint_root`) is searched last.
function(lockstep_find_torch hint_root)
  set(_hints "")
  if(hint_root)
    file(GLOB _local LIST_DIRECTORIES true "${hint_root}/.deps/torch-*/torch/share/cmake")
    list(SORT _local COMPARE NATURAL ORDER DESCENDING)
    set(_hints ${_local})
  endif()
  find_package(Torch CONFIG QUIET HINTS ${_hints})
  set(LOCKSTEP_TORCH_FOUND ${Torch_FOUND} PARENT_SCOPE)
  if(NOT Torch_FOUND)
    return()
  endif()
  set(LOCKSTEP_TORCH_VERSION "${Torch_VERSION}" PARENT_SCOPE)
  set(LOCKSTEP_TORCH_LIBRARIES "${TORCH_LIBRARIES}" PARENT_SCOPE)
  if(TORCH_CUDA_LIBRARIES OR TARGET torch_cuda)
    set(LOCKSTEP_TORCH_CUDA ON PARENT_SCOPE)
  else()
    set(LOCKSTEP_TORCH_CUDA OFF PARENT_SCOPE)
  endif()
  set(_options "")
  get_filename_component(_site "${TORCH_INSTALL_PREFIX}/.." ABSOLUTE)
  file(GLOB _nvidia LIST_DIRECTORIES true "${_site}/nvidia/*/lib")
  if(_nvidia)
    list(APPEND _nvidia "${TORCH_INSTALL_PREFIX}/lib")
    list(JOIN _nvidia ":" _path)
    list(APPEND _options "LINKER:--disable-new-dtags" "LINKER:-rpath,${_path}" "LINKER:-rpath-link,${_path}")
  endif()
  set(LOCKSTEP_TORCH_LINK_OPTIONS "${_options}" PARENT_SCOPE)
  if(EXISTS "${_site}/nvidia/nccl/include/nccl.h" AND EXISTS "${_site}/nvidia/nccl/lib/libnccl.so.2")
    set(LOCKSTEP_TORCH_NCCL_ROOT "${_site}/nvidia/nccl" PARENT_SCOPE)
  endif()
  # The folder holding the torch Python package, where the wheel's was installed (tests import it).
  if(EXISTS "${_site}/torch/__init__.py")
    set(LOCKSTEP_TORCH_PYTHONPATH "${_site}" PARENT_SCOPE)
  endif()
endfunction()

# lockstep_torch_nccl(out): sets `out` to whether the torch component all-reduces CUDA replicas'
# buckets with NCCL here (Note [libtorch NCCL buckets] in torch/nccl_group.hpp): libtorch is a
# CUDA build (LOCKSTEP_TORCH_CUDA, from lockstep_find_torch), the CUDA toolkit is found
# (CUDA::cudart) and so is an NCCL: the one libtorch loads where it comes from PyPI's wheel (an
# older one, the CUDA toolkit's, say, lacks symbols libtorch_cuda needs), else FindNCCL's. The
# NCCL becomes the imported target lockstep_torch::nccl; the caller then defines
# LOCKSTEP_TORCH_NCCL=1 and links both.
function(lockstep_torch_nccl out)
  set(${out} OFF PARENT_SCOPE)
  if(NOT LOCKSTEP_TORCH_CUDA)
    return()
  endif()
  if(NOT TARGET CUDA::cudart)
    find_package(CUDAToolkit QUIET)
  endif()
  if(NOT TARGET lockstep_torch::nccl)
    if(LOCKSTEP_TORCH_NCCL_ROOT)
      set(_include "${LOCKSTEP_TORCH_NCCL_ROOT}/include")
      set(_library "${LOCKSTEP_TORCH_NCCL_ROOT}/lib/libnccl.so.2")
    else()
      if(NOT NCCL_FOUND)
        find_package(NCCL QUIET)
      endif()
      if(NOT NCCL_FOUND)
        return()
      endif()
      set(_include "${NCCL_INCLUDE_DIR}")
      set(_library "${NCCL_LIBRARY}")
    endif()
    add_library(lockstep_torch::nccl UNKNOWN IMPORTED)
    set_target_properties(lockstep_torch::nccl PROPERTIES IMPORTED_LOCATION "${_library}"
                                                          INTERFACE_INCLUDE_DIRECTORIES "${_include}")
  endif()
  if(TARGET CUDA::cudart)
    set(${out} ON PARENT_SCOPE)
  endif()
endfunction()
