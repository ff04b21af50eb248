#!/usr/bin/env bash
# ./train plan: layout validity (ranks, batch divisibility), memory per rank
# against --gpu-mem, the suggested ZeRO stage and micro-batch, bad usage, and
# agreement with --dry-run's per-rank state lines. Arithmetic only: < 1 s.
# Prints one line per check.
set -u
cd "$(dirname "$0")/.."
T=${KILN_TEST_TMP:-$(mktemp -d)}/t_plan
rm -rf "$T" && mkdir -p "$T"

. test/lib.sh

CFG=configs/gpt2-124m.yaml
XL="--set model.n_layer=48 --set model.n_head=25 --set model.n_embd=1600"
# the hand counts below are of fp32 storage (the CPU backend's, CUDA's precision.compute fp32)
F32="--set precision.compute=fp32"

expect plan_help 0 'usage: ./train plan' -- ./train plan --help
expect plan_in_train_help 0 './train plan CONFIG' -- ./train --help
expect plan_missing_gpus 2 'kiln: error: plan: --gpus N is required' -- ./train plan $CFG
expect plan_bad_gpus 2 "--gpus: expected a count" -- ./train plan $CFG --gpus eight
expect plan_bad_gpu_mem 2 "--gpu-mem: expected GiB" -- ./train plan $CFG --gpus 8 --gpu-mem -3
expect plan_nodes_indivisible 2 '--gpus 6 do not split evenly over --nodes 4' -- ./train plan $CFG --gpus 6 --nodes 4
expect plan_unknown_flag 2 "unknown flag '--bogus'" -- ./train plan $CFG --gpus 8 --bogus
# ep > 1 needs an MoE model (the config refuses a dense one; the MoE lines: test/t_ep.sh; cp: test/t_cp.sh)
expect plan_ep_dense_refused 2 "parallel.ep.*spreads MoE experts" -- ./train plan $CFG --gpus 8 --set parallel.ep=2
# pp: every stage's layers and memory, the schedule's bubble; one that cannot run: invalid, exit 2
expect plan_pp_stages 0 "stage 1 +layers 6..11 \+ head" -- ./train plan configs/gpt2-124m.yaml --gpus 8 \
    --set parallel.pp=2 --set parallel.pp_layers=[6,6]
expect plan_pp_interleaved_indivisible 2 "not a multiple of pp = 4" -- ./train plan configs/gpt2-124m.yaml --gpus 8 \
    --set parallel.pp=4 --set parallel.pp_schedule=interleaved_1f1b --set parallel.pp_virtual=2 \
    --set batch.total_tokens=196608
# tp: the split per rank and the communication; a tp that does not divide the heads: invalid, exit 2
expect plan_tp_lines 0 "tensor parallel        tp 2, sequence parallel on: per rank 6 of 12 heads" -- \
    ./train plan configs/gpt2-124m.yaml --gpus 8 --set parallel.tp=2
expect plan_tp_comm 0 "comm per step, tp .* GB sent per rank" -- ./train plan configs/gpt2-124m.yaml --gpus 8 \
    --set parallel.tp=2
expect plan_tp_heads 2 "tp 8 must divide the 12 attention heads" -- ./train plan configs/gpt2-124m.yaml --gpus 8 \
    --set parallel.tp=8
expect plan_dry_run_tp 0 "comm per step, tp" -- ./train configs/llama-tiny.yaml --dry-run --set parallel.tp=2

# GPT-2 124M, llm.c's recipe (524288 tokens, micro-batch 16) on 8 x 80 GiB at
# ZeRO 0 (the config's): 1.85 GiB of state + 12.79 GiB of activations fits.
expect plan_124m_fits 0 'verdict: fits' -- ./train plan $CFG --gpus 8 --gpu-mem 80 --nodes 1
if grep -qE 'layout +dp 8 .*ZeRO 0' "$T/out.txt"; then ok plan_124m_zero0; else fail plan_124m_zero0 "$(grep layout "$T/out.txt")"; fi

