#!/usr/bin/env bash
# plan_memory_table.sh: `./train plan`'s memory per rank against the CPU
# backend's measured peak (peak_device_mib, the bytes live through its alloc at
# most: docs/metrics.md) for one tiny model in every layout kind (issue 33 §2:
# the planner must be exact for what kiln allocates): dp with ZeRO 0-3, tp
# with and without sp, the four pp schedules, cp ring and allgather, ep with
# MoE, recompute, fp8, the optimizers, and micro-batch 1 where start-up's
# transient arenas can exceed the steady state. Each layout runs 2 steps
# under mpirun as test/t_dp.sh ... t_ep.sh launch them, then plans the same
# layout. Predicted = the plan's "total per rank" less its "overhead" (the 32
# MiB cuBLAS workspace and the 5% margin; the CPU has neither), summed from
# its parts, which are printed to more digits. Measured is the most over the
# ranks (ranks.jsonl), as the plan's lines are the costliest pipeline
# stage's. The planner counts fp32 throughout, as the CPU backend stores it.
# RSS: the most over the ranks of peak_rss_mib less rss_base_mib (VmRSS before
# the model allocates) against the prediction plus the checkpoint writer's
# host buffers (rss_pred), "RSS_OFF" past KILN_PLAN_RSS_TOL (default 0.10).
# Prints one row per layout ("OFF" past 2%) and exits 1 if any is off.
# Usage: scripts/plan_memory_table.sh [NAME...]; KILN_PLAN_TABLE_DIR=DIR keeps the runs there.
set -u
cd "$(dirname "$0")/.."
W=${KILN_PLAN_TABLE_DIR:-$(mktemp -d /tmp/kiln-plan-table.XXXXXX)}
mkdir -p "$W"
if [ ! -f "$W/data/train_000000.bin" ]; then
    head -c 60000 data/austen.txt >"$W/corpus.txt"
    ./train prepare --tokenizer byte --out "$W/data" --val-fraction 0.1 "$W/corpus.txt" >/dev/null || exit 1
fi
# metrics.peak_gflops: no start-up matmul measurement, whose 8.25 MiB would be
# the floor of these ~2 MiB peaks. One thread: the attention scratch is per
# thread (cpu_scratch_get), and a 2-core machine runs several ranks.
cat >"$W/tiny.yaml" <<YAML
run: {name: plan_table, dir: "$W/run", seed: 7, threads: 1}
model: {n_layer: 4, n_head: 4, n_embd: 64, seq_len: 32, vocab_size: 256}
data: {train: "$W/data/train_*.bin", val: "$W/data/val_*.bin"}
batch: {micro_batch: 4, total_tokens: 512}
train: {steps: 2, eval_every: 0, eval_batches: 2, sample_every: 0}
schedule: {warmup_steps: 1}
checkpoint: {every: 0}
metrics: {peak_gflops: 1, tensorboard: false, log_every: 100}
YAML
MPIRUN=(timeout 300 mpirun --allow-run-as-root --oversubscribe)
LLAMA="--set model.arch=llama --set model.n_head=8 --set model.n_kv_head=4 --set model.ffn_hidden=96"
MOE="$LLAMA --set model.mlp=moe --set model.moe.n_experts=4 --set model.moe.top_k=2 --set model.moe.expert_hidden=32"
MOE="$MOE --set model.moe.n_shared=1 --set model.moe.capacity_factor=1.25 --set model.moe.aux_loss_coef=0.01"
PP="--set parallel.pp=2 --set parallel.pp_schedule"
WIDE="--set model.n_embd=240 --set model.n_layer=16"

