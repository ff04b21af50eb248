#!/usr/bin/env bash
# Pipeline parallelism on the CPU backend under real Open MPI: one rank
# against pp 2 and pp 4 with every schedule (gpipe, 1f1b, interleaved_1f1b
# with 2 chunks per rank, zb_h1) for a tiny GPT-2 (tied head: the first and
# last stage hold the embedding) and a tiny Llama; pp 2 x dp 2 (ZeRO 0 to 3:
# ZeRO-2/3 shard each stage's layers over its dp group, with 1f1b, zb_h1 and
# interleaved), pp 2 x cp 2 (ring and all-gather attention inside a stage;
# with ZeRO-3), pp 2 x tp 2, pp 2 x tp 2 x dp 2 (8 ranks); micro-batch counts that are not
# multiples of pp; recomputation; an MoE; evaluation and generation through
# the stages; a stage killed mid-step (the others end within
# parallel.timeout_s naming it, and --resume auto continues it to the bit);
# checkpoints resharded pp 2 -> pp 1 -> pp 4, pp 2 x tp 2 -> pp 2 x dp 2 and
# pp 2 x dp 2 ZeRO 3 -> one rank -> pp 2 x dp 2 ZeRO 2;
# what a schedule cannot run refused on every rank; the bubble in
# metrics.jsonl and the plan. One line per check.
#
# Tolerances (docs/parallel.md, "Correctness"): a stage computes its layers
# with the same ops on the same inputs as one rank, so the forward is
# bit-identical; what differs is the order of a few sums: the tied
# embedding's gradient is the first stage's plus the last stage's (one rank
# adds the embedding's scatter into the head's gradient), the global norm is
# a sum of the stages' sums of squares, and dp / tp reassociate as in
# t_dp.sh / t_tp.sh: a few ulps (~1e-7 relative) per reassociation, which
# through 4 layers and 6 AdamW steps (scale-free updates) stays far below
# 1e-5 (measured: losses equal to the 6 digits metrics.jsonl prints,
# parameters within 1.2e-7 for pp alone and 3.8e-7 with dp and tp; the
# untied Llama and the MoE at pp 4 and 2 to the bit; pp 2 x dp 2 within
# 9.5e-7 for every ZeRO stage alike, the largest in h.0.mlp.c_proj.weight,
# whose AdamW update divides tiny gradients by their tiny RMS: ZeRO-3 and
# ZeRO-1 on that layout differ by 6.3e-8; pp 2 x cp 2 within 7e-7, the
# same tensor). So: loss at every
# step within relative 1e-5, every final parameter within absolute 1e-5
# (parameters are O(0.02-1)).
set -u
cd "$(dirname "$0")/.."
T=${KILN_TEST_TMP:-$(mktemp -d)}/t_pp
rm -rf "$T"
. test/ckpt_lib.sh
if ! command -v mpirun >/dev/null 2>&1; then skip pp "mpirun not found (make deps installs openmpi-bin)"; exit 0; fi
if ! ldd ./train | grep -q libmpi; then skip pp "./train is not an MPI build (make deps, then make)"; exit 0; fi
ckpt_setup
Y=$T/tiny.yaml
MPIRUN=(timeout 300 mpirun --allow-run-as-root --oversubscribe)
now() { date +%s.%N; }
# 512 tokens a step = 4 micro-batches of 4 x 32 (2 per rank with dp 2); 4
# layers, so that pp 4 and 2 x 2 virtual stages get one each.
S="--set batch.total_tokens=512 --set train.steps=6 --set checkpoint.every=6 --set checkpoint.async=false"
S="$S --set model.n_layer=4 --set model.vocab_size=300 --set train.eval_every=3"
GPT2="--set model.n_head=4"
LLAMA="--set model.arch=llama --set model.n_head=8 --set model.n_kv_head=4 --set model.n_embd=64 --set model.ffn_hidden=96"
MOE="$LLAMA --set model.mlp=moe --set model.moe.n_experts=4 --set model.moe.top_k=2 --set model.moe.expert_hidden=32"
MOE="$MOE --set model.moe.n_shared=1 --set model.moe.aux_loss_coef=0.01"
# three micro-batches a step: not a multiple of pp 2 or 4
ODD="--set batch.total_tokens=384"

