#!/usr/bin/env bash
# Asynchronous checkpoints with several ranks (Open MPI, CPU backend): every
# rank's writer thread writes its file while training goes on, the main
# threads complete the checkpoint a step or more later. Checks that such
# checkpoints are complete and resume bit-identically, that a kill -9 while a
# write is in flight never leaves a checkpoint that loads, and that a write
# failing on one rank fails the run on every rank with the cause named, with
# no new checkpoint in place. One line per check.
set -u
cd "$(dirname "$0")/.."
T=${KILN_TEST_TMP:-$(mktemp -d)}/t_ckpt_mpi
rm -rf "$T"
. test/ckpt_lib.sh
if ! command -v mpirun >/dev/null 2>&1; then skip ckpt_mpi "mpirun not found (make deps installs openmpi-bin)"; exit 0; fi
if ! ldd ./train | grep -q libmpi; then skip ckpt_mpi "./train is not an MPI build (make deps, then make)"; exit 0; fi
ckpt_setup
Y=$T/tiny.yaml
MPIRUN=(timeout 120 mpirun --allow-run-as-root --oversubscribe -np 2)
# 2 ranks, ZeRO-1 (each rank writes its optimizer block), a checkpoint every
# 2 steps: most saves find the previous write still completing
S="--set batch.total_tokens=512 --set parallel.zero=1 --set checkpoint.every=2 --set checkpoint.async=true"

"${MPIRUN[@]}" ./train $Y $S --set run.dir=$T/ref >$T/ref.txt 2>&1
rc=$?
CK=$T/ref/checkpoints
bad=""
for d in $CK/step_*; do ./train ckpt-info "$d" >/dev/null 2>&1 || bad="$bad $(basename $d)"; done
if [ $rc -eq 0 ] && [ "$(ls -d $CK/step_* | wc -l)" -eq 10 ] && [ -z "$bad" ] && [ "$(cat $CK/latest)" = step_00000020 ] \
    && ! ls -d $CK/*.tmp >/dev/null 2>&1 && grep -q 'checkpoint: step 2 staged for' $T/ref.txt \
    && [ -f $CK/step_00000020/rank00001.bin ] && ! ls $CK/step_00000020/manifest.rank* >/dev/null 2>&1; then
    ok ckpt_mpi_async_complete
else fail ckpt_mpi_async_complete "rc $rc, bad:$bad, latest $(cat $CK/latest 2>/dev/null): $(grep -m2 error $T/ref.txt)"; fi

# resume from an async checkpoint of step 8 on 2 ranks: bit-identical to the
# uninterrupted run's final checkpoint
mkdir -p $T/res/checkpoints && cp -r $CK/step_00000008 $T/res/checkpoints/ && echo step_00000008 >$T/res/checkpoints/latest
"${MPIRUN[@]}" ./train $Y $S --set run.dir=$T/res --resume auto >$T/res.txt 2>&1
rc=$?
if [ $rc -eq 0 ] && ./train ckpt-diff $CK/step_00000020 $T/res/checkpoints/step_00000020 --quiet --tol 0 >$T/diff.txt 2>&1; then
    ok ckpt_mpi_async_resume_bit_identical
else fail ckpt_mpi_async_resume_bit_identical "rc $rc: $(head -c 300 $T/diff.txt) $(grep -m2 error $T/res.txt)"; fi

# kill -9 (both ranks, as a lost node would) at random instants of a longer
# run; every resume loads only complete checkpoints (a `.tmp` directory or a
# torn one never), and the run ends bit-identical to an uninterrupted one
K="$S --set train.steps=240 --set checkpoint.keep_last=3"
"${MPIRUN[@]}" ./train $Y $K --set run.dir=$T/kref >$T/kref.txt 2>&1
fails=0 kills=0
rm -rf $T/kill
for i in $(seq 12); do
    # kill at a random step 10-50 past where this attempt starts (the step
    # count, not a sleep: a loaded machine makes time a poor guide)
    have=$(cat $T/kill/metrics.jsonl 2>/dev/null | wc -l)
    target=$((have + 10 + RANDOM % 40))
    "${MPIRUN[@]}" ./train $Y $K --set run.dir=$T/kill --resume auto >$T/kill$i.txt 2>&1 &
    mp=$!
    while kill -0 $mp 2>/dev/null && [ "$(cat $T/kill/metrics.jsonl 2>/dev/null | wc -l)" -lt $target ]; do sleep 0.02; done
    if kill -0 $mp 2>/dev/null; then
        pkill -9 -f "run.dir=$T/kill --resume" 2>/dev/null
        kills=$((kills + 1))
    fi
    wait $mp 2>/dev/null
    grep -q 'kiln: error' $T/kill$i.txt && fails=$((fails + 1))
    [ "$(cat $T/kill/checkpoints/latest 2>/dev/null)" = step_00000240 ] && break
done
"${MPIRUN[@]}" ./train $Y $K --set run.dir=$T/kill --resume auto >$T/killend.txt 2>&1
rc=$?
if [ $rc -eq 0 ] && [ $fails -eq 0 ] && [ $kills -ge 2 ] \
    && ./train ckpt-diff $T/kref/checkpoints/step_00000240 $T/kill/checkpoints/step_00000240 --quiet --tol 0 >$T/kdiff.txt 2>&1; then
    ok ckpt_mpi_async_kill9_resume_bit_identical
else fail ckpt_mpi_async_kill9_resume_bit_identical "rc $rc, $kills kills, $fails resumes failed: $(head -c 300 $T/kdiff.txt) $(grep -m2 error $T/killend.txt $T/kill*.txt)"; fi
echo "ckpt_mpi: $kills kills" >&2

# the write fails on rank 1 only (injected ENOSPC): every rank stops with the
# cause, rank 1's named; the step's directory is never completed
cat > $T/fault.sh <<SH
#!/bin/sh
[ "\$OMPI_COMM_WORLD_RANK" = 1 ] && export KILN_FAULT_ENOSPC_AFTER=100
exec ./train "\$@"
SH
chmod +x $T/fault.sh
"${MPIRUN[@]}" $T/fault.sh $Y $S --set run.dir=$T/fault >$T/fault.txt 2>&1
rc=$?
if [ $rc -ne 0 ] && [ $rc -ne 124 ] && grep -q 'rank00001.bin: writing entry' $T/fault.txt \
    && grep -q 'another rank failed to write its part' $T/fault.txt && [ ! -e $T/fault/checkpoints/latest ] \
    && ! ls -d $T/fault/checkpoints/step_* 2>/dev/null | grep -qv '\.tmp$'; then
    ok ckpt_mpi_async_write_failure_on_one_rank
else fail ckpt_mpi_async_write_failure_on_one_rank "rc $rc: $(grep -m3 error $T/fault.txt)"; fi
