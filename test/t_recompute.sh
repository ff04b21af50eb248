#!/usr/bin/env bash
# model.recompute end to end on the CPU backend: --dry-run and ./train plan
# print the smaller activation figure; training with gelu and norm_gelu gives
# the losses, gradient norms and final checkpoint of `none` bit for bit (tol
# 0: the backward recomputes with the forward's own ops on the forward's own
# inputs), also under ZeRO-3 on 2 MPI ranks; the key may change across a
# resume, which stays bit-identical; a bad value is refused. One line a check.
set -u
cd "$(dirname "$0")/.."
T=${KILN_TEST_TMP:-$(mktemp -d)}/t_recompute
rm -rf "$T"
. test/ckpt_lib.sh
ckpt_setup
Y=$T/tiny.yaml
CFG=configs/gpt2-124m.yaml

# --dry-run, GPT-2 124M at micro-batch 16 x 1024 (N = 16384 tokens, C = 768,
# 12 layers): gelu keeps 11 fewer (N,4C) fp32 tensors = 11 x 192 MiB =
# 2.06 GiB, norm_gelu 23 fewer (N,C) ones more = 23 x 48 MiB = 1.08 GiB:
# 12.79 -> 10.72 -> 9.64 GiB (bf16: 6.40 -> 5.37 -> 4.83). block keeps one
# (N,C) output per layer, plus one whole layer, the workspace (X: ln1, atty,
# res2, ln2, res3, qkv's 3 and fch, fch_gelu's 4 + 4 = 16 (N,C) = 768 MiB,
# and 1 MiB of statistics), and its (2N,C) outputs: 11 X - 14 x 48 MiB =
# 7.60 GiB less.
act() { grep -E "^  $2 " "$1" | head -n 1 | awk '{print $(NF-1)}'; }
for r in none gelu norm_gelu; do
    ./train $CFG --dry-run --set model.recompute=$r >"$T/dry_$r.txt" 2>&1
done
got="$(act $T/dry_none.txt activations) $(act $T/dry_gelu.txt activations) $(act $T/dry_norm_gelu.txt activations)"
got16="$(act $T/dry_none.txt 'activations, bf16') $(act $T/dry_gelu.txt 'activations, bf16') $(act $T/dry_norm_gelu.txt 'activations, bf16')"
if [ "$got" = "12.79 10.72 9.64" ] && [ "$got16" = "6.40 5.37 4.83" ]; then ok recompute_dry_run_activations
else fail recompute_dry_run_activations "fp32 $got (want 12.79 10.72 9.64), bf16 $got16 (want 6.40 5.37 4.83)"; fi
if grep -q '^  recompute  *gelu (model.recompute): 2.06 GiB less than none in fp32, 1.03 GiB in bf16' $T/dry_gelu.txt \
    && grep -q '^  recompute  *none (model.recompute: gelu would take 2.06 GiB less in fp32, norm_gelu 3.14 GiB, block 7.60 GiB)' \
        $T/dry_none.txt; then ok recompute_dry_run_names_mode
else fail recompute_dry_run_names_mode "$(grep recompute $T/dry_gelu.txt $T/dry_none.txt | tr '\n' ' ')"; fi
# ./train plan prints the same lines (and counts them in its total); device cpu:
# the fp32 the dry run counts on this machine (a GPU's bf16 halves them)
./train plan $CFG --gpus 8 --set device=cpu --set model.recompute=norm_gelu >"$T/plan.txt" 2>&1
./train plan $CFG --gpus 8 --set device=cpu >"$T/plan_none.txt" 2>&1
total() { grep -E '^  total per rank' "$1" | awk '{print $(NF-1)}'; }
if [ "$(grep -E '^  (activations|recompute)' $T/plan.txt)" = "$(grep -E '^  (activations|recompute)' $T/dry_norm_gelu.txt)" ] \
    && python3 -c "import sys; sys.exit(0 if $(total $T/plan.txt) < $(total $T/plan_none.txt) - 3 else 1)"; then
    ok recompute_plan_matches_dry_run
else fail recompute_plan_matches_dry_run "total $(total $T/plan.txt) vs none $(total $T/plan_none.txt) GiB"; fi

expect recompute_bad_value 2 "model.recompute.*one of none, gelu, norm_gelu" -- \
    ./train $Y --set model.recompute=everything

