#!/usr/bin/env bash
# cuda_check: everything a short GPU window should establish, as one prepared
# command (`make cuda-check`), shaped so that what comes back cannot be empty.
# Usage: scripts/cuda_check.sh [--limit SECONDS] [--dry-run]
#   --limit (or CUDA_CHECK_LIMIT_S, default 480): the whole command ends inside
#     it; every section checks the time left against its own worst case (the
#     sum of its commands' timeouts) before it starts, and is skipped if short.
#   --dry-run: the same script on the CPU backend at toy shapes, for
#     test/t_gpu_check.sh (needs a fake nvidia-smi on PATH); rows that only
#     mean something on CUDA say "skip (dry run)".
# Order, headline first: the op tables against references and the CPU; the
# GPT-2 124M and 1.5B benchmarks; the CPU-vs-GPU loss curves; then the rest
# (attention paths, NCCL, variants, llama/moe, benchmark variants).
# What lands in $OUT, and nothing else (the device tool returns at most 8
# files of 16 MiB, two folders deep, and the last 12,000 characters of output):
#   summary.txt        the table (also the last thing printed, < 10,000 chars)
#   logs.tar.gz        every log and small artefact of the scratch folder, no
#                      checkpoints, no file over 2 MiB, refreshed after each section
#   metrics_tiny_*.jsonl  the metrics of the headline loss-curve runs
# Binaries come only from the bundle (.gpu/kiln-gpu.tar.xz, `make gpu-bundle`
# on the build machine: STATIC=1, since a GPU host lacks libyaml, zstd,
# OpenBLAS and MPI); a missing or stale bundle is one line and exit 2 at once,
# never a build here. Exit: 0 all checks passed, 1 a check failed, 2 no GPU,
# no bundle or a stale one.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
LIMIT_S=${CUDA_CHECK_LIMIT_S:-480}
DRY=0
while [ $# -gt 0 ]; do
    case $1 in
    --limit) LIMIT_S=${2:-}; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    *) echo "cuda_check: unknown argument '$1' (usage: scripts/cuda_check.sh [--limit SECONDS] [--dry-run])"; exit 2 ;;
    esac
done
case $LIMIT_S in '' | *[!0-9]*) echo "cuda_check: --limit wants whole seconds, not '$LIMIT_S'"; exit 2 ;; esac
T0=$(date +%s)
RESERVE_S=15 # the last archive and the summary, kept back from every section's budget
OUT=${OUT:-$(mktemp -d /tmp/kiln-cuda-check.XXXXXX)}
mkdir -p "$OUT"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/kiln-check-work.XXXXXX") # run dirs and logs; never $OUT
LOG=$WORK/cuda_check.log
SUM=$OUT/summary.txt
: > "$SUM"
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

# Worst cases (seconds): each command's timeout, so a section's worst case is
# the sum of its commands'. On one H100/H200 the expected times are a fraction
# of these (op tables ~10-30 s with their CPU references, a tiny run ~5 s,
# 124M bench ~30 s, 1.5B ~60 s with threaded initialisation).
W_OPS=60 W_CROSS=90 W_BENCH_124M=90 W_BENCH_1558M=150 W_TINY=45 W_ATTN=180 W_NCCL=60

# One row of the table: NAME STATUS TEXT; the text is cut to 150 characters in
# the summary (the whole of it goes to the log), so the table stays short.
row() {
    printf '%-30s %-5s %s\n' "$1" "$2" "$3" >> "$LOG"
    printf '%-30s %-5s %.150s\n' "$1" "$2" "$3" >> "$SUM"
}
say() { echo "$*" | tee -a "$LOG"; }
elapsed() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( LIMIT_S - RESERVE_S - $(elapsed) )); }
# need WORST NAME: may a section of this worst case start? If not, a skip row.
need() {
    local l; l=$(left)
    [ "$l" -ge "$1" ] && return 0
    row "$2" skip "needs up to $1 s, $l s left of --limit $LIMIT_S"
    return 1
}
section() { say ""; say "=== $* ($(elapsed) s of $LIMIT_S) ==="; }
# cuda_only NAME: in a dry run, rows that only mean something on CUDA are skipped
cuda_only() { [ $DRY = 0 ] && return 0; row "$1" skip "dry run: needs CUDA"; return 1; }
# pack: the archive, rebuilt from the scratch folder after every section so a
# command killed at its limit still leaves the logs so far
pack() {
    (cd "$WORK" && find . -type f -size -2048k ! -path './bin/*' ! -path '*/checkpoints/*' -print0 |
        tar --null -czf "$OUT/logs.tar.gz.tmp" -T - 2>/dev/null) &&
        mv "$OUT/logs.tar.gz.tmp" "$OUT/logs.tar.gz"
    # a cap that cannot be reached by logs this size, kept as a guarantee
    if [ "$(stat -c %s "$OUT/logs.tar.gz" 2>/dev/null || echo 0)" -gt 15728640 ]; then
        tail -c 4194304 "$LOG" | gzip > "$OUT/logs.tar.gz"
    fi
}
# keep_metrics NAME: the metrics of a headline run, capped at 4 MiB
keep_metrics() { [ -f "$WORK/tiny_$1/metrics.jsonl" ] && head -c 4194304 "$WORK/tiny_$1/metrics.jsonl" > "$OUT/metrics_tiny_$1.jsonl"; }
commit_of() { cat .gpu/COMMIT 2>/dev/null || echo unknown; }
finish() {
    trap - EXIT
    say ""
    say "=== summary ($(elapsed) s of $LIMIT_S; logs in $OUT/logs.tar.gz) ==="
    row total "$([ $failed -eq 0 ] && echo ok || echo FAIL)" "$(elapsed) s, $(date -u +%Y-%m-%dT%H:%MZ), bundle of commit $(commit_of)$([ $DRY = 1 ] && echo ', DRY RUN on the CPU')"
    pack
    rm -rf "$WORK"
    # ~45 rows of at most 187 characters fit; the cut is a guarantee, not the plan
    if [ "$(stat -c %s "$SUM")" -gt 9800 ]; then
        { head -c 9000 "$SUM"; echo; echo "(summary cut at 9,000 characters: the whole table is in logs.tar.gz)"; grep '^total ' "$SUM"; } > "$SUM.tmp"
        mv "$SUM.tmp" "$SUM"
    fi
    cat "$SUM"
}
trap 'finish; exit 1' INT TERM
trap finish EXIT

