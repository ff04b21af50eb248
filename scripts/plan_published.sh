#!/usr/bin/env bash
# plan_published.sh: runs `./train plan` on published training layouts (docs/planner.md,
# "Published layouts") and prints the table's markdown rows and its summary.
# On paper only: it starts no backend; one search at a time (a 16k-GPU one takes minutes).
#   scripts/plan_published.sh [ROW_PREFIX]    # e.g. "megatron" for the Megatron rows only
#   PLAN_PUBLISHED_REUSE=1 keeps a row's search JSON from an earlier run (the searches take minutes).
# Raw JSON goes to ${PLAN_PUBLISHED_DIR:-/tmp/plan_published}/<row>.{search,pub}.json.
set -u
cd "$(dirname "$0")/.."
TRAIN=./train
OUT=${PLAN_PUBLISHED_DIR:-/tmp/plan_published}
ONLY=${1:-}
mkdir -p "$OUT"
[ -x "$TRAIN" ] || { echo "plan_published: build ./train first (make)" >&2; exit 2; }

# row NAME CONFIG GPUS HW "SHAPE SETS" "PUBLISHED MESH dp,tp,pp,cp,ep" "PUBLISHED SETS" KIND VALUE "LABEL"
#   SHAPE SETS: --set pairs (k=v, space-separated) for both the search and the published layout;
#   PUBLISHED SETS: the published layout's own keys (recompute, unless they set it as published, is
#   tried none, gelu, norm_gelu, block, the first that fits);
#   KIND VALUE: the published throughput: mfu (a fraction, as published), tps (tokens/s per GPU),
#   or meg_tf (Megatron's teraFLOP/s per GPU under its eq. 3 count, recompute included).
ROWS=()
row() { local IFS='|'; ROWS+=("$*"); }

A=a100-80
G="model.seq_len=2048 model.vocab_size=51200"
mg() { # mg NAME heads hidden layers batch tp pp gpus mb virtual tf
    local sched="" vl=""
    [ "$7" -gt 1 ] && sched="parallel.pp_schedule=1f1b"
    [ "${10}" -gt 1 ] && sched="parallel.pp_schedule=interleaved_1f1b parallel.pp_virtual=${10}" vl=", v ${10}"
    row "megatron-$1" configs/plan/megatron-gpt.yaml "$8" "$A" \
        "model.n_head=$2 model.n_embd=$3 model.n_layer=$4 batch.total_tokens=$(($5 * 2048))" \
        "$(($8 / $6 / $7)),$6,$7,1,1" \
        "parallel.dp=$(($8 / $6 / $7)) parallel.tp=$6 parallel.pp=$7 parallel.zero=0 batch.micro_batch=$9 $sched model.recompute=block" \
        meg_tf "${11}" "Megatron-LM Table 1: t$6 p$7 d$(($8 / $6 / $7)), mb $9$vl, batch $5"
}
#      name  heads hidden layers batch tp pp gpus mb v  TF/s   (run_table_1.sh; TF/s from Table 1)
mg 1.7b   24  2304  24  512 1  1   32  16 1 137
mg 3.6b   32  3072  30  512 2  1   64  16 1 138
mg 7.5b   32  4096  36  512 4  1  128  16 1 142
mg 18b    48  6144  40 1024 8  1  256   8 1 135
mg 39b    64  8192  48 1536 8  2  512   4 1 138
mg 76b    80 10240  60 1792 8  4 1024   2 3 140
mg 145b   96 12288  80 2304 8  8 1536   2 2 148
mg 310b  128 16384  96 2160 8 16 1920   1 2 155
mg 530b  128 20480 105 2520 8 35 2520   1 3 163
mg 1t    160 25600 128 3072 8 64 3072   1 1 163
# Figure 13 (162.2B, 64 A100s, mb 1): t8 p8 is best; the figure gives no number we could read.
row megatron-162b-b128 configs/plan/megatron-gpt-162b.yaml 64 "$A" "batch.total_tokens=262144" \
    "1,8,8,1,1" "parallel.dp=1 parallel.tp=8 parallel.pp=8 parallel.zero=0 batch.micro_batch=1" \
    none 0 "Megatron-LM Fig. 13: t8 p8 best, batch 128"
row megatron-162b-b32 configs/plan/megatron-gpt-162b.yaml 64 "$A" "batch.total_tokens=65536" \
    "1,8,8,1,1" "parallel.dp=1 parallel.tp=8 parallel.pp=8 parallel.zero=0 batch.micro_batch=1" \
    none 0 "Megatron-LM Fig. 13: t8 p8 best, batch 32"
# Llama 3 paper, Table 4 (bf16, 16M tokens a step; 430 / 400 / 380 TFLOP/s, 43 / 41 / 38% MFU); §3.3.2:
# FSDP over dp (ZeRO 3 here), the interleaved schedule, all-gather context parallelism.
L3="parallel.pp_schedule=interleaved_1f1b parallel.pp_virtual=2 batch.micro_batch=1 parallel.zero=3"
row llama3-405b-8k configs/plan/llama3-405b.yaml 8192 h100 "" "64,8,16,1,1" \
    "parallel.dp=64 parallel.tp=8 parallel.pp=16 $L3" mfu 0.43 "Llama 3 Table 4: t8 p16 d64, 8k GPUs"
