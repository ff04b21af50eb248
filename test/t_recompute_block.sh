#!/usr/bin/env bash
# model.recompute: block (and model.recompute_every) composed with every
# layout, on the CPU backend: each pair trains the same config with
# recompute none and with block, and the losses, gradient norms and
# validation losses printed, and the final checkpoint's parameters and
# optimizer state, must be the same bits (tol 0: a checkpointed layer's
# forward runs again on its kept input with the forward's own ops, its own
# weights and its own exchanges, so any difference is a bug: a stale
# workspace, a scale taken twice, a statistic counted twice, a collective
# out of order). Also the MoE figures (loads, drops, aux and z losses: counted
# once), the smaller arena at start-up, --dry-run beside the run, and the
# key's refusals. One line a check.
set -u
cd "$(dirname "$0")/.."
T=${KILN_TEST_TMP:-$(mktemp -d)}/t_recompute_block
rm -rf "$T"
. test/ckpt_lib.sh
ckpt_setup
. test/recompute_lib.sh
# pair NAME NP ARGS...: none against block (ARGS may set recompute_every)
pair() { recompute_pair block "$@"; }

pair gpt2 1
pair gpt2_every2 1 --set model.recompute_every=2
pair llama_qknorm_docmask 1 $LLAMA --set model.qk_norm=head --set data.doc_masking=true --set data.eot_id=10
pair moe 1 $MOE --set model.moe.capacity_factor=1.25
pair fp8_rowwise 1 $LLAMA --set precision.fp8=rowwise
pair fp8_delayed 1 $LLAMA --set precision.fp8=tensorwise --set precision.fp8_amax_history=4
pair fp8_delayed_every2_accum 1 $LLAMA --set precision.fp8=tensorwise --set precision.fp8_amax_history=4 \
    --set model.recompute_every=2 --set batch.total_tokens=1024
pair tp2_sp 2 $LLAMA --set parallel.tp=2 --set parallel.sequence_parallel=true
pair tp2_fp8_delayed 2 $LLAMA --set parallel.tp=2 --set precision.fp8=tensorwise --set precision.fp8_amax_history=4
pair pp2_1f1b 2 --set parallel.pp=2
pair pp2_gpipe 2 --set parallel.pp=2 --set parallel.pp_schedule=gpipe
pair pp2_interleaved 2 $LLAMA --set parallel.pp=2 --set parallel.pp_schedule=interleaved_1f1b --set parallel.pp_virtual=2
pair pp2_zb_h1 2 --set parallel.pp=2 --set parallel.pp_schedule=zb_h1
pair pp2_zb_h1_moe_every2 2 $MOE --set parallel.pp=2 --set parallel.pp_schedule=zb_h1 --set model.recompute_every=2
pair cp2_allgather 2 $LLAMA --set parallel.cp=2 --set parallel.cp_attention=allgather
pair cp2_ring_docmask 2 $LLAMA --set parallel.cp=2 --set parallel.cp_attention=ring --set data.doc_masking=true --set data.eot_id=10
pair ep2 2 $MOE --set parallel.ep=2 --set model.moe.capacity_factor=1.25
pair zero3 2 --set parallel.zero=3

# hardware FLOPs: metrics.jsonl's hfu adds each checkpointed layer's forward
# again (a third of its training FLOPs) to the model FLOPs MFU counts:
# GPT-2, 4 layers 32 wide, context 32, vocabulary 256: 6 (4 x 12 x 32^2 +
# 32 x 256) + 6 x 4 x 32 x 32 = 368640 a token, of which the layers' 319488,
# so + 106496 with every layer, + 53248 with every other; none has no hfu
if python3 - $T/gpt2_block/metrics.jsonl $T/gpt2_every2_block/metrics.jsonl $T/gpt2_none/metrics.jsonl <<'PY'
import json, sys
rd = lambda p: [json.loads(l) for l in open(p)]
ok = all(abs(x["hfu"] / x["mfu"] - (368640 + 106496) / 368640) < 1e-4 for x in rd(sys.argv[1]))
ok = ok and all(abs(x["hfu"] / x["mfu"] - (368640 + 53248) / 368640) < 1e-4 for x in rd(sys.argv[2]))
sys.exit(0 if ok and not any("hfu" in x for x in rd(sys.argv[3])) else 1)
PY
then ok recompute_block_hardware_flops
else fail recompute_block_hardware_flops "$(grep -o '"mfu":[^,]*,"hfu":[^,]*' $T/gpt2_block/metrics.jsonl | head -2)"; fi

# the arena at start-up: block keeps one (N,C) per layer and one workspace
a() { grep -o 'activations: [0-9.]* MiB' "$1" | awk '{print $2}'; }
if python3 -c "import sys; sys.exit(0 if $(a $T/gpt2_none.txt) > $(a $T/gpt2_every2_block.txt) > $(a $T/gpt2_block.txt) else 1)"; then
    ok recompute_block_startup_line_smaller
else fail recompute_block_startup_line_smaller "$(a $T/gpt2_none.txt) $(a $T/gpt2_every2_block.txt) $(a $T/gpt2_block.txt) MiB"; fi
# --dry-run counts what the run allocates (both printed to 2 decimals)
./train $Y $S --set model.recompute=block --dry-run >$T/dry_block.txt 2>&1
if dry_matches $T/dry_block.txt "$(a $T/gpt2_block.txt)"
then ok recompute_block_dry_run_matches_run
else fail recompute_block_dry_run_matches_run "dry-run '$(grep -m1 -E '^  activations ' $T/dry_block.txt)', run $(a $T/gpt2_block.txt) MiB"; fi

expect recompute_every_without_block 2 "model.recompute_every.*only model.recompute: block" -- \
    ./train $Y --set model.recompute_every=2
expect recompute_every_zero 2 "model.recompute_every" -- ./train $Y --set model.recompute=block --set model.recompute_every=0

# Resume: 3 steps with none, then to 6 with block every 2 layers: allowed
# (reported), and the bits of 6 steps straight (a constant schedule: the
# 3-step run has the 6-step one's first learning rates)
K="--set schedule.kind=constant --set checkpoint.every=3"
./train $Y $S $K --set run.dir=$T/straight >$T/straight.txt 2>&1
./train $Y $S $K --set run.dir=$T/switch --set train.steps=3 >$T/switch0.txt 2>&1
./train $Y $S $K --set run.dir=$T/switch --set model.recompute=block --set model.recompute_every=2 --resume auto \
    >$T/switch.txt 2>&1
rc=$?
if [ $rc -eq 0 ] && grep -q "resume: key 'model.recompute': none -> block changed" $T/switch.txt \
    && grep -q "resume: key 'model.recompute_every': 1 -> 2 changed" $T/switch.txt \
    && ./train ckpt-diff $T/straight/checkpoints/step_00000006 $T/switch/checkpoints/step_00000006 --quiet --tol 0 \
        >$T/switch_diff.txt 2>&1; then ok recompute_block_change_on_resume
else fail recompute_block_change_on_resume "rc $rc; $(grep -E 'resume|error' $T/switch.txt | head -3) $(head -c 200 $T/switch_diff.txt)"; fi
