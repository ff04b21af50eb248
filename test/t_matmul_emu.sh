#!/usr/bin/env bash
# cuda/matmul.cu's cuBLASLt products on the CPU: builds test/matmul_emu.cc
# with the host C++ compiler against test/cuda_emu.h and test/cublaslt_emu.h
# (a cuBLASLt that checks what cublasLt.h documents), links the CPU backend
# as the reference, and runs it (one line per check, both activation dtypes).
# Needs no GPU and no nvcc; skips without g++.
set -u
cd "$(dirname "$0")/.."
tmp=${KILN_TEST_TMP:-$(mktemp -d)}/matmul_emu
mkdir -p "$tmp"
CC=${CC:-gcc}
CXX=${CXX:-g++}
if ! command -v "$CXX" >/dev/null 2>&1 || ! command -v "$CC" >/dev/null 2>&1; then
    echo "skip matmul_emu: no C/C++ compiler ($CC, $CXX)"
    exit 0
fi
BLAS_DIR=/usr/lib/x86_64-linux-gnu/openblas-openmp
for f in src/cpu/backend_cpu.c src/backend.c src/util.c; do
    o="$tmp/$(basename "$f" .c).o"
    if ! "$CC" -std=c11 -O3 -march=native -fopenmp -D_GNU_SOURCE -Isrc -I/usr/include/x86_64-linux-gnu/openblas-openmp \
            -c -o "$o" "$f" >"$tmp/build.log" 2>&1; then
        echo "FAIL matmul_emu_build: $f: $(head -c 400 "$tmp/build.log")"
        exit 0
    fi
done
if ! "$CXX" -std=c++17 -O2 -Wall -Wextra -Wno-unknown-pragmas -Wno-unused-parameter -ffp-contract=off -Isrc \
        -o "$tmp/emu" test/matmul_emu.cc "$tmp"/backend_cpu.o "$tmp"/backend.o "$tmp"/util.o \
        -fopenmp -L$BLAS_DIR -Wl,-rpath,$BLAS_DIR -lopenblas -lm -lpthread >"$tmp/build.log" 2>&1; then
    echo "FAIL matmul_emu_build: $(grep -m3 -E 'error|undefined' "$tmp/build.log" | head -c 600)"
    exit 0
fi
if [ -s "$tmp/build.log" ]; then echo "FAIL matmul_emu_build_warnings: $(head -c 600 "$tmp/build.log")"; fi
"$tmp/emu"
