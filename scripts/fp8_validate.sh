#!/usr/bin/env bash
# fp8_validate.sh [OUT_DIR]: the accuracy check of precision.fp8 on the CPU.
# Trains the tiny Llama (configs/llama-tiny.yaml; ffn_hidden 352, the nearest
# multiple of 16 above its 344, for every run, since fp8 products need
# multiples of 16) for the same tokens in fp32, bf16-emulated
# (precision.fp8: bf16: the same products' operands rounded to bf16, no
# scale, products in fp32: the CPU's stand-in for bf16 compute), fp8
# tensorwise and fp8 rowwise (the CPU backend's exact emulation: operands
# quantised onto the E4M3/E5M2 grids, products in fp32), then runs ./train
# compare on them and writes the per-step loss gaps (mean and worst over
# windows of 10 steps, relative to fp32, and the mean relative to the
# bf16-emulated run) and the validation losses to OUT_DIR/fp8_validate.txt.
# A few minutes on 2 loaded cores (one thread: OpenMP barriers spin against
# other jobs). STEPS=N overrides the 100 steps.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/fp8_validate}
STEPS=${STEPS:-100}
mkdir -p "$OUT"
[ -x ./train ] || { echo "fp8_validate: build ./train first (make)" >&2; exit 2; }
COMMON=(--set model.ffn_hidden=352 --set train.steps=$STEPS --set batch.micro_batch=8 --set batch.total_tokens=1024
        --set schedule.warmup_steps=10 --set train.eval_every=$((STEPS / 4)) --set train.eval_batches=8
        --set train.sample_every=0 --set run.threads=1 --set checkpoint.every=0 --set checkpoint.final=false
        --set metrics.log_every=1 --set metrics.tensorboard=false)
for mode in off bf16 tensorwise rowwise; do
    case $mode in off) name=fp32 ;; bf16) name=bf16_emulated ;; *) name=fp8_$mode ;; esac
    rm -rf "$OUT/$name"
    echo "fp8_validate: $name ($STEPS steps)" >&2
    ./train configs/llama-tiny.yaml "${COMMON[@]}" --set precision.fp8=$mode --set run.name=$name \
        --set run.dir="$OUT/$name" >"$OUT/$name.log" 2>&1 || { tail -n 3 "$OUT/$name.log" >&2; exit 1; }
done
{
    echo "# fp8_validate.sh, $(date -u +%Y-%m-%d), $(uname -n), commit $(git rev-parse --short HEAD 2>/dev/null)"
    echo "# configs/llama-tiny.yaml, ffn_hidden 352, $STEPS steps x 1024 tokens, CPU backend, one thread"
    ./train compare "$OUT/fp32" "$OUT/bf16_emulated" "$OUT/fp8_tensorwise" "$OUT/fp8_rowwise"
    echo
    python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
def rows(name):
    return [json.loads(l) for l in open("%s/%s/metrics.jsonl" % (out, name))]
def losses(name):
    return {r["tokens"]: r["loss"] for r in rows(name) if "loss" in r}
def gaps(name, ref):
    a, b = losses(name), losses(ref)
    return [(a[t] - b[t]) / b[t] for t in sorted(a) if t in b]
print("relative training-loss gap at equal tokens, windows of 10 steps (to fp32; the mean to bf16-emulated too):")
print("%-16s %10s %10s %10s %10s %12s %12s" % ("run", "mean", "worst win", "last win", "mean bf16", "final loss",
                                                "val loss"))
for name in ("fp32", "bf16_emulated", "fp8_tensorwise", "fp8_rowwise"):
    r, g, gb = rows(name), gaps(name, "fp32"), gaps(name, "bf16_emulated")
    wins = [sum(g[i:i + 10]) / len(g[i:i + 10]) for i in range(0, len(g), 10)]
    val = [x["val_loss"] for x in r if "val_loss" in x]
    loss = [x["loss"] for x in r if "loss" in x]
    print("%-16s %+10.2e %+10.2e %+10.2e %+10.2e %12.4f %12s" % (name, sum(g) / len(g), max(wins, key=abs), wins[-1],
          sum(gb) / len(gb), loss[-1], "%.4f" % val[-1] if val else "-"))
PY
} | tee "$OUT/fp8_validate.txt"
