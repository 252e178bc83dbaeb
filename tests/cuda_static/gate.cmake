# SPDX-License-Identifier: MIT
# The static gate of the CUDA kernels, run by CTest (see CMakeLists.txt here):
#   cmake -DNVCC=... -DSOURCE=... -DWORK=... -DSCRIPT=... -DPYTHON=... -DARCHS="75|80|90"
#         -DINCLUDES="dir|dir" [-DHOST_COMPILER=...] -DMODE=gate|catches_lmem|catches_scalar_packs -P gate.cmake
# (lists joined by '|': CTest would split a ';' list into separate arguments)
# MODE=gate: SOURCE compiles for every architecture in ARCHS in one nvcc run with ptxas's
#   -warn-spills,-warn-lmem-usage,-Werror (a kernel that spills or uses local memory fails the
#   compile), and check-kernel-resources.py checks what --resource-usage printed against the launch
#   bounds in the PTX of the same run, and that every kernel of vector width > 1 has vector
#   loads and (map kernels) stores in that PTX. Passes only if both pass.
# MODE=catches_lmem: the gate's own negative test. SOURCE uses local memory: the -Werror compile
#   must fail, saying so; a compile without -Werror must succeed and the script must fail on it,
#   naming every kernel of SOURCE; and the script must fail on input with no kernel at all.
# MODE=catches_scalar_packs: the negative test of the vector check. SOURCE's kernels use no local
#   memory, so the -Werror compile must pass; the script must then fail for exactly its width-4
#   kernels that access packs element by element, on every architecture, and for nothing else.

foreach(var NVCC SOURCE WORK SCRIPT PYTHON ARCHS MODE)
  if(NOT DEFINED ${var} OR "${${var}}" STREQUAL "")
    message(FATAL_ERROR "gate.cmake: -D${var}= is required")
  endif()
endforeach()

string(REPLACE "|" ";" ARCHS "${ARCHS}")
string(REPLACE "|" ";" INCLUDES "${INCLUDES}")
set(werror -Xptxas -warn-spills,-warn-lmem-usage,-Werror)
set(common -std=c++20 --expt-relaxed-constexpr -O3 --resource-usage)
if(HOST_COMPILER)
  list(APPEND common -ccbin "${HOST_COMPILER}")
endif()
set(expect_archs)
foreach(arch IN LISTS ARCHS)
  list(APPEND common -gencode "arch=compute_${arch},code=sm_${arch}")
  list(APPEND expect_archs --expect-arch "sm_${arch}")
endforeach()
foreach(dir IN LISTS INCLUDES)
  list(APPEND common "-I${dir}")
endforeach()

get_filename_component(stem "${SOURCE}" NAME_WE)
file(REMOVE_RECURSE "${WORK}")
file(MAKE_DIRECTORY "${WORK}")

