#!/usr/bin/env bash
# cuda_check: everything a short GPU window should establish, as one prepared
# command (`make cuda-check`): the GPU and its libraries, every op of the CUDA
# backend against double references and against the CPU backend (both with
# fp32 and with bf16 activations), which attention paths the bf16 path kept
# and the throughput and error of each (SIMT, tensor cores, cuDNN), a 50-step
# tiny run on the CPU and on CUDA with precision.compute fp32 and bf16 (and
# precision.attention simt and cudnn, and bf16 without a master:
# precision.master bf16), the loss curves compared step by step
# (and model.recompute=norm_gelu's against none's, bit for bit; GeLU fused into
# the fc products by cuBLASLt's epilogues against precision.gelu_fusion off,
# and whether the fusion ran), GPT-2 124M (also with norm_gelu, and without
# GeLU fusion) and 1.5B benchmark steps (tokens/s, MFU, peak memory), and comm's
# NCCL device mode on one rank (test_nccl). Full log and a summary go
# to $OUT (or a fresh /tmp folder); the summary table is printed last. Aims at
# well under 8 minutes on one H100/H200.
#
# The binaries are normally built on the build machine with `make gpu-bundle`
# (scripts/gpu_bundle.sh: STATIC=1, packed into .gpu/kiln-gpu.tar.xz, since the
# GPU machine lacks libyaml, zstd, OpenBLAS and MPI and five static binaries
# overflow a 64 MiB transfer) and carried as .gpu; if no usable ./train is
# there the bundle is unpacked, and failing that the script tries a STATIC=1
# build here. Exit: 0 all checks passed, 1 a check failed, 2 no GPU or no binary.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-$(mktemp -d /tmp/kiln-cuda-check.XXXXXX)}
mkdir -p "$OUT"
LOG=$OUT/cuda_check.log
SUM=$OUT/summary.txt
: > "$SUM"
exec > >(tee -a "$LOG") 2>&1
T0=$(date +%s)
BUDGET_S=${CUDA_CHECK_BUDGET_S:-420} # later sections are skipped past this
failed=0

# Tolerances, written down once (see also test/test_ops.c, test_backend_cross.c):
# tiny run, relative loss difference to the CPU backend at every one of 50 steps:
#   fp32 1e-3: both sides fp32, different summation orders; differences start
#     near 1e-6 and grow through training's chaos, staying ~1e-4 over 50 steps
#     on a model this small. A wrong op shows up at step 1 as > 1e-2.
#   bf16 1e-2 (1%): activations, their gradients and the weights' compute copy
#     stored in bf16 (2^-9 relative per rounding, fp32 math and master weights):
#     test/test_model_bf16 measures ~1e-3 on a CPU emulation of bf16 storage.
#   The fused GeLU (precision.gelu_fusion auto) against off, both bf16, also
#     1e-2: the epilogue's GeLU reads the unrounded product (one bf16 rounding
#     fewer) and is cuBLASLt's own formula; either is well inside the bf16
#     storage's 1e-3-scale differences, a wrong aux or gradient is not.
#   precision.master bf16 (no fp32 master, AdamW stores each parameter with
#     stochastic rounding) 3e-2: on top of the bf16 storage above, each step
#     rounds every weight to bf16 (zero-mean, up to one ulp = 2^-8 relative);
#     test/test_model_master16 measures a 1.2% final-loss gap to the fp32
#     master on an emulated 40-step overfit, so 3e-2 leaves 2.5x margin. A
#     broken update is far outside it: tiny's loss falls 5.55 -> 2.55 in 50
#     steps, and an update that is lost (rounded away) or wrong stalls it.
TOL_TINY_FP32=1e-3
TOL_TINY_BF16=1e-2
TOL_TINY_MASTER16=3e-2

row() { printf '%-28s %-6s %s\n' "$1" "$2" "$3" | tee -a "$SUM" >/dev/null; }
elapsed() { echo $(( $(date +%s) - T0 )); }
over_budget() { [ "$(elapsed)" -ge "$BUDGET_S" ]; }
section() { echo; echo "=== $* ($(elapsed) s) ==="; }

# --- 1. The GPU ------------------------------------------------------------
section "GPU"
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv; then
    echo "cuda_check: no NVIDIA GPU here (nvidia-smi is missing or failed); run it on a machine with one"
    row gpu FAIL "no GPU (nvidia-smi missing or failed)"
    cat "$SUM"
    exit 2
fi
row gpu ok "$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
nvidia-smi --query-gpu=memory.used,memory.total --format=csv

