#!/usr/bin/env bash
# make test-cores: the numerical part of the suite once per OpenBLAS core type.
#
# Debian's OpenBLAS is built with DYNAMIC_ARCH: at start-up it picks the
# kernels of the CPU it finds (Haswell's AVX2, SkylakeX's AVX-512, Zen's, ...),
# and each sums a product's terms in its own order, so the last bits of every
# fp32 result differ from one machine kind to the next. OPENBLAS_CORETYPE
# forces a kind, which reproduces on one machine what CI's other machines
# would compute. A tolerance that holds here under every kind holds on them.
#
#   scripts/test_cores.sh [CORETYPE ...]     (default: Haswell SkylakeX Zen)
#
# A kind whose instructions this CPU lacks is named and left out (OpenBLAS
# would take it and die of SIGILL). KILN_CORE_TESTS overrides the list of test
# files; OPENBLAS_L2_SIZE, when set, is kept for every kind (it changes the
# blocking, so the order, too). Each kind's lines go to build/cores/KIND.log;
# the script ends with one line per kind and fails if any kind failed.
# docs/testing.md, "Tolerances".
set -u
cd "$(dirname "$0")/.."
kinds=("$@")
[ ${#kinds[@]} -gt 0 ] || kinds=(Haswell SkylakeX Zen)

# The files that compare floats the CPU backend computed with those of another
# run, layout, backend or implementation: the rest (parsers, launchers, the
# trackers, the fuzz regressions) do not touch OpenBLAS's sums.
NUMERIC="test_backend_cross test_cp test_docmask test_ep test_fp8 test_model_arch_ref test_model_bf16 test_model_fusion
test_model_init test_model_master16 test_model_recompute test_model_ref test_model_stages test_ops test_optim test_pipe
t_ep t_pp t_fp8 t_muon t_adafactor t_dp t_cp t_arch_resume t_tp t_model_emu t_cuda_emu t_resume t_ckpt_mpi t_mpi
t_docmask t_lion t_hf_interop t_hf_llama t_recompute t_matmul_emu t_attention_tc_emu t_arch_train t_optim_ref
t_optim_state t_train"
tests=${KILN_CORE_TESTS:-$NUMERIC}

# has FLAG...: every flag is in /proc/cpuinfo
flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
has() { local f; for f in "$@"; do case "$flags" in *" $f "*) ;; *) return 1 ;; esac; done; }
# needs KIND: the cpuinfo flags OpenBLAS's kernels for KIND use
needs() {
    case $1 in
    Haswell | Zen) echo avx2 fma ;;
    SkylakeX) echo avx512f avx512bw avx512dq avx512vl avx2 fma ;;
    Cooperlake) echo avx512f avx512bw avx512dq avx512vl avx512_bf16 ;;
    Sapphirerapids) echo avx512f avx512bw avx512dq avx512vl avx512_bf16 avx512_fp16 amx_bf16 ;;
    Sandybridge) echo avx ;;
    Nehalem | Core2 | Prescott | Atom) echo sse2 ;;
    *) echo unknown-core-type ;;
    esac
}

mkdir -p build/cores
summary=() bad=0
for k in "${kinds[@]}"; do
    # shellcheck disable=SC2046
    if ! has $(needs "$k"); then
        summary+=("$k: not run, this CPU lacks $(for f in $(needs "$k"); do has $f || printf '%s ' $f; done)")
        continue
    fi
    echo "== OPENBLAS_CORETYPE=$k${OPENBLAS_L2_SIZE:+ OPENBLAS_L2_SIZE=$OPENBLAS_L2_SIZE}"
    OPENBLAS_CORETYPE=$k KILN_TESTS="$tests" bash test/run.sh > "build/cores/$k.log" 2>&1
    rc=$?
    grep '^FAIL ' "build/cores/$k.log"
    summary+=("$k: $(tail -n 1 "build/cores/$k.log")")
    [ $rc -eq 0 ] || bad=1
done
printf '%s\n' "${summary[@]}"
exit $bad