# close_vals A B: the validation losses (evaluated through every stage) of two
# metrics.jsonl files, within relative 1e-5 as the training losses
close_vals() {
    python3 - "$1" "$2" <<'PY'
import json, sys
a = [json.loads(l).get("val_loss") for l in open(sys.argv[1])]
b = [json.loads(l).get("val_loss") for l in open(sys.argv[2])]
if len(a) != len(b) or any((x is None) != (y is None) or (x is not None and abs(x - y) > 1e-5 * abs(x))
                           for x, y in zip(a, b)):
    print("val losses differ: %r vs %r" % ([x for x in a if x], [y for y in b if y])); sys.exit(1)
PY
}
# equiv NAME REF NP ARGS...: the run against reference REF (a one-rank run)
equiv() {
    local name=$1 ref=$2 np=$3; shift 3
    local D=$T/$name
    "${MPIRUN[@]}" -np $np ./train $Y $S "$@" --set run.dir=$D >$D.txt 2>&1
    local rc=$? why diff drc=1
    why=$(close_losses $T/$ref/metrics.jsonl $D/metrics.jsonl 2>&1; close_vals $T/$ref/metrics.jsonl $D/metrics.jsonl 2>&1)
    diff=$(./train ckpt-diff $T/$ref/checkpoints/step_00000006 $D/checkpoints/step_00000006 --quiet --tol 1e-5 \
        2>&1) && drc=0
    if [ $rc -eq 0 ] && [ $drc -eq 0 ] && [ -z "$why" ]; then ok pp_equiv_$name
    else fail pp_equiv_$name "rc $rc: $why $diff $(grep -m2 error $D.txt)"; fi
}
reference() {
    local name=$1; shift
    ./train $Y $S "$@" --set run.dir=$T/$name >$T/$name.txt 2>&1 || fail pp_reference_$name "$(tail -n 3 $T/$name.txt)"
}

reference ref_gpt2 $GPT2
reference ref_llama $LLAMA
reference ref_gpt2_odd $GPT2 $ODD
reference ref_moe $MOE
reference ref_gpt2_muon $GPT2 --set optim.name=muon
# six micro-batches: three per dp rank, not a multiple of pp 2
ODD_DP="--set batch.total_tokens=768"
reference ref_llama_odd_dp $LLAMA $ODD_DP
# 6 layers and 3 micro-batches for pp 3 with 2 chunks each: an odd pipeline
# whose wrap-around link (stage 2 -> 0) has a channel split of its own
reference ref_gpt2_6 $GPT2 $ODD --set model.n_layer=6
for sched in gpipe 1f1b zb_h1; do
    equiv gpt2_pp2_$sched ref_gpt2 2 $GPT2 --set parallel.pp=2 --set parallel.pp_schedule=$sched
    equiv llama_pp4_$sched ref_llama 4 $LLAMA --set parallel.pp=4 --set parallel.pp_schedule=$sched
done
equiv gpt2_pp4_1f1b ref_gpt2 4 $GPT2 --set parallel.pp=4
equiv llama_pp2_zb_h1 ref_llama 2 $LLAMA --set parallel.pp=2 --set parallel.pp_schedule=zb_h1
IL="--set parallel.pp_schedule=interleaved_1f1b --set parallel.pp_virtual=2"
equiv gpt2_pp2_interleaved_v2 ref_gpt2 2 $GPT2 --set parallel.pp=2 $IL
equiv llama_pp2_interleaved_v2 ref_llama 2 $LLAMA --set parallel.pp=2 $IL
equiv gpt2_pp3_interleaved_v2 ref_gpt2_6 3 $GPT2 $ODD --set model.n_layer=6 --set parallel.pp=3 $IL
equiv gpt2_pp2_odd_1f1b ref_gpt2_odd 2 $GPT2 $ODD --set parallel.pp=2
equiv gpt2_pp4_odd_zb_h1 ref_gpt2_odd 4 $GPT2 $ODD --set parallel.pp=4 --set parallel.pp_schedule=zb_h1
equiv gpt2_pp2_stages_by_hand ref_gpt2 2 $GPT2 --set parallel.pp=2 --set parallel.pp_layers=[3,1]
equiv gpt2_pp2_dp2 ref_gpt2 4 $GPT2 --set parallel.pp=2 --set parallel.dp=2
# interleaved over dp: the buckets are posted from the rank's last backward
# only, when every chunk's gradients are complete; every collective agreed on
equiv gpt2_pp2_dp2_interleaved_checked ref_gpt2 4 $GPT2 --set parallel.pp=2 --set parallel.dp=2 $IL \
    --set monitor.check_collectives=true