# --- 2. Libraries: cuBLAS(Lt), cuDNN, NCCL from the toolkit or pip --------
section "libraries"
find /usr/local/cuda/lib64/ -maxdepth 1 \( -name '*cudnn*' -o -name '*nccl*' -o -name '*cublas*' \) 2>/dev/null | grep . ||
    echo "(none under /usr/local/cuda/lib64)"
PIP_NV=$(python3 -c "import nvidia, os; print(os.path.dirname(nvidia.__path__[0]))" 2>/dev/null || true)
echo "pip nvidia packages under: ${PIP_NV:-none}"
extra=""
if [ -n "$PIP_NV" ]; then
    for lib in 'libcublasLt.so.*' 'libcudnn_graph.so.9*' 'libnvrtc.so.*' 'libnccl.so.2*'; do
        f=$(find "$PIP_NV/nvidia" -name "$lib" 2>/dev/null | head -1)
        [ -n "$f" ] && echo "found $f" && extra="$extra:$(dirname "$f")"
    done
fi
# NCCL is opened at run time (dlopen "libnccl.so.2"), so it must be on the
# loader's path: pip's nvidia-nccl-cu1x puts it in site-packages/nvidia/nccl/lib
# (any python's), the toolkit in lib or lib64.
if ! echo "$extra" | grep -q nccl; then
    for d in "$PIP_NV/nvidia/nccl/lib" /usr/local/lib/python3*/dist-packages/nvidia/nccl/lib \
             /usr/lib/python3*/site-packages/nvidia/nccl/lib "$HOME"/.local/lib/python3*/site-packages/nvidia/nccl/lib \
             /usr/local/cuda/lib /usr/local/cuda/lib64; do
        if [ -e "$d/libnccl.so.2" ]; then echo "found $d/libnccl.so.2"; extra="$extra:$d"; break; fi
    done
fi
# cuDNN is opened the same way (dlopen "libcudnn_graph.so.9", by
# cuda/attention_cudnn.cu): pip's nvidia-cudnn-cu13 puts it in
# site-packages/nvidia/cudnn/lib (its engines beside it); the runtime-compiled
# fused-attention engines also load NVRTC (pip nvidia-cuda-nvrtc, or the toolkit).
cudnn_found=0
echo "$extra" | grep -q cudnn && cudnn_found=1
if [ $cudnn_found = 0 ]; then
    for d in "$PIP_NV/nvidia/cudnn/lib" /usr/local/lib/python3*/dist-packages/nvidia/cudnn/lib \
             /usr/lib/python3*/site-packages/nvidia/cudnn/lib "$HOME"/.local/lib/python3*/site-packages/nvidia/cudnn/lib \
             /usr/local/cuda/lib /usr/local/cuda/lib64 /usr/lib/x86_64-linux-gnu; do
        if [ -e "$d/libcudnn_graph.so.9" ]; then echo "found $d/libcudnn_graph.so.9"; extra="$extra:$d"; cudnn_found=1; break; fi
    done
fi
[ $cudnn_found = 1 ] ||
    echo "libcudnn_graph.so.9 not found: precision.attention cudnn will be refused (auto notes it and goes on)"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${extra}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"

# --- 3. The binaries -------------------------------------------------------
section "binaries"
usable() { [ -x ./train ] && ./train --version 2>/dev/null | grep -q 'backends: .*cuda' &&
           [ -x build/test/test_ops ] && [ -x build/test/test_backend_cross ] && [ -x build/test/test_nccl ]; }
if ! usable && [ -f .gpu/kiln-gpu.tar.xz ]; then # `make gpu-bundle` on the build machine, carried as .gpu
    BUNDLE_NOTE="; bundle of commit $(cat .gpu/COMMIT 2>/dev/null || echo unknown)"
    echo "unpacking .gpu/kiln-gpu.tar.xz (${BUNDLE_NOTE#; })"
    tar -xJf .gpu/kiln-gpu.tar.xz 2>/dev/null ||
        python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall()' .gpu/kiln-gpu.tar.xz
    # a bundle built from other sources than this tree's tests stale code
    if [ -f .gpu/SOURCES.sha256 ] && ! stale=$(sha256sum -c --quiet .gpu/SOURCES.sha256 2>&1); then
        row bundle FAIL "built from other sources than this tree (make gpu-bundle again): $(echo "$stale" | head -n 3 | tr '\n' ' ')"
        failed=1
    fi
