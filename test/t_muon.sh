#!/usr/bin/env bash
# Muon (optim.name: muon) on the CPU backend: it trains; resume is
# bit-identical; 1 rank vs 2 ranks with ZeRO 0 (each rank orthogonalises
# every matrix of the same reduced gradient); ZeRO >= 1 refused naming
# parallel.zero. One line per check. Tolerances as test/t_dp.sh: losses
# within relative 1e-5, parameters within 1e-5 (Newton-Schulz is smooth in
# its input, so the ranks' reassociated gradient sums stay ulps apart).
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
expect muon_refuses_zero1 2 "parallel.zero" -- ./train $Y $M --set run.dir=$T/z1 --set parallel.zero=1 --dry-run

if ! command -v mpirun >/dev/null 2>&1 || ! ldd ./train | grep -q libmpi; then
    skip muon_dp "no mpirun or not an MPI build"; exit 0
fi
D=$T/z0
timeout 120 mpirun --allow-run-as-root --oversubscribe -np 2 ./train $Y $M --set run.dir=$D >$D.txt 2>&1
rc=$?
why=$(close_losses $T/ref/metrics.jsonl $D/metrics.jsonl 2>&1)
drc=1
diff=$(./train ckpt-diff $T/ref/checkpoints/step_00000010 $D/checkpoints/step_00000010 --quiet --tol 1e-5 2>&1) && drc=0
if [ $rc -eq 0 ] && [ $drc -eq 0 ] && [ -z "$why" ]; then ok muon_dp_equiv_zero0_np2
else fail muon_dp_equiv_zero0_np2 "rc $rc: $why $diff $(grep -m2 -i error $D.txt)"; fi
