# SPDX-License-Identifier: MIT
# What FindNCCL.cmake and FindCUDNN.cmake share: where an NVIDIA library that ships no CMake
# package may be, in the order they look.

# lockstep_nvidia_hints(OUT ROOT_VAR WHEEL_MODULE [FIRST...]): in OUT, the FIRST directories, then
# ${ROOT_VAR} and $ENV{ROOT_VAR}, the CUDA toolkit's root (and /usr/local/cuda), then the directory of
# python3's WHEEL_MODULE (nvidia.nccl, nvidia.cudnn: the wheels PyTorch installs), where there is one.
function(lockstep_nvidia_hints out root_var wheel_module)
  set(_hints ${ARGN} ${${root_var}} $ENV{${root_var}})
  if(CUDAToolkit_LIBRARY_ROOT)
    list(APPEND _hints "${CUDAToolkit_LIBRARY_ROOT}")
  endif()
  list(APPEND _hints /usr/local/cuda)
  find_program(LOCKSTEP_PYTHON3 NAMES python3)
  mark_as_advanced(LOCKSTEP_PYTHON3)
  if(LOCKSTEP_PYTHON3)
    execute_process(COMMAND ${LOCKSTEP_PYTHON3} -c "import ${wheel_module} as m; print(list(m.__path__)[0])"
                    OUTPUT_VARIABLE _wheel OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE _rc)
    if(_rc EQUAL 0 AND _wheel)
      list(APPEND _hints "${_wheel}")
    endif()
  endif()
  set(${out} ${_hints} PARENT_SCOPE)
endfunction()
