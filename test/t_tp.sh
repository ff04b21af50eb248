#!/usr/bin/env bash
# Tensor and sequence parallelism on the CPU backend under real Open MPI: one
# rank against tp 2, tp 4, tp 2 x dp 2 (ZeRO 1 and 3), with and without
# sequence parallelism, for a tiny GPT-2 (biases, learned positions, tied
# head) and a tiny Llama with grouped-query attention, a Llama with QK-norm
# and an MoE Llama; the replicated gradients bit-identical on every tp rank;
# a checkpoint resharded tp 2 -> tp 1 -> tp 2 x dp 2; layouts that do not
# split refused on every rank. One line per check.
#
# Tolerances (docs/parallel.md, "Correctness"): tensor parallelism computes
# the same sums in another association order (a row-parallel product's dot
# products are split over the ranks and added by the reduction; the
# cross-entropy's sum of exponentials is combined from per-rank partial sums;
# the norms' gradients of sequence shards are added over tp), a few ulps
# (~1e-7 relative) per reassociation. Through 2 layers and 6 AdamW steps
# (scale-free updates) that stays far below 1e-5: measured, the losses agree
# to the 6 digits metrics.jsonl prints and parameters within 2e-6. So: loss at
# every step within relative 1e-5, every final parameter within absolute 1e-5
# (parameters are O(0.02-1)).
set -u
cd "$(dirname "$0")/.."
T=${KILN_TEST_TMP:-$(mktemp -d)}/t_tp
rm -rf "$T"
. test/ckpt_lib.sh
if ! command -v mpirun >/dev/null 2>&1; then skip tp "mpirun not found (make deps installs openmpi-bin)"; exit 0; fi
if ! ldd ./train | grep -q libmpi; then skip tp "./train is not an MPI build (make deps, then make)"; exit 0; fi
ckpt_setup
Y=$T/tiny.yaml
MPIRUN=(timeout 300 mpirun --allow-run-as-root --oversubscribe)
# 512 tokens a step = 4 micro-batches of 4 x 32 (1 or 2 per dp rank); a
# vocabulary of 300 pads to 320 logical rows and, split over tp 4, to 4 x 128
# rows: rank 2 holds 44 real tokens and rank 3 none.
S="--set batch.total_tokens=512 --set train.steps=6 --set checkpoint.every=6 --set checkpoint.async=false"
S="$S --set model.vocab_size=300 --set train.eval_every=3"
GPT2="--set model.n_head=4"
LLAMA="--set model.arch=llama --set model.n_head=8 --set model.n_kv_head=4 --set model.n_embd=64 --set model.ffn_hidden=96"
QKN="$LLAMA --set model.qk_norm=head"
MOE="$LLAMA --set model.mlp=moe --set model.moe.n_experts=4 --set model.moe.top_k=2 --set model.moe.expert_hidden=32"
MOE="$MOE --set model.moe.n_shared=1 --set model.moe.capacity_factor=1.25 --set model.moe.aux_loss_coef=0.01"

# equiv NAME MODEL NP TP SP ZERO: the run against the model's one-rank reference
equiv() {
    local name=$1 model=$2 np=$3 tp=$4 sp=$5 z=$6
    local D=$T/$name
    "${MPIRUN[@]}" -np $np ./train $Y $S ${!model} --set parallel.tp=$tp --set parallel.sequence_parallel=$sp \
        --set parallel.zero=$z --set run.dir=$D >$D.txt 2>&1
    local rc=$? why diff drc=1
    why=$(close_losses $T/ref_$model/metrics.jsonl $D/metrics.jsonl 2>&1)
    diff=$(./train ckpt-diff $T/ref_$model/checkpoints/step_00000006 $D/checkpoints/step_00000006 --quiet --tol 1e-5 \
        2>&1) && drc=0
    if [ $rc -eq 0 ] && [ $drc -eq 0 ] && [ -z "$why" ]; then ok tp_equiv_$name
    else fail tp_equiv_$name "rc $rc: $why $diff $(grep -m2 error $D.txt)"; fi
}

for model in GPT2 LLAMA QKN MOE; do
    ./train $Y $S ${!model} --set run.dir=$T/ref_$model >$T/ref_$model.txt 2>&1 \
        || fail tp_reference_$model "$(tail -n 3 $T/ref_$model.txt)"
done
equiv gpt2_tp2_sp GPT2 2 2 true 0
equiv gpt2_tp2_nosp GPT2 2 2 false 0
equiv gpt2_tp4_sp GPT2 4 4 true 0
equiv gpt2_tp2_dp2_zero1 GPT2 4 2 true 1
equiv gpt2_tp2_dp2_zero3_nosp GPT2 4 2 false 3
equiv llama_gqa_tp2_sp LLAMA 2 2 true 0
equiv llama_gqa_tp4_nosp LLAMA 4 4 false 0
equiv llama_gqa_tp4_sp LLAMA 4 4 true 0
equiv llama_gqa_tp2_dp2_zero1_nosp LLAMA 4 2 false 1
equiv llama_gqa_tp2_dp2_zero3_sp LLAMA 4 2 true 3
equiv llama_qknorm_tp2_sp QKN 2 2 true 0
equiv moe_tp2_sp MOE 2 2 true 0
equiv moe_tp2_dp2_zero1_nosp MOE 4 2 false 1

# Generation under tp: every rank runs the forward on its part, the logits row
# is gathered, and every rank draws the same token: the text of one rank.
G="--set train.sample_every=6 --set train.sample_tokens=40"
./train $Y $S $LLAMA $G --set run.dir=$T/gen1 2>&1 | sed -n '/--- sample/,/^---$/p' >$T/gen1.txt
"${MPIRUN[@]}" -np 2 ./train $Y $S $LLAMA $G --set parallel.tp=2 --set run.dir=$T/gen2 2>&1 \
    | sed -n '/--- sample/,/^---$/p' >$T/gen2.txt
