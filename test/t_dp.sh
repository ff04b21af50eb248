#!/usr/bin/env bash
# Data parallelism and ZeRO on the CPU backend under real Open MPI: 1 rank vs
# 2 and 4 ranks on the same global batch (plain DP, ZeRO-1, ZeRO-2, ZeRO-3); a
# checkpoint resharded across rank counts and ZeRO stages; a rank killed
# mid-run; a batch that does not split over the ranks. One line per check.
#
# Tolerances (docs/parallel.md, "Correctness"): with dp ranks each rank sums
# its own micro-batches' gradients and the all-reduce (or reduce-scatter) adds
# the ranks' sums, so the one-rank sum of the same per-token gradients is
# computed in another association order. Each reassociation changes a float
# sum by a few ulps (~1e-7 relative); over 2 layers, 20 AdamW steps (whose
# update m/sqrt(v) is scale-free, so relative errors do not grow through it)
# that stays far below 1e-5 (measured: losses equal to the 6 digits
# metrics.jsonl prints, parameters within 6e-7). So: loss at every step within
# relative 1e-5, every final parameter within absolute 1e-5 (parameters are
# O(0.02-1)).
set -u
cd "$(dirname "$0")/.."
T=${KILN_TEST_TMP:-$(mktemp -d)}/t_dp
rm -rf "$T"
. test/ckpt_lib.sh
skip() { echo "skip $1: $2"; }
if ! command -v mpirun >/dev/null 2>&1; then skip dp "mpirun not found (make deps installs openmpi-bin)"; exit 0; fi
if ! ldd ./train | grep -q libmpi; then skip dp "./train is not an MPI build (make deps, then make)"; exit 0; fi
ckpt_setup
Y=$T/tiny.yaml
MPIRUN=(timeout 120 mpirun --allow-run-as-root --oversubscribe)
now() { date +%s.%N; }
# 512 tokens a step = 4 micro-batches of 4 x 32: 4, 2 or 1 per rank.
S="--set batch.total_tokens=512 --set checkpoint.async=false --set checkpoint.every=10"
t0=$(now)
./train $Y $S --set run.dir=$T/ref >$T/ref.txt 2>&1 || fail dp_reference "$(tail -n 3 $T/ref.txt)"
REF=$T/ref/checkpoints/step_00000020
for z in 0 1 2 3; do
    for np in 2 4; do
        D=$T/z${z}_np$np
        "${MPIRUN[@]}" -np $np ./train $Y $S --set parallel.zero=$z --set run.dir=$D >$D.txt 2>&1
        rc=$?
        why=$(close_losses $T/ref/metrics.jsonl $D/metrics.jsonl 2>&1)
        drc=1
        diff=$(./train ckpt-diff $REF $D/checkpoints/step_00000020 --quiet --tol 1e-5 2>&1) && drc=0
        if [ $rc -eq 0 ] && [ $drc -eq 0 ] && [ -z "$why" ]; then ok dp_equiv_zero${z}_np$np
        else fail dp_equiv_zero${z}_np$np "rc $rc: $why $diff $(grep -m2 error $D.txt)"; fi
    done
done
# ZeRO-2 on 4 ranks: every rank wrote its own optimizer shard
n=$(./train ckpt-info $T/z2_np4/checkpoints/step_00000020 | grep -c 'optim.m/.* rank [1-3] ')
[ "$n" -gt 0 ] && [ -f $T/z2_np4/checkpoints/step_00000020/rank00003.bin ] && ok dp_zero_shards_written_per_rank \
    || fail dp_zero_shards_written_per_rank "$n optimizer pieces from ranks 1-3"
# the time blocked in dp's collectives, from ranks.jsonl, not the end-of-run line's wording
why=$(ranks_comm_why $T/z0_np2 dp 2)
[ -z "$why" ] && ok dp_reports_blocked_fraction || fail dp_reports_blocked_fraction "$why"
echo "dp equivalence: $(echo "$(now) - $t0" | bc) s" >&2