equiv llama_pp2_dp2_zero1_zb_h1 ref_llama 4 $LLAMA --set parallel.pp=2 --set parallel.dp=2 --set parallel.zero=1 \
    --set parallel.pp_schedule=zb_h1
# ZeRO-2/3 inside each stage: the stage's dp group shards its layers; a
# stage's gradients accumulate over the micro-batches and each layer is
# reduce-scattered once, after its chunk's last backward (zb_h1: its last
# weight part); the tied embedding's two copies summed before that
Z3="--set parallel.pp=2 --set parallel.dp=2 --set parallel.zero=3"
equiv gpt2_pp2_dp2_zero3_1f1b ref_gpt2 4 $GPT2 $Z3
equiv gpt2_pp2_dp2_zero3_zb_h1 ref_gpt2 4 $GPT2 $Z3 --set parallel.pp_schedule=zb_h1
equiv gpt2_pp2_dp2_zero3_interleaved ref_gpt2 4 $GPT2 $Z3 $IL
# ... and to the bit what ZeRO 0 computes on the same layout: with dp 2 every
# sum of two ranks commutes, the micro-batches accumulate in the same order,
# and the tied embedding's unit is all-reduced before the two copies are
# summed, as ZeRO 0 does (the norm's double sums split the same squares at
# other points: equal to the bit here, measured)
for z in gpt2_pp2_dp2_zero3_1f1b gpt2_pp2_dp2_zero3_zb_h1 gpt2_pp2_dp2_zero3_interleaved; do
    r=gpt2_pp2_dp2; [ $z = gpt2_pp2_dp2_zero3_interleaved ] && r=gpt2_pp2_dp2_interleaved_checked
    d=$(./train ckpt-diff $T/$r/checkpoints/step_00000006 $T/$z/checkpoints/step_00000006 --quiet --tol 0 2>&1) \
        && ok pp_${z}_equals_zero0_bitwise || fail pp_${z}_equals_zero0_bitwise "$d"
done
equiv llama_pp2_dp2_zero2_1f1b ref_llama 4 $LLAMA --set parallel.pp=2 --set parallel.dp=2 --set parallel.zero=2
equiv llama_pp2_dp2_zero2_zb_h1_odd ref_llama_odd_dp 4 $LLAMA $ODD_DP --set parallel.pp=2 --set parallel.dp=2 \
    --set parallel.zero=2 --set parallel.pp_schedule=zb_h1
# context parallelism inside each stage: a stage's cp group runs attention,
# the pipeline sends each cp rank's B T / cp rows to its peer in the next stage
equiv gpt2_pp2_cp2_1f1b ref_gpt2 4 $GPT2 --set parallel.pp=2 --set parallel.cp=2
equiv llama_pp2_cp2_ring_zb_h1 ref_llama 4 $LLAMA --set parallel.pp=2 --set parallel.cp=2 \
    --set parallel.cp_attention=ring --set parallel.pp_schedule=zb_h1
equiv llama_pp2_cp2_zero3_interleaved ref_llama 4 $LLAMA --set parallel.pp=2 --set parallel.cp=2 \
    --set parallel.zero=3 $IL
# Muon's owners plan over the stage's units (ddp_rank_piece: other stages' empty)
equiv gpt2_pp2_dp2_zero3_muon ref_gpt2_muon 4 $GPT2 $Z3 --set optim.name=muon
equiv gpt2_pp2_tp2 ref_gpt2 4 $GPT2 --set parallel.pp=2 --set parallel.tp=2
equiv llama_pp2_tp2_nosp_interleaved ref_llama 4 $LLAMA --set parallel.pp=2 --set parallel.tp=2 $IL \
    --set parallel.sequence_parallel=false