# compile(NAME FLAGS...): nvcc on SOURCE into WORK/NAME, keeping the PTX; sets NAME_rc, NAME_err
# (ptxas's report, on stderr; also written to WORK/NAME.resource-usage.txt) and NAME_ptx.
function(compile name)
  set(keep "${WORK}/${name}.keep")
  file(MAKE_DIRECTORY "${keep}")
  string(TIMESTAMP t0 "%s")
  execute_process(
    COMMAND "${NVCC}" ${common} ${ARGN} --keep --keep-dir "${keep}" -c "${SOURCE}" -o "${WORK}/${name}.o"
    WORKING_DIRECTORY "${WORK}"
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  string(TIMESTAMP t1 "%s")
  math(EXPR seconds "${t1} - ${t0}")
  list(JOIN ARCHS ", sm_" archs)
  message(STATUS "nvcc ${name}: exit ${rc} after ${seconds} s (sm_${archs})")
  file(WRITE "${WORK}/${name}.resource-usage.txt" "${out}${err}")
  # Only the PTX is needed (for the launch bounds); the rest of --keep is tens of megabytes.
  file(GLOB ptx_kept "${keep}/*.ptx")
  set(ptx)
  foreach(p IN LISTS ptx_kept)
    get_filename_component(n "${p}" NAME)
    file(RENAME "${p}" "${WORK}/${name}.${n}")
    list(APPEND ptx "--ptx" "${WORK}/${name}.${n}")
  endforeach()
  file(REMOVE_RECURSE "${keep}")
  set(${name}_rc "${rc}" PARENT_SCOPE)
  set(${name}_err "${out}${err}" PARENT_SCOPE)
  set(${name}_ptx "${ptx}" PARENT_SCOPE)
endfunction()

# check(NAME RESULT_VAR OUTPUT_VAR): the script on compile NAME's report.
function(check name result output)
  execute_process(
    COMMAND "${PYTHON}" "${SCRIPT}" --resource-usage "${WORK}/${name}.resource-usage.txt" ${${name}_ptx} ${expect_archs}
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  set(${result} "${rc}" PARENT_SCOPE)
  set(${output} "${out}${err}" PARENT_SCOPE)
endfunction()

# What ptxas said beyond its per-kernel info lines (errors, warnings), for a failure message.
function(not_info text out)
  string(REPLACE ";" "\\;" text "${text}")
  string(REPLACE "\n" ";" lines "${text}")
  set(kept)
  foreach(line IN LISTS lines)
    if(NOT line MATCHES "^ptxas info|bytes stack frame|^$")
      string(APPEND kept "${line}\n")
    endif()
  endforeach()
  set(${out} "${kept}" PARENT_SCOPE)
endfunction()

if(MODE STREQUAL "gate")
  compile(strict ${werror})
  if(NOT strict_rc EQUAL 0)
    not_info("${strict_err}" why)
    list(JOIN werror " " werror_text)
    message(FATAL_ERROR "the kernels do not compile with ${werror_text} (a kernel spills or uses local "
                        "memory, or does not compile):\n${why}\n(full report: ${WORK}/strict.resource-usage.txt)")
  endif()
  check(strict rc out)
  message("${out}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "check-kernel-resources.py refused the kernels (exit ${rc}); see above")
  endif()
elseif(MODE STREQUAL "catches_lmem")
  compile(strict ${werror})
  not_info("${strict_err}" why)
  if(strict_rc EQUAL 0)
    message(FATAL_ERROR "ptxas -Werror passed kernels that use local memory: the gate's compile catches nothing")
  endif()
  if(NOT strict_err MATCHES "Local memory used for function" OR NOT strict_err MATCHES "Registers are spilled")
    message(FATAL_ERROR "the -Werror compile failed, but not for local memory and spills:\n${why}")
  endif()
  message(STATUS "ptxas -Werror refused the local memory, as it should:\n${why}")
  check(strict rc out)
  if(rc EQUAL 0)
    message(FATAL_ERROR "check-kernel-resources.py passed a failed -Werror compile's report:\n${out}")
  endif()

  compile(lenient)
  if(NOT lenient_rc EQUAL 0)
    not_info("${lenient_err}" why)
    message(FATAL_ERROR "${SOURCE} does not compile without -Werror either:\n${why}")
  endif()
  check(lenient rc out)
  message("${out}")
  if(rc EQUAL 0)
    message(FATAL_ERROR "check-kernel-resources.py passed kernels that use local memory")
  endif()
  foreach(kernel uses_local_memory spills_registers)
    foreach(arch IN LISTS ARCHS)
      if(NOT out MATCHES "sm_${arch} ${kernel}: [1-9][0-9]* bytes of local memory")
        message(FATAL_ERROR "check-kernel-resources.py did not report ${kernel}'s local memory on sm_${arch}")
      endif()
    endforeach()
  endforeach()
  if(NOT out MATCHES "spills_registers: spills registers to local memory")
    message(FATAL_ERROR "check-kernel-resources.py did not report spills_registers's spills")
  endif()

  file(WRITE "${WORK}/empty.resource-usage.txt" "")
  set(empty_ptx ${lenient_ptx})
  check(empty rc out)
  if(rc EQUAL 0 OR NOT out MATCHES "no kernel found")
    message(FATAL_ERROR "check-kernel-resources.py passed a report with no kernel in it:\n${out}")
  endif()
  message(STATUS "check-kernel-resources.py refused local memory, spills and an empty report, as it should")
elseif(MODE STREQUAL "catches_scalar_packs")
  compile(strict ${werror})
  if(NOT strict_rc EQUAL 0)
    not_info("${strict_err}" why)
    message(FATAL_ERROR "${SOURCE} must compile with -Werror (only its vector accesses are wrong):\n${why}")
  endif()
  check(strict rc out)
  message("${out}")
  if(rc EQUAL 0)
    message(FATAL_ERROR "check-kernel-resources.py passed width-4 kernels that access their packs element by element")
  endif()
  set(expected
      "map_kernel<ScalarStores<4> >: width 4 but no vector global store"
      "map_kernel<ScalarLoads<4> >: width 4 but no vector global load"
      "reduce_kernel<ScalarSum<4> >: width 4 but no vector global load"
      "map_kernel<ScalarPairs<__half, 2> >: width 2 but no vector global load"
      "map_kernel<ScalarPairs<__half, 2> >: width 2 but no vector global store")
  foreach(arch IN LISTS ARCHS)
    foreach(what IN LISTS expected)
      string(FIND "${out}" "sm_${arch} ${what}" at)
      if(at EQUAL -1)
        message(FATAL_ERROR "check-kernel-resources.py did not report on sm_${arch}: ${what}")
      endif()
    endforeach()
  endforeach()
  # Nothing else: not the kernels done right, not the reducing kernel's scalar store (no pack).
  list(LENGTH expected per_arch)
  list(LENGTH ARCHS arch_count)
  math(EXPR want "${per_arch} * ${arch_count}")
  if(NOT out MATCHES "FAILED: ${want} violation")
    message(FATAL_ERROR "check-kernel-resources.py should have found exactly ${want} violations (${per_arch} per "
                        "architecture), no more")
  endif()
  message(STATUS "check-kernel-resources.py refused the packs accessed element by element, and only them, as it should")
else()
  message(FATAL_ERROR "gate.cmake: MODE=${MODE}: gate, catches_lmem or catches_scalar_packs")
endif()
