#!/usr/bin/env bash
# The flight recorder, monitor.check_collectives and ./train doctor under real
# Open MPI on the CPU backend: a rank that skips an all-reduce (the job ends at
# parallel.timeout_s, every rank wrote its ring, doctor names the rank and the
# sequence number); a rank that calls another collective with
# check_collectives on (an immediate error naming both ranks and both calls);
# SIGUSR2 to a running rank (its ring written, the run goes on); a SIGSEGV
# (the ring still written); a watchdog stall; the recorder and the check on and off (the same
# losses and parameters to the bit); the config keys; --help. The unit checks
# of the ring and of doctor on written files are build/test/test_flight.
# Nothing here waits on a clock: the signal test waits for a file, then the
# rank waits for the signal (KILN_TEST_FLIGHT_PAUSE). One line per check.
set -u
cd "$(dirname "$0")/.."
T=${KILN_TEST_TMP:-$(mktemp -d)}/t_flight
rm -rf "$T"
. test/ckpt_lib.sh
if ! command -v mpirun >/dev/null 2>&1; then skip flight "mpirun not found (make deps installs openmpi-bin)"; exit 0; fi
if ! ldd ./train | grep -q libmpi; then skip flight "./train is not an MPI build (make deps, then make)"; exit 0; fi
ckpt_setup
Y=$T/tiny.yaml
MPIRUN=(timeout 120 mpirun --allow-run-as-root --oversubscribe)
now() { date +%s.%N; }
# 4 ranks: 512 tokens a step = one micro-batch of 4 x 32 per rank; no eval,
# samples or checkpoints, so each step's collectives are the gradient
# buckets and the loss sum on dp and the stop agreement on world.
S=(--set batch.total_tokens=512 --set train.steps=5 --set train.eval_every=0 --set checkpoint.every=0
   --set checkpoint.final=false)
parses() { python3 -c 'import json,sys; [json.load(open(f)) for f in sys.argv[1:]]' "$@" 2>/dev/null; }
field() { python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])' "$1" "$2" 2>/dev/null; }

# 1. rank 2 skips the loss all-reduce of step 3: ranks 0, 1, 3 wait in it,
# rank 2 goes on to the stop agreement on world and waits there. Each rank's
# deadline (5 s) writes its ring; doctor names rank 2 and the number.
TO=5
D=$T/skip
t0=$(now)
KILN_TEST_SKIP_COLLECTIVE=2:3:dp "${MPIRUN[@]}" -np 4 -x KILN_TEST_SKIP_COLLECTIVE ./train $Y "${S[@]}" \
    --set parallel.timeout_s=$TO --set run.dir=$D >$D.out 2>$D.err
rc=$?
dt=$(echo "$(now) - $t0" | bc)
# the waiting rank whose deadline fires first prints the line (0, 1 or 3: all
# three wait in the same all-reduce; which one is first is the scheduler's)
seq=$(grep -m1 -oE "rank [013]: all_reduce #[0-9]+ on group 'dp'" $D.err | grep -oE '#[0-9]+' | tr -d '#')
# exit 1 with a waiting rank's line is the deadline's end (rc 124 would be `timeout`
# ending a hang); the time it took is printed, never asserted (a loaded
# machine may take any time to start 4 ranks)
if [ $rc -eq 1 ] && [ -n "$seq" ]; then
    ok "flight_skip_ends_at_timeout (exit 1 after $dt s, timeout ${TO} s)"
else fail flight_skip_ends_at_timeout "exit $rc after $dt s; stderr: $(grep -m3 error $D.err)"; fi
files=$(ls $D/flight/rank*.json 2>/dev/null | wc -l)
if [ "$files" -eq 4 ] && parses $D/flight/rank{0,1,2,3}.json; then ok flight_skip_every_rank_wrote_its_ring
else fail flight_skip_every_rank_wrote_its_ring "$files files in $D/flight: $(ls $D/flight 2>&1)"; fi
./train doctor $D >$D.doctor 2>&1
drc=$?
prev=$(( ${seq:-1} - 1 ))
if [ $drc -eq 3 ] && grep -qE "^hang: ranks 0,1,3 wait in dp all_reduce #$seq \(1 f64\)" $D.doctor &&
   grep -qE "rank 2 on [^ ]+ never posted it: it is at dp #$prev .* waits in world all_reduce_max" $D.doctor &&
   grep -qE "^culprit: rank 2 on .*never posted dp all_reduce #$seq" $D.doctor; then
    ok flight_doctor_names_skipping_rank_and_seq