fi
if ! usable; then
    echo "no usable carried binary: building here (make STATIC=1)"
    if command -v nvcc >/dev/null 2>&1; then
        make -j"$(nproc)" STATIC=1 CUDA=1 train build/test/test_ops build/test/test_backend_cross build/test/test_nccl \
            build/test/bench_attention 2>&1 | tail -n 20
    fi
fi
if ! usable; then
    echo "cuda_check: no ./train with the CUDA backend could be run or built here"
    [ -x ./train ] && ldd ./train | grep 'not found'
    row binary FAIL "no runnable ./train with cuda (build with make STATIC=1 and carry it)"
    cat "$SUM"
    exit 2
fi
./train --version
ldd ./train | grep -E 'not found|cublas|cudart|gomp|stdc' || true
row binary ok "$(./train --version | sed -n 's/^cuda: //p')${BUNDLE_NOTE:-}"

# --- 4. Ops ----------------------------------------------------------------
count() { grep -c "^$1 " "$2" || true; }
# A table of op checks on the GPU: every one passes, some with bf16 activations.
op_table() { # ROW SECONDS BINARY LOG BF16_PREFIX
    timeout "$2" "$3" cuda > "$OUT/$4" 2>&1; local rc=$?
    cat "$OUT/$4"
    local nok nfail nbf
    nok=$(count ok "$OUT/$4"); nfail=$(count FAIL "$OUT/$4")
    nbf=$(grep -c "^ok $5" "$OUT/$4" || true)
    if [ $rc -eq 0 ] && [ "$nfail" -eq 0 ] && [ "$nbf" -gt 0 ]; then row "$1" ok "$nok checks ($nbf with bf16 activations)"
    else row "$1" FAIL "$nok ok, $nfail failed, exit $rc"; failed=1; fi
}
section "ops: test_ops cuda (double references, small shapes)"
op_table test_ops 120 build/test/test_ops test_ops.txt ops_cuda_bf16_

section "ops: test_backend_cross cuda (vs the CPU backend, GPT-2 shapes)"
op_table test_backend_cross 150 build/test/test_backend_cross test_cross.txt cross_cuda_bf16_

section "comm: test_nccl (NCCL device mode, one rank: collectives, stream order, overlap, deadline)"
timeout 120 build/test/test_nccl > "$OUT/test_nccl.txt" 2>&1; rc=$?
cat "$OUT/test_nccl.txt"
nok=$(count ok "$OUT/test_nccl.txt"); nfail=$(count FAIL "$OUT/test_nccl.txt")
if [ $rc -eq 0 ] && [ "$nfail" -eq 0 ] && [ "$nok" -gt 1 ]; then
    row test_nccl ok "$nok checks, $(sed -n 's/^nccl: //p' "$OUT/test_nccl.txt" | head -1)"
else
    row test_nccl FAIL "$nok ok, $nfail failed, exit $rc: $(grep -m1 -E '^(FAIL|skip)' "$OUT/test_nccl.txt")"; failed=1
fi

# --- 4b. Attention: the candidates bf16 kept, each path's throughput and error --
# build/test/bench_attention prints the backend line after set_precision bf16
# (precision.attention auto: "attention: auto, the first that takes the shape among cudnn,
# tensor_cores, simt (tensor cores passed: self-check ...; cuDNN passed: ...)"),
# then forward and backward times of each implementation at B 8 and 16,
# T 1024, C 768, NH 12 (GPT-2 124M), with its max error against the SIMT
# kernels on the same inputs. TFLOP/s count the causal half only: forward
# 2 B NH T^2 hs, backward 2.5x that (test/bench_attention.c).
# Error tolerance 2e-2 of the largest element, out and dqkv: the start-up
# self-check's (cuda/attention.cu ATT_CHECK_TOL): one bf16 ulp (2^-7 of the
# max) from two roundings of nearby fp32 values, plus P and dS rounded to bf16
# before their products (~1e-3), times 2; a wrong mask or stride errs by 0.1.
TOL_ATTN=2e-2
section "attention: candidates, throughput and error vs SIMT (bench_attention)"
if [ -x build/test/bench_attention ]; then
    timeout 150 build/test/bench_attention cuda bf16 > "$OUT/bench_attention.txt" 2>&1; rc=$?
    cat "$OUT/bench_attention.txt"
    choice=$(sed -n 's/^# .*\(attention: .*\)$/\1/p' "$OUT/bench_attention.txt" | head -n 1)
    if [ $rc -ne 0 ]; then row attention_choice FAIL "bench_attention exit $rc: $(tail -n 1 "$OUT/bench_attention.txt")"; failed=1
    elif grep -q 'disagree' "$OUT/bench_attention.txt"; then row attention_choice FAIL "self-check failed: $choice"; failed=1
    elif [[ $choice == *"tensor cores passed"* ]]; then row attention_choice ok "$choice"
    else row attention_choice FAIL "auto refused the tensor cores: ${choice:-no backend line}"; failed=1; fi
    # cuDNN is on this machine (pip nvidia-cudnn-cu13): auto must keep it
    if [[ $choice == *"among cudnn"* ]]; then row attention_cudnn ok "self-check passed: ${choice##*cuDNN passed: }"
    else row attention_cudnn FAIL "auto did not keep cuDNN: ${choice##*cuDNN refused: }"; failed=1; fi
    while read -r line; do
        v() { echo "$line" | sed -n "s/.* $1=\([^ ]*\).*/\1/p"; }
        eo=$(v err_out); ed=$(v err_dqkv)
        st=$(python3 -c "import sys; print('ok' if float(sys.argv[1]) <= float(sys.argv[3]) and float(sys.argv[2]) <= float(sys.argv[3]) else 'FAIL')" "$eo" "$ed" "$TOL_ATTN")
        [ "$st" = ok ] || failed=1
        row "attn_$(v impl)_B$(v B)" "$st" "fwd $(v fwd_ms) ms $(v fwd_tflops) TFLOP/s, bwd $(v bwd_ms) ms $(v bwd_tflops) TFLOP/s, fwd+bwd $(v total_tflops) TFLOP/s; vs simt: out $eo, dqkv $ed (tol $TOL_ATTN)"
    done < <(grep '^bench_attention ' "$OUT/bench_attention.txt")