# Reshard on resume: 2 ranks ZeRO-2 for 8 steps -> 1 rank to 14 -> 2 ranks
# ZeRO-1 to 20 (constant schedule: a shorter run has the same learning rates),
# against 20 steps on one rank. The data position is global, so it carries over.
t0=$(now)
C="$S --set schedule.kind=constant --set checkpoint.every=2"
./train $Y $C --set run.dir=$T/cref >/dev/null 2>&1
"${MPIRUN[@]}" -np 2 ./train $Y $C --set parallel.zero=2 --set run.dir=$T/rs --set train.steps=8 >$T/rs1.txt 2>&1
./train $Y $C --set run.dir=$T/rs --set train.steps=14 --resume auto >$T/rs2.txt 2>&1
r2=$(resumed $T/rs)
"${MPIRUN[@]}" -np 2 ./train $Y $C --set parallel.zero=1 --set run.dir=$T/rs --resume auto >$T/rs3.txt 2>&1
rc=$?
r3=$(resumed $T/rs)
why=$(close_losses $T/cref/metrics.jsonl $T/rs/metrics.jsonl 2>&1)
if [ $rc -eq 0 ] && [ -z "$why" ] && [ "$r2" = "8 2 true" ] && [ "$r3" = "14 1 true" ] \
    && ./train ckpt-diff $T/cref/checkpoints/step_00000020 $T/rs/checkpoints/step_00000020 --quiet --tol 1e-5 >/dev/null; then
    ok dp_reshard_zero2x2_1_zero1x2
else fail dp_reshard_zero2x2_1_zero1x2 "rc $rc, resumed '$r2', '$r3': $why $(grep -h -E 'resumed|error' $T/rs*.txt | head -4)"; fi
# The same with ZeRO-3 first: 2 ranks ZeRO-3 (every rank wrote its parameter
# blocks) -> 1 rank -> 2 ranks ZeRO-1; and into ZeRO-3: 1 rank -> 4 ranks
# ZeRO-3 -> 2 ranks ZeRO-3 (each rank loads its blocks of every layer).
"${MPIRUN[@]}" -np 2 ./train $Y $C --set parallel.zero=3 --set run.dir=$T/rz --set train.steps=8 >$T/rz1.txt 2>&1
./train $Y $C --set run.dir=$T/rz --set train.steps=14 --resume auto >$T/rz2.txt 2>&1
r2=$(resumed $T/rz)
"${MPIRUN[@]}" -np 2 ./train $Y $C --set parallel.zero=1 --set run.dir=$T/rz --resume auto >$T/rz3.txt 2>&1
rc=$?
r3=$(resumed $T/rz)
why=$(close_losses $T/cref/metrics.jsonl $T/rz/metrics.jsonl 2>&1)
n=$(./train ckpt-info $T/rz/checkpoints/step_00000008 | grep -c '^ *tensor h\.[0-9]*\.mlp\.c_fc\.weight .* rank 1 ')
if [ $rc -eq 0 ] && [ -z "$why" ] && [ "$n" -gt 0 ] && [ "$r2" = "8 2 true" ] && [ "$r3" = "14 1 true" ] \
    && ./train ckpt-diff $T/cref/checkpoints/step_00000020 $T/rz/checkpoints/step_00000020 --quiet --tol 1e-5 >/dev/null; then
    ok dp_reshard_zero3x2_1_zero1x2
else fail dp_reshard_zero3x2_1_zero1x2 "rc $rc, $n parameter pieces from rank 1, resumed '$r2', '$r3': $why $(grep -h -E 'resumed|error' $T/rz*.txt | head -4)"; fi
./train $Y $C --set run.dir=$T/ry --set train.steps=8 >$T/ry1.txt 2>&1
"${MPIRUN[@]}" -np 4 ./train $Y $C --set parallel.zero=3 --set run.dir=$T/ry --set train.steps=14 --resume auto >$T/ry2.txt 2>&1
r2=$(resumed $T/ry)
"${MPIRUN[@]}" -np 2 ./train $Y $C --set parallel.zero=3 --set run.dir=$T/ry --resume auto >$T/ry3.txt 2>&1
rc=$?
r3=$(resumed $T/ry)
why=$(close_losses $T/cref/metrics.jsonl $T/ry/metrics.jsonl 2>&1)
if [ $rc -eq 0 ] && [ -z "$why" ] && [ "$r2" = "8 1 true" ] && [ "$r3" = "14 4 true" ] \
    && ./train ckpt-diff $T/cref/checkpoints/step_00000020 $T/ry/checkpoints/step_00000020 --quiet --tol 1e-5 >/dev/null; then
    ok dp_reshard_1_zero3x4_zero3x2
