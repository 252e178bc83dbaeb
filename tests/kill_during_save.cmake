# SPDX-License-Identifier: MIT
# Kills a save at STAGE (LOCKSTEP_TEST_KILL_AT, see nn::detail::save_stage) and checks what it
# leaves: the checkpoint's name holds a complete checkpoint that loads and is either the previous
# one (killed before the rename) or the new one (after it), never a torn file.
#   MNIST: the example; TOOL: mnist_tool; DATA: a data folder; DIR: a scratch folder; STAGE.
set(ckpt "${DIR}/ckpt.safetensors")
file(REMOVE_RECURSE "${DIR}")
file(MAKE_DIRECTORY "${DIR}")
set(run ${MNIST} --data ${DATA} --seed 5 --batch 30 --epochs 1 --replicas 2 --quiet)

# The previous checkpoint (1 step) and, for reference, the complete new one (2 steps).
execute_process(COMMAND ${run} --steps 1 --save ${ckpt} RESULT_VARIABLE rc ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "the first save failed (${rc}): ${err}")
endif()
file(COPY_FILE "${ckpt}" "${DIR}/previous.safetensors")
execute_process(COMMAND ${run} --steps 2 --save ${DIR}/new.safetensors RESULT_VARIABLE rc ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "the reference save failed (${rc}): ${err}")
endif()

# The same 2-step run, killed while it saves over the previous checkpoint.
set(ENV{LOCKSTEP_TEST_KILL_AT} "${STAGE}")
execute_process(COMMAND ${run} --steps 2 --save ${ckpt} RESULT_VARIABLE rc ERROR_VARIABLE err)
unset(ENV{LOCKSTEP_TEST_KILL_AT})
if(rc EQUAL 0 OR NOT rc MATCHES "[Kk]ill")
  message(FATAL_ERROR "the run was not killed at '${STAGE}' (result: ${rc}); is the hook built in? ${err}")
endif()

# What the name holds loads and is exactly one of the two complete checkpoints.
if(STAGE STREQUAL "after-rename")
  set(expected "${DIR}/new.safetensors")
else()
  set(expected "${DIR}/previous.safetensors")
endif()
execute_process(COMMAND ${TOOL} checkpoints ${ckpt} ${expected} 0 RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "killed at '${STAGE}': ${ckpt} is not the expected complete checkpoint ${expected}:\n${out}${err}")
endif()
# A kill before the rename leaves its full-size temporary file (the next save removes it).
file(GLOB temporaries "${ckpt}.tmp-*")
if(NOT STAGE STREQUAL "after-rename" AND NOT temporaries)
  message(FATAL_ERROR "killed at '${STAGE}' but no temporary file was left: was the save interrupted where it should be?")
endif()
message(STATUS "killed at '${STAGE}': ${ckpt} is ${expected}; temporaries: ${temporaries}")