equiv gpt2_pp2_tp2_dp2_zero1 ref_gpt2 8 $GPT2 --set parallel.pp=2 --set parallel.tp=2 --set parallel.dp=2 \
    --set parallel.zero=1 --set parallel.pp_schedule=zb_h1
equiv gpt2_pp2_tp2_dp2_zero3_interleaved ref_gpt2 8 $GPT2 $Z3 --set parallel.tp=2 $IL
equiv llama_pp2_cp2_tp2 ref_llama 8 $LLAMA --set parallel.pp=2 --set parallel.cp=2 --set parallel.tp=2
# recomputation: the one-rank reference keeps everything (bit-identical on the CPU)
equiv gpt2_pp2_zb_h1_recompute ref_gpt2 2 $GPT2 --set parallel.pp=2 --set parallel.pp_schedule=zb_h1 \
    --set model.recompute=norm_gelu
equiv llama_pp2_interleaved_recompute ref_llama 2 $LLAMA --set parallel.pp=2 $IL --set model.recompute=gelu
equiv moe_pp2_1f1b ref_moe 2 $MOE --set parallel.pp=2
equiv moe_pp2_dp2_zero3_zb_h1 ref_moe 4 $MOE $Z3 --set parallel.pp_schedule=zb_h1

# the validation loss (through every stage) is compared in the equivalence
# above; the bubble: the measured figure and the schedule's beside it, every step
D=$T/gpt2_pp2_zb_h1
if grep -q '"pp_bubble":[0-9.e-]*,"pp_bubble_theory":0.07692' $D/metrics.jsonl && grep -q 'val_loss' $D/metrics.jsonl
then ok pp_bubble_reported
else fail pp_bubble_reported "$(tail -n 1 $D/metrics.jsonl | head -c 300)"; fi
# the stages' time idle waiting for a neighbour, per rank (ranks.jsonl), and the start-up line
why=$(ranks_comm_why $D pp 2)
[ -z "$why" ] && grep -q 'pipeline parallel: 2 stages, zb_h1' $D.txt \
    && ok pp_start_and_end_lines || fail pp_start_and_end_lines "$why $(grep -m2 pipeline $D.txt)"
# each stage wrote its own layers; the last stage left the tied wte to the first
info=$(./train ckpt-info $D/checkpoints/step_00000006)
if printf '%s\n' "$info" | grep -E '^ *tensor wte ' | grep -q ' rank 0 ' && ! printf '%s\n' "$info" \
    | grep -E '^ *tensor (optim\.[mv]/)?wte ' | grep -q ' rank 1 ' \
    && printf '%s\n' "$info" | grep -E '^ *tensor h\.3\.' | grep -q ' rank 1 '; then ok pp_checkpoint_by_stage
else fail pp_checkpoint_by_stage "$(printf '%s\n' "$info" | grep -E 'tensor (wte|h\.3\.attn\.c_attn\.weight) ' | head -4)"; fi

# Generation through the stages: the last stage draws each token (its
# logits are the one rank's to ~1e-7 after 6 steps, the draws the same
# seeded stream), every stage appends it; the text of one rank, also with tp
# 2 (sequence parallelism pads each window to a multiple of tp).
G="--set train.sample_every=6 --set train.sample_tokens=40"
./train $Y $S $LLAMA $G --set run.dir=$T/gen1 2>&1 | sed -n '/--- sample/,/^---$/p' >$T/gen1.txt
"${MPIRUN[@]}" -np 2 ./train $Y $S $LLAMA $G --set parallel.pp=2 --set run.dir=$T/gen2 2>&1 \
    | sed -n '/--- sample/,/^---$/p' >$T/gen2.txt
"${MPIRUN[@]}" -np 4 ./train $Y $S $LLAMA $G --set parallel.pp=2 --set parallel.tp=2 --set run.dir=$T/gen4 2>&1 \
    | sed -n '/--- sample/,/^---$/p' >$T/gen4.txt
