#!/usr/bin/env bash
# The whole model on the CUDA backend, on the CPU: builds test/model_emu_cuda.cc
# (every file of cuda/, matmul.cu over test/cublaslt_emu.h's cuBLASLt, under
# test/cuda_emu.h) with the host C++ compiler, links it with src/model.c,
# src/optim.c and the CPU backend (the reference), and runs test/model_emu.c:
# a few AdamW steps of a small GPT-2 in fp32 and bf16 compared with the CPU
# (one line per check). Needs no GPU and no nvcc; skips without g++.
set -u
cd "$(dirname "$0")/.."
tmp=${KILN_TEST_TMP:-$(mktemp -d)}/model_emu
mkdir -p "$tmp"
CC=${CC:-gcc}
CXX=${CXX:-g++}
if ! command -v "$CXX" >/dev/null 2>&1 || ! command -v "$CC" >/dev/null 2>&1; then
    echo "skip model_emu: no C/C++ compiler ($CC, $CXX)"
    exit 0
fi
BLAS_DIR=/usr/lib/x86_64-linux-gnu/openblas-openmp
# The host side and the reference as ./train builds them (same flags that matter).
for f in src/model.c src/optim.c src/cpu/backend_cpu.c src/backend.c src/util.c; do
    o="$tmp/$(basename "$f" .c).o"
    if ! "$CC" -std=c11 -O3 -march=native -fopenmp -D_GNU_SOURCE -Isrc -I/usr/include/x86_64-linux-gnu/openblas-openmp \
            -c -o "$o" "$f" >"$tmp/build.log" 2>&1; then
        echo "FAIL model_emu_build: $f: $(head -c 400 "$tmp/build.log")"
        exit 0
    fi
done
# -ffp-contract=off and UBSan's alignment check, as test/t_cuda_emu.sh says why.
UBSAN=
if echo 'int main(void) { return 0; }' | "$CXX" -x c++ -fsanitize=alignment -o "$tmp/ubsan_probe" - >/dev/null 2>&1; then
    UBSAN="-fsanitize=alignment -fno-sanitize-recover=alignment"
fi
if ! "$CXX" -std=c++17 -O2 -Wall -Wextra -Wno-unknown-pragmas -Wno-unused-parameter -ffp-contract=off $UBSAN -Isrc \
        -c -o "$tmp/cuda.o" test/model_emu_cuda.cc >"$tmp/build.log" 2>&1 ||
   ! "$CC" -std=c11 -O2 -fopenmp -D_GNU_SOURCE -Wall -Wextra -Wno-unused-parameter -Isrc -Itest \
        -c -o "$tmp/model_emu.o" test/model_emu.c >>"$tmp/build.log" 2>&1 ||
   ! "$CXX" $UBSAN -o "$tmp/emu" "$tmp/model_emu.o" "$tmp/cuda.o" "$tmp"/model.o "$tmp"/optim.o "$tmp"/backend_cpu.o \
        "$tmp"/backend.o "$tmp"/util.o -fopenmp -L$BLAS_DIR -Wl,-rpath,$BLAS_DIR -lopenblas -lm -lpthread \
        >>"$tmp/build.log" 2>&1; then
    echo "FAIL model_emu_build: $(grep -m3 -E 'error|undefined' "$tmp/build.log" | head -c 600)"
    exit 0
fi
if [ -s "$tmp/build.log" ]; then echo "FAIL model_emu_build_warnings: $(head -c 600 "$tmp/build.log")"; fi
"$tmp/emu"