else fail flight_doctor_names_skipping_rank_and_seq "exit $drc, seq '$seq': $(cat $D.doctor)"; fi

# 2. rank 1 calls a broadcast where the others all-reduce; the agreement
# before each collective stops every rank at once (the deadline, 60 s, is
# never reached: a timeout line instead would fail the pattern).
D=$T/wrong
KILN_TEST_WRONG_COLLECTIVE=1:3:dp "${MPIRUN[@]}" -np 4 -x KILN_TEST_WRONG_COLLECTIVE ./train $Y "${S[@]}" \
    --set parallel.timeout_s=60 --set monitor.check_collectives=true --set run.dir=$D >$D.out 2>$D.err
rc=$?
pat="kiln: error: rank 0: collective mismatch on group 'dp' \(4 ranks\) at step 3: rank 1 calls broadcast #([0-9]+) \(8 bytes, root rank 0\) where rank 0 calls all_reduce #\1 \(1 f64\)"
if [ $rc -eq 1 ] && grep -qE "$pat" $D.err && ! grep -q 'did not complete within' $D.err; then
    ok flight_check_collectives_names_both_ranks_and_calls
else fail flight_check_collectives_names_both_ranks_and_calls "exit $rc; stderr: $(grep -m3 error $D.err)"; fi
./train doctor $D >$D.doctor 2>&1
drc=$?
if [ $drc -eq 3 ] && [ "$(ls $D/flight/rank*.json | wc -l)" -eq 4 ] && [ "$(field $D/flight/rank2.json reason)" = mismatch ] &&
   grep -qE "^mismatch: group dp's collective #[0-9]+: ranks 0,2,3 called dp all_reduce .*rank 1 on [^ ]+ called dp broadcast" $D.doctor; then
    ok flight_mismatch_rings_and_doctor
else fail flight_mismatch_rings_and_doctor "exit $drc: $(cat $D.doctor)"; fi

# 3. SIGUSR2 to rank 1 of 2, paused at step 2 until its ring is written: the
# file appears, the run finishes every step and exits 0, rank 0 wrote none.
D=$T/usr2
KILN_TEST_FLIGHT_PAUSE=1:2 "${MPIRUN[@]}" -np 2 -x KILN_TEST_FLIGHT_PAUSE ./train $Y --set train.steps=4 \
    --set train.eval_every=0 --set checkpoint.every=0 --set checkpoint.final=false --set run.dir=$D >$D.out 2>$D.err &
job=$!
# the heartbeat is written after the handlers are installed; bounded wait for it
for _ in $(seq 600); do [ -s $D/heartbeat/rank1.json ] && break; sleep 0.1; done
pid=$(field $D/heartbeat/rank1.json pid)
[ -n "$pid" ] && kill -USR2 "$pid"
wait $job
rc=$?
steps=$(grep -c '"step"' $D/metrics.jsonl 2>/dev/null)
if [ $rc -eq 0 ] && [ "$steps" = 4 ] && [ "$(field $D/flight/rank1.json reason)" = SIGUSR2 ] &&
   parses $D/flight/rank1.json && [ ! -e $D/flight/rank0.json ] && grep -q 'rank 1: SIGUSR2: flight recorder written to' $D.err; then
    ok flight_sigusr2_writes_ring_run_goes_on
else fail flight_sigusr2_writes_ring_run_goes_on "exit $rc, $steps steps, pid '$pid': $(ls $D/flight 2>&1) $(tail -n 3 $D.err)"; fi

# 4. rank 1 writes through a null pointer in step 2's forward: the handler
# writes its ring (then Open MPI's handler and the default action follow).
D=$T/segv
KILN_TEST_SEGV=1:2 "${MPIRUN[@]}" -np 2 -x KILN_TEST_SEGV ./train $Y --set train.steps=4 --set train.eval_every=0 \
    --set checkpoint.every=0 --set checkpoint.final=false --set run.dir=$D >$D.out 2>$D.err
rc=$?
if [ $rc -ne 0 ] && parses $D/flight/rank1.json && [ "$(field $D/flight/rank1.json reason)" = SIGSEGV ] &&
   [ "$(field $D/flight/rank1.json step)" = 2 ] && grep -q 'kiln: error: rank 1: SIGSEGV in step 2 (phase forward); flight recorder written to' $D.err &&
   ./train doctor $D 2>&1 | grep -q '^crash: rank 1 on .* died of SIGSEGV in step 2, phase forward'; then
    ok flight_sigsegv_leaves_readable_ring