# ZeRO-3 inside the stages (each stage gathers its layers for the
# generation's forwards) and cp inside them (the last position's cp rank
# broadcasts its logits row)
"${MPIRUN[@]}" -np 4 ./train $Y $S $LLAMA $G $Z3 --set run.dir=$T/genz 2>&1 | sed -n '/--- sample/,/^---$/p' >$T/genz.txt
"${MPIRUN[@]}" -np 4 ./train $Y $S $LLAMA $G --set parallel.pp=2 --set parallel.cp=2 --set run.dir=$T/genc 2>&1 \
    | sed -n '/--- sample/,/^---$/p' >$T/genc.txt
[ -s $T/gen1.txt ] && cmp -s $T/gen1.txt $T/gen2.txt && cmp -s $T/gen1.txt $T/gen4.txt && cmp -s $T/gen1.txt $T/genz.txt \
    && cmp -s $T/gen1.txt $T/genc.txt && ok pp_generation_same_text \
    || fail pp_generation_same_text "$(head -c 200 $T/gen1.txt) vs $(head -c 200 $T/gen2.txt) $(head -c 200 $T/genz.txt) $(head -c 200 $T/genc.txt)"

# Resharding: pp 2 for 8 steps -> one rank to 14 -> pp 4 to 20, against 20
# steps on one rank (constant schedule: a shorter run has the same learning
# rates; the data position is global, so it carries over).
C="$S $GPT2 --set schedule.kind=constant --set checkpoint.every=2 --set train.steps=20"
./train $Y $C --set run.dir=$T/cref >$T/cref.txt 2>&1
"${MPIRUN[@]}" -np 2 ./train $Y $C --set parallel.pp=2 --set run.dir=$T/rs --set train.steps=8 >$T/rs1.txt 2>&1
./train $Y $C --set run.dir=$T/rs --set train.steps=14 --resume auto >$T/rs2.txt 2>&1
cp $T/rs/summary.json $T/rs2.summary.json 2>/dev/null
"${MPIRUN[@]}" -np 4 ./train $Y $C --set parallel.pp=4 --set run.dir=$T/rs --resume auto >$T/rs3.txt 2>&1
rc=$?
why=$(close_losses $T/cref/metrics.jsonl $T/rs/metrics.jsonl 2>&1)
diff=$(./train ckpt-diff $T/cref/checkpoints/step_00000020 $T/rs/checkpoints/step_00000020 --quiet --tol 1e-5 2>&1)
drc=$?
rs="$(resumed_why $T/rs2.summary.json world=2 pp=2 to.world=1)$(resumed_why $T/rs/summary.json world=1 to.pp=4)"
if [ $rc -eq 0 ] && [ $drc -eq 0 ] && [ -z "$why" ] && [ -z "$rs" ]; then ok pp_reshard_pp2_pp1_pp4
else fail pp_reshard_pp2_pp1_pp4 "rc $rc: $why $rs $diff $(grep -m2 -h -E 'error|resumed' $T/rs[123].txt)"; fi
# pp 2 x tp 2 -> pp 2 x dp 2 (ZeRO 1), interleaved -> zb_h1
"${MPIRUN[@]}" -np 4 ./train $Y $C --set parallel.pp=2 --set parallel.tp=2 $IL --set run.dir=$T/rt --set train.steps=10 \
    >$T/rt1.txt 2>&1
"${MPIRUN[@]}" -np 4 ./train $Y $C --set parallel.pp=2 --set parallel.dp=2 --set parallel.zero=1 \
    --set parallel.pp_schedule=zb_h1 --set run.dir=$T/rt --resume auto >$T/rt2.txt 2>&1
rc=$?
why=$(close_losses $T/cref/metrics.jsonl $T/rt/metrics.jsonl 2>&1)
diff=$(./train ckpt-diff $T/cref/checkpoints/step_00000020 $T/rt/checkpoints/step_00000020 --quiet --tol 1e-5 2>&1)
drc=$?
if [ $rc -eq 0 ] && [ $drc -eq 0 ] && [ -z "$why" ]; then ok pp_reshard_pp2tp2_pp2dp2
else fail pp_reshard_pp2tp2_pp2dp2 "rc $rc: $why $diff $(grep -m2 -h -E 'error' $T/rt[12].txt)"; fi