# --- 0. The bundle: present and built from this tree, said at once --------------
if [ ! -f .gpu/kiln-gpu.tar.xz ]; then
    row bundle FAIL "no .gpu/kiln-gpu.tar.xz: run 'make gpu-bundle' on the build machine and carry .gpu"
    echo "cuda_check: no bundle .gpu/kiln-gpu.tar.xz: run 'make gpu-bundle' on the build machine and carry .gpu (nothing is built here)"
    trap - EXIT; rm -rf "$WORK"; exit 2
fi
if [ ! -f .gpu/SOURCES.sha256 ] || ! stale=$(sha256sum -c --quiet .gpu/SOURCES.sha256 2>&1); then
    what=$( [ -f .gpu/SOURCES.sha256 ] && echo "$stale" | sed -n 's/: FAILED.*//p' | head -n 3 | tr '\n' ' ' || echo "no .gpu/SOURCES.sha256")
    row bundle FAIL "stale: built from commit $(commit_of), differs in ${what:-unreadable sources}"
    echo "cuda_check: stale bundle (commit $(commit_of)): ${what:-sources unreadable} changed since; run 'make gpu-bundle' again and carry .gpu"
    trap - EXIT; rm -rf "$WORK"; exit 2
fi
BIN=$WORK/bin
mkdir -p "$BIN"
tar -xJf .gpu/kiln-gpu.tar.xz -C "$BIN" 2>/dev/null ||
    python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' .gpu/kiln-gpu.tar.xz "$BIN" || {
    row bundle FAIL "could not unpack .gpu/kiln-gpu.tar.xz (no xz, no python3?)"; failed=1
    echo "cuda_check: could not unpack .gpu/kiln-gpu.tar.xz"; exit 2; }
TRAIN=$BIN/train
say "cuda_check: bundle of commit $(commit_of) unpacked in $BIN; limit $LIMIT_S s$([ $DRY = 1 ] && echo '; DRY RUN: CPU backend, toy shapes')"
DEV=cuda OPS=cuda
[ $DRY = 1 ] && DEV=cpu OPS=cpu

# --- 1. The GPU and its libraries ------------------------------------------------
section "GPU"
if ! command -v nvidia-smi >/dev/null 2>&1 ||
   ! nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv >> "$LOG" 2>&1; then
    row gpu FAIL "no GPU (nvidia-smi missing or failed)"; failed=1
    say "cuda_check: no NVIDIA GPU here (nvidia-smi is missing or failed); run it on a machine with one"
    exit 2
fi
row gpu ok "$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -1)"
{
    find /usr/local/cuda/lib64/ -maxdepth 1 \( -name '*cudnn*' -o -name '*nccl*' -o -name '*cublas*' \) 2>/dev/null | grep . ||
        echo "(none under /usr/local/cuda/lib64)"
} >> "$LOG"
PIP_NV=$(python3 -c "import nvidia, os; print(os.path.dirname(nvidia.__path__[0]))" 2>/dev/null || true)
echo "pip nvidia packages under: ${PIP_NV:-none}" >> "$LOG"
extra=""
if [ -n "$PIP_NV" ]; then
    for lib in 'libcublasLt.so.*' 'libcudnn_graph.so.9*' 'libnvrtc.so.*' 'libnccl.so.2*'; do
        f=$(find "$PIP_NV/nvidia" -name "$lib" 2>/dev/null | head -1)
        [ -n "$f" ] && echo "found $f" >> "$LOG" && extra="$extra:$(dirname "$f")"
    done
fi
# NCCL and cuDNN are opened at run time (dlopen "libnccl.so.2",
# "libcudnn_graph.so.9"), so they must be on the loader's path: pip's wheels
# put them in site-packages/nvidia/{nccl,cudnn}/lib, the toolkit in lib(64).
for want in nccl:libnccl.so.2 cudnn:libcudnn_graph.so.9; do
    echo "$extra" | grep -q "${want%%:*}" && continue
    for d in "$PIP_NV/nvidia/${want%%:*}/lib" /usr/local/lib/python3*/dist-packages/nvidia/"${want%%:*}"/lib \
             /usr/lib/python3*/site-packages/nvidia/"${want%%:*}"/lib /usr/local/cuda/lib /usr/local/cuda/lib64 \
             /usr/lib/x86_64-linux-gnu; do
        if [ -e "$d/${want#*:}" ]; then echo "found $d/${want#*:}" >> "$LOG"; extra="$extra:$d"; break; fi
    done
