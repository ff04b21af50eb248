#!/usr/bin/env bash
# Muon (optim.name: muon) on the CPU backend: it trains; resume is
# bit-identical; changing optim.name on resume is refused; distributed Muon
# (src/muon.c: each matrix owned by one dp rank) on 2 and 4 ranks under ZeRO
# 0-3 against one rank, the owners balanced (printed), resume onto other
# layouts; under tensor parallelism (tp 2, tp 4, tp 2 x dp 2 ZeRO 1-3; GPT-2
# with q|k|v thirds and whole, Llama with grouped kv heads, MoE) against one
# rank, and a tp checkpoint resharded. One line per check.
# Tolerances. Ten steps: as test/t_dp.sh, losses within relative 1e-5 and
# parameters within 1e-5 (several ranks sum the gradients in another order,
# ulps apart). One step's update of every Muon matrix within 1e-5 relative
# (Frobenius, test/ckpt_update.py; measured 6.9e-6): the owner orthogonalises
# the same reduced gradient one rank would, and what differs is that sum's
# rounding (~1e-7 relative), which Newton-Schulz amplifies along the small
# singular directions (its slope there is up to 3.4445 per iteration). Ranks
# and stages whose reductions add in the same order agree to the bit.
# model.bias: false, as in t_lion.sh: GPT-2's key bias has an exact gradient
# of zero, so its float gradient is rounding noise, which AdamW's m/sqrt(v)
# turns into steps of ~lr (0.02 here): with biases 1 vs 2 ranks differ there
# by 1.25e-5, everywhere else by ulps.
set -u
cd "$(dirname "$0")/.."
T=${KILN_TEST_TMP:-$(mktemp -d)}/t_muon
rm -rf "$T"
. test/ckpt_lib.sh
ckpt_setup
Y=$T/tiny.yaml
M="--set model.bias=false --set optim.name=muon --set optim.lr=0.02 --set schedule.kind=constant --set train.steps=10
   --set checkpoint.async=false --set checkpoint.every=5 --set batch.total_tokens=512"

./train $Y $M --set run.dir=$T/ref >$T/ref.txt 2>&1
rc=$?
REF=$(sums $T/ref/checkpoints/step_00000010)
first=$(losses $T/ref/metrics.jsonl | head -1 | sed 's/.*"loss"://')
last=$(losses $T/ref/metrics.jsonl | tail -1 | sed 's/.*"loss"://')
if [ $rc -eq 0 ] && [ -n "$REF" ] && grep -q 'optim: muon on 12 matrices' $T/ref.txt \
    && python3 -c "import sys; sys.exit(not $last < $first)"; then
    ok muon_trains
else fail muon_trains "rc $rc, loss $first -> $last: $(grep -m2 -iE 'error|muon' $T/ref.txt)"; fi

D=$T/half
./train $Y $M --set run.dir=$D --set train.steps=5 >/dev/null 2>&1
./train $Y $M --set run.dir=$D --resume auto >$T/resume.txt 2>&1
rc=$?
if [ $rc -eq 0 ] && grep -q 'resumed from .*step_00000005 at step 5' $T/resume.txt \
    && [ "$(losses $T/ref/metrics.jsonl)" = "$(losses $D/metrics.jsonl)" ] \
    && [ "$(sums $D/checkpoints/step_00000010)" = "$REF" ]; then
    ok muon_resume_bit_identical
else fail muon_resume_bit_identical "rc $rc; $(grep -E 'resum|error' $T/resume.txt | head -3)"; fi
expect muon_resume_refuses_optim_name 2 "optim.name" -- \
    ./train $Y $M --set run.dir=$D --set optim.name=lion --set train.steps=12 --resume auto

if ! command -v mpirun >/dev/null 2>&1 || ! ldd ./train | grep -q libmpi; then
    skip muon_dp "no mpirun or not an MPI build"; exit 0
