#!/usr/bin/env bash
# The tensor-core attention kernels (cuda/attention_tc.cu) on the CPU: builds
# test/attention_tc_emu.cc with the host C++ compiler against the CUDA/WMMA
# stand-ins of test/cuda_emu.h and runs it (one line per shape). Needs no GPU
# and no nvcc; skips without a C++ compiler.
set -u
cd "$(dirname "$0")/.."
tmp=${KILN_TEST_TMP:-$(mktemp -d)}/tc_emu
mkdir -p "$tmp"
CXX=${CXX:-g++}
if ! command -v "$CXX" >/dev/null 2>&1; then
    echo "skip attention_tc_emu: no C++ compiler ($CXX)"
    exit 0
fi
# UBSan's alignment check, where the compiler has it: a 16-byte vector load
# or store at an address a GPU would fault on stops the test (x86 would not).
UBSAN=
if echo 'int main(void) { return 0; }' | "$CXX" -x c++ -fsanitize=alignment -o "$tmp/ubsan_probe" - >/dev/null 2>&1; then
    UBSAN="-fsanitize=alignment -fno-sanitize-recover=alignment"
fi
if ! "$CXX" -std=c++17 -O2 -Wall -Wextra -Wno-unknown-pragmas -Wno-unused-parameter -ffp-contract=off $UBSAN -Isrc -o "$tmp/emu" \
        test/attention_tc_emu.cc -lpthread >"$tmp/build.log" 2>&1; then
    echo "FAIL attention_tc_emu_build: $(head -c 400 "$tmp/build.log")"
    exit 0
fi
if [ -s "$tmp/build.log" ]; then echo "FAIL attention_tc_emu_build_warnings: $(head -c 400 "$tmp/build.log")"; fi
"$tmp/emu"