# The 1.5B shape (GPT-2 XL: 48 layers, 25 heads, 1600 wide; vocab 50304 padded,
# context 1024) on 8 x 16 GiB, 524288 tokens, so 64 samples per rank per step.
# By hand (P parameters, shard = ceil(P/8), all fp32):
#   P = 50304*1600 + 1024*1600 + 48*(12*1600^2 + 13*1600) + 2*1600 = 1557686400
#   shard = 194710800; one layer 30740800 params; wte+wpe+ln_f 82128000
#   activations per token (model.c plan_floats, floats): 48 layers x (16C + 4 +
#   n_head) = 1230192, + encoded C + ln_f C+2 + logits 50304 + losses 1 +
#   scratch 13C = 1304499 floats = 5217996 B; per sample (x1024) 5343227904 B
#   ZeRO 0/1 with micro-batch 1: state >= 16P or 8P + 8 shard = 14019177600 B,
#     + 5343227904 + 32 MiB workspace, x 1.05 = 20.3e9 B > 16 GiB (17.18e9): none
#   ZeRO 2 and 3 hold two layers' whole gradients, wte+wpe+ln_f's, and two
#     1/8-layer reduce-scatter targets: unreduced = 4 (2 x 30740800 + 82128000
#     + 2 x 3842600) = 605179200 B
#   ZeRO 2: state = 4P (whole parameters) + 4 shard (fp32 shard) + 4 shard
#     (gradients) + 8 shard (AdamW) + unreduced = 9951297600 B
#     micro-batch 1: (9951297600 + 5343227904 + 33554432) x 1.05 = 16094483933 B
#                    = 14.99 GiB <= 16 GiB: fits
#     micro-batch 2: + 5343227904 x 1.05 more = 21.7e9 B: does not
#   ZeRO 3: state = 16 shard + 4 (2 layers + 82128000) gathered + unreduced
#     = 4294990400 B; micro-batch 2: (4294990400 + 2*5343227904 + 33554432)
#     x 1.05 = 15765750672 B = 14.68 GiB: fits too, but ZeRO 2 comes first
#   so: --set parallel.zero=2 --set batch.micro_batch=1, and the config's own
#   layout (ZeRO 0, micro-batch 16: 108 GiB) does not fit: exit 2.
expect plan_xl_does_not_fit 2 'verdict: does not fit.*use --set parallel.zero=2 --set batch.micro_batch=1' -- \
    ./train plan $CFG $XL $F32 --gpus 8 --gpu-mem 16
if grep -qE '^suggest: --set parallel.zero=2 --set batch.micro_batch=1 +\(14.99 GiB' "$T/out.txt"; then ok plan_xl_suggests_zero2_mb1
else fail plan_xl_suggests_zero2_mb1 "$(grep suggest "$T/out.txt")"; fi
expect plan_xl_suggestion_fits 0 'verdict: fits: 14.99 GiB' -- \
    ./train plan $CFG $XL $F32 --gpus 8 --gpu-mem 16 --set parallel.zero=2 --set batch.micro_batch=1
expect plan_xl_zero3_mb2_fits 0 'verdict: fits: 14.68 GiB' -- \
    ./train plan $CFG $XL $F32 --gpus 8 --gpu-mem 16 --set parallel.zero=3 --set batch.micro_batch=2
# on one 16 GiB GPU nothing fits: ZeRO does not shard over dp = 1
expect plan_xl_nothing_fits 2 'suggest: nothing fits in 16.00 GiB.*needs [0-9.]+ GiB' -- \
    ./train plan $CFG $XL $F32 --gpus 1 --gpu-mem 16

# CUDA bf16 (device auto is planned as a GPU): the bf16 compute copy of the fp32
# master is 2 bytes a parameter, 2 x 1557686400 = 3115372800 B = 2.90 GiB at
# ZeRO 2 (the whole arena is cast); ZeRO-3 casts only its gathered units, half
# their fp32 bytes, each unit padded to 64 x dp = 512 floats as ddp.c lays it
# out (ddp_unit_align): 4 (2 x 30740992 + 82128384) / 2 = 287220736 B = 273.92 MiB
expect plan_xl_bf16_compute_copy 0 'bf16 compute copy +2.90 GiB' -- \
    ./train plan $CFG $XL --gpus 8 --gpu-mem 80 --set parallel.zero=2 --set batch.micro_batch=1