fi
# every layout against one rank: ten steps, and one step's update
M1="$M --set train.steps=1 --set checkpoint.every=1 --set train.eval_every=0"
./train $Y $M1 --set optim.lr=0 --set run.dir=$T/u0 >/dev/null 2>&1   # lr 0: the start, as a checkpoint
./train $Y $M1 --set run.dir=$T/u1 >/dev/null 2>&1
U0=$T/u0/checkpoints/step_00000001 U1=$T/u1/checkpoints/step_00000001
for n in 2 4; do
    for z in 0 1 2 3; do
        D=$T/n${n}z$z
        timeout 120 mpirun --allow-run-as-root --oversubscribe -np $n ./train $Y $M --set parallel.zero=$z \
            --set run.dir=$D >$D.txt 2>&1
        rc=$?
        why=$(close_losses $T/ref/metrics.jsonl $D/metrics.jsonl 2>&1)
        drc=1
        diff=$(./train ckpt-diff $T/ref/checkpoints/step_00000010 $D/checkpoints/step_00000010 --quiet --tol 1e-5 2>&1) && drc=0
        if [ $rc -eq 0 ] && [ $drc -eq 0 ] && [ -z "$why" ]; then ok muon_dp_equiv_zero${z}_np$n
        else fail muon_dp_equiv_zero${z}_np$n "rc $rc: $why $diff $(grep -m2 -i error $D.txt)"; fi
        timeout 120 mpirun --allow-run-as-root --oversubscribe -np $n ./train $Y $M1 --set parallel.zero=$z \
            --set run.dir=$D.u >/dev/null 2>&1
        upd=$($NPY test/ckpt_update.py $U0 $U1 $D.u/checkpoints/step_00000001 --match 'attn\.c_|mlp\.c_' \
            --tol 1e-5 2>&1) && ok muon_update_zero${z}_np$n || fail muon_update_zero${z}_np$n "$upd"
        echo "# np $n zero $z: $upd"
    done
done
# 2 ranks add a pair of floats, in either order the same bits: every stage whose
# gradients are summed once (ZeRO 0 and 1 all-reduce the accumulated ones)
# gives the same update to the bit, however the owners send it
if ./train ckpt-diff $T/n2z0.u/checkpoints/step_00000001 $T/n2z1.u/checkpoints/step_00000001 --quiet \
    | grep -q 'params max abs diff 0 .*state max abs diff 0$'; then ok muon_zero0_zero1_bit_identical
else fail muon_zero0_zero1_bit_identical "$(./train ckpt-diff $T/n2z0.u/checkpoints/step_00000001 \
    $T/n2z1.u/checkpoints/step_00000001 --quiet)"; fi

# the owners, balanced by Newton-Schulz cost: the tiny model's 12 matrices are
# 4 MLP ones of 18 C^3 per iteration and 8 attention ones of 6 C^3, which
# longest-first assignment splits exactly over 2 and over 4 ranks
if grep -q 'muon owners over 2 dp rank(s): matrices 6/6, .*(max/mean 1.000)' $T/n2z0.txt \
    && grep -q 'muon owners over 4 dp rank(s): matrices 3/3/3/3, .*(max/mean 1.000)' $T/n4z3.txt; then
    ok muon_owners_balanced
else fail muon_owners_balanced "$(grep -h 'muon owners' $T/n2z0.txt $T/n4z3.txt)"; fi
grep -h 'muon owners' $T/n2z0.txt $T/n4z3.txt | sed 's/^/# /'

# resume onto another layout: 2 ranks ZeRO 3 -> 1 rank, 1 rank -> 4 ranks ZeRO 2
D=$T/rs3
timeout 120 mpirun --allow-run-as-root --oversubscribe -np 2 ./train $Y $M --set parallel.zero=3 --set train.steps=5 \
    --set run.dir=$D >/dev/null 2>&1
./train $Y $M --set run.dir=$D --resume auto >$D.txt 2>&1
rc=$?
why=$(close_losses $T/ref/metrics.jsonl $D/metrics.jsonl 2>&1)
rs=$(resumed_why $D/summary.json world=2 dp=2 to.world=1)
if [ $rc -eq 0 ] && [ -z "$rs" ] && [ -z "$why" ] \
    && ./train ckpt-diff $T/ref/checkpoints/step_00000010 $D/checkpoints/step_00000010 --quiet --tol 1e-5 >/dev/null; then
    ok muon_resume_zero3_np2_to_np1
