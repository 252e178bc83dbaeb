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
  set(_options "")
  get_filename_component(_site "${TORCH_INSTALL_PREFIX}/.." ABSOLUTE)
  file(GLOB _nvidia LIST_DIRECTORIES true "${_site}/nvidia/*/lib")
  if(_nvidia)
    list(APPEND _nvidia "${TORCH_INSTALL_PREFIX}/lib")
    list(JOIN _nvidia ":" _path)
    list(APPEND _options "LINKER:--disable-new-dtags" "LINKER:-rpath,${_path}" "LINKER:-rpath-link,${_path}")
  endif()
  set(LOCKSTEP_TORCH_LINK_OPTIONS "${_options}" PARENT_SCOPE)
  # The folder holding the torch Python package, where the wheel's was installed (tests import it).
  if(EXISTS "${_site}/torch/__init__.py")
    set(LOCKSTEP_TORCH_PYTHONPATH "${_site}" PARENT_SCOPE)
  endif()
endfunction()