done
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${extra}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH" >> "$LOG"
if ! "$TRAIN" --version > "$WORK/version.txt" 2>&1 || ! grep -q 'backends: .*cuda' "$WORK/version.txt"; then
    row binary FAIL "the bundle's train does not run or has no CUDA backend: $(tail -n 1 "$WORK/version.txt")"; failed=1
    ldd "$TRAIN" 2>&1 | grep 'not found' >> "$LOG"
    exit 2
fi
row binary ok "$(sed -n 's/^cuda: //p' "$WORK/version.txt"); bundle of commit $(commit_of)"
pack

# --- 2. The op tables: against double references, and against the CPU --------------
count() { grep -c "^$1 " "$2" || true; }
op_table() { # ROW SECONDS BINARY LOG BF16_PREFIX
    section "ops: $1"
    need "$2" "$1" || return
    timeout "$2" "$BIN/$3" "$OPS" > "$WORK/$4" 2>&1; local rc=$?
    local nok nfail nbf
    nok=$(count ok "$WORK/$4"); nfail=$(count FAIL "$WORK/$4")
    nbf=$(grep -c "^ok $5" "$WORK/$4" || true)
    grep '^FAIL' "$WORK/$4" | head -n 5 | tee -a "$LOG"
    if [ $rc -eq 0 ] && [ "$nfail" -eq 0 ] && { [ "$nbf" -gt 0 ] || [ $DRY = 1 ]; }; then
        row "$1" ok "$nok checks ($nbf with bf16 activations)"
    else row "$1" FAIL "$nok ok, $nfail failed, exit $rc: $(grep -m1 '^FAIL' "$WORK/$4")"; failed=1; fi
    pack
}
op_table test_ops $W_OPS build/test/test_ops test_ops.txt "ops_${OPS}_bf16_"
op_table test_backend_cross $W_CROSS build/test/test_backend_cross test_cross.txt "cross_${OPS}_bf16_"

# --- 3. The headline benchmarks: GPT-2 124M and 1.5B ----------------------------------
# Random tokens, no data. MFU against the H100/H200 dense bf16 datasheet peak
# (989 TFLOP/s); measured bf16 GEMM there is ~770-800 TFLOP/s.
PEAK_GFLOPS=989000
GPT2_124M="model.n_layer=12 model.n_head=12 model.n_embd=768 model.seq_len=1024"
GPT2_1558M="model.n_layer=48 model.n_head=25 model.n_embd=1600 model.seq_len=1024"
DRY_BENCH=()
[ $DRY = 1 ] && DRY_BENCH=(--set model.n_layer=1 --set model.n_head=2 --set model.n_embd=64 --set model.seq_len=32
                           --set batch.micro_batch=2 --set batch.total_tokens=64)
bench() { # NAME WORST STEPS SETS...
    local name=$1 worst=$2 steps=$3; shift 3
    section "bench $name"
    need "$worst" "bench_$name" || return
    local sets=()
    for s in "$@"; do sets+=(--set "$s"); done
    timeout "$worst" "$TRAIN" bench configs/bench-cpu.yaml --steps "$steps" --set device=$DEV "${sets[@]}" \
        "${DRY_BENCH[@]}" > "$WORK/bench_$name.txt" 2>&1
    local rc=$?
    grep '^bench' "$WORK/bench_$name.txt" | tee -a "$LOG"
    local line; line=$(grep '^bench: tok_per_s=' "$WORK/bench_$name.txt")
    if [ $rc -ne 0 ] || [ -z "$line" ]; then
        row "bench_$name" FAIL "exit $rc: $(tail -n 1 "$WORK/bench_$name.txt")"; failed=1; pack; return
    fi
    local tok gf mem prec fus fb
    tok=$(echo "$line" | sed -n 's/.*tok_per_s=\([0-9.]*\).*/\1/p')
    gf=$(echo "$line" | sed -n 's/.*step_gflops=\([0-9.]*\).*/\1/p')
    mem=$(sed -n 's/^bench: peak_mem_gib=//p' "$WORK/bench_$name.txt")
    prec=$(sed -n 's/^bench: \(master=.*\)/\1/p' "$WORK/bench_$name.txt")
    if [[ $name == *master16* && $prec != *master=bf16* ]]; then # the mode really ran
        row "bench_$name" FAIL "precision.master bf16 did not run: '${prec:-no master line}'"; failed=1; pack; return
    fi
    fus=$(sed -n 's/^bench: gelu_fusion=//p' "$WORK/bench_$name.txt")
    fb=$(grep -c 'the GeLU runs as its own kernel' "$WORK/bench_$name.txt")
    [ "$fb" -gt 0 ] && fus="$fus, fell back for $fb shape(s)"
    fb=$(grep -c 'the bias gradient is a column sum' "$WORK/bench_$name.txt")
    [ "$fb" -gt 0 ] && fus="$fus; BGRADB refused for $fb shape(s)"
    local init; init=$(sed -n 's/^bench: init_s=\([0-9.]*\).*/, init \1 s/p' "$WORK/bench_$name.txt")
    init="$init$(sed -n 's/^bench: host_syncs_per_step=\(.*\)/, \1 host syncs\/step/p' "$WORK/bench_$name.txt")"
    init="$init$(sed -n 's/^bench: fused_copy=\(.*\)/, compute copy by the update: \1/p' "$WORK/bench_$name.txt")"
    row "bench_$name" ok "$(awk -v t="$tok" -v g="$gf" -v p="$PEAK_GFLOPS" -v m="${mem:-?}" \
        'BEGIN { printf "%.0f tok/s, %.1f TFLOP/s, MFU %.1f%%, peak %s GiB", t, g / 1e3, 100 * g / p, m }')$init, gelu $fus, $prec"
    pack
}
# shellcheck disable=SC2086
bench 124m_bf16 $W_BENCH_124M 10 $GPT2_124M batch.micro_batch=16 batch.total_tokens=16384 precision.compute=bf16
# 1.5B: ~25 GB of fp32 parameters, gradients and AdamW state, 3 GB of bf16
# weight copy, and ~23 GB of bf16 activations at micro-batch 8 (45 GB in fp32).
# shellcheck disable=SC2086
bench 1558m_bf16 $W_BENCH_1558M 5 $GPT2_1558M batch.micro_batch=8 batch.total_tokens=8192 precision.compute=bf16