else fail muon_resume_zero3_np2_to_np1 "rc $rc: $why $rs $(grep -m2 -iE 'error|resum' $D.txt)"; fi
D=$T/rs2
./train $Y $M --set train.steps=5 --set run.dir=$D >/dev/null 2>&1
timeout 120 mpirun --allow-run-as-root --oversubscribe -np 4 ./train $Y $M --set parallel.zero=2 --set run.dir=$D \
    --resume auto >$D.txt 2>&1
rc=$?
why=$(close_losses $T/ref/metrics.jsonl $D/metrics.jsonl 2>&1)
rs=$(resumed_why $D/summary.json world=1 to.world=4 to.dp=4)
if [ $rc -eq 0 ] && [ -z "$rs" ] && [ -z "$why" ] \
    && ./train ckpt-diff $T/ref/checkpoints/step_00000010 $D/checkpoints/step_00000010 --quiet --tol 1e-5 >/dev/null; then
    ok muon_resume_np1_to_zero2_np4
else fail muon_resume_np1_to_zero2_np4 "rc $rc: $why $rs $(grep -m2 -iE 'error|resum' $D.txt)"; fi

# Tensor parallelism: the tp owner of a split matrix gathers its parts (row
# blocks, or column blocks through copy_2d), orthogonalises the whole and
# sends each part back; matrices not split (MoE experts) go from the tp owner
# to every tp rank. Six steps against one rank, tolerances as above.
TS="$M --set train.steps=6 --set checkpoint.every=3"
GPT2="--set model.n_head=4"
WHOLE="$GPT2 --set optim.muon_split_qkv=false"
LLAMA="--set model.arch=llama --set model.n_head=8 --set model.n_kv_head=4 --set model.n_embd=64 --set model.ffn_hidden=96"
MOE="$LLAMA --set model.mlp=moe --set model.moe.n_experts=4 --set model.moe.top_k=2 --set model.moe.expert_hidden=32"
MOE="$MOE --set model.moe.n_shared=1 --set model.moe.capacity_factor=1.25 --set model.moe.aux_loss_coef=0.01"
for model in GPT2 WHOLE LLAMA MOE; do
    ./train $Y $TS ${!model} --set run.dir=$T/tref_$model >$T/tref_$model.txt 2>&1 \
        || fail muon_tp_reference_$model "$(tail -n 3 $T/tref_$model.txt)"
done
# tp_equiv NAME MODEL NP TP ZERO
tp_equiv() {
    local name=$1 model=$2 np=$3 tp=$4 z=$5 D=$T/tp_$1
    timeout 120 mpirun --allow-run-as-root --oversubscribe -np $np ./train $Y $TS ${!model} --set parallel.tp=$tp \
        --set parallel.zero=$z --set run.dir=$D >$D.txt 2>&1
    local rc=$? why diff drc=1
    why=$(close_losses $T/tref_$model/metrics.jsonl $D/metrics.jsonl 2>&1)
    diff=$(./train ckpt-diff $T/tref_$model/checkpoints/step_00000006 $D/checkpoints/step_00000006 --quiet \
        --tol 1e-5 2>&1) && drc=0
    if [ $rc -eq 0 ] && [ $drc -eq 0 ] && [ -z "$why" ] && grep -q "muon owners over .* x $tp tp" $D.txt; then
        ok muon_tp_equiv_$name
    else fail muon_tp_equiv_$name "rc $rc: $why $diff $(grep -m2 -i error $D.txt)"; fi
}
tp_equiv gpt2_tp2 GPT2 2 2 0
tp_equiv gpt2_tp4 GPT2 4 4 0
tp_equiv gpt2_tp2_dp2_zero1 GPT2 4 2 1
tp_equiv gpt2_tp2_dp2_zero3 GPT2 4 2 3
tp_equiv gpt2_whole_qkv_tp2_dp2_zero2 WHOLE 4 2 2
tp_equiv llama_gqa_tp2 LLAMA 2 2 0
tp_equiv llama_gqa_tp2_dp2_zero3 LLAMA 4 2 3
tp_equiv moe_tp2_dp2_zero1 MOE 4 2 1
grep -h 'muon owners' $T/tp_gpt2_tp2_dp2_zero3.txt | sed 's/^/# /'
# a tp checkpoint's momentum is boxes of the logical tensors: tp 2 to step 3,
# then tp 2 x dp 2 under ZeRO 3 to step 6, against one rank
D=$T/tp_reshard
timeout 120 mpirun --allow-run-as-root --oversubscribe -np 2 ./train $Y $TS $GPT2 --set parallel.tp=2 --set train.steps=3 \
    --set run.dir=$D >/dev/null 2>&1
