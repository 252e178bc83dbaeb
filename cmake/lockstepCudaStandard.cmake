# SPDX-License-Identifier: MIT
# lockstep_cuda_standard(TARGET [BUILD_ONLY]): CUDA sources that use TARGET compile as C++20.
# Where CMake knows how to ask nvcc for C++20 (the cuda_std_20 feature), the feature is used, so
# it merges with a consumer's own CMAKE_CUDA_STANDARD (CMake takes the higher); where it does not
# (CMake 3.25 has no feature table for nvcc 13), the flag is passed directly, and nvcc keeps the
# last -std it is given. BUILD_ONLY: the flag applies in the build tree only (the package file
# decides again for each consumer, with the consumer's CMake).
function(lockstep_cuda_standard target)
  set(flags --expt-relaxed-constexpr)
  if("cuda_std_20" IN_LIST CMAKE_CUDA_COMPILE_FEATURES)
    target_compile_features(${target} INTERFACE cuda_std_20)
  else()
    list(APPEND flags -std=c++20)
  endif()
  foreach(flag IN LISTS flags)
    if(ARGV1 STREQUAL "BUILD_ONLY")
      target_compile_options(${target} INTERFACE "$<BUILD_INTERFACE:$<$<COMPILE_LANGUAGE:CUDA>:${flag}>>")
    else()
      target_compile_options(${target} INTERFACE "$<$<COMPILE_LANGUAGE:CUDA>:${flag}>")
    endif()
  endforeach()
endfunction()
