# SPDX-License-Identifier: MIT
# Runs benchmark BENCH briefly (ARGS, a ;-list, e.g. a filter) and checks that it exits 0, that
# it ran at least one benchmark, that none reported an error and that every counter named in
# COUNTERS (a ;-list) is printed with a finite value. Figures are not judged: timing belongs to
# the benchmarks, not to tests.
execute_process(COMMAND "${BENCH}" --benchmark_min_time=0.01 ${ARGS} RESULT_VARIABLE rc OUTPUT_VARIABLE out
                ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${BENCH} exited with ${rc}\nstdout: ${out}\nstderr: ${err}")
endif()
if(NOT out MATCHES "\nBM_")
  message(FATAL_ERROR "${BENCH} ran no benchmark:\n${out}")
endif()
if(out MATCHES "ERROR OCCURRED")
  message(FATAL_ERROR "${BENCH} reported an error:\n${out}")
endif()
foreach(counter IN LISTS COUNTERS)
  if(NOT out MATCHES " ${counter}=[0-9]")
    message(FATAL_ERROR "${BENCH} printed no finite ${counter}:\n${out}")
  endif()
  if(out MATCHES " ${counter}=(nan|-?inf)")
    message(FATAL_ERROR "${BENCH} printed a non-finite ${counter}:\n${out}")
  endif()
endforeach()
message(STATUS "${BENCH}: every counter printed (${COUNTERS})")