timeout 120 mpirun --allow-run-as-root --oversubscribe -np 4 ./train $Y $TS $GPT2 --set parallel.tp=2 --set parallel.zero=3 \
    --set run.dir=$D --resume auto >$D.txt 2>&1
rc=$?
why=$(close_losses $T/tref_GPT2/metrics.jsonl $D/metrics.jsonl 2>&1)
rs=$(resumed_why $D/summary.json world=2 dp=1 tp=2 to.world=4)
if [ $rc -eq 0 ] && [ -z "$rs" ] && [ -z "$why" ] \
    && ./train ckpt-diff $T/tref_GPT2/checkpoints/step_00000006 $D/checkpoints/step_00000006 --quiet --tol 1e-5 >/dev/null
then ok muon_tp_reshard_tp2_to_tp2_dp2_zero3
else fail muon_tp_reshard_tp2_to_tp2_dp2_zero3 "rc $rc: $why $rs $(grep -m2 -iE 'error|resum' $D.txt)"; fi

# Pipeline and context parallelism: each stage's dp group owns its own
# layers' matrices (a stage's tensor table is its layers); under cp the owners
# are ddp's dp x cp ranks, which hold the same parameters. Six steps of a
# 4-layer GPT-2 (tied: the last stage's copy of wte is AdamW's, as the first
# stage's) against one rank; a pp 2 checkpoint resumed on one rank.
PC="$TS $GPT2 --set model.n_layer=4"
./train $Y $PC --set run.dir=$T/pref >/dev/null 2>&1
tp_equiv_pc() { # NAME NP SETTINGS...
    local name=$1 np=$2 D=$T/pc_$1
    shift 2
    timeout 120 mpirun --allow-run-as-root --oversubscribe -np $np ./train $Y $PC "$@" --set run.dir=$D >$D.txt 2>&1
    local rc=$? why diff drc=1
    why=$(close_losses $T/pref/metrics.jsonl $D/metrics.jsonl 2>&1)
    diff=$(./train ckpt-diff $T/pref/checkpoints/step_00000006 $D/checkpoints/step_00000006 --quiet --tol 1e-5 \
        2>&1) && drc=0
    if [ $rc -eq 0 ] && [ $drc -eq 0 ] && [ -z "$why" ]; then ok muon_equiv_$name
    else fail muon_equiv_$name "rc $rc: $why $diff $(grep -m2 -i error $D.txt)"; fi
}
tp_equiv_pc pp2 2 --set parallel.pp=2
tp_equiv_pc pp2_dp2_zero1 4 --set parallel.pp=2 --set parallel.zero=1
tp_equiv_pc cp2_dp2_zero3 4 --set parallel.cp=2 --set parallel.zero=3
tp_equiv_pc cp2_tp2 4 --set parallel.cp=2 --set parallel.tp=2
D=$T/pp_reshard
timeout 120 mpirun --allow-run-as-root --oversubscribe -np 2 ./train $Y $PC --set parallel.pp=2 --set train.steps=3 \
    --set run.dir=$D >/dev/null 2>&1
./train $Y $PC --set run.dir=$D --resume auto >$D.txt 2>&1
rc=$?
why=$(close_losses $T/pref/metrics.jsonl $D/metrics.jsonl 2>&1)
rs=$(resumed_why $D/summary.json world=2 pp=2 to.world=1)
if [ $rc -eq 0 ] && [ -z "$rs" ] && [ -z "$why" ] \
    && ./train ckpt-diff $T/pref/checkpoints/step_00000006 $D/checkpoints/step_00000006 --quiet --tol 1e-5 >/dev/null
then ok muon_resume_pp2_to_np1
else fail muon_resume_pp2_to_np1 "rc $rc: $why $rs $(grep -m2 -iE 'error|resum' $D.txt)"; fi