# ZeRO-3 inside the stages -> one rank -> ZeRO-2 inside interleaved stages:
# pp 2 x dp 2 ZeRO 3 (zb_h1) writes each stage's units' blocks for 8 steps,
# one rank assembles the whole model and continues to 14, pp 2 x dp 2 ZeRO 2
# takes its stages' blocks back to 20; against 20 steps on one rank.
"${MPIRUN[@]}" -np 4 ./train $Y $C $Z3 --set parallel.pp_schedule=zb_h1 --set run.dir=$T/rz --set train.steps=8 \
    >$T/rz1.txt 2>&1
./train $Y $C --set run.dir=$T/rz --set train.steps=14 --resume auto >$T/rz2.txt 2>&1
cp $T/rz/summary.json $T/rz2.summary.json 2>/dev/null
"${MPIRUN[@]}" -np 4 ./train $Y $C --set parallel.pp=2 --set parallel.dp=2 --set parallel.zero=2 $IL \
    --set run.dir=$T/rz --resume auto >$T/rz3.txt 2>&1
rc=$?
why=$(close_losses $T/cref/metrics.jsonl $T/rz/metrics.jsonl 2>&1)
diff=$(./train ckpt-diff $T/cref/checkpoints/step_00000020 $T/rz/checkpoints/step_00000020 --quiet --tol 1e-5 2>&1)
drc=$?
rs="$(resumed_why $T/rz2.summary.json world=4 pp=2 dp=2 to.world=1)$(resumed_why $T/rz/summary.json world=1 to.pp=2 to.dp=2)"
if [ $rc -eq 0 ] && [ $drc -eq 0 ] && [ -z "$why" ] && [ -z "$rs" ]; then ok pp_reshard_pp2dp2zero3_pp1_pp2dp2zero2
else fail pp_reshard_pp2dp2zero3_pp1_pp2dp2zero2 "rc $rc: $why $rs $diff $(grep -m2 -h -E 'error|resumed' $T/rz[123].txt)"; fi

# The same layout resumed: pp 2 x dp 2 ZeRO 3 (zb_h1) stopped at step 3 and
# continued with --resume auto gives an uninterrupted run's losses and
# checkpoint to the bit (each rank reloads its blocks of its stage's units;
# a constant schedule: the shorter first run has the same learning rates).
B="$S $GPT2 $Z3 --set parallel.pp_schedule=zb_h1 --set checkpoint.every=3 --set schedule.kind=constant"
"${MPIRUN[@]}" -np 4 ./train $Y $B --set run.dir=$T/zref >$T/zref.txt 2>&1
"${MPIRUN[@]}" -np 4 ./train $Y $B --set run.dir=$T/zres --set train.steps=3 >$T/zres1.txt 2>&1
"${MPIRUN[@]}" -np 4 ./train $Y $B --set run.dir=$T/zres --resume auto >$T/zres2.txt 2>&1
rc=$?
if [ $rc -eq 0 ] && [ -n "$(losses $T/zref/metrics.jsonl)" ] \
    && [ "$(losses $T/zref/metrics.jsonl)" = "$(losses $T/zres/metrics.jsonl)" ] \
    && [ "$(sums $T/zref/checkpoints/step_00000006)" = "$(sums $T/zres/checkpoints/step_00000006)" ] \
    && grep -q 'resumed from' $T/zres2.txt; then ok pp_dp2_zero3_resume_bit_identical
else fail pp_dp2_zero3_resume_bit_identical "rc $rc: $(grep -m2 -h -E 'resumed|error' $T/zres2.txt)"; fi