# name|ranks|settings
LAYOUTS=(
    "one_rank|1|"
    "recompute_gelu|1|--set model.recompute=gelu"
    "recompute_norm_gelu|1|--set model.recompute=norm_gelu"
    "fp8_tensorwise|1|--set precision.fp8=tensorwise"
    "fp8_rowwise|1|--set precision.fp8=rowwise"
    "dp2_zero0|2|--set parallel.zero=0"
    "dp2_zero1|2|--set parallel.zero=1"
    "dp2_zero2|2|--set parallel.zero=2"
    "dp2_zero3|2|--set parallel.zero=3"
    "tp2_sp|2|--set parallel.tp=2"
    "tp2_nosp|2|--set parallel.tp=2 --set parallel.sequence_parallel=false"
    "pp2_gpipe|2|$PP=gpipe"
    "pp2_1f1b|2|$PP=1f1b"
    "pp2_interleaved|2|$PP=interleaved_1f1b --set parallel.pp_virtual=2"
    "pp2_zb_h1|2|$PP=zb_h1"
    "cp2_ring|2|--set parallel.cp=2 --set parallel.cp_attention=ring"
    "cp2_allgather|2|--set parallel.cp=2 --set parallel.cp_attention=allgather"
    "moe_one_rank|1|$MOE"
    "moe_ep2|2|$MOE --set parallel.ep=2"
    "recompute_block|1|--set model.recompute=block"
    "moe_selective|1|$MOE --set model.recompute=selective"
    "moe_ep2_selective|2|$MOE --set parallel.ep=2 --set model.recompute=selective"
    "moe_ep2_dp2_zero1|4|$MOE --set parallel.ep=2 --set parallel.zero=1"
    "moe_dropless_ep2|2|$MOE --set model.moe.capacity_factor=0 --set parallel.ep=2"
    "cp4_ring|4|--set parallel.cp=4 --set parallel.cp_attention=ring"
    "cp4_allgather|4|--set parallel.cp=4 --set parallel.cp_attention=allgather"
    "pp2_dp2_zero1|4|$PP=1f1b --set parallel.zero=1"
    "pp2_dp2_zero3|4|$PP=1f1b --set parallel.zero=3"
    # micro-batch 1 on 4 ranks: little activation memory, so start-up's
    # transient buffers (the whole arenas before ZeRO shards them) show;
    # wide: 16 layers of 240, parameters outweigh activations as in large models
    "dp4_zero1_mb1|4|--set parallel.zero=1 --set batch.micro_batch=1"
    "dp4_zero2_mb1|4|--set parallel.zero=2 --set batch.micro_batch=1"
    "dp4_zero3_mb1|4|--set parallel.zero=3 --set batch.micro_batch=1"
    "wide_dp4_zero1_mb1|4|$WIDE --set parallel.zero=1 --set batch.micro_batch=1"
    "wide_dp4_zero2_mb1|4|$WIDE --set parallel.zero=2 --set batch.micro_batch=1"
    "wide_dp4_zero3_mb1|4|$WIDE --set parallel.zero=3 --set batch.micro_batch=1"
    "optim_state_bf16|1|--set precision.optim_state=bf16"
    "lion|1|--set optim.name=lion"
    "muon|1|--set optim.name=muon"
    "adafactor|1|--set optim.name=adafactor"
    "muon_dp2_zero1|2|--set optim.name=muon --set parallel.zero=1"
    "doc_masking|1|--set data.doc_masking=true --set data.eot_id=10"
)

# predicted MiB: the plan's state + activations + fp8 buffers (= total -
# overhead), summed from their parts (each printed to 3 significant digits
# or more: parameters, the ZeRO "+" lines, gradients, optimizer state,
# activations, fp8's operands, scales and histories)
predicted() {
    awk 'function mib(v, u) { return u == "B" ? v / 1048576 : u == "KiB" ? v / 1024 : u == "GiB" ? v * 1024 : v }
         /^  (parameters|gradients|optimizer state|  \+ )/ { s += mib($(NF-1), $NF) }
         /^  activations  / { s += mib($(NF-1), $NF) }
         /^    (operands and codes|amaxes, scales|amax histories) / { s += mib($(NF-1), $NF) }
         /^  (total per rank|overhead) / { t[$1] = mib($(NF-1), $NF) }
         END { printf "%.4f %.4f\n", s, t["total"] - t["overhead"] }' "$1"
}