# --- 4. Loss curves: tiny for 50 steps on the CPU and on CUDA ----------------------
# (a dry run: 8 steps of a one-layer, 32-token shrink of tiny, checkpoint at 4)
STEPS=50 CK=20 TINY_DRY=()
[ $DRY = 1 ] && STEPS=8 CK=4 TINY_DRY=(--set model.n_layer=1 --set model.seq_len=32 --set batch.micro_batch=2
                                       --set batch.total_tokens=64)
CKDIR=$(printf 'step_%08d' $CK)
if [ ! -f data/austen/train_000000.bin ]; then
    "$TRAIN" prepare --tokenizer byte --out data/austen --val-fraction 0.05 --shard-tokens 2000000 data/austen.txt >> "$LOG" 2>&1
fi
tiny() { # NAME DEVICE COMPUTE [ATTENTION [RECOMPUTE [GELU_FUSION [MASTER]]]]
    timeout $W_TINY "$TRAIN" configs/tiny.yaml --set device="$2" --set precision.compute="$3" \
        --set precision.attention="${4:-auto}" --set model.recompute="${5:-none}" \
        --set precision.gelu_fusion="${6:-auto}" --set precision.master="${7:-fp32}" \
        --set train.steps=$STEPS --set train.sample_every=0 --set train.eval_every=0 --set checkpoint.every=$CK \
        --set metrics.log_every=10 "${TINY_DRY[@]}" --set run.dir="$WORK/tiny_$1" > "$WORK/tiny_$1.txt" 2>&1
}
# tiny_FROM's step-CK checkpoint resumed on DEVICE for steps CK+1..STEPS
resume_on() { # NAME DEVICE COMPUTE FROM
    timeout $W_TINY "$TRAIN" configs/tiny.yaml --set device="$2" --set precision.compute="$3" \
        --set train.steps=$STEPS --set train.sample_every=0 --set train.eval_every=0 --set checkpoint.every=$CK \
        --set metrics.log_every=10 "${TINY_DRY[@]}" --set run.dir="$WORK/tiny_$1" \
        --resume "$WORK/tiny_$4/checkpoints/$CKDIR" > "$WORK/tiny_$1.txt" 2>&1
}
compare() { # NAME TOL [BASE]: every step's loss against the CPU run (or tiny_BASE's)
    python3 - "$WORK/tiny_${3:-cpu}/metrics.jsonl" "$WORK/tiny_$1/metrics.jsonl" "$2" "${3:-cpu}" "$STEPS" "$CK" <<'EOF'
import json, sys
def losses(p):
    return [json.loads(l)["loss"] for l in open(p) if '"loss"' in l]
a, b, tol = losses(sys.argv[1]), losses(sys.argv[2]), float(sys.argv[3])
steps, ck = int(sys.argv[5]), int(sys.argv[6])
n = min(len(a), len(b))
if len(a) == steps and len(b) == steps - ck:  # a resumed run (resume_on): steps ck+1.. against the base's
    a, n = a[ck:], steps - ck
elif n < steps:
    print(f"only {n} steps to compare"); sys.exit(1)
worst = max(range(n), key=lambda i: abs(a[i] - b[i]) / abs(a[i]))
rel = abs(a[worst] - b[worst]) / abs(a[worst])
ref = "cpu" if sys.argv[4] == "cpu" else sys.argv[4]
run = "gpu" if sys.argv[4] == "cpu" else "this"
first = steps + 1 - n  # 1, or ck+1 for a resumed run
print(f"max rel diff {rel:.2e} at step {worst + first} ({ref} {a[worst]:.5f}, {run} {b[worst]:.5f}); "
      f"final {ref} {a[n-1]:.4f} {run} {b[n-1]:.4f}")
sys.exit(0 if rel <= tol else 1)
EOF
}
# curve NAME TOL DEVICE COMPUTE [ATTENTION...]: a tiny run compared with tiny_cpu
curve() {
    local name=$1 tol=$2; shift 2
    need $W_TINY "tiny_$name" || return 1
    if ! tiny "$name" "$@"; then row "tiny_$name" FAIL "run failed: $(tail -n 1 "$WORK/tiny_$name.txt")"; failed=1; return 1; fi
    local msg rc
    msg=$(compare "$name" "$tol"); rc=$?
    say "$name: $msg"
    if [ $rc -eq 0 ]; then row "tiny_$name" ok "$msg (tol $tol)"; else row "tiny_$name" FAIL "$msg (tol $tol)"; failed=1; fi
}
section "loss curves: tiny, $STEPS steps, cpu vs $DEV"
tiny_cpu_ok=0
if need $W_TINY tiny_cpu; then
    if tiny cpu cpu fp32; then
        tiny_cpu_ok=1
        row tiny_cpu ok "$(grep -o 'final loss [0-9.]*' "$WORK/tiny_cpu.txt")"
        keep_metrics cpu
    else row tiny_cpu FAIL "cpu run failed: $(tail -n 1 "$WORK/tiny_cpu.txt")"; failed=1; fi