# A stage killed mid-run. mpirun --enable-recovery leaves the other stage
# waiting for its neighbour (as a scheduler that does not kill the step
# would): the deadline (parallel.timeout_s = 3) must end it naming rank 1 as
# dead, which its line shows (the time it took is not asserted). Both stages
# wait after step 40 (KILN_TEST_PAUSE_AT_STEP), rank 1 is killed there and
# rank 0 goes on into the stop agreement's all-reduce (test/lib.sh
# kill_rank1_paused): mid-run however fast or slow the machine is. Then
# --resume auto on the same layout finishes with the losses of an
# uninterrupted run, bit for bit.
t0=$(now)
K="$S $GPT2 --set parallel.pp=2 --set train.steps=300 --set checkpoint.every=6 --set parallel.timeout_s=3"
K="$K --set train.eval_every=0 --set schedule.kind=constant"
"${MPIRUN[@]}" -np 2 ./train $Y $K --set run.dir=$T/kref >/dev/null 2>&1
KILN_TEST_PAUSE_AT_STEP=40 "${MPIRUN[@]}" -np 2 --enable-recovery -x KILN_TEST_PAUSE_AT_STEP ./train $Y $K \
    --set run.dir=$T/kill >$T/kill.txt 2>&1 &
mpid=$!
pid1=$(kill_rank1_paused $T/kill 40 $mpid)
wait $mpid
rc=$?
if [ -n "$pid1" ] && [ $rc -ne 124 ] \
    && grep -qE "kiln: error: rank 0: .* did not complete within 3 s: rank 1 \(pid $pid1 on [^)]*\) is dead" $T/kill.txt; then
    ok pp_killed_stage_named_within_timeout
else fail pp_killed_stage_named_within_timeout "pid '$pid1', rc $rc: $(grep -m2 -E 'error' $T/kill.txt)"; fi
"${MPIRUN[@]}" -np 2 ./train $Y $K --set run.dir=$T/kill --resume auto >$T/kill2.txt 2>&1
rc=$?
if [ $rc -eq 0 ] && [ "$(losses $T/kref/metrics.jsonl)" = "$(losses $T/kill/metrics.jsonl)" ] \
    && [ "$(sums $T/kref/checkpoints/step_00000300)" = "$(sums $T/kill/checkpoints/step_00000300)" ] \
    && grep -q 'resumed from' $T/kill2.txt; then ok pp_killed_stage_resume_auto
else fail pp_killed_stage_resume_auto "rc $rc: $(grep -m2 -E 'resumed|error' $T/kill2.txt)"; fi
echo "pp killed stage: $(echo "$(now) - $t0" | bc) s" >&2

# What a schedule cannot run: one line, exit 2, before any allocation (test/lib.sh mpi_refuse).
refuse() { mpi_refuse pp "$@"; }
refuse interleaved_odd 2 "not a multiple of pp = 2" $GPT2 $ODD --set parallel.pp=2 $IL
refuse too_few_layers 4 "need at least one layer each" $GPT2 --set parallel.pp=4 $IL
refuse stage_sum 2 "add up to 5 layers" $GPT2 --set parallel.pp=2 --set parallel.pp_layers=[3,2]
out=$(./train $Y $S $GPT2 --set parallel.pp=2 --set precision.optim_state=bf16 --dry-run 2>&1); rc=$?
[ $rc -eq 2 ] && printf '%s\n' "$out" | grep -q "tied embedding would drift" && ok pp_refuses_tied_stochastic_rounding \
    || fail pp_refuses_tied_stochastic_rounding "rc $rc: $out"
# the plan shows every stage, the bubble and the schedule's timeline
out=$(./train plan $Y $S --set parallel.pp=2 --set parallel.pp_schedule=zb_h1 --gpus 2 --show-schedule 2>&1); rc=$?
if [ $rc -eq 0 ] && printf '%s\n' "$out" | grep -q 'bubble 7.7% of the step ((p-1)/(3m) = 8.3%' &&
    printf '%s\n' "$out" | grep -q 'stage 1 .*layers 2..3 + head' &&
    printf '%s\n' "$out" | grep -q 'rank 1 | .  F0 B0 F1 B1 W0'; then ok pp_plan_show_schedule
else fail pp_plan_show_schedule "rc $rc: $(printf '%s\n' "$out" | grep -E 'pipeline|stage|rank' | head -5)"; fi