expect plan_xl_bf16_compute_copy_zero3 0 'bf16 compute copy +273.92 MiB' -- \
    ./train plan $CFG $XL --gpus 8 --gpu-mem 80 --set parallel.zero=3 --set batch.micro_batch=1

# 524288 tokens = 512 samples of 1024 do not split over 6 ranks: exit 2 naming
# batch.total_tokens and the nearest multiples of 16*1024*6 = 98304.
expect plan_batch_indivisible 2 "key 'batch.total_tokens'.*nearest: 491520 or 589824" -- ./train plan $CFG --gpus 6
# an explicit parallel.dp that is not the GPU count
expect plan_dp_mismatch 2 "parallel.*dp 4 .*8" -- ./train plan $CFG --gpus 8 --set parallel.dp=4

# The state lines (parameters, gradients, optimizer state and their sum, ZeRO-3's
# gathered/unreduced) and activations are the --dry-run's, to the printed digit.
mem_lines() { grep -E '^  (parameters|gradients|optimizer state|params \+ grads|  \+ |bf16 compute|activations|  \(in ).* (B|KiB|MiB|GiB|TiB)$' "$1"; }
# fp32 (what --dry-run counts for device auto on a machine without a GPU), then
# device cuda's bf16 activations and compute copy
for z in 0 1 2 3 bf16_0 bf16_3; do
    d=$F32; case $z in bf16_*) d="--set device=cuda";; esac
    ./train $CFG $d --dry-run --set parallel.dp=8 --set parallel.zero=${z#bf16_} > "$T/dry$z.txt" 2>&1
    ./train plan $CFG $d --gpus 8 --set parallel.zero=${z#bf16_} > "$T/plan$z.txt" 2>&1
    mem_lines "$T/dry$z.txt" > "$T/dry$z.mem"; mem_lines "$T/plan$z.txt" > "$T/plan$z.mem"
    if [ "$(wc -l < "$T/dry$z.mem")" -ge 5 ] && cmp -s "$T/dry$z.mem" "$T/plan$z.mem"; then ok plan_matches_dry_run_zero$z
    else fail plan_matches_dry_run_zero$z "$(diff "$T/dry$z.mem" "$T/plan$z.mem" | tr '\n' ' ')"; fi
done

# precision.fp8's buffers (src/model_fp8.c model_fp8_plan), counted from the shapes here, independently:
# the operand buffers at the largest product's rows x widths (fp32 act in the count; dout's holds its
# codes and dout^T's too, 2 bytes an element, under 4), a routed expert's rows ep x the micro-batch's
# under ep, the amax scratch (2 x tp x cp x n) and six inverse-scale vectors of n (16-byte rounded) + 1,
# n the most rows or width; delayed scaling's rings slots x 5 operands x history x tp x cp.
fp8_want() { # N EP IN_MAX W_MAX OUT_MAX SLOTS HISTORY (experts' in/out widths as in, rows N x EP)
    python3 - "$@" <<'PY'
import sys
N, ep, inx, w, outx, slots, H, einx, eoutx = (int(a) for a in sys.argv[1:])
x = max(N * inx, N * ep * einx); d = max(N * outx, N * ep * eoutx)
n = max(N * ep if einx else N, inx, outx, einx, eoutx)
ops = (x + w) * 4 + max(4 * d, 2 * d)
sc = (2 * n + 6 * ((n + 3) // 4 * 4) + 1) * 4
hist = slots * 5 * H * 4
def fmt(b):
    u = 0; units = ["B", "KiB", "MiB", "GiB", "TiB"]
    while b >= 1024 and u < 4: b /= 1024; u += 1
    return "%.2f %s" % (b, units[u])
print("%s|%s|%s|%s" % (fmt(ops + sc + hist), fmt(ops), fmt(sc), fmt(hist) if H else "-"))
PY
}
fp8_got() { # FILE: "total|operands|scales|histories" as printed
    local f=$1 t o s h
    t=$(sed -n 's/^  fp8 buffers  *\([0-9.]* [A-Za-z]*\)$/\1/p' "$f"); o=$(sed -n 's/^    operands and codes  *\(.*\)$/\1/p' "$f")
    s=$(sed -n 's/^    amaxes, scales  *\(.*\)$/\1/p' "$f"); h=$(sed -n 's/^    amax histories  *\(.*\)$/\1/p' "$f")
    echo "$t|$o|$s|${h:--}"
}
# GPT-2 124M, micro-batch 16 x 1024: widths in 3072 (down), w 3072 x 768, out 3072 (fc); 12 x 6 + 1 slots
./train $CFG $F32 --dry-run --set precision.fp8=tensorwise --set precision.fp8_amax_history=16 > "$T/fp8dry.txt" 2>&1
./train plan $CFG $F32 --gpus 8 --set precision.fp8=tensorwise --set precision.fp8_amax_history=16 > "$T/fp8plan.txt" 2>&1
want=$(fp8_want 16384 1 3072 2359296 3072 73 16 0 0) got=$(fp8_got "$T/fp8dry.txt") gotp=$(fp8_got "$T/fp8plan.txt")
[ "$got" = "$want" ] && [ "$gotp" = "$want" ] && ok "plan_fp8_buffers ($got)" \
    || fail plan_fp8_buffers "dry-run $got, plan $gotp, want $want"
# moe-tiny at ep 2, rowwise: micro-batch 16 x 128 = 2048 rows, an expert's up to 2 x 2048; widths 128 in,
# qkv and the gate-ups 256 out, w 256 x 128; no history
./train configs/moe-tiny.yaml $F32 --dry-run --set precision.fp8=rowwise --set parallel.ep=2 > "$T/fp8ep.txt" 2>&1
want=$(fp8_want 2048 2 128 32768 256 0 0 128 256) got=$(fp8_got "$T/fp8ep.txt")
[ "$got" = "$want" ] && ok "plan_fp8_buffers_ep2_expert_rows ($got)" || fail plan_fp8_buffers_ep2_expert_rows "got $got, want $want"

# ---- layout selection (issue 33): hardware profiles, the time model, --search, --json ----
# Llama 3 8B on 64 H100s (the issue's case): bf16 activations are 36.99 GiB, not
# 73.95 (fp32), and ZeRO 3 at dp 64 fits as configured
L8=configs/llama3-8b.yaml
expect plan_8b_bf16_activations 0 'activations +36.99 GiB' -- ./train plan $L8 --gpus 64 --nodes 8
grep -qE '^  activations, fp32 +73.95 GiB' "$T/out.txt" && grep -q 'activations in bf16' "$T/out.txt" && ok plan_8b_counted_in_bf16 \
    || fail plan_8b_counted_in_bf16 "$(grep -E 'activations' "$T/out.txt" | tr '\n' ' ')"
expect plan_8b_fits_as_configured 0 'verdict: fits: 55.40 GiB of 79.60 GiB' -- ./train plan $L8 --gpus 64 --nodes 8
expect plan_8b_time_line 0 'time per step +[0-9.]+ s on h100: compute' -- ./train plan $L8 --gpus 64 --nodes 8
expect plan_8b_search 0 '^#1 ' -- ./train plan $L8 --gpus 64 --nodes 8 --search
grep -qE '^    why +[0-9.]+ ms faster per step than #2 .*mostly in ' "$T/out.txt" && ok plan_8b_search_says_why \
    || fail plan_8b_search_says_why "$(grep -E '^    why' "$T/out.txt")"
[ "$(grep -c '^#[0-9]' "$T/out.txt")" = 5 ] && ok plan_8b_search_top5 || fail plan_8b_search_top5 "$(grep -c '^#' "$T/out.txt") ranked"
grep -qE '^    slurm +srun --nodes=8 --ntasks-per-node=8 --gpus-per-node=8 ./train configs/llama3-8b.yaml --set parallel.dp=' \
    "$T/out.txt" && ok plan_8b_search_srun || fail plan_8b_search_srun "$(grep -m1 slurm "$T/out.txt")"
# ZeRO and the micro-batch alone cannot fit 8B on 8 x 40 GiB: the change with the fewest keys that fits
expect plan_8b_cheapest_change 2 'suggest: --set .*the fewest keys changed that fit, 1;' -- ./train plan $L8 --gpus 8 --gpu-mem 40

# --json: the schema of docs/planner.md; layouts best first and each within the GPU's memory;
# every layout the search returns is one ./train plan accepts on its own, with the same memory and
# time (the search and the single-layout path are one accounting); no layout kiln would refuse
# (gpt2-124m's 12 heads: tp 8 or 16 never appears)
./train plan $CFG --gpus 16 --search --json --top 40 > "$T/search.json" 2>"$T/search.err"
python3 - "$T/search.json" > "$T/search.check" 2>&1 <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
top = {"fits", "gpus", "nodes", "hardware", "layouts"}
lay = {"dp", "tp", "pp", "cp", "ep", "zero", "micro_batch", "grad_accum", "recompute", "sequence_parallel",
       "pp_schedule", "pp_virtual", "loss_chunk", "memory_bytes", "memory", "step_s", "time", "tokens_per_s_per_gpu", "mfu",
       "set"}
assert top <= set(d), "top-level keys missing: %s" % (top - set(d))
assert d["fits"] and d["gpus"] == 16 and d["nodes"] == 2 and len(d["layouts"]) > 5, d.keys()
steps = [l["step_s"] for l in d["layouts"]]
assert steps == sorted(steps), "not best first"
for l in d["layouts"]:
    assert lay <= set(l), "layout keys missing: %s" % (lay - set(l))
    assert l["dp"] * l["tp"] * l["pp"] * l["cp"] == 16, l
    assert 12 % l["tp"] == 0, "tp %d does not divide 12 heads" % l["tp"]
    assert l["memory_bytes"] <= d["hardware"]["memory_bytes"], l
    assert 0 < l["mfu"] < 1 and l["step_s"] > 0
    assert abs(sum(v for k, v in l["time"].items() if k not in ("dp_total", "dp_hidden", "cp_hidden", "recompute")) - l["step_s"]) < 1e-6 * l["step_s"] + 1e-9
for i in (0, len(d["layouts"]) // 2, len(d["layouts"]) - 1):
    l = d["layouts"][i]
    print("%d %.0f %.9g %s" % (i, l["memory_bytes"], l["step_s"], " ".join("--set " + s for s in l["set"])))
PY
if [ $? = 0 ]; then ok plan_json_schema; else fail plan_json_schema "$(tail -3 "$T/search.check")"; fi
while read -r i mem step flags; do
    [ -n "$i" ] || continue
    ./train plan $CFG --gpus 16 $flags --json > "$T/one.json" 2>"$T/one.err"; rc=$?
    got=$(python3 -c "import json,sys; l=json.load(open(sys.argv[1]))['layouts'][0]; print('%.0f %.9g' % (l['memory_bytes'], l['step_s']))" "$T/one.json" 2>&1)
    [ $rc = 0 ] && [ "$got" = "$mem $step" ] && ok "plan_search_layout_${i}_runs_alone" \
        || fail "plan_search_layout_${i}_runs_alone" "exit $rc, got '$got', want '$mem $step' for $flags; $(tail -c 200 "$T/one.err")"
done < <(grep -E '^[0-9]+ ' "$T/search.check")
expect plan_json_refused 2 '"error": ".*tp 8 must divide the 12 attention heads' -- ./train plan $CFG --gpus 8 --set parallel.tp=8 --json

# the time model's terms, by direction (each would fail if the model ignored what it names):
# a dp group inside one node reduces over NVLink, across two over the NICs (longer);
# zb_h1's bubble is a third of 1F1B's, gpipe's equal to 1F1B's
jt() { python3 -c "import json,sys; l=json.load(open(sys.argv[1]))['layouts'][0]; print(l['time'][sys.argv[2]])" "$@"; }
./train plan $CFG --gpus 8 --nodes 1 --json > "$T/dp1.json"; ./train plan $CFG --gpus 8 --nodes 2 --json > "$T/dp2.json"
a=$(jt "$T/dp1.json" dp_total) b=$(jt "$T/dp2.json" dp_total)
python3 -c "import sys; sys.exit(0 if 0 < float('$a') < float('$b') else 1)" && ok "plan_time_dp_nvlink_vs_nic ($a < $b s)" \
    || fail plan_time_dp_nvlink_vs_nic "one node $a s, two nodes $b s"
PP="--set parallel.pp=4 --set parallel.dp=2"
for k in 1f1b gpipe zb_h1; do ./train plan $CFG --gpus 8 $PP --set parallel.pp_schedule=$k --json > "$T/pp_$k.json"; done
python3 - "$T" <<'PY' && ok plan_time_bubble_follows_schedule || fail plan_time_bubble_follows_schedule "$(python3 - "$T" <<'Q' 2>&1
import json,sys
for k in ("1f1b","gpipe","zb_h1"): print(k, json.load(open(sys.argv[1]+"/pp_%s.json"%k))["layouts"][0]["time"]["bubble"])
Q
)"
import json, sys
b = {k: json.load(open(sys.argv[1] + "/pp_%s.json" % k))["layouts"][0]["time"]["bubble"] for k in ("1f1b", "gpipe", "zb_h1")}
sys.exit(0 if b["1f1b"] > 0 and abs(b["gpipe"] - b["1f1b"]) < 0.02 * b["1f1b"] and b["zb_h1"] < 0.5 * b["1f1b"] else 1)
PY

# hardware profiles: built-in names, a YAML file over a base, bad files named with their key
expect plan_hw_h200 0 '139.80 GiB each \(h200' -- ./train plan $CFG --gpus 8 --hardware h200
expect plan_hw_unknown 2 "--hardware: 'h1000' is neither a built-in profile \(h100, h200" -- ./train plan $CFG --gpus 8 --hardware h1000
printf 'base: h100\nname: h100-40\nmemory_gib: 40\n' > "$T/hw.yaml"
expect plan_hw_file 0 '40.00 GiB each \(h100-40' -- ./train plan $CFG --gpus 8 --hardware "$T/hw.yaml"
printf 'base: h100\nmemory_gb: 40\n' > "$T/hw_bad.yaml"
expect plan_hw_file_unknown_key 2 "hw_bad.yaml: unknown key 'memory_gb'" -- ./train plan $CFG --gpus 8 --hardware "$T/hw_bad.yaml"
printf 'name: mine\nmemory_gib: 40\n' > "$T/hw_nobase.yaml"
expect plan_hw_file_missing_key 2 "hw_nobase.yaml: key 'bf16_tflops': required" -- ./train plan $CFG --gpus 8 --hardware "$T/hw_nobase.yaml"
# without a base every key is given but fp8's (docs/planner.md: 0, none)
printf 'name: mine\nmemory_gib: 40\nbf16_tflops: 100\nfp32_tflops: 10\ngemm_efficiency: 0.8\nhbm_gbps: 1000\nintra_gbps: 100\ninter_gbps: 10\nintra_latency_us: 3\ninter_latency_us: 8\ngpus_per_node: 8\n' > "$T/hw_nofp8.yaml"
expect plan_hw_file_no_fp8 0 '40.00 GiB each \(mine' -- ./train plan $CFG --gpus 8 --hardware "$T/hw_nofp8.yaml"
printf 'base: h100\nhbm_gbps: -3\n' > "$T/hw_range.yaml"
expect plan_hw_file_range 2 "hw_range.yaml: key 'hbm_gbps': expected a number in" -- ./train plan $CFG --gpus 8 --hardware "$T/hw_range.yaml"
# cpu: measured once, then read from the cache (KILN_CACHE)
KILN_CACHE="$T/cache" ./train plan configs/llama-tiny.yaml --gpus 2 --hardware cpu > "$T/cpu1.txt" 2>&1
ls "$T/cache"/cpu2-*.yaml >/dev/null 2>&1 && grep -q '^bf16_tflops: ' "$T"/cache/cpu2-*.yaml && ok plan_hw_cpu_cached \
    || fail plan_hw_cpu_cached "$(tail -2 "$T/cpu1.txt")"
expect plan_hw_cpu_search 0 '^#1 ' -- env KILN_CACHE="$T/cache" ./train plan configs/llama-tiny.yaml --gpus 2 --hardware cpu --search