fi
if [ $tiny_cpu_ok = 1 ]; then
    # cuda_bf16 runs attention on auto's choice (cudnn, tensor_cores, simt:
    # the log's "attention: B=..." line says which; tiny's head size is 32)
    curve cuda_fp32 $TOL_TINY_FP32 "$DEV" fp32 && keep_metrics cuda_fp32
    curve cuda_bf16 $TOL_TINY_BF16 "$DEV" bf16 && keep_metrics cuda_bf16 &&
        grep -q '^attention: B=' "$WORK/tiny_cuda_bf16.txt" &&
        row attention_auto_tiny note "$(grep -m1 '^attention: B=' "$WORK/tiny_cuda_bf16.txt")"
fi
pack

# --- 5. The rest ------------------------------------------------------------------------
# Attention: the candidates bf16 kept, each path's throughput and error, and
# auto's path against the targets (bench_attention: the backend line after
# set_precision bf16, then forward and backward times of simt, tensor_cores,
# cudnn, cudnn with precision.attention_deterministic false, and auto, at
# GPT-2 124M's (B 16, 12 heads) and 1.5B's (B 8, 25 heads) shapes, T 1024,
# head size 64, each with its max error against the SIMT kernels on the same
# inputs). TFLOP/s count the causal half, 2 per multiply-add: forward 2 B NH
# T^2 hs (half of 4 B T^2 NH hs), backward 2.5x that (FlashAttention-2's
# five products). Targets (issue 20, H200): auto's path >= 350 TFLOP/s
# forward, >= 250 backward; a miss is a note, not a failure. The dry run
# runs the same bench on the CPU backend at its small shape (one path).
# Worst case 180 s: cuDNN plans each shape once per backward form (the
# self-check's, 124M's, 1.5B's: 6 forward and 6 backward graphs, its
# runtime-compiled engines seconds each), the timings themselves well under
# a second per path.
# Error tolerance 2e-2 of the largest element, out and dqkv: the start-up
# self-check's (cuda/attention.cu ATT_CHECK_TOL): one bf16 ulp (2^-7 of the
# max) from two roundings of nearby fp32 values, plus P and dS rounded to bf16
# before their products (~1e-3), times 2; a wrong mask or stride errs by 0.1.
TOL_ATTN=2e-2
section "attention: candidates, throughput and error vs SIMT, targets (bench_attention)"
if need $W_ATTN attention_paths; then
    if [ $DRY = 1 ]; then ATTN_ARGS=(cpu fp32 0 small); else ATTN_ARGS=(cuda bf16); fi
    timeout $W_ATTN "$BIN/build/test/bench_attention" "${ATTN_ARGS[@]}" > "$WORK/bench_attention.txt" 2>&1; rc=$?
    head -n 40 "$WORK/bench_attention.txt" >> "$LOG"
    choice=$(sed -n 's/^# .*\(attention: .*\)$/\1/p' "$WORK/bench_attention.txt" | head -n 1)
    if [ $rc -ne 0 ]; then row attention_paths FAIL "bench_attention exit $rc: $(tail -n 1 "$WORK/bench_attention.txt")"; failed=1
    elif cuda_only attention_choice; then
        if grep -q 'disagree' "$WORK/bench_attention.txt"; then row attention_choice FAIL "self-check failed: $choice"; failed=1
        elif [[ $choice == *"tensor cores passed"* ]]; then row attention_choice ok "$choice"
        else row attention_choice FAIL "auto refused the tensor cores: ${choice:-no backend line}"; failed=1; fi
        if [[ $choice == *"among cudnn"* ]]; then row attention_cudnn ok "self-check passed: ${choice##*cuDNN passed: }"
        else row attention_cudnn FAIL "auto did not keep cuDNN: ${choice##*cuDNN refused: }"; failed=1; fi
    fi
    while read -r line; do
        v() { echo "$line" | sed -n "s/.* $1=\([^ ]*\).*/\1/p"; }
        eo=$(v err_out); ed=$(v err_dqkv)
        st=$(python3 -c "import sys; print('ok' if float(sys.argv[1]) <= float(sys.argv[3]) and float(sys.argv[2]) <= float(sys.argv[3]) else 'FAIL')" "$eo" "$ed" "$TOL_ATTN")
        [ "$st" = ok ] || failed=1
        row "attn_$(v shape)_$(v impl)" "$st" "fwd $(v fwd_tflops) bwd $(v bwd_tflops) TFLOP/s ($(v fwd_ms)/$(v bwd_ms) ms, B=$(v B) NH=$(v NH)); vs simt: out $eo, dqkv $ed (tol $TOL_ATTN)"
    done < <(grep '^bench_attention ' "$WORK/bench_attention.txt")
    while read -r line; do
        v() { echo "$line" | sed -n "s/.* $1=\([^ ]*\).*/\1/p"; }
        st=ok; [ "$(v fwd_target)$(v bwd_target)" = metmet ] || st=note
        row "attn_$(v shape)_auto_target" "$st" "auto runs $(v path): fwd $(v fwd_tflops) TFLOP/s (target $(v target_fwd): $(v fwd_target)), bwd $(v bwd_tflops) (target $(v target_bwd): $(v bwd_target)); targets for an H200"
    done < <(grep '^bench_attention_auto ' "$WORK/bench_attention.txt")
    grep -q '^# skip cudnn_atomic' "$WORK/bench_attention.txt" &&
        row attn_cudnn_atomic note "$(sed -n 's/^# skip cudnn_atomic: //p' "$WORK/bench_attention.txt" | head -n 1)"
