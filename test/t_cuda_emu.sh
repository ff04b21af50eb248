#!/usr/bin/env bash
# The CUDA backend's SIMT kernels and their host wrappers (cuda/embed_norm.cu,
# pointwise.cu, attention.cu) on the CPU: builds test/cuda_emu.cc with the
# host C++ compiler against the CUDA stand-ins of test/cuda_emu.h, links the
# CPU backend as the reference, and runs it (one line per check, both
# activation dtypes). Needs no GPU and no nvcc; skips without g++.
set -u
cd "$(dirname "$0")/.."
tmp=${KILN_TEST_TMP:-$(mktemp -d)}/cuda_emu
mkdir -p "$tmp"
CC=${CC:-gcc}
CXX=${CXX:-g++}
if ! command -v "$CXX" >/dev/null 2>&1 || ! command -v "$CC" >/dev/null 2>&1; then
    echo "skip cuda_emu: no C/C++ compiler ($CC, $CXX)"
    exit 0
fi
BLAS_DIR=/usr/lib/x86_64-linux-gnu/openblas-openmp
# The reference: the CPU backend as ./train builds it (same flags that matter).
for f in src/cpu/backend_cpu.c src/backend.c src/util.c; do
    o="$tmp/$(basename "$f" .c).o"
    if ! "$CC" -std=c11 -O3 -march=native -fopenmp -D_GNU_SOURCE -Isrc -I/usr/include/x86_64-linux-gnu/openblas-openmp \
            -c -o "$o" "$f" >"$tmp/build.log" 2>&1; then
        echo "FAIL cuda_emu_build: $f: $(head -c 400 "$tmp/build.log")"
        exit 0
    fi
done
# -ffp-contract=off: the __f*_rn intrinsics must stay unfused, as on the GPU.
# UBSan's alignment check, where the compiler has it: a 16-byte vector load
# or store at an address a GPU would fault on stops the test (x86 would not).
UBSAN=
if echo 'int main(void) { return 0; }' | "$CXX" -x c++ -fsanitize=alignment -o "$tmp/ubsan_probe" - >/dev/null 2>&1; then
    UBSAN="-fsanitize=alignment -fno-sanitize-recover=alignment"
fi
if ! "$CXX" -std=c++17 -O2 -Wall -Wextra -Wno-unknown-pragmas -Wno-unused-parameter -ffp-contract=off $UBSAN -Isrc -o "$tmp/emu" \
        test/cuda_emu.cc "$tmp"/backend_cpu.o "$tmp"/backend.o "$tmp"/util.o \
        -fopenmp -L$BLAS_DIR -Wl,-rpath,$BLAS_DIR -lopenblas -lm -lpthread >"$tmp/build.log" 2>&1; then
    echo "FAIL cuda_emu_build: $(grep -m3 -E 'error|undefined' "$tmp/build.log" | head -c 600)"
    exit 0
fi
if [ -s "$tmp/build.log" ]; then echo "FAIL cuda_emu_build_warnings: $(head -c 600 "$tmp/build.log")"; fi
"$tmp/emu"
