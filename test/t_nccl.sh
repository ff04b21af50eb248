#!/usr/bin/env bash
# NCCL without a GPU: that ./train says whether NCCL support is built in, that
# the NCCL path of src/comm.c compiles without warnings with and without MPI
# (the CUDA build and the STATIC=1 build), and that a missing libnccl.so.2 ends
# a multi-GPU start with exit 1 and one line naming the library and
# LD_LIBRARY_PATH, while runs that need no NCCL are untouched. The GPU side is
# build/test/test_nccl, run by scripts/cuda_check.sh. One line per check.
set -u
cd "$(dirname "$0")/.."
T=${KILN_TEST_TMP:-$(mktemp -d)}/t_nccl
rm -rf "$T" && mkdir -p "$T"
. test/lib.sh

# Where the Makefile finds nccl.h (its NCCL_H), and the CUDA headers.
CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc 2>/dev/null || echo /usr/local/cuda/bin/nvcc)")")}
NCCL_H=""
for f in "$CUDA_HOME/include/nccl.h" /usr/include/nccl.h /usr/local/include/nccl.h; do
    [ -f "$f" ] && NCCL_H=$f && break
done

if ./train --version | grep -q '^nccl: built in'; then built=1; else built=0; fi
if [ -z "$NCCL_H" ] || [ ! -f "$CUDA_HOME/include/cuda_runtime.h" ]; then
    if [ $built = 0 ]; then ok nccl_version_not_built; else fail nccl_version_not_built "no nccl.h, yet: $(./train --version | grep nccl)"; fi
    skip nccl_compiles "nccl.h or cuda_runtime.h not found"
    exit 0
fi
# a CPU-only build (CUDA=0) leaves NCCL out whatever headers exist
if ./train --version | grep -q '^backends: .*cuda'; then
    if [ $built = 1 ]; then ok nccl_version_built_in
    else fail nccl_version_built_in "nccl.h at $NCCL_H but ./train --version says: $(./train --version | grep nccl) (built with NCCL=0?)"; fi
elif [ $built = 0 ]; then ok nccl_version_not_built_cpu_only
else fail nccl_version_not_built_cpu_only "a build without the CUDA backend says: $(./train --version | grep nccl)"; fi

CC=${CC:-gcc}
INC="-I$CUDA_HOME/include -I$(dirname "$NCCL_H")"
WARN="-std=c11 -D_GNU_SOURCE -Isrc -Wall -Wextra -Wshadow -Wno-unused-parameter -Werror"
MPI_FLAGS=""
command -v mpicc >/dev/null 2>&1 && MPI_FLAGS="-DKILN_MPI $(mpicc --showme:compile)"
if $CC $WARN -DKILN_NCCL $MPI_FLAGS $INC -c -o "$T/comm_mpi.o" src/comm.c 2>"$T/cc1.txt" &&
   $CC $WARN -DKILN_NCCL $INC -c -o "$T/comm_nompi.o" src/comm.c 2>"$T/cc2.txt"; then
    ok nccl_compiles_without_warnings
else fail nccl_compiles_without_warnings "$(head -c 600 "$T/cc1.txt" "$T/cc2.txt")"; fi

# A missing library: comm.c compiled to look for a name that does not exist.
cat > "$T/missing.c" <<'C'
#include "comm.h"
int main(int argc, char **argv) {
    comm_init(0);
    comm_nccl_init(comm_world(), argv[1]);
    return 0;
}
C
if $CC $WARN -DKILN_NCCL '-DKILN_NCCL_SONAME="libnccl-kiln-missing.so.2"' $INC -o "$T/missing" "$T/missing.c" \
    src/comm.c src/flight.c src/testhooks.c src/util.c -L"$CUDA_HOME/lib64" -lcudart_static -ldl -lpthread -lrt -lm 2>"$T/cc3.txt"; then
    expect nccl_missing_library_one_line 1 \
        '^kiln: error: rank 0: cannot load libnccl-kiln-missing.so.2 \(.*\): install NCCL .* set LD_LIBRARY_PATH to the folder that holds libnccl-kiln-missing.so.2$' \
        -- "$T/missing" "$T"
    if [ "$(wc -l < "$T/err.txt")" -eq 1 ]; then ok nccl_missing_library_exactly_one_line
    else fail nccl_missing_library_exactly_one_line "$(wc -l < "$T/err.txt") lines: $(head -c 400 "$T/err.txt")"; fi
else
    fail nccl_missing_library_one_line "cannot build the probe: $(head -c 400 "$T/cc3.txt")"
fi
