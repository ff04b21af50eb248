# emu_lib.sh: what the CPU-emulation tests of cuda/ share (t_cuda_emu.sh,
# t_matmul_emu.sh, t_model_emu.sh): a scratch folder, the compilers, the host
# C files built as ./train builds them (the CPU backend is the reference), and
# the flags the emulated CUDA sources need. Sourced, after `cd` to the root.

# emu_setup NAME: $tmp, $CC, $CXX; no compiler prints "skip NAME" and exits 0.
emu_setup() {
    EMU_NAME=$1
    tmp=${KILN_TEST_TMP:-$(mktemp -d)}/$1
    mkdir -p "$tmp"
    CC=${CC:-gcc}
    CXX=${CXX:-g++}
    if ! command -v "$CXX" >/dev/null 2>&1 || ! command -v "$CC" >/dev/null 2>&1; then
        echo "skip $1: no C/C++ compiler ($CC, $CXX)"
        exit 0
    fi
    # -ffp-contract=off: the __f*_rn intrinsics must stay unfused, as on the
    # GPU. UBSan's alignment check, where the compiler has it: a 16-byte vector
    # load or store at an address a GPU would fault on stops the test (x86
    # would not).
    UBSAN=
    if echo 'int main(void) { return 0; }' | "$CXX" -x c++ -fsanitize=alignment -o "$tmp/ubsan_probe" - >/dev/null 2>&1; then
        UBSAN="-fsanitize=alignment -fno-sanitize-recover=alignment"
    fi
    EMU_CXXFLAGS="-std=c++17 -O2 -Wall -Wextra -Wno-unknown-pragmas -Wno-unused-parameter -ffp-contract=off $UBSAN -Isrc"
    BLAS_DIR=/usr/lib/x86_64-linux-gnu/openblas-openmp
    EMU_LIBS="-fopenmp -L$BLAS_DIR -Wl,-rpath,$BLAS_DIR -lopenblas -lm -lpthread"
}

# emu_host_objs FILE.c...: each into $tmp/BASENAME.o with the flags that
# matter as ./train builds them; a failure prints "FAIL NAME_build" and exits 0.
emu_host_objs() {
    local f o
    for f in "$@"; do
        o="$tmp/$(basename "$f" .c).o"
        if ! "$CC" -std=c11 -O3 -march=native -fopenmp -D_GNU_SOURCE -Isrc -I/usr/include/x86_64-linux-gnu/openblas-openmp \
                -c -o "$o" "$f" >"$tmp/build.log" 2>&1; then
            echo "FAIL ${EMU_NAME}_build: $f: $(head -c 400 "$tmp/build.log")"
            exit 0
        fi
    done
}

# emu_build_failed: one line naming the first errors of $tmp/build.log.
emu_build_failed() {
    echo "FAIL ${EMU_NAME}_build: $(grep -m3 -E 'error|undefined' "$tmp/build.log" | head -c 600)"
    exit 0
}

# emu_run: a warning in the build is a failure of its own; then the binary.
emu_run() {
    if [ -s "$tmp/build.log" ]; then echo "FAIL ${EMU_NAME}_build_warnings: $(head -c 600 "$tmp/build.log")"; fi
    "$tmp/emu"
}
