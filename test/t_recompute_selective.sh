#!/usr/bin/env bash
# model.recompute: selective composed with every layout, on the CPU backend,
# on an MoE model (where it differs from norm_gelu: its experts' and shared
# expert's SwiGLU outputs and the permuted rows are shared buffers the
# backward fills again) and a dense one: each pair trains the same config
# with recompute none and with selective, and the losses, gradient norms,
# validation losses and MoE figures (loads, drops, aux and z losses: counted
# once) printed, and the final checkpoint's parameters and optimizer state,
# must be the same bits (tol 0: the backward runs the forward's own
# pointwise ops on the forward's own kept inputs, so any difference is a bug:
# a buffer another layer or micro-batch overwrote, a recomputation before its
# input is there). Also the smaller arena at start-up and in --dry-run, and
# ./train plan's figure for it. One line a check.
set -u
cd "$(dirname "$0")/.."
T=${KILN_TEST_TMP:-$(mktemp -d)}/t_recompute_selective
rm -rf "$T"
. test/ckpt_lib.sh
ckpt_setup
CAP="--set model.moe.capacity_factor=1.25"
. test/recompute_lib.sh
pair() { recompute_pair selective "$@"; }

pair gpt2 1
pair moe 1 $MOE $CAP
pair moe_dropless_qknorm_docmask 1 $MOE --set model.qk_norm=head --set data.doc_masking=true --set data.eot_id=10
pair moe_fp8_delayed 1 $MOE $CAP --set precision.fp8=tensorwise --set precision.fp8_amax_history=4
pair moe_tp2_sp 2 $MOE $CAP --set parallel.tp=2 --set parallel.sequence_parallel=true
pair moe_pp2_1f1b 2 $MOE $CAP --set parallel.pp=2
pair moe_pp2_interleaved 2 $MOE $CAP --set parallel.pp=2 --set parallel.pp_schedule=interleaved_1f1b --set parallel.pp_virtual=2
pair moe_pp2_zb_h1 2 $MOE $CAP --set parallel.pp=2 --set parallel.pp_schedule=zb_h1
pair moe_cp2_allgather 2 $MOE $CAP --set parallel.cp=2 --set parallel.cp_attention=allgather
pair moe_cp2_ring_docmask 2 $MOE --set parallel.cp=2 --set parallel.cp_attention=ring --set data.doc_masking=true \
    --set data.eot_id=10
pair moe_ep2 2 $MOE $CAP --set parallel.ep=2
pair moe_ep2_dropless 2 $MOE --set parallel.ep=2
pair moe_zero3 2 $MOE $CAP --set parallel.zero=3

# the arena at start-up: selective keeps less than norm_gelu on MoE (the
# run's line), equal on GPT-2; --dry-run counts what the run allocates
a() { grep -o 'activations: [0-9.]* MiB' "$1" | awk '{print $2}'; }
./train $Y $S $MOE $CAP --set model.recompute=norm_gelu --set run.dir=$T/moe_norm_gelu --set train.steps=1 \
    >$T/moe_norm_gelu.txt 2>&1
./train $Y $S --set model.recompute=norm_gelu --set run.dir=$T/gpt2_norm_gelu --set train.steps=1 >$T/gpt2_norm_gelu.txt 2>&1
if python3 -c "import sys; sys.exit(0 if $(a $T/moe_none.txt) > $(a $T/moe_norm_gelu.txt) > $(a $T/moe_selective.txt) \
    and $(a $T/gpt2_norm_gelu.txt) == $(a $T/gpt2_selective.txt) else 1)"; then
    ok recompute_selective_startup_line_smaller
else fail recompute_selective_startup_line_smaller "moe none $(a $T/moe_none.txt) norm_gelu $(a $T/moe_norm_gelu.txt) selective $(a $T/moe_selective.txt); gpt2 norm_gelu $(a $T/gpt2_norm_gelu.txt) selective $(a $T/gpt2_selective.txt) MiB"; fi
./train $Y $S $MOE $CAP --set model.recompute=selective --dry-run >$T/dry_sel.txt 2>&1
if dry_matches $T/dry_sel.txt "$(a $T/moe_selective.txt)"
then ok recompute_selective_dry_run_matches_run
else fail recompute_selective_dry_run_matches_run "dry-run '$(grep -m1 -E '^  activations ' $T/dry_sel.txt)', run $(a $T/moe_selective.txt) MiB"; fi
# ./train plan names what selective would save beside the others
./train plan $Y $S $MOE $CAP --gpus 1 >$T/plan.txt 2>&1
if grep -q "norm_gelu [0-9.]* GiB, block [0-9.]* GiB, selective [0-9.]* GiB" $T/plan.txt; then
    ok recompute_selective_in_plan
else fail recompute_selective_in_plan "$(grep -m1 'recompute ' $T/plan.txt)"; fi
./train plan $Y $S --gpus 1 >$T/plan_gpt2.txt 2>&1
if grep -q "recompute  *none" $T/plan_gpt2.txt && ! grep -q "selective" $T/plan_gpt2.txt; then
    ok recompute_selective_not_offered_dense
else fail recompute_selective_not_offered_dense "$(grep -m1 'recompute ' $T/plan_gpt2.txt)"; fi
