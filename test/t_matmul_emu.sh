#!/usr/bin/env bash
# cuda/matmul.cu's cuBLASLt products on the CPU: builds test/matmul_emu.cc
# with the host C++ compiler against test/cuda_emu.h and test/cublaslt_emu.h
# (a cuBLASLt that checks what cublasLt.h documents), links the CPU backend
# as the reference, and runs it (one line per check, both activation dtypes).
# Needs no GPU and no nvcc; skips without g++.
set -u
cd "$(dirname "$0")/.."
. test/emu_lib.sh
emu_setup matmul_emu
emu_host_objs src/cpu/backend_cpu.c src/fp8.c src/backend.c src/util.c
# shellcheck disable=SC2086
"$CXX" $EMU_CXXFLAGS -o "$tmp/emu" test/matmul_emu.cc "$tmp"/backend_cpu.o "$tmp"/fp8.o "$tmp"/backend.o "$tmp"/util.o \
    $EMU_LIBS >"$tmp/build.log" 2>&1 || emu_build_failed
emu_run
