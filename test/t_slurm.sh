#!/usr/bin/env bash
# Integration with a real Slurm: test/slurm/up.sh starts slurmctld and two
# slurmd "nodes" on this machine; jobs go through sbatch --wait and srun
# --mpi=pmix exactly as on a cluster. Checks: test_comm as 2 ranks on one
# node and 4 ranks on two nodes (every collective), ./train-style direct
# start in the batch shell is one rank (not rank 0 of the allocation), a
# rank killed under srun ends the step promptly, and ./train itself through
# scripts/train.sbatch: 2 tasks on one node and on two nodes (losses = the
# one-rank run's), then signalled mid-run, requeued (exit 75), resumed and
# finished. The cluster is always torn down (trap). One line per check; about
# 70 s, 30 of them Slurm's hold of the requeued job.
set -u
cd "$(dirname "$0")/.."
T=${KILN_TEST_TMP:-$(mktemp -d)}/t_slurm
rm -rf "$T" && mkdir -p "$T"
ok() { echo "ok $1"; }
fail() { echo "FAIL $1: $2"; }
skip() { echo "skip $1: $2"; }
BIN=build/test/test_comm
for c in slurmctld slurmd sbatch srun munged; do
    command -v $c >/dev/null 2>&1 || { skip slurm "$c not found (make deps installs slurmctld slurmd slurm-client munge)"; exit 0; }
done
if [ ! -x "$BIN" ] || ! ldd "$BIN" | grep -q libmpi; then skip slurm "$BIN is not an MPI build"; exit 0; fi
[ "$(id -u)" = 0 ] || { skip slurm "needs root to run the daemons"; exit 0; }

export KILN_SLURM_DIR="$T/cluster"
# One private cluster per machine at a time: two suites side by side (two
# clones' make test) would both start slurmctld on port 16817, the second's
# commands would reach the first's controller, and one cluster's teardown
# (scancel --full, and stopping the munged it started) would cancel the other's
# jobs. The lock is this process's fd 9, released when it exits; up.sh's
# daemons do not inherit it (9>&-), so a leftover daemon cannot keep it. The
# wait follows the other suite's cluster, and its limit only ends a hang.
exec 9>/tmp/kiln-slurm.lock
t0=$(date +%s.%N)
if ! flock -w 1800 9; then fail slurm_up "another suite's Slurm cluster held /tmp/kiln-slurm.lock for 30 min"; exit 0; fi
echo "slurm lock: $(echo "$(date +%s.%N) - $t0" | bc) s" >&2
trap 'bash test/slurm/down.sh "$KILN_SLURM_DIR" >/dev/null 2>&1' EXIT
t0=$(date +%s.%N)
if ! bash test/slurm/up.sh 2 >"$T/up.out" 2>"$T/up.err" 9>&-; then
    fail slurm_up "$(tail -c 400 "$T/up.err")"; exit 0
fi
echo "slurm up: $(echo "$(date +%s.%N) - $t0" | bc) s" >&2
source "$KILN_SLURM_DIR/env"
ok slurm_up

# count_ok FILE: the ok lines rank 0 printed; any FAIL line is returned as text
check_job() { # name rc outfile minimum-ok
    local name=$1 rc=$2 out=$3 min=$4 n
    n=$(grep -c '^ok ' "$out" 2>/dev/null)
    if [ "$rc" -eq 0 ] && [ "$n" -ge "$min" ] && ! grep -q '^FAIL' "$out"; then ok "$name"
    else fail "$name" "exit $rc, $n ok lines: $(grep -m3 '^FAIL' "$out") $(tail -c 300 "$out")"; fi
}

# One node, 2 tasks. First ./train-style: the binary started in the batch
# shell sees SLURM_PROCID=0 and SLURM_NTASKS=2 but must be one rank.
cat >"$T/one.sbatch" <<JOB
#!/bin/bash
#SBATCH --nodes=1 --ntasks=2 --time=2
$BIN > $T/direct.out 2>&1 || echo "direct run exited \$?" >> $T/direct.out
srun --mpi=pmix -n 2 $BIN
JOB
t0=$(date +%s.%N)
sbatch --wait --chdir="$PWD" -o "$T/one.out" -e "$T/one.err" "$T/one.sbatch" >/dev/null 2>"$T/sbatch1.err"
rc=$?
echo "sbatch 1 node x 2: $(echo "$(date +%s.%N) - $t0" | bc) s" >&2
check_job slurm_srun_1node_2ranks $rc "$T/one.out" 23
if grep -q '^ok comm_describe' "$T/direct.out" && ! grep -q 'exited' "$T/direct.out"; then ok slurm_batch_shell_is_one_rank
else fail slurm_batch_shell_is_one_rank "$(head -c 300 "$T/direct.out")"; fi

