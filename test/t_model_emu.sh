#!/usr/bin/env bash
# The whole model on the CUDA backend, on the CPU: builds test/model_emu_cuda.cc
# (every file of cuda/, matmul.cu over test/cublaslt_emu.h's cuBLASLt, under
# test/cuda_emu.h) with the host C++ compiler, links it with src/model.c,
# src/optim.c and the CPU backend (the reference), and runs test/model_emu.c:
# a few AdamW steps of a small GPT-2, two Llamas and two MoE models in fp32
# and bf16 compared with the CPU (one line per check). Needs no GPU and no nvcc; skips without g++.
set -u
cd "$(dirname "$0")/.."
. test/emu_lib.sh
emu_setup model_emu
emu_host_objs src/model.c src/model_init.c src/model_fp8.c src/fp8.c src/arch.c src/optim.c src/cpu/backend_cpu.c src/backend.c src/util.c
# shellcheck disable=SC2086
{ "$CXX" $EMU_CXXFLAGS -c -o "$tmp/cuda.o" test/model_emu_cuda.cc &&
  "$CC" -std=c11 -O2 -fopenmp -D_GNU_SOURCE -Wall -Wextra -Wno-unused-parameter -Isrc -Itest \
      -c -o "$tmp/model_emu.o" test/model_emu.c &&
  "$CXX" $UBSAN -o "$tmp/emu" "$tmp/model_emu.o" "$tmp/cuda.o" "$tmp"/model.o "$tmp"/model_init.o "$tmp"/model_fp8.o "$tmp"/fp8.o "$tmp"/arch.o "$tmp"/optim.o "$tmp"/backend_cpu.o \
      "$tmp"/backend.o "$tmp"/util.o $EMU_LIBS; } >"$tmp/build.log" 2>&1 || emu_build_failed
emu_run