else
    row attention_choice skip "build/test/bench_attention not built (see the build line at the top)"
fi

# --- 5. Benchmarks (defined here, run in two parts: the headline shapes right
# after the first tiny runs, the variants at the end) --------------------
# Random tokens, no data. MFU against the H100/H200 dense bf16 datasheet peak
# (989 TFLOP/s); measured bf16 GEMM there is ~770-800 TFLOP/s.
PEAK_GFLOPS=989000
bench() { # NAME STEPS SETS...
    local name=$1 steps=$2; shift 2
    if over_budget; then row "bench_$name" skip "over the time budget"; return; fi
    section "bench $name"
    local sets=()
    for s in "$@"; do sets+=(--set "$s"); done
    timeout 200 ./train bench configs/bench-cpu.yaml --steps "$steps" --set device=cuda "${sets[@]}" \
        > "$OUT/bench_$name.txt" 2>&1
    local rc=$?
    cat "$OUT/bench_$name.txt"
    local line; line=$(grep '^bench: tok_per_s=' "$OUT/bench_$name.txt")
    if [ $rc -ne 0 ] || [ -z "$line" ]; then
        row "bench_$name" FAIL "exit $rc: $(tail -n 1 "$OUT/bench_$name.txt")"; failed=1; return
    fi
    local tok gf mem
    tok=$(echo "$line" | sed -n 's/.*tok_per_s=\([0-9.]*\).*/\1/p')
    gf=$(echo "$line" | sed -n 's/.*step_gflops=\([0-9.]*\).*/\1/p')
    mem=$(sed -n 's/^bench: peak_mem_gib=//p' "$OUT/bench_$name.txt")
    local prec; prec=$(sed -n 's/^bench: \(master=.*\)/\1/p' "$OUT/bench_$name.txt")
    if [[ $name == *master16* && $prec != *master=bf16* ]]; then # the mode really ran
        row "bench_$name" FAIL "precision.master bf16 did not run: '${prec:-no master line}'"; failed=1; return
    fi
    local fus; fus=$(sed -n 's/^bench: gelu_fusion=//p' "$OUT/bench_$name.txt")
    local fb; fb=$(grep -c 'the GeLU runs as its own kernel' "$OUT/bench_$name.txt")
    [ "$fb" -gt 0 ] && fus="$fus, fell back for $fb shape(s)"
    row "bench_$name" ok "$(awk -v t="$tok" -v g="$gf" -v p="$PEAK_GFLOPS" -v m="$mem" \
        'BEGIN { printf "%.0f tok/s, %.1f TFLOP/s, MFU %.1f%%, peak mem %s GiB", t, g / 1e3, 100 * g / p, m }'), gelu fusion $fus, $prec"
}
GPT2_124M="model.n_layer=12 model.n_head=12 model.n_embd=768 model.seq_len=1024"
GPT2_1558M="model.n_layer=48 model.n_head=25 model.n_embd=1600 model.seq_len=1024"