else fail flight_sigsegv_leaves_readable_ring "exit $rc: $(grep -m2 -E 'kiln|Segm' $D.err) $(ls $D/flight 2>&1)"; fi

# 5. rank 1 hangs in step 2's forward (outside any collective); its watchdog
# (2 s) writes its ring with reason stall, and doctor names it whether or not
# rank 0's watchdog, waiting in the gradient all-reduce, fired too. The hook
# is given to rank 1 alone (an mpirun app context of its own).
D=$T/stall
W=(./train $Y --set train.steps=4 --set train.eval_every=0 --set checkpoint.every=0 --set checkpoint.final=false
   --set monitor.stall_timeout_s=2 --set parallel.timeout_s=60 --set run.dir=$D)
"${MPIRUN[@]}" -np 1 "${W[@]}" : -np 1 -x KILN_TEST_STALL_AT_STEP=2 "${W[@]}" >$D.out 2>$D.err
rc=$?
./train doctor $D >$D.doctor 2>&1
drc=$?
if [ $rc -eq 1 ] && [ "$(field $D/flight/rank1.json reason)" = stall ] && [ $drc -eq 3 ] &&
   grep -q '^stall: rank 1 on .* made no progress in step 2, phase forward, outside any collective' $D.doctor &&
   grep -q '^culprit: rank 1 ' $D.doctor && ! grep -q '^culprit: rank 0 ' $D.doctor; then
    ok flight_watchdog_stall_ring_and_doctor
else fail flight_watchdog_stall_ring_and_doctor "exit $rc, doctor $drc: $(grep -m2 error $D.err) $(cat $D.doctor)"; fi

# 6. The recorder off, on (default), and on with the agreement: the same
# losses and the same final parameters, to the bit (recording reads no data).
B=(--set train.steps=6 --set train.eval_every=0 --set checkpoint.every=0 --set checkpoint.final=true)
"${MPIRUN[@]}" -np 2 ./train $Y "${B[@]}" --set monitor.flight_records=0 --set run.dir=$T/off >$T/off.out 2>&1
"${MPIRUN[@]}" -np 2 ./train $Y "${B[@]}" --set run.dir=$T/on >$T/on.out 2>&1
"${MPIRUN[@]}" -np 2 ./train $Y "${B[@]}" --set monitor.check_collectives=true --set run.dir=$T/chk >$T/chk.out 2>&1
C=checkpoints/step_00000006
a=$(losses $T/off/metrics.jsonl); b=$(losses $T/on/metrics.jsonl); c=$(losses $T/chk/metrics.jsonl)
sa=$(sums $T/off/$C); sb=$(sums $T/on/$C); sc=$(sums $T/chk/$C)
if [ -n "$a" ] && [ "$a" = "$b" ] && [ "$a" = "$c" ] && [ -n "$sa" ] && [ "$sa" = "$sb" ] && [ "$sa" = "$sc" ] &&
   [ "$(echo "$a" | wc -l)" = 6 ]; then ok flight_on_off_bit_identical
else fail flight_on_off_bit_identical "losses off/on/check: $(echo $a | tail -c 80) | $(echo $b | tail -c 80) | $(echo $c | tail -c 80); sums '$sa' '$sb' '$sc'"; fi

# 7. The keys are validated like any other, and --help shows doctor.
expect flight_records_not_a_number_exit2 2 "key 'monitor.flight_records'" -- ./train $Y --dry-run --set monitor.flight_records=lots
expect flight_records_negative_exit2 2 "key 'monitor.flight_records'" -- ./train $Y --dry-run --set monitor.flight_records=-1
expect check_collectives_not_a_bool_exit2 2 "key 'monitor.check_collectives'" -- ./train $Y --dry-run --set monitor.check_collectives=maybe
if ./train --help | grep -q '^  ./train doctor RUN_DIR' && ./train --help | grep -q 'doctor: 3 culprit found'; then ok flight_help_shows_doctor
else fail flight_help_shows_doctor "$(./train --help | grep -i doctor)"; fi
expect doctor_not_a_directory_exit2 2 "not a directory" -- ./train doctor $T/nowhere