else fail dp_reshard_1_zero3x4_zero3x2 "rc $rc, resumed '$r2', '$r3': $why $(grep -h -E 'resumed|error' $T/ry*.txt | head -4)"; fi
# ZeRO-3 sampling: every rank runs the generation (each forward gathers
# layers collectively), rank 0 prints it; a rank-0-only forward would hang
"${MPIRUN[@]}" -np 2 ./train $Y $S --set parallel.zero=3 --set train.steps=4 --set train.sample_every=2 \
    --set train.sample_tokens=16 --set parallel.timeout_s=20 --set run.dir=$T/zs >$T/zs.txt 2>&1
rc=$?
[ $rc -eq 0 ] && [ "$(grep -c -- '--- sample at step' $T/zs.txt)" = 2 ] && ok dp_zero3_samples \
    || fail dp_zero3_samples "rc $rc: $(grep -m2 -E 'error|sample' $T/zs.txt)"
# ZeRO-2 samples on rank 0 alone: its forward only waits for the parameter
# refreshes every rank posted after the optimizer step (no hang, no deadline)
"${MPIRUN[@]}" -np 2 ./train $Y $S --set parallel.zero=2 --set train.steps=4 --set train.sample_every=2 \
    --set train.sample_tokens=16 --set parallel.timeout_s=20 --set run.dir=$T/z2s >$T/z2s.txt 2>&1
rc=$?
[ $rc -eq 0 ] && [ "$(grep -c -- '--- sample at step' $T/z2s.txt)" = 2 ] && ok dp_zero2_samples_rank0 \
    || fail dp_zero2_samples_rank0 "rc $rc: $(grep -m2 -E 'error|sample' $T/z2s.txt)"
# Across ZeRO-2 and ZeRO-3: 2 ranks ZeRO-2 (every rank wrote its blocks of the
# parameters, as ZeRO-3 does) -> 4 ranks ZeRO-3 -> 2 ranks ZeRO-2. The config
# change is reported once (by rank 0), not once per rank.
"${MPIRUN[@]}" -np 2 ./train $Y $C --set parallel.zero=2 --set run.dir=$T/r23 --set train.steps=8 >$T/r23_1.txt 2>&1
"${MPIRUN[@]}" -np 4 ./train $Y $C --set parallel.zero=3 --set run.dir=$T/r23 --set train.steps=14 --resume auto >$T/r23_2.txt 2>&1
r2=$(resumed $T/r23)
"${MPIRUN[@]}" -np 2 ./train $Y $C --set parallel.zero=2 --set run.dir=$T/r23 --resume auto >$T/r23_3.txt 2>&1
rc=$?
r3=$(resumed $T/r23)
why=$(close_losses $T/cref/metrics.jsonl $T/r23/metrics.jsonl 2>&1)
n=$(./train ckpt-info $T/r23/checkpoints/step_00000008 | grep -c '^ *tensor h\.[0-9]*\.mlp\.c_fc\.weight .* rank 1 ')
if [ $rc -eq 0 ] && [ -z "$why" ] && [ "$n" -gt 0 ] && [ "$r2" = "8 2 true" ] && [ "$r3" = "14 4 true" ] \
    && ./train ckpt-diff $T/cref/checkpoints/step_00000020 $T/r23/checkpoints/step_00000020 --quiet --tol 1e-5 >/dev/null; then
    ok dp_reshard_zero2x2_zero3x4_zero2x2