fi
pack

section "comm: test_nccl (NCCL device mode, one rank)"
if need $W_NCCL test_nccl; then
    timeout $W_NCCL "$BIN/build/test/test_nccl" > "$WORK/test_nccl.txt" 2>&1; rc=$?
    nok=$(count ok "$WORK/test_nccl.txt"); nfail=$(count FAIL "$WORK/test_nccl.txt")
    if [ $DRY = 1 ] && grep -q '^skip nccl_device' "$WORK/test_nccl.txt"; then row test_nccl skip "dry run: $(grep -m1 '^skip' "$WORK/test_nccl.txt")"
    elif [ $rc -eq 0 ] && [ "$nfail" -eq 0 ] && [ "$nok" -gt 1 ]; then
        row test_nccl ok "$nok checks, $(sed -n 's/^# nccl: //p' "$WORK/test_nccl.txt" | head -1)"
    else
        row test_nccl FAIL "$nok ok, $nfail failed, exit $rc: $(grep -m1 -E '^(FAIL|skip)' "$WORK/test_nccl.txt")"; failed=1
    fi
fi
pack

if [ $tiny_cpu_ok = 1 ]; then
    section "loss curves: attention paths, GeLU fusion, checkpoints across backends"
    cuda_only tiny_cuda_bf16_simt && curve cuda_bf16_simt $TOL_TINY_BF16 "$DEV" bf16 simt
    cuda_only tiny_cuda_bf16_cudnn && curve cuda_bf16_cudnn $TOL_TINY_BF16 "$DEV" bf16 cudnn
    # cuDNN's execute failing at the training shape (tiny's B 16; the test hook
    # fails every execute there): auto warns once and kiln's kernels go on
    if cuda_only tiny_cudnn_fallback && grep -q 'among cudnn' "$WORK/tiny_cuda_bf16.txt" 2>/dev/null &&
       KILN_TEST_CUDNN_FAIL_B=16 curve cudnn_fallback $TOL_TINY_BF16 "$DEV" bf16; then
        n=$(grep -c 'cuDNN failed at B=16' "$WORK/tiny_cudnn_fallback.txt")
        [ "$n" = 1 ] || { row tiny_cudnn_fallback FAIL "$n 'cuDNN failed' warnings, want 1"; failed=1; }
    fi
    # precision.gelu_fusion: did cuBLASLt's epilogue run, or fall back (a warning)?
    fusion_state() { # LOG: "fused" or why not
        if ! grep -q 'gelu fusion: on' "$1"; then echo "not on: $(grep -o 'gelu fusion: .*' "$1" | head -1)"
        elif grep -q 'the GeLU runs as its own kernel' "$1"; then
            echo "fell back for $(grep -c 'the GeLU runs as its own kernel' "$1") shape(s): $(grep -m1 -o 'cublasLt: .*epilogue: [^(]*' "$1")"
        else echo fused; fi
    }
    for name in cuda_bf16 cuda_fp32; do
        [ -s "$WORK/tiny_$name.txt" ] && cuda_only "gelu_fusion_$name" || continue
        st=$(fusion_state "$WORK/tiny_$name.txt")
        # not a failure: cuBLASLt may lack the epilogue for a type or shape
        if [ "$st" = fused ]; then row "gelu_fusion_$name" ok "fc + GeLU fused by cuBLASLt (forward and backward)"
        else row "gelu_fusion_$name" note "$st"; fi
    done
    # A GPU checkpoint resumes on the CPU and a CPU one on the GPU, format
    # unchanged: each continuation against the run it left, within the bf16
    # tolerance (the two sides round differently from the resumed step on).
    for pair in "resume_gpu_on_cpu cpu fp32 cuda_bf16" "resume_cpu_on_gpu $DEV bf16 cpu"; do
        set -- $pair
        need $W_TINY "$1" || continue
        if [ ! -d "$WORK/tiny_$4/checkpoints/$CKDIR" ]; then row "$1" FAIL "no $CKDIR checkpoint in tiny_$4"; failed=1; continue; fi
        if ! resume_on "$1" "$2" "$3" "$4"; then row "$1" FAIL "run failed: $(tail -n 1 "$WORK/tiny_$1.txt")"; failed=1; continue; fi
        msg=$(compare "$1" "$TOL_TINY_BF16" "$4"); rc=$?
        say "$1: $msg"
        if [ $rc -eq 0 ]; then row "$1" ok "$msg (tol $TOL_TINY_BF16)"; else row "$1" FAIL "$msg (tol $TOL_TINY_BF16)"; failed=1; fi
    done
    pack

    section "loss curves: fusion off, recompute, master bf16"
    if need $W_TINY tiny_cuda_bf16_nofusion; then
        if tiny cuda_bf16_nofusion "$DEV" bf16 auto none off; then
            msg=$(compare cuda_bf16_nofusion "$TOL_TINY_BF16"); rc=$?
            msg2=$(compare cuda_bf16 "$TOL_TINY_BF16" cuda_bf16_nofusion); rc2=$?
            say "cuda_bf16_nofusion: $msg; fused vs not: $msg2"
            if [ $rc -eq 0 ] && [ $rc2 -eq 0 ]; then row tiny_cuda_bf16_nofusion ok "vs cpu: $msg; fused run vs this: ${msg2%%;*} (tol $TOL_TINY_BF16)"
            else row tiny_cuda_bf16_nofusion FAIL "vs cpu: $msg; fused run vs this: $msg2 (tol $TOL_TINY_BF16)"; failed=1; fi
        else row tiny_cuda_bf16_nofusion FAIL "run failed: $(tail -n 1 "$WORK/tiny_cuda_bf16_nofusion.txt")"; failed=1; fi
    fi
    # model.recompute: the backward recomputes LayerNorm and GeLU outputs with
    # the forward's own kernels on the same inputs, so every loss is the one
    # without recomputation, bit for bit (the kernels are deterministic); with
    # GeLU fusion off, as the recomputed GeLU is the kernel's, not the epilogue's
    if need $W_TINY tiny_cuda_bf16_norm_gelu; then
        if [ -s "$WORK/tiny_cuda_bf16_nofusion/metrics.jsonl" ] && tiny cuda_bf16_norm_gelu "$DEV" bf16 auto norm_gelu off; then
            strip() { grep -o '"step":[0-9]*,"tokens":[0-9]*,"loss":[^,]*\|"grad_norm":[^,]*' "$1"; }
            if [ "$(strip "$WORK/tiny_cuda_bf16_nofusion/metrics.jsonl")" = "$(strip "$WORK/tiny_cuda_bf16_norm_gelu/metrics.jsonl")" ]; then
                row tiny_cuda_bf16_norm_gelu ok "fusion off: losses and gradient norms equal to recompute none's, bit for bit"
            else row tiny_cuda_bf16_norm_gelu FAIL "fusion off: losses or gradient norms differ from recompute none's"; failed=1; fi
        else row tiny_cuda_bf16_norm_gelu FAIL "run failed: $(tail -n 1 "$WORK/tiny_cuda_bf16_norm_gelu.txt" 2>/dev/null)"; failed=1; fi
    fi
    # with fusion on: the fused forward keeps the pre-activation, the backward
    # recomputes the GeLU from it; within the bf16 tolerance of the CPU
    curve cuda_bf16_norm_gelu_fused $TOL_TINY_BF16 "$DEV" bf16 auto norm_gelu auto
    # precision.master bf16: the bf16 copy is the parameters, updated by
    # adamw_update_p16 with stochastic rounding; the log line says the mode ran
    if cuda_only tiny_cuda_bf16_master16 && curve cuda_bf16_master16 $TOL_TINY_MASTER16 "$DEV" bf16 auto none auto bf16 &&
       ! grep -q 'parameters: bf16 (precision.master)' "$WORK/tiny_cuda_bf16_master16.txt"; then
        row tiny_cuda_bf16_master16 FAIL "no 'parameters: bf16' line: the mode did not run"; failed=1
    fi
    pack
