#!/usr/bin/env bash
# The CUDA backend's SIMT kernels and their host wrappers (cuda/embed_norm.cu,
# pointwise.cu, attention.cu, attention_block.cu) on the CPU: builds test/cuda_emu.cc with the
# host C++ compiler against the CUDA stand-ins of test/cuda_emu.h, links the
# CPU backend as the reference, and runs it (one line per check, both
# activation dtypes). Needs no GPU and no nvcc; skips without g++.
set -u
cd "$(dirname "$0")/.."
. test/emu_lib.sh
emu_setup cuda_emu
emu_host_objs src/cpu/backend_cpu.c src/backend.c src/util.c
# shellcheck disable=SC2086
"$CXX" $EMU_CXXFLAGS -o "$tmp/emu" test/cuda_emu.cc "$tmp"/backend_cpu.o "$tmp"/backend.o "$tmp"/util.o \
    $EMU_LIBS >"$tmp/build.log" 2>&1 || emu_build_failed
emu_run