else fail dp_reshard_zero2x2_zero3x4_zero2x2 "rc $rc, $n parameter pieces from rank 1, resumed '$r2', '$r3': $why $(grep -h -E 'resumed|error' $T/r23*.txt | head -4)"; fi
# resume notes print once however many ranks resume (rank 0 speaks for all)
n2=$(grep -c "resume: key 'parallel.zero': 2 -> 3 changed" $T/r23_2.txt)
n3=$(grep -c "resume: key 'train.steps': 14 -> 20 changed" $T/r23_3.txt)
[ "$n2" = 1 ] && [ "$n3" = 1 ] && ok dp_resume_notes_once || fail dp_resume_notes_once "printed $n2 and $n3 times"
echo "dp reshard: $(echo "$(now) - $t0" | bc) s" >&2

# ZeRO-2 reduce-scatters each layer's gradients during the backward into a
# shard: no rank holds a whole gradient arena. Its gradient buffers (the
# shard, two layer slots, two reduce-scatter targets, wte/wpe/ln_f's whole
# gradients) must be fewer floats than the parameters on 12 layers x 2 ranks
# (~0.8 of them; a whole arena would be >= 1).
"${MPIRUN[@]}" -np 2 ./train $Y $S --set parallel.zero=2 --set model.n_layer=12 --set train.steps=1 \
    --set train.eval_every=0 --set run.dir=$T/z2mem >$T/z2mem.txt 2>&1
rc=$?
read -r z gf np < <(jget $T/z2mem/summary.json "'%d %d %d' % (d['layout']['zero'], d['layout']['grad_floats'], d['layout']['param_floats'])")
if [ $rc -eq 0 ] && [ "$z" = 2 ] && [ -n "$gf" ] && [ "$gf" -lt "$np" ]; then ok dp_zero2_gradients_sharded
else fail dp_zero2_gradients_sharded "rc $rc: '$gf' gradient floats for '$np' parameters: $(grep -m2 -E 'data parallel|error' $T/z2mem.txt)"; fi
# ZeRO-2 on one rank is plain training (it used to step on an empty shard)
./train $Y $S --set parallel.zero=2 --set run.dir=$T/z2one >/dev/null 2>&1
[ "$(losses $T/ref/metrics.jsonl)" = "$(losses $T/z2one/metrics.jsonl)" ] && ok dp_zero2_one_rank_is_plain \
    || fail dp_zero2_one_rank_is_plain "$(losses $T/z2one/metrics.jsonl | tail -n 1) vs $(losses $T/ref/metrics.jsonl | tail -n 1)"
# A poisoned gradient (the test hook writes a NaN into each rank's gradients
# once their reduction is complete: the arena, or ZeRO-2/3's shard) skips the
# step on every rank, as on one rank: the same losses. ZeRO 0 and 1 take the
# norm of each rank's own copy, ZeRO 2 of the shards summed; tp 2 sums it over
# the tp group too.
NAN="--set train.on_nonfinite=skip --set train.steps=8"
KILN_TEST_INJECT_NAN_STEP=5 ./train $Y $S $NAN --set run.dir=$T/nan1 >/dev/null 2>&1
for layout in zero0 zero1 zero2 tp2; do
    case $layout in
        zero*) L="--set parallel.zero=${layout#zero}" ;;
        tp2) L="--set parallel.tp=2" ;;
    esac
    KILN_TEST_INJECT_NAN_STEP=5 "${MPIRUN[@]}" -x KILN_TEST_INJECT_NAN_STEP -np 2 ./train $Y $S $NAN $L \
        --set run.dir=$T/nan_$layout >$T/nan_$layout.txt 2>&1
    rc=$?
    why=$(close_losses $T/nan1/metrics.jsonl $T/nan_$layout/metrics.jsonl 2>&1)
    if [ $rc -eq 0 ] && [ -z "$why" ] && grep -q '"step":5,.*"skipped":true' $T/nan_$layout/metrics.jsonl; then
        ok dp_${layout}_nonfinite_skip
    else fail dp_${layout}_nonfinite_skip "rc $rc: $why $(grep -m2 -E 'error|warning' $T/nan_$layout.txt)"; fi
done