# Two nodes, 2 tasks each: 4 ranks, dp 2 x tp 2 in the mesh check.
cat >"$T/two.sbatch" <<JOB
#!/bin/bash
#SBATCH --nodes=2 --ntasks-per-node=2 --time=2
srun --mpi=pmix $BIN
JOB
t0=$(date +%s.%N)
sbatch --wait --chdir="$PWD" -o "$T/two.out" -e "$T/two.err" "$T/two.sbatch" >/dev/null 2>"$T/sbatch2.err"
rc=$?
echo "sbatch 2 nodes x 2: $(echo "$(date +%s.%N) - $t0" | bc) s" >&2
check_job slurm_srun_2nodes_4ranks $rc "$T/two.out" 23
if grep -q 'rank 0/4 (local 0/2, 2 nodes' "$T/two.err"; then ok slurm_rank_discovery_2nodes
else fail slurm_rank_discovery_2nodes "$(head -c 300 "$T/two.err")"; fi

# A rank killed under srun: Slurm's pmix plugin cancels the step (~2 s here)
# and srun names the task; the deadline (3 s) is the backstop. The step must
# end by itself (not by the outer `timeout 60`, exit 124) with either line;
# the time it took is printed, never asserted (a loaded machine may take any
# time to start the tasks).
t0=$(date +%s.%N)
KILN_COMM_TIMEOUT_S=3 KILN_TEST_KILL_RANK=1 timeout 60 srun --mpi=pmix -N 2 -n 4 $BIN >"$T/kill.out" 2>"$T/kill.err"
rc=$?
dt=$(echo "$(date +%s.%N) - $t0" | bc)
echo "srun killed rank: $dt s (exit $rc)" >&2
if [ $rc -ne 0 ] && [ $rc -ne 124 ] && grep -qE 'task 1: Killed|rank 1 .*dead' "$T/kill.err"; then
    ok slurm_killed_rank_ends_step
else fail slurm_killed_rank_ends_step "exit $rc after $dt s: $(head -c 400 "$T/kill.err")"; fi