# Training: 20 steps of each mode, checkpoints at 5, 10, 15, 20.
metrics() { grep -o '"step":[0-9]*,"tokens":[0-9]*,"loss":[^,]*\|"grad_norm":[^,]*\|"val_loss":[^,]*' "$1"; }
for r in none gelu norm_gelu; do
    ./train $Y --set model.recompute=$r --set run.dir=$T/$r >$T/$r.txt 2>&1 || fail recompute_run_$r "$(tail -n 2 $T/$r.txt)"
done
for r in gelu norm_gelu; do
    if grep -q "activations: .* recompute $r" $T/$r.txt && [ -s $T/$r/metrics.jsonl ] \
        && [ "$(metrics $T/none/metrics.jsonl)" = "$(metrics $T/$r/metrics.jsonl)" ] \
        && ./train ckpt-diff $T/none/checkpoints/step_00000020 $T/$r/checkpoints/step_00000020 --quiet --tol 0 \
            >$T/diff_$r.txt 2>&1; then ok recompute_${r}_bit_identical
    else fail recompute_${r}_bit_identical "$(grep activations: $T/$r.txt) $(head -c 300 $T/diff_$r.txt)"; fi
done
# the start-up line's arena is smaller, in the same proportion as above
a() { grep -o 'activations: [0-9.]* MiB' "$1" | awk '{print $2}'; }
if python3 -c "import sys; sys.exit(0 if $(a $T/none.txt) > $(a $T/gelu.txt) > $(a $T/norm_gelu.txt) else 1)"; then
    ok recompute_startup_line_smaller
else fail recompute_startup_line_smaller "$(a $T/none.txt) $(a $T/gelu.txt) $(a $T/norm_gelu.txt) MiB"; fi

# Resume: 10 steps with none, then to 20 with norm_gelu: allowed (reported),
# and the same bits as 20 steps straight (constant schedule: a 10-step run
# has the learning rates of the 20-step one's first half).
D=$T/switch
K="--set schedule.kind=constant"
./train $Y $K --set run.dir=$T/constant >/dev/null 2>&1
./train $Y $K --set run.dir=$D --set train.steps=10 >/dev/null 2>&1
./train $Y $K --set run.dir=$D --set model.recompute=norm_gelu --resume auto >$T/switch.txt 2>&1
rc=$?
if [ $rc -eq 0 ] && grep -q "resume: key 'model.recompute': none -> norm_gelu changed" $T/switch.txt \
    && [ -n "$(sums $D/checkpoints/step_00000020)" ] \
    && [ "$(sums $D/checkpoints/step_00000020)" = "$(sums $T/constant/checkpoints/step_00000020)" ]; then
    ok recompute_change_on_resume
else fail recompute_change_on_resume "rc $rc; $(grep -E 'resume|error' $T/switch.txt | head -3)"; fi

# ZeRO-3 on 2 ranks, 4 layers: each layer is gathered into one of two slots
# before its backward, and the recomputation must come after (until then the
# slot may hold the layer two ahead).
if command -v mpirun >/dev/null 2>&1 && ldd ./train | grep -q libmpi; then
    MPIRUN=(timeout 120 mpirun --allow-run-as-root --oversubscribe -np 2)
    for r in none norm_gelu; do
        "${MPIRUN[@]}" ./train $Y --set parallel.zero=3 --set model.n_layer=4 --set model.recompute=$r --set run.dir=$T/z3_$r \
            --set checkpoint.async=false >$T/z3_$r.txt 2>&1
    done
    if [ -s $T/z3_norm_gelu/metrics.jsonl ] && [ "$(metrics $T/z3_none/metrics.jsonl)" = "$(metrics $T/z3_norm_gelu/metrics.jsonl)" ] \
        && ./train ckpt-diff $T/z3_none/checkpoints/step_00000020 $T/z3_norm_gelu/checkpoints/step_00000020 --quiet \
            --tol 0 >$T/z3diff.txt 2>&1; then ok recompute_zero3_np2_bit_identical
    else fail recompute_zero3_np2_bit_identical "$(grep -m2 error $T/z3_*.txt) $(head -c 300 $T/z3diff.txt)"; fi
else
    skip recompute_zero3_np2_bit_identical "no MPI build or mpirun"
fi