fi

# Llama and MoE: GQA + RoPE + SwiGLU, and MoE routing, dispatch and per-expert
# products; tolerances as tiny's. In bf16 a router score within bf16 noise of
# another may pick another expert (test/model_emu.c), so a moe-tiny bf16
# failure alone points there first.
section "llama-tiny and moe-tiny: cpu vs $DEV"
arch_tiny() { # NAME CONFIG DEVICE COMPUTE
    timeout $W_TINY "$TRAIN" "configs/$2.yaml" --set device="$3" --set precision.compute="$4" --set train.steps=$STEPS \
        --set train.sample_every=0 --set train.eval_every=0 --set checkpoint.every=0 --set checkpoint.final=false \
        --set metrics.log_every=10 "${TINY_DRY[@]}" --set run.dir="$WORK/tiny_$1" > "$WORK/tiny_$1.txt" 2>&1
}
for cfg in llama-tiny moe-tiny; do
    need $((3 * W_TINY)) "$cfg" || continue
    if ! arch_tiny "${cfg}_cpu" "$cfg" cpu fp32; then row "$cfg" FAIL "cpu run failed: $(tail -n 1 "$WORK/tiny_${cfg}_cpu.txt")"; failed=1; continue; fi
    for pc in "fp32 $TOL_TINY_FP32" "bf16 $TOL_TINY_BF16"; do
        set -- $pc
        n="${cfg}_cuda_$1"
        if ! arch_tiny "$n" "$cfg" "$DEV" "$1"; then row "$n" FAIL "run failed: $(tail -n 1 "$WORK/tiny_$n.txt")"; failed=1; continue; fi
        msg=$(compare "$n" "$2" "${cfg}_cpu"); rc=$?
        say "$n: $msg"
        if [ $rc -eq 0 ]; then row "$n" ok "$msg (tol $2)"; else row "$n" FAIL "$msg (tol $2)"; failed=1; fi
    done
    pack
done

# Benchmark variants: without GeLU fusion (what the epilogues gain), with
# model.recompute=norm_gelu (peak memory down by its 1.57 GiB of bf16
# activations, tok/s down by the recomputation), fp32, and 1.5B with
# precision.master bf16 (no fp32 parameter arena: 6.2 GB less)
# shellcheck disable=SC2086
bench 124m_bf16_nofusion $W_BENCH_124M 10 $GPT2_124M batch.micro_batch=16 batch.total_tokens=16384 \
    precision.compute=bf16 precision.gelu_fusion=off
# shellcheck disable=SC2086
bench 124m_bf16_norm_gelu $W_BENCH_124M 10 $GPT2_124M batch.micro_batch=16 batch.total_tokens=16384 \
    precision.compute=bf16 model.recompute=norm_gelu
# shellcheck disable=SC2086
bench 124m_fp32 $W_BENCH_124M 5 $GPT2_124M batch.micro_batch=16 batch.total_tokens=16384 precision.compute=fp32
# shellcheck disable=SC2086
cuda_only bench_1558m_bf16_master16 && bench 1558m_bf16_master16 $W_BENCH_1558M 5 $GPT2_1558M batch.micro_batch=8 batch.total_tokens=8192 \
    precision.compute=bf16 precision.master=bf16