RSS_TOL=${KILN_PLAN_RSS_TOL:-0.10}
bad=0
printf '%-22s %5s %12s %13s %7s %9s %9s %7s\n' layout ranks measured_MiB predicted_MiB ratio rss_MiB rss_pred rss_rat
for row in "${LAYOUTS[@]}"; do
    IFS='|' read -r name np sets <<<"$row"
    if [ $# -gt 0 ] && ! printf '%s\n' "$@" | grep -qx "$name"; then continue; fi
    D=$W/$name
    rm -rf "$D"
    # shellcheck disable=SC2086 # $sets is a list of flags
    if [ "$np" -gt 1 ]; then "${MPIRUN[@]}" -np "$np" ./train "$W/tiny.yaml" $sets --set run.dir="$D" >"$D.txt" 2>&1
    else ./train "$W/tiny.yaml" $sets --set run.dir="$D" >"$D.txt" 2>&1; fi || {
        printf '%-22s %5s run failed: %s\n' "$name" "$np" "$(grep -m1 'kiln: error' "$D.txt")"; bad=1; continue; }
    # shellcheck disable=SC2086
    ./train plan "$W/tiny.yaml" $sets --set device=cpu --gpus "$np" >"$D.plan" 2>&1 || {
        printf '%-22s %5s plan failed: %s\n' "$name" "$np" "$(grep -m1 'kiln: error' "$D.plan")"; bad=1; continue; }
    # the most over the ranks (ranks.jsonl, several ranks), else rank 0's:
    # the backend's peak, and peak RSS less the RSS before the model allocates
    read -r meas rss <<<"$(python3 -c 'import json, sys; d = sys.argv[1]
try:
    r = json.loads(open(d + "/ranks.jsonl").readlines()[-1])
    dev, rss = max(r["peak_device_mib"]), max(p - b for p, b in zip(r["peak_rss_mib"], r["rss_base_mib"]))
except OSError:
    r = json.loads(open(d + "/metrics.jsonl").readlines()[-1])
    dev, rss = r["peak_device_mib"], r["peak_rss_mib"] - r["rss_base_mib"]
print(dev, rss)' "$D")"
    read -r pred pred_total <<<"$(predicted "$D.plan")"
    # the checkpoint writer's host buffers, which RSS holds and the plan (of
    # device memory) does not: its sink's 4 x 8 MiB (ckpt_sink_new(4),
    # CKPT_IO_CHUNK, touched at start) and its async staging copy of what
    # the rank writes (rank 0's "N MB here", touched by a thread at start)
    ck=$(awk '/checkpoint: step .* written in/ { for (i = 1; i <= NF; i++) if ($(i+1) == "MB" && $(i+2) == "here,") mb = substr($i, 2) }
              END { printf "%.4f", 32 + mb * 1e6 / 1048576 }' "$D.txt")
    awk -v n="$name" -v np="$np" -v m="$meas" -v p="$pred" -v pt="$pred_total" -v rss="$rss" -v rt="$RSS_TOL" -v ck="$ck" 'BEGIN {
        r = m / p; q = rss / (p + ck); off = r < 0.98 || r > 1.02; roff = q < 1 - rt || q > 1 + rt
        printf "%-22s %5d %12.4f %13.4f %7.4f %9.4f %9.4f %7.4f%s%s\n", n, np, m, p, r, rss, p + ck, q, off ? "  OFF" : "",
            (roff ? "  RSS_OFF" : "") (p - pt > 0.011 || pt - p > 0.011 ? "  (total - overhead " pt ")" : "")
        exit off || roff }' || bad=1
done
echo "runs and plans in $W"
exit $bad