[ -s $T/gen1.txt ] && cmp -s $T/gen1.txt $T/gen2.txt && ok tp_generation_same_text \
    || fail tp_generation_same_text "$(head -c 200 $T/gen1.txt) vs $(head -c 200 $T/gen2.txt)"

grep -q 'tensor parallel: 2 ranks' $T/llama_gqa_tp2_sp/log/rank0.txt 2>/dev/null || grep -q 'tensor parallel: 2 ranks' \
    $T/llama_gqa_tp2_sp.txt && ok tp_start_up_line || fail tp_start_up_line "$(grep -m3 tensor $T/llama_gqa_tp2_sp.txt)"
grep -q 'blocked in tp communication' $T/llama_gqa_tp2_sp.txt && ok tp_reports_blocked_fraction \
    || fail tp_reports_blocked_fraction "$(tail -n 3 $T/llama_gqa_tp2_sp.txt)"

# Every replicated tensor's gradient (norms, row-parallel biases, positions,
# QK-norm gains, whole MoE layers) is the same, bit for bit, on each tp rank
# after the first step's sync: the sequence-parallel norms' partial
# gradients were summed over tp, and nothing was summed twice (a doubled
# gradient would differ from the one-rank run above).
for model in GPT2 QKN MOE; do
    for sp in true false; do
        D=$T/grads_${model}_$sp
        mkdir -p $D
        KILN_TEST_TP_GRADS=$D/g "${MPIRUN[@]}" -np 4 ./train $Y $S ${!model} --set parallel.tp=2 --set train.steps=1 \
            --set parallel.sequence_parallel=$sp --set parallel.zero=1 --set run.dir=$D/run >$D.txt 2>&1
        n=$(wc -l < $D/g.rank0 2>/dev/null || echo 0)
        # ranks 0,1 are dp 0's tp pair, 2,3 dp 1's
        if [ "$n" -gt 3 ] && cmp -s $D/g.rank0 $D/g.rank1 && cmp -s $D/g.rank2 $D/g.rank3 && cmp -s $D/g.rank0 $D/g.rank2
        then ok tp_replicated_grads_identical_${model}_sp_$sp
        else fail tp_replicated_grads_identical_${model}_sp_$sp "$n tensors; $(diff $D/g.rank0 $D/g.rank1 2>&1 | head -3)"
        fi
    done
done

# Resharding: tp 2 for 8 steps -> one rank to 14 -> tp 2 x dp 2 (ZeRO 1) to
# 20, against 20 steps on one rank (constant schedule: a shorter run has the
# same learning rates; the data position is global, so it carries over).
C="$S $LLAMA --set schedule.kind=constant --set checkpoint.every=2 --set train.steps=20"
./train $Y $C --set run.dir=$T/cref >$T/cref.txt 2>&1
"${MPIRUN[@]}" -np 2 ./train $Y $C --set parallel.tp=2 --set run.dir=$T/rs --set train.steps=8 >$T/rs1.txt 2>&1
./train $Y $C --set run.dir=$T/rs --set train.steps=14 --resume auto >$T/rs2.txt 2>&1
from_tp=$(jget $T/rs/summary.json "'%d %d' % (d['resumed']['from']['dp'], d['resumed']['from']['tp'])")
"${MPIRUN[@]}" -np 4 ./train $Y $C --set parallel.tp=2 --set parallel.zero=1 --set run.dir=$T/rs --resume auto \
    >$T/rs3.txt 2>&1
rc=$?
why=$(close_losses $T/cref/metrics.jsonl $T/rs/metrics.jsonl 2>&1)
diff=$(./train ckpt-diff $T/cref/checkpoints/step_00000020 $T/rs/checkpoints/step_00000020 --quiet --tol 1e-5 2>&1)
drc=$?
if [ $rc -eq 0 ] && [ $drc -eq 0 ] && [ -z "$why" ] && [ "$from_tp" = "1 2" ]; then ok tp_reshard_tp2_tp1_tp2dp2
else fail tp_reshard_tp2_tp1_tp2dp2 "rc $rc, resumed from dp/tp '$from_tp': $why $diff $(grep -m2 -h error $T/rs[123].txt)"; fi
# a tp-split checkpoint holds boxes of the logical tensors: rank 1 wrote its parts
n=$(./train ckpt-info $T/rs/checkpoints/step_00000008 | grep -c ' rank 1 ')
[ "$n" -gt 0 ] && ok tp_checkpoint_parts_per_rank || fail tp_checkpoint_parts_per_rank "no pieces from rank 1"

# Layouts that do not split: one line, exit 2, before any allocation (test/lib.sh mpi_refuse).
refuse() { mpi_refuse tp "$@"; }
refuse heads_tp3 3 "tp 3 must divide the 4 attention heads" $GPT2 --set parallel.tp=3 \
    --set parallel.sequence_parallel=false
refuse kv_heads_tp4 4 "tp 4 must divide the 2 kv heads" $LLAMA --set model.n_kv_head=2 --set parallel.tp=4
refuse qk_norm_full 2 "full normalises over every head" $LLAMA --set model.qk_norm=full --set parallel.tp=2
refuse ffn_width 2 "must divide the MLP width 95" $LLAMA --set model.ffn_hidden=95 --set parallel.tp=2
# Muon under tp (each split matrix gathered to one tp rank for Newton-Schulz): test/t_muon.sh