# --- 6. Tiny run on both backends --------------------------------------------
section "tiny: 50 steps, cpu vs cuda"
if [ ! -f data/austen/train_000000.bin ]; then
    ./train prepare --tokenizer byte --out data/austen --val-fraction 0.05 --shard-tokens 2000000 data/austen.txt >/dev/null
fi
tiny() { # NAME DEVICE COMPUTE [ATTENTION [RECOMPUTE [GELU_FUSION [MASTER]]]]
    timeout 150 ./train configs/tiny.yaml --set device="$2" --set precision.compute="$3" \
        --set precision.attention="${4:-auto}" --set model.recompute="${5:-none}" \
        --set precision.gelu_fusion="${6:-auto}" --set precision.master="${7:-fp32}" \
        --set train.steps=50 --set train.sample_every=0 --set train.eval_every=0 --set checkpoint.every=20 \
        --set metrics.log_every=10 --set run.dir="$OUT/tiny_$1" > "$OUT/tiny_$1.txt" 2>&1
    local rc=$?
    tail -n 4 "$OUT/tiny_$1.txt"
    return $rc
}
# Checkpoints across backends: tiny_FROM's step-20 checkpoint resumed on
# DEVICE for steps 21..50 (run tiny_NAME); compare NAME TOL FROM then checks
# that continuation against FROM's own steps 21..50.
resume_on() { # NAME DEVICE COMPUTE FROM
    timeout 150 ./train configs/tiny.yaml --set device="$2" --set precision.compute="$3" \
        --set train.steps=50 --set train.sample_every=0 --set train.eval_every=0 --set checkpoint.every=20 \
        --set metrics.log_every=10 --set run.dir="$OUT/tiny_$1" \
        --resume "$OUT/tiny_$4/checkpoints/step_00000020" > "$OUT/tiny_$1.txt" 2>&1
    local rc=$?
    tail -n 4 "$OUT/tiny_$1.txt"
    return $rc
}
compare() { # NAME TOL [BASE]: every step's loss against the CPU run (or tiny_BASE's)
    python3 - "$OUT/tiny_${3:-cpu}/metrics.jsonl" "$OUT/tiny_$1/metrics.jsonl" "$2" "${3:-cpu}" <<'EOF'
import json, sys
def losses(p):
    return [json.loads(l)["loss"] for l in open(p) if '"loss"' in l]
a, b, tol = losses(sys.argv[1]), losses(sys.argv[2]), float(sys.argv[3])
n = min(len(a), len(b))
if len(a) == 50 and len(b) == 30:  # a resumed run (resume_on): steps 21..50 against the base's
    a, n = a[20:], 30
elif n < 50:
    print(f"only {n} steps to compare"); sys.exit(1)
worst = max(range(n), key=lambda i: abs(a[i] - b[i]) / abs(a[i]))
rel = abs(a[worst] - b[worst]) / abs(a[worst])
ref = "cpu" if sys.argv[4] == "cpu" else sys.argv[4]
run = "gpu" if sys.argv[4] == "cpu" else "this"
first = 51 - n  # 1, or 21 for a resumed run
print(f"max rel diff {rel:.2e} at step {worst + first} ({ref} {a[worst]:.5f}, {run} {b[worst]:.5f}); "
      f"final {ref} {a[n-1]:.4f} {run} {b[n-1]:.4f}")
sys.exit(0 if rel <= tol else 1)
EOF
}
tiny_cpu_ok=0
if tiny cpu cpu fp32; then
    tiny_cpu_ok=1
    row tiny_cpu ok "$(grep -o 'final loss [0-9.]*' "$OUT/tiny_cpu.txt")"
    # cuda_bf16 runs attention on auto's choice, the first kept path of
    # cudnn, tensor_cores, simt (its log's "attention: B=..." line says which;
    # tiny's head size is 32),
    # cuda_bf16_simt on the SIMT kernels, cuda_bf16_cudnn on cuDNN's fused
    # attention: if only one fails, suspect its path.
    for pair in "cuda_fp32 fp32 $TOL_TINY_FP32 auto" "cuda_bf16 bf16 $TOL_TINY_BF16 auto" \
                "cuda_bf16_simt bf16 $TOL_TINY_BF16 simt" "cuda_bf16_cudnn bf16 $TOL_TINY_BF16 cudnn"; do
        set -- $pair
        if over_budget; then row "tiny_$1" skip "over the time budget"; continue; fi
        if ! tiny "$1" cuda "$2" "$4"; then row "tiny_$1" FAIL "run failed: $(tail -n 1 "$OUT/tiny_$1.txt")"; failed=1; continue; fi
        msg=$(compare "$1" "$3"); rc=$?
        echo "$1: $msg"
        if [ $rc -eq 0 ]; then row "tiny_$1" ok "$msg (tol $3)"; else row "tiny_$1" FAIL "$msg (tol $3)"; failed=1; fi
        if [ "$1" = cuda_bf16 ]; then row attention_auto_tiny note "$(grep -m1 '^attention: B=' "$OUT/tiny_$1.txt")"; fi
    done
    # precision.gelu_fusion: the runs above fuse the fc product and its GeLU
    # (cuBLASLt GELU_AUX_BIAS forward, DGELU backward) where cuBLASLt takes
    # the shape; a refused shape falls back to the separate ops with a warning
    # naming it. Did it run? The log's "gelu fusion:" line and no warning.
    # The same bf16 run with fusion off must agree within the bf16 tolerance
    # (the epilogue's GeLU reads the unrounded product, and is the library's).
    fusion_state() { # LOG: "fused" or why not
        if ! grep -q 'gelu fusion: on' "$1"; then echo "not on: $(grep -o 'gelu fusion: .*' "$1" | head -1)"
        elif grep -q 'the GeLU runs as its own kernel' "$1"; then
            echo "fell back for $(grep -c 'the GeLU runs as its own kernel' "$1") shape(s): $(grep -m1 -o 'cublasLt: .*epilogue: [^(]*' "$1")"
        else echo fused; fi
    }
    for name in cuda_bf16 cuda_fp32; do
        [ -s "$OUT/tiny_$name.txt" ] || continue
        st=$(fusion_state "$OUT/tiny_$name.txt")
        # not a failure: cuBLASLt may lack the epilogue for a type or shape
        if [ "$st" = fused ]; then row "gelu_fusion_$name" ok "fc + GeLU fused by cuBLASLt (forward and backward)"
        else row "gelu_fusion_$name" note "$st"; fi
    done
    # A GPU checkpoint resumes on the CPU and a CPU one on the GPU, format
    # unchanged: each continuation (steps 21..50) against the run it left,
    # within the bf16 tolerance (the two sides round differently from step 21
    # on). A checkpoint that lost the optimizer state or misplaced a tensor
    # is off by far more at step 21.
    for pair in "resume_gpu_on_cpu cpu fp32 cuda_bf16" "resume_cpu_on_gpu cuda bf16 cpu"; do
        set -- $pair
        if over_budget; then row "$1" skip "over the time budget"; continue; fi
        if [ ! -d "$OUT/tiny_$4/checkpoints/step_00000020" ]; then row "$1" FAIL "no step-20 checkpoint in tiny_$4"; failed=1; continue; fi
        if ! resume_on "$1" "$2" "$3" "$4"; then row "$1" FAIL "run failed: $(tail -n 1 "$OUT/tiny_$1.txt")"; failed=1; continue; fi
        msg=$(compare "$1" "$TOL_TINY_BF16" "$4"); rc=$?
        echo "$1: $msg"
        if [ $rc -eq 0 ]; then row "$1" ok "$msg (tol $TOL_TINY_BF16)"; else row "$1" FAIL "$msg (tol $TOL_TINY_BF16)"; failed=1; fi
    done