# ./train through scripts/train.sbatch (srun --mpi=pmix, --resume auto): the
# tiny model on 2 tasks of one node, then 2 nodes x 1 task; the losses must be
# the one-rank run's within relative 1e-5 (test/t_dp.sh says why). The
# script's GPU and core requests are overridden on the command line.
if ! ldd ./train | grep -q libmpi; then skip slurm_train "./train is not an MPI build"; exit 0; fi
. test/ckpt_lib.sh
ckpt_setup
Y=$T/tiny.yaml
S="--set batch.total_tokens=512 --set checkpoint.async=false"
./train $Y $S --set run.dir=$T/ref >/dev/null 2>&1
SB=(sbatch --chdir="$PWD" --cpus-per-task=1 --gpus-per-node=0 --time=5)
for layout in "1node:--nodes=1 --ntasks-per-node=2" "2nodes:--nodes=2 --ntasks-per-node=1"; do
    name=${layout%%:*}
    t0=$(date +%s.%N)
    "${SB[@]}" --wait ${layout#*:} -o "$T/train_$name.out" scripts/train.sbatch $Y $S --set run.dir=$T/sb_$name \
        >/dev/null 2>"$T/sbatch_$name.err"
    rc=$?
    echo "sbatch train.sbatch $name: $(echo "$(date +%s.%N) - $t0" | bc) s" >&2
    why=$(close_losses $T/ref/metrics.jsonl $T/sb_$name/metrics.jsonl 2>&1)
    if [ $rc -eq 0 ] && [ -z "$why" ] && grep -q 'kiln: finished with exit 0' "$T/train_$name.out" \
        && grep -q 'rank 0/2 .*from Slurm' "$T/train_$name.out"; then ok slurm_train_sbatch_$name
    else fail slurm_train_sbatch_$name "rc $rc: $why $(tail -c 400 "$T/train_$name.out") $(cat "$T/sbatch_$name.err")"; fi
done

# Signalled mid-run: scancel --signal=USR1 reaches both tasks, they agree on
# the step, save and exit 75; the script requeues the job; the rerun resumes
# from that checkpoint and finishes with the losses of an uninterrupted run on
# the same 2 ranks, bit for bit. Every wait follows the job's own progress,
# never a sleep racing it: the ranks wait after step 20 until the signal has
# come (KILN_TEST_PAUSE_AT_STEP, in the job's environment; the resumed run
# starts after it), so the signal always lands at step 20 and the rerun has
# 20 steps to go; the waits follow the metrics file and the job's state, and
# their limits (10 min) only end a hang.
t0=$(date +%s.%N)
L="$S --set train.steps=40 --set checkpoint.every=0 --set train.eval_every=0 --set schedule.kind=constant"
timeout 600 mpirun --allow-run-as-root --oversubscribe -np 2 ./train $Y $L --set run.dir=$T/sigref >/dev/null 2>&1
J=$(KILN_TEST_PAUSE_AT_STEP=20 "${SB[@]}" --parsable --nodes=1 --ntasks-per-node=2 -o "$T/sig.out" \
    scripts/train.sbatch $Y $L --set run.dir=$T/sig 2>"$T/sig.err")
job_state() { scontrol show job "$J" 2>/dev/null | grep -o 'JobState=[A-Z_]*' | cut -d= -f2; }
job_over() { [ "$state" = COMPLETED ] || [ "$state" = FAILED ] || [ "$state" = CANCELLED ]; }
# wait_job [METRICS N]: until the job has ended, or METRICS has N lines; sets state
wait_job() {
    state=""
    for i in $(seq 3000); do
        [ $# = 2 ] && [ "$(cat "$1" 2>/dev/null | wc -l)" -ge "$2" ] && return
        state=$(job_state)
        job_over && return
        sleep 0.2
    done
}
wait_job $T/sig/metrics.jsonl 20
scancel --signal=USR1 "$J"
# The requeued job starts when Slurm's own hold ends (AuthInfo cred_expire,
# 30 s here), which exists so that the new launch's credential postdates the
# node's revocation of the old one. It is not shortened: when the node
# revokes is not visible from here, and a launch before it is refused ("Job
# credential revoked") and ends the job FAILED; a start moved to 2 s after
# the script printed "requeueing" only narrowed that race.
wait_job
echo "sbatch signalled + requeued: $(echo "$(date +%s.%N) - $t0" | bc) s ($state)" >&2
if [ "$state" = COMPLETED ] && grep -q 'exit 75.*requeueing' "$T/sig.out" && grep -q 'restart 1' "$T/sig.out" \
    && grep -q 'stopped by .* after step 20;' "$T/sig.out" \
    && grep -q 'resumed from .*step_00000020' "$T/sig.out" && grep -q 'done: 40 steps' "$T/sig.out" \
    && [ "$(losses $T/sigref/metrics.jsonl)" = "$(losses $T/sig/metrics.jsonl)" ]; then
    ok slurm_train_signal_requeue_resume
else fail slurm_train_signal_requeue_resume "state '$state': $(grep -E 'kiln:|stopped|resumed|done|error' "$T/sig.out" | head -8)"; fi
scancel "$J" >/dev/null 2>&1

# parallel.layout auto: train.sbatch plans the allocation it got at every
# start (./train plan --auto-sets, the cpu profile measured once into
# KILN_CACHE). Submitted on 2 nodes it runs the layout chosen for 2 ranks on 2
# nodes; signalled at step 20 it saves and requeues itself, and while it waits
# in the queue it is shrunk to 1 node (as an operator would when a node is
# lost: scontrol update NumNodes=1-1); the rerun, one task per node, plans 1 rank and resumes
# the 2-rank checkpoint resharded onto it. Every loss of the 40 steps within the resharding
# tolerance of a run that never moved (close_losses, relative 1e-5). The waits
# follow the job as above.
t0=$(date +%s.%N)
A="$L --set parallel.layout=auto"
./train $Y $A --set run.dir=$T/autoref >/dev/null 2>&1
J=$(KILN_CACHE=$T/kcache KILN_PLAN_HARDWARE=cpu KILN_TEST_PAUSE_AT_STEP=20 "${SB[@]}" --parsable --nodes=2 \
    --ntasks-per-node=1 -o "$T/auto.out" scripts/train.sbatch $Y $A --set run.dir=$T/auto 2>"$T/auto.err")
wait_job $T/auto/metrics.jsonl 20
scancel --signal=USR1 "$J"
# requeued: pending (Slurm holds it 30 s, see above) with restart count 1
for i in $(seq 3000); do
    state=$(job_state)
    [ "$state" = PENDING ] && scontrol show job "$J" | grep -q 'Restarts=1' && break
    job_over && break
    sleep 0.2
done
scontrol update JobId="$J" NumNodes=1-1 NumTasks=1 2>"$T/shrink.err"
wait_job
echo "sbatch layout auto, requeued onto 1 node: $(echo "$(date +%s.%N) - $t0" | bc) s ($state)" >&2
why=$(close_losses $T/autoref/metrics.jsonl $T/auto/metrics.jsonl 2>&1)
if [ "$state" = COMPLETED ] && grep -q 'layout auto: 2 task(s) on 2 node(s)' "$T/auto.out" \
    && grep -q 'layout auto: 1 task(s) on 1 node(s)' "$T/auto.out" && grep -q 'exit 75.*requeueing' "$T/auto.out" \
    && grep -q 'resumed from .*step_00000020' "$T/auto.out" && grep -q 'done: 40 steps' "$T/auto.out" \
    && [ -z "$why" ]; then
    ok slurm_train_layout_auto_requeue_fewer_nodes
else fail slurm_train_layout_auto_requeue_fewer_nodes "state '$state': $why $(cat "$T/shrink.err") $(grep -E 'kiln:|resumed|done|error' "$T/auto.out" | head -8)"; fi
scancel "$J" >/dev/null 2>&1