row llama3-405b-16k configs/plan/llama3-405b.yaml 16384 h100 "" "128,8,16,1,1" \
    "parallel.dp=128 parallel.tp=8 parallel.pp=16 $L3" mfu 0.41 "Llama 3 Table 4: t8 p16 d128, 16k GPUs"
row llama3-405b-16k-131k configs/plan/llama3-405b.yaml 16384 h100 "model.seq_len=131072" "8,8,16,16,1" \
    "parallel.dp=8 parallel.tp=8 parallel.pp=16 parallel.cp=16 parallel.cp_attention=allgather $L3" mfu 0.38 \
    "Llama 3 Table 4: t8 p16 c16 d8, seq 131072"
# torchtitan, benchmarks/llama3_h100_202412_torchtitan.md (96 GB H100s at 500 W: --gpu-mem 89.4).
TT="--gpu-mem 89.4"
row titan-8b-8 configs/llama3-8b.yaml 8 "h100 $TT" "batch.total_tokens=131072" "8,1,1,1,1" \
    "parallel.dp=8 parallel.zero=3 batch.micro_batch=2" tps 5762 "torchtitan Table 1: FSDP 8, local batch 2"
row titan-8b-128 configs/llama3-8b.yaml 128 "h100 $TT" "batch.total_tokens=2097152" "128,1,1,1,1" \
    "parallel.dp=128 parallel.zero=3 batch.micro_batch=2" tps 5605 "torchtitan Table 3: FSDP 128, local batch 2"
row titan-70b-256 configs/plan/llama3-70b.yaml 256 "h100 $TT" "precision.fp8=tensorwise" "32,8,1,1,1" \
    "parallel.dp=32 parallel.tp=8 parallel.zero=3 batch.micro_batch=16 model.recompute=block" tps 829 \
    "torchtitan Table 4: FSDP 32 TP 8, Float8, local batch 16"
row titan-405b-512 configs/plan/llama3-405b.yaml 512 "h100 $TT" "precision.fp8=tensorwise batch.total_tokens=2097152" \
    "8,8,8,1,1" "parallel.dp=8 parallel.tp=8 parallel.pp=8 parallel.zero=3 batch.micro_batch=1 parallel.pp_schedule=interleaved_1f1b parallel.pp_virtual=2 model.recompute=block" \
    tps 128 "torchtitan Table 5: FSDP 8 TP 8 PP 8, interleaved 1F1B, Float8"
# DeepSeek-V3 report: 180K H800 GPU hours per trillion tokens = 1543 tokens/s per GPU.
row deepseek-v3-2048 configs/plan/deepseek-v3.yaml 2048 h800 "" "128,1,16,1,64" \
    "parallel.dp=128 parallel.pp=16 parallel.ep=64 parallel.zero=1 batch.micro_batch=1 parallel.pp_schedule=zb_h1" \
    tps 1543 "DeepSeek-V3: PP 16, EP 64, ZeRO-1 DP 128, DualPipe"

sets() { local s; for s in $1; do printf -- '--set %s ' "$s"; done; }

for r in "${ROWS[@]}"; do
    IFS='|' read -r name cfg gpus hw shape mesh pub kind value label <<<"$r"
    case "$name" in "$ONLY"*) ;; *) continue ;; esac
    read -r hwname hwflags <<<"$hw"
    t0=$(date +%s)
    if [ "${PLAN_PUBLISHED_REUSE:-0}" = 1 ] && { [ -e "$OUT/$name.search.timeout" ] ||
        jq -e '.layouts' "$OUT/$name.search.json" >/dev/null 2>&1; }; then
        echo "$name: search reused" >&2
    else
    # shellcheck disable=SC2046  # the --set pairs are words on purpose
    timeout 900 "$TRAIN" plan "$cfg" --gpus "$gpus" --hardware "$hwname" $hwflags $(sets "$shape") \
        --search --top 100000 --json >"$OUT/$name.search.json" 2>"$OUT/$name.search.err"
    [ $? = 124 ] && { touch "$OUT/$name.search.timeout"; echo "$name: search stopped after 900 s" >&2; }
    echo "$name: search $(($(date +%s) - t0)) s" >&2
    fi
    : >"$OUT/$name.pub.json"
    rcs="none gelu norm_gelu block"
    case "$pub" in *model.recompute=*) rcs=as_published ;; esac
    for rc in $rcs; do
        rcset="--set model.recompute=$rc"
        [ "$rc" = as_published ] && rcset=""
        # shellcheck disable=SC2046,SC2086
        "$TRAIN" plan "$cfg" --gpus "$gpus" --hardware "$hwname" $hwflags $(sets "$shape") $(sets "$pub") \
            $rcset --json >"$OUT/$name.pub.json" 2>"$OUT/$name.pub.err"
        jq -e '.fits' "$OUT/$name.pub.json" >/dev/null 2>&1 && break
    done
    python3 scripts/plan_published_row.py "$name" "$mesh" "$kind" "$value" "$label" "$shape" \
        "$OUT/$name.search.json" "$OUT/$name.pub.json" "$(cat "$OUT/$name.pub.err")" >>"$OUT/rows.tsv.$$"
done
python3 scripts/plan_published_row.py --table "$OUT/rows.tsv.$$"
rm -f "$OUT/rows.tsv.$$"