else
    row tiny_cpu FAIL "cpu run failed: $(tail -n 1 "$OUT/tiny_cpu.txt")"; failed=1
fi

# The headline figures next, before the variants, so a short window has them.
# shellcheck disable=SC2086
bench 124m_bf16 10 $GPT2_124M batch.micro_batch=16 batch.total_tokens=16384 precision.compute=bf16
# 1.5B: ~25 GB of fp32 parameters, gradients and AdamW state, 3 GB of bf16
# weight copy, and ~23 GB of bf16 activations at micro-batch 8 (45 GB in fp32).
# shellcheck disable=SC2086
bench 1558m_bf16 5 $GPT2_1558M batch.micro_batch=8 batch.total_tokens=8192 precision.compute=bf16

# --- 7. Tiny variants (against the runs above) --------------------------------
if [ $tiny_cpu_ok = 1 ]; then
    section "tiny variants: fusion off, recompute, master bf16"
    if over_budget; then row tiny_cuda_bf16_nofusion skip "over the time budget"
    elif tiny cuda_bf16_nofusion cuda bf16 auto none off; then
        msg=$(compare cuda_bf16_nofusion "$TOL_TINY_BF16"); rc=$?
        msg2=$(compare cuda_bf16 "$TOL_TINY_BF16" cuda_bf16_nofusion); rc2=$?
        echo "cuda_bf16_nofusion: $msg; fused vs not: $msg2"
        if [ $rc -eq 0 ] && [ $rc2 -eq 0 ]; then row tiny_cuda_bf16_nofusion ok "vs cpu: $msg; fused run vs this: ${msg2%%;*} (tol $TOL_TINY_BF16)"
        else row tiny_cuda_bf16_nofusion FAIL "vs cpu: $msg; fused run vs this: $msg2 (tol $TOL_TINY_BF16)"; failed=1; fi
    else row tiny_cuda_bf16_nofusion FAIL "run failed: $(tail -n 1 "$OUT/tiny_cuda_bf16_nofusion.txt")"; failed=1; fi
    # model.recompute: the backward recomputes LayerNorm and GeLU outputs with
    # the forward's own kernels on the same inputs, so every loss is the one
    # without recomputation, bit for bit (the kernels are deterministic); with
    # GeLU fusion off, as the recomputed GeLU is the kernel's, not the epilogue's
    if over_budget; then row tiny_cuda_bf16_norm_gelu skip "over the time budget"
    elif [ -s "$OUT/tiny_cuda_bf16_nofusion/metrics.jsonl" ] && tiny cuda_bf16_norm_gelu cuda bf16 auto norm_gelu off; then
        strip() { grep -o '"step":[0-9]*,"tokens":[0-9]*,"loss":[^,]*\|"grad_norm":[^,]*' "$1"; }
        if [ "$(strip "$OUT/tiny_cuda_bf16_nofusion/metrics.jsonl")" = "$(strip "$OUT/tiny_cuda_bf16_norm_gelu/metrics.jsonl")" ]; then
            row tiny_cuda_bf16_norm_gelu ok "fusion off: losses and gradient norms equal to recompute none's, bit for bit"
        else row tiny_cuda_bf16_norm_gelu FAIL "fusion off: losses or gradient norms differ from recompute none's"; failed=1; fi
    else row tiny_cuda_bf16_norm_gelu FAIL "run failed: $(tail -n 1 "$OUT/tiny_cuda_bf16_norm_gelu.txt")"; failed=1; fi
    # and with fusion on: the fused forward keeps the pre-activation, the
    # backward recomputes the GeLU from it; within the bf16 tolerance of the CPU
    if over_budget; then row tiny_cuda_bf16_norm_gelu_fused skip "over the time budget"
    elif tiny cuda_bf16_norm_gelu_fused cuda bf16 auto norm_gelu auto; then
        msg=$(compare cuda_bf16_norm_gelu_fused "$TOL_TINY_BF16"); rc=$?
        echo "cuda_bf16_norm_gelu_fused: $msg"
        if [ $rc -eq 0 ]; then row tiny_cuda_bf16_norm_gelu_fused ok "$msg (tol $TOL_TINY_BF16)"
        else row tiny_cuda_bf16_norm_gelu_fused FAIL "$msg (tol $TOL_TINY_BF16)"; failed=1; fi
    else row tiny_cuda_bf16_norm_gelu_fused FAIL "run failed: $(tail -n 1 "$OUT/tiny_cuda_bf16_norm_gelu_fused.txt")"; failed=1; fi
    # precision.master bf16: the bf16 copy is the parameters, updated by
    # adamw_update_p16 with stochastic rounding; the log line says the mode ran
    if over_budget; then row tiny_cuda_bf16_master16 skip "over the time budget"
    elif tiny cuda_bf16_master16 cuda bf16 auto none auto bf16; then
        msg=$(compare cuda_bf16_master16 "$TOL_TINY_MASTER16"); rc=$?
        echo "cuda_bf16_master16: $msg"
        if ! grep -q 'parameters: bf16 (precision.master)' "$OUT/tiny_cuda_bf16_master16.txt"; then
            row tiny_cuda_bf16_master16 FAIL "no 'parameters: bf16' line: the mode did not run"; failed=1
        elif [ $rc -eq 0 ]; then row tiny_cuda_bf16_master16 ok "$msg (tol $TOL_TINY_MASTER16)"
        else row tiny_cuda_bf16_master16 FAIL "$msg (tol $TOL_TINY_MASTER16)"; failed=1; fi
    else row tiny_cuda_bf16_master16 FAIL "run failed: $(tail -n 1 "$OUT/tiny_cuda_bf16_master16.txt")"; failed=1; fi
