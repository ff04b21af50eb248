#!/usr/bin/env bash
# The planner's time model against measured steps on this machine (issue 33,
# "CPU, time"): each layout of 1 or 2 ranks (one thread a rank, so 2 ranks on
# 2 cores do not oversubscribe) trains BENCH_PLAN_STEPS steps on byte-level
# Austen (the median step_time_s of metrics.jsonl past the first two steps;
# `./train bench` would not do: under mpirun each of its ranks runs alone) and
# is planned by `./train plan --hardware cpu`
# (this machine's profile, measured once and cached); the table gives the
# predicted step, the measured one (the slowest rank's) and their ratio. The
# aim is a ratio within 0.7-1.3. A benchmark, never a test: the machine is
# shared and a step's time is whatever it was given.   make bench runs it.
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${BENCH_PLAN_STEPS:-8}
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
head -c 400000 data/austen.txt > "$W/a.txt"
./train prepare --tokenizer byte --out "$W/data" --val-fraction 0.05 "$W/a.txt" >/dev/null
D="data: {train: \"$W/data/train_*.bin\", val: \"$W/data/val_*.bin\"}"
T="train: {steps: $steps, eval_every: 0, sample_every: 0}
checkpoint: {every: 0}"
cat > "$W/gpt.yaml" <<YAML
$D
$T
run: {name: bench-plan, dir: "$W/run", seed: 1, threads: 1}
device: cpu
model: {arch: gpt2, n_layer: 4, n_head: 4, n_embd: 256, seq_len: 128, vocab_size: 256}
batch: {micro_batch: 8, total_tokens: 4096}
metrics: {peak_gflops: 1}
YAML
cat > "$W/moe.yaml" <<YAML
$D
$T
run: {name: bench-plan-moe, dir: "$W/run", seed: 1, threads: 1}
device: cpu
model: {arch: llama, n_layer: 4, n_head: 4, n_kv_head: 2, n_embd: 256, seq_len: 128, vocab_size: 256, mlp: moe,
        moe: {n_experts: 4, top_k: 2, expert_hidden: 512}}
batch: {micro_batch: 8, total_tokens: 4096}
metrics: {peak_gflops: 1}
YAML
mpi=0
command -v mpirun >/dev/null 2>&1 && ldd ./train | grep -q libmpi && mpi=1
# name ranks config --set flags...
rows=(
    "one_rank 1 gpt"
    "recompute_norm_gelu 1 gpt model.recompute=norm_gelu"
    "micro_batch_4 1 gpt batch.micro_batch=4"
    "moe_one_rank 1 moe"
    "dp2 2 gpt"
    "dp2_zero1 2 gpt parallel.zero=1"
    "dp2_zero3 2 gpt parallel.zero=3"
    "tp2_sp 2 gpt parallel.tp=2 parallel.sequence_parallel=true"
    "pp2_1f1b 2 gpt parallel.pp=2 parallel.pp_schedule=1f1b"
    "cp2_ring 2 gpt parallel.cp=2 parallel.cp_attention=ring"
    "moe_ep2 2 moe parallel.ep=2"
)
./train plan "$W/gpt.yaml" --gpus 1 --hardware cpu >/dev/null # measure the profile once, before any timing
echo "== planner time model vs measured step (cpu profile: $(sed -n 's/^# .*: //p' ~/.cache/kiln/cpu2-*.yaml 2>/dev/null | head -1)) =="
printf '%-22s %5s %12s %12s %7s\n' layout ranks predicted_s measured_s ratio
for r in "${rows[@]}"; do
    set -- $r
    name=$1 n=$2 cfg=$W/$3.yaml
    shift 3
    sets=()
    for s in "$@"; do sets+=(--set "$s"); done
    if [ "$n" -gt 1 ] && [ $mpi = 0 ]; then printf '%-22s %5s   (no MPI build)\n' "$name" "$n"; continue; fi
    pred=$(./train plan "$cfg" --gpus "$n" --hardware cpu "${sets[@]}" --json |
        python3 -c 'import json,sys; print("%.4f" % json.load(sys.stdin)["layouts"][0]["step_s"])')
    run=(./train)
    [ "$n" -gt 1 ] && run=(mpirun --allow-run-as-root --oversubscribe -np "$n" ./train)
    rm -rf "$W/run"
    timeout 600 "${run[@]}" "$cfg" "${sets[@]}" >"$W/out.txt" 2>&1 || { echo "$name: $(tail -n 2 "$W/out.txt")"; continue; }
    meas=$(python3 -c '
import json, statistics, sys
t = [json.loads(l)["step_time_s"] for l in open(sys.argv[1]) if "step_time_s" in l][2:]
print("%.4f" % statistics.median(t))' "$W/run/metrics.jsonl")
    printf '%-22s %5s %12s %12s %7s\n' "$name" "$n" "$pred" "${meas:-?}" \
        "$(python3 -c "print('%.2f' % ($pred / $meas))" 2>/dev/null || echo '?')"
done