# A rank killed mid-run. mpirun --enable-recovery leaves the survivor waiting
# in its collective (as a scheduler that does not kill the step would): kiln's
# deadline (parallel.timeout_s = 3) must end it naming rank 1 as dead, which
# its line shows (the time it took is not asserted). Both ranks wait after
# step 40 (KILN_TEST_PAUSE_AT_STEP), rank 1 is killed there and rank 0 goes
# on into the stop agreement's all-reduce (test/lib.sh kill_rank1_paused):
# mid-run however fast or slow the machine is. Then
# --resume auto on 2 ranks finishes with the losses of an uninterrupted
# 2-rank run, bit for bit (same layout, same summation order; against one
# rank the few-ulp differences would compound over hundreds of steps).
t0=$(now)
K="$C --set train.steps=300 --set parallel.timeout_s=3 --set train.eval_every=0"
"${MPIRUN[@]}" -np 2 ./train $Y $K --set run.dir=$T/kref >/dev/null 2>&1
KILN_TEST_PAUSE_AT_STEP=40 "${MPIRUN[@]}" -np 2 --enable-recovery -x KILN_TEST_PAUSE_AT_STEP ./train $Y $K \
    --set run.dir=$T/kill >$T/kill.txt 2>&1 &
mpid=$!
pid1=$(kill_rank1_paused $T/kill 40 $mpid)
wait $mpid
rc=$?
if [ -n "$pid1" ] && [ $rc -ne 124 ] \
    && grep -qE "kiln: error: rank 0: .* did not complete within 3 s: rank 1 \(pid $pid1 on [^)]*\) is dead" $T/kill.txt; then
    ok dp_killed_rank_named_within_timeout
else fail dp_killed_rank_named_within_timeout "pid '$pid1', rc $rc: $(grep -m2 -E 'error' $T/kill.txt)"; fi
"${MPIRUN[@]}" -np 2 ./train $Y $K --set run.dir=$T/kill --resume auto >$T/kill2.txt 2>&1
rc=$?
if [ $rc -eq 0 ] && [ "$(losses $T/kref/metrics.jsonl)" = "$(losses $T/kill/metrics.jsonl)" ] \
    && [ "$(sums $T/kref/checkpoints/step_00000300)" = "$(sums $T/kill/checkpoints/step_00000300)" ] \
    && [ "$(resumed $T/kill | cut -d' ' -f2-)" = "2 false" ]; then ok dp_killed_rank_resume_auto
else fail dp_killed_rank_resume_auto "rc $rc: $(grep -m2 -E 'resumed|error' $T/kill2.txt)"; fi
echo "dp killed rank: $(echo "$(now) - $t0" | bc) s" >&2

# A global batch that does not split: 2 micro-batches over 4 ranks.
expect dp_batch_must_split 2 "key 'batch.total_tokens'.*4 data-parallel ranks" -- "${MPIRUN[@]}" -np 4 ./train $Y --set run.dir=$T/bad
# --dry-run shows the per-rank memory of the layout
expect dp_dry_run_per_rank 0 "optimizer state \(1/dp\) +3\.17 MiB" -- ./train $Y --dry-run --set model.n_embd=128 \
    --set model.n_layer=4 --set parallel.dp=2 --set parallel.zero=1 --set batch.total_tokens=512
# ZeRO-2: the whole 3.17 MiB of parameters, but half of the gradients (plus
# two layers' and wte/wpe/ln_f's, unreduced), not a whole gradient arena
expect dp_dry_run_zero2 0 "gradients \(1/dp\) +1\.58 MiB" -- ./train $Y --dry-run --set model.n_embd=128 \
    --set model.n_layer=4 --set parallel.dp=2 --set parallel.zero=2 --set batch.total_tokens=512
# ZeRO-3: half of the 3.17 MiB of parameters, plus what is gathered (two
# layers and wte/wpe/ln_f)
expect dp_dry_run_zero3 0 "parameters \(1/dp\) +1\.58 MiB" -- ./train $Y --dry-run --set model.n_embd=128 \
    --set model.n_layer=4 --set parallel.dp=2 --set parallel.zero=3 --set batch.total_tokens=512