fi

# --- 7b. Llama and MoE: 50 steps of llama-tiny and moe-tiny, cpu vs cuda -------
# GQA + RoPE + SwiGLU (SIMT attention: grouped K/V heads), and MoE routing,
# dispatch and per-expert products; tolerances as tiny's. In bf16 a router
# score within bf16 noise of another may pick another expert (test/model_emu.c
# says why), so a moe-tiny bf16 failure alone points there first.
section "llama-tiny and moe-tiny: 50 steps, cpu vs cuda"
arch_tiny() { # NAME CONFIG DEVICE COMPUTE
    timeout 150 ./train "configs/$2.yaml" --set device="$3" --set precision.compute="$4" --set train.steps=50 \
        --set train.sample_every=0 --set train.eval_every=0 --set checkpoint.every=0 --set checkpoint.final=false \
        --set metrics.log_every=10 --set run.dir="$OUT/tiny_$1" > "$OUT/tiny_$1.txt" 2>&1
}
for cfg in llama-tiny moe-tiny; do
    if over_budget; then row "$cfg" skip "over the time budget"; continue; fi
    if ! arch_tiny "${cfg}_cpu" "$cfg" cpu fp32; then row "$cfg" FAIL "cpu run failed: $(tail -n 1 "$OUT/tiny_${cfg}_cpu.txt")"; failed=1; continue; fi
    for pc in "fp32 $TOL_TINY_FP32" "bf16 $TOL_TINY_BF16"; do
        set -- $pc
        n="${cfg}_cuda_$1"
        if ! arch_tiny "$n" "$cfg" cuda "$1"; then row "$n" FAIL "run failed: $(tail -n 1 "$OUT/tiny_$n.txt")"; failed=1; continue; fi
        msg=$(compare "$n" "$2" "${cfg}_cpu"); rc=$?
        echo "$n: $msg"
        if [ $rc -eq 0 ]; then row "$n" ok "$msg (tol $2)"; else row "$n" FAIL "$msg (tol $2)"; failed=1; fi
    done
