# SPDX-License-Identifier: MIT
# Runs an MPI test under mpirun and judges each rank's own lines ("PASS rank R: ..." / "FAIL rank
# R: ..."), not mpirun's exit code (a job that ends with MPI_Abort, or that lost a killed rank, is
# still judged by what its ranks said). EXPECT_PASS: how many PASS lines the ranks must print.
set(ENV{OMPI_ALLOW_RUN_AS_ROOT} 1)
set(ENV{OMPI_ALLOW_RUN_AS_ROOT_CONFIRM} 1)
set(ENV{OMPI_MCA_btl_vader_single_copy_mechanism} none)  # no ptrace-based copies in containers
set(ENV{ASAN_OPTIONS} detect_leaks=0)  # libmpi leaks at exit
string(REPLACE "!" ";" SCENARIO "${SCENARIO}")  # a scenario with arguments: "train!2"
# 45 s: every scenario ends in seconds, but Open MPI's mpirun can hang after ranks call MPI_Abort
# (seen in "silent" on a loaded 2-core machine, every rank having printed) until the timeout ends
# it; its ranks' lines still judge the run, and a shorter wait keeps CI's budget.
# "silent" ends with MPI_Abort on the ranks that timed out, after which this machine's mpirun
# has hung every time, its ranks gone and their lines printed within 2 s: 15 s there.
set(_timeout 45)
if(SCENARIO STREQUAL "silent")
  set(_timeout 15)
endif()
execute_process(COMMAND ${MPIEXEC} ${FLAGS} -np ${NP} ${PROGRAM} ${SCENARIO}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT ${_timeout})
message(STATUS "mpirun exit ${rc}\n${out}\n${err}")
string(REGEX MATCHALL "PASS rank [0-9]+" passes "${out}")
list(LENGTH passes pass_count)
if(out MATCHES "FAIL rank")
  message(FATAL_ERROR "a rank failed (see above)")
endif()
if(NOT pass_count EQUAL EXPECT_PASS)
  message(FATAL_ERROR "${pass_count} PASS lines, expected ${EXPECT_PASS}")
endif()
