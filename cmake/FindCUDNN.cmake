# SPDX-License-Identifier: MIT
# Finds cuDNN 9, which ships no CMake package. Looks where LOCKSTEP_CUDNN_INCLUDE_DIR and
# LOCKSTEP_CUDNN_LIBRARY point, then in LOCKSTEP_CUDNN_HINTS (lockstep's package file: where
# lockstep found it), under CUDNN_ROOT (variable or environment), next to the CUDA toolkit, in
# python3's nvidia-cudnn wheel (as PyTorch installs it), then in the system paths; the library next
# to the header first.
#
# Defines CUDNN_FOUND, LOCKSTEP_CUDNN_INCLUDE_DIR, LOCKSTEP_CUDNN_LIBRARY, CUDNN_VERSION and the
# target CUDNN::cudnn.

include(FindPackageHandleStandardArgs)

include("${CMAKE_CURRENT_LIST_DIR}/lockstepToolkitHints.cmake")
lockstep_nvidia_hints(_cudnn_hints CUDNN_ROOT nvidia.cudnn ${LOCKSTEP_CUDNN_HINTS})

find_path(LOCKSTEP_CUDNN_INCLUDE_DIR cudnn.h HINTS ${_cudnn_hints} PATH_SUFFIXES include)
# The library next to the header first: both from one installation.
set(_cudnn_lib_hints ${_cudnn_hints})
if(LOCKSTEP_CUDNN_INCLUDE_DIR)
  get_filename_component(_cudnn_root "${LOCKSTEP_CUDNN_INCLUDE_DIR}" DIRECTORY)
  list(PREPEND _cudnn_lib_hints "${_cudnn_root}")
endif()
find_library(LOCKSTEP_CUDNN_LIBRARY NAMES cudnn libcudnn.so.9 HINTS ${_cudnn_lib_hints} PATH_SUFFIXES lib64 lib lib/x86_64-linux-gnu)

set(CUDNN_VERSION "")
foreach(_cudnn_header cudnn_version.h cudnn.h)
  if(NOT CUDNN_VERSION AND LOCKSTEP_CUDNN_INCLUDE_DIR AND EXISTS "${LOCKSTEP_CUDNN_INCLUDE_DIR}/${_cudnn_header}")
    file(STRINGS "${LOCKSTEP_CUDNN_INCLUDE_DIR}/${_cudnn_header}" _cudnn_defs REGEX "^#define CUDNN_(MAJOR|MINOR|PATCHLEVEL)[ \t]+[0-9]+")
    if(_cudnn_defs)
      foreach(_part MAJOR MINOR PATCHLEVEL)
        string(REGEX REPLACE ".*#define CUDNN_${_part}[ \t]+([0-9]+).*" "\\1" _cudnn_${_part} "${_cudnn_defs}")
      endforeach()
      set(CUDNN_VERSION "${_cudnn_MAJOR}.${_cudnn_MINOR}.${_cudnn_PATCHLEVEL}")
    endif()
  endif()
endforeach()

# A directory given by hand must hold the header, a library given by hand must exist, and the
# library must be cuDNN 9's (libcudnn.so.9, through its links).
set(_cudnn_files_exist FALSE)
if(EXISTS "${LOCKSTEP_CUDNN_INCLUDE_DIR}/cudnn.h" AND EXISTS "${LOCKSTEP_CUDNN_LIBRARY}")
  get_filename_component(_cudnn_real "${LOCKSTEP_CUDNN_LIBRARY}" REALPATH)
  if(_cudnn_real MATCHES "libcudnn\\.so\\.9")
    set(_cudnn_files_exist TRUE)
  else()
    message(STATUS "${LOCKSTEP_CUDNN_LIBRARY} is not cuDNN 9's library (${_cudnn_real}): not used")
  endif()
endif()
find_package_handle_standard_args(CUDNN REQUIRED_VARS LOCKSTEP_CUDNN_LIBRARY LOCKSTEP_CUDNN_INCLUDE_DIR _cudnn_files_exist
                                  VERSION_VAR CUDNN_VERSION)
# lockstep calls cuDNN 9's convolution API (cudnn_cnn.h); another major version is not used.
if(CUDNN_FOUND AND NOT CUDNN_VERSION MATCHES "^9\\.")
  message(STATUS "cuDNN ${CUDNN_VERSION} at ${LOCKSTEP_CUDNN_INCLUDE_DIR} is not cuDNN 9: not used")
  set(CUDNN_FOUND FALSE)
endif()

if(CUDNN_FOUND AND NOT TARGET CUDNN::cudnn)
  add_library(CUDNN::cudnn UNKNOWN IMPORTED)
  set_target_properties(CUDNN::cudnn PROPERTIES
    IMPORTED_LOCATION "${LOCKSTEP_CUDNN_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${LOCKSTEP_CUDNN_INCLUDE_DIR}")
endif()
mark_as_advanced(LOCKSTEP_CUDNN_INCLUDE_DIR LOCKSTEP_CUDNN_LIBRARY)