done

# --- 8. Benchmark variants ------------------------------------------------------
# the same without GeLU fusion (precision.gelu_fusion off): what the
# epilogues gain against the separate GeLU kernels
# shellcheck disable=SC2086
bench 124m_bf16_nofusion 10 $GPT2_124M batch.micro_batch=16 batch.total_tokens=16384 precision.compute=bf16 \
    precision.gelu_fusion=off
# the same with model.recompute=norm_gelu: peak memory down by its 1.57 GiB
# of bf16 activations (--dry-run), tok/s down by the recomputation's cost
# shellcheck disable=SC2086
bench 124m_bf16_norm_gelu 10 $GPT2_124M batch.micro_batch=16 batch.total_tokens=16384 precision.compute=bf16 \
    model.recompute=norm_gelu
# shellcheck disable=SC2086
bench 124m_fp32 5 $GPT2_124M batch.micro_batch=16 batch.total_tokens=16384 precision.compute=fp32
# 1.5B with precision.master bf16: no fp32 parameter arena, 6.2 GB less
# (peak memory against 1558m_bf16's), AdamW writing bf16 parameters
# shellcheck disable=SC2086
bench 1558m_bf16_master16 5 $GPT2_1558M batch.micro_batch=8 batch.total_tokens=8192 precision.compute=bf16 \
    precision.master=bf16

# fp8 products (docs/precision.md): tensorwise through cuBLASLt's fp8
# kernels, rowwise as quantised operands with bf16 products; the fp8 vs
# bf16 step-time ratio is tok/s against 124m_bf16's and 1558m_bf16's rows
# shellcheck disable=SC2086
bench 124m_fp8_tensorwise 10 $GPT2_124M batch.micro_batch=16 batch.total_tokens=16384 precision.compute=bf16 \
    precision.fp8=tensorwise
# shellcheck disable=SC2086
bench 124m_fp8_rowwise 10 $GPT2_124M batch.micro_batch=16 batch.total_tokens=16384 precision.compute=bf16 \
    precision.fp8=rowwise
# shellcheck disable=SC2086
bench 1558m_fp8_tensorwise 5 $GPT2_1558M batch.micro_batch=8 batch.total_tokens=8192 precision.compute=bf16 \
    precision.fp8=tensorwise

# --- Summary -------------------------------------------------------------------
echo
echo "=== summary ($(elapsed) s; log $LOG) ==="
row total "$([ $failed -eq 0 ] && echo ok || echo FAIL)" "$(elapsed) s, $(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)"
cat "$SUM"
exit $failed