# fp8 products (docs/precision.md): tensorwise through cuBLASLt's fp8
# kernels with one scale per operand, rowwise with its outer-vector scales
# (sm_90 and cuBLAS >= 12.9; else quantised operands into bf16 products, one
# warning); the fp8 vs bf16 step-time ratio is tok/s against 124m_bf16's and
# 1558m_bf16's rows
# shellcheck disable=SC2086
bench 124m_fp8_tensorwise $W_BENCH_124M 10 $GPT2_124M batch.micro_batch=16 batch.total_tokens=16384 \
    precision.compute=bf16 precision.fp8=tensorwise
# shellcheck disable=SC2086
bench 124m_fp8_rowwise $W_BENCH_124M 10 $GPT2_124M batch.micro_batch=16 batch.total_tokens=16384 \
    precision.compute=bf16 precision.fp8=rowwise
# shellcheck disable=SC2086
cuda_only bench_1558m_fp8_tensorwise && bench 1558m_fp8_tensorwise $W_BENCH_1558M 5 $GPT2_1558M batch.micro_batch=8 \
    batch.total_tokens=8192 precision.compute=bf16 precision.fp8=tensorwise

# fp8 against bf16 on the loss, at a larger shape than scripts/fp8_validate.sh's
# tiny Llama on the CPU (docs/precision.md, "Validating a run"): GPT-2 of 8
# layers, 512 wide, 256 tokens, on the Austen bytes, 300 steps of 16 x 256
# tokens, in bf16, fp8 tensorwise and fp8 rowwise; `./train compare` on the
# three (its verdict is the row fp8_compare) and each fp8 run's mean and worst
# relative training-loss gap to bf16 at equal steps (rows fp8_gap_*). Bound:
# 5% on the mean gap. The CPU validation measures +0.33% (tensorwise) and
# -0.17% (rowwise) to bf16-emulated over 100 steps; a wrong scale, format or
# transpose diverges by tens of percent within a few dozen steps, so 5% keeps
# an order of magnitude of margin on both sides. (A dry run: 1 layer, 64 wide,
# 32 tokens, 8 steps on the CPU's fp8 emulation.)
W_FP8CMP=60
section "fp8 vs bf16 loss, GPT-2 8 x 512, $DEV"
FP8_SETS=(--set model.n_layer=8 --set model.n_head=8 --set model.n_embd=512 --set model.seq_len=256
          --set batch.micro_batch=16 --set batch.total_tokens=4096 --set train.steps=300 --set train.eval_every=100
          --set train.eval_batches=8 --set optim.lr=1e-3)
[ $DRY = 1 ] && FP8_SETS=(--set model.n_layer=1 --set model.n_head=2 --set model.n_embd=64 --set model.seq_len=32
                          --set batch.micro_batch=2 --set batch.total_tokens=64 --set train.steps=8
                          --set train.eval_every=4 --set train.eval_batches=2 --set metrics.log_every=1)
fp8_ok=1
for mode in off tensorwise rowwise; do
    need $W_FP8CMP "fp8_run_$mode" || { fp8_ok=0; break; }
    if ! timeout $W_FP8CMP "$TRAIN" configs/tiny.yaml --set device=$DEV --set precision.compute=bf16 \
        --set precision.fp8=$mode "${FP8_SETS[@]}" --set train.sample_every=0 --set checkpoint.every=0 \
        --set run.name="fp8_$mode" --set run.dir="$WORK/fp8cmp_$mode" > "$WORK/fp8cmp_$mode.txt" 2>&1; then
        row "fp8_run_$mode" FAIL "run failed: $(tail -n 1 "$WORK/fp8cmp_$mode.txt")"; failed=1; fp8_ok=0; break
    fi
done
if [ $fp8_ok = 1 ]; then
    "$TRAIN" compare "$WORK/fp8cmp_off" "$WORK/fp8cmp_tensorwise" "$WORK/fp8cmp_rowwise" > "$WORK/fp8cmp.txt" 2>&1
    verdict=$(sed -n 's/^verdict: //p' "$WORK/fp8cmp.txt")
    if [ -n "$verdict" ]; then row fp8_compare note "$verdict"
    else row fp8_compare FAIL "no verdict: $(tail -n 1 "$WORK/fp8cmp.txt")"; failed=1; fi
    for mode in tensorwise rowwise; do
        msg=$(python3 - "$WORK/fp8cmp_off/metrics.jsonl" "$WORK/fp8cmp_$mode/metrics.jsonl" 2>&1 <<'EOF'
import json, sys
def losses(p):
    return {r["step"]: r["loss"] for r in map(json.loads, open(p)) if "loss" in r}
a, b = losses(sys.argv[1]), losses(sys.argv[2])
gaps = [(b[s] - a[s]) / a[s] for s in sorted(a) if s in b]
if not gaps: print("no common steps"); sys.exit(1)
mean = sum(gaps) / len(gaps)
worst = max(gaps, key=abs)
print(f"mean gap to bf16 {100 * mean:+.2f}%, worst {100 * worst:+.2f}% over {len(gaps)} logged steps")
sys.exit(0 if abs(mean) <= 0.05 else 1)
EOF
)
        if [ $? -eq 0 ]; then row "fp8_gap_$mode" ok "$msg (bound 5%)"; else row "fp8_gap_$mode" FAIL "$msg (bound 5%)"; failed=1; fi
    done
fi
pack
exit $failed
