#!/usr/bin/env bash
# What the flight recorder and monitor.check_collectives cost per step, on the
# CPU backend under mpirun: a tiny model (2 layers x 32 wide, one micro-batch
# of 4 x 32 per rank) so that the collectives, not the compute, dominate a
# step. Each point is the wall time of a step (metrics.jsonl elapsed_s,
# steps 21..N: everything a step does, logging and the stop agreement
# included), the median over steps of each run, then the median of REPS runs
# interleaved with the other points (the machine may be shared). The
# collectives per step are counted from a SIGUSR2 snapshot of rank 0's ring.
# Then build/test/bench_flight gives the cost per operation in isolation.
#
#   scripts/bench_flight.sh [NP] [STEPS] [REPS]     (default 4 200 3; make bench: 2 1000 5)
set -euo pipefail
cd "$(dirname "$0")/.."
NP=${1:-4}
STEPS=${2:-200}
REPS=${3:-3}
command -v mpirun >/dev/null 2>&1 && ldd ./train | grep -q libmpi || { echo "bench_flight: needs mpirun and an MPI build" >&2; exit 2; }
[ -x build/test/bench_flight ] || make --no-print-directory build/test/bench_flight >/dev/null
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
head -c 60000 data/austen.txt > "$dir/corpus.txt"
./train prepare --tokenizer byte --out "$dir/data" "$dir/corpus.txt" >/dev/null
cat > "$dir/tiny.yaml" <<YAML
run: {threads: 1}
model: {n_layer: 2, n_head: 2, n_embd: 32, seq_len: 32, vocab_size: 256}
data: {train: "$dir/data/train_*.bin", val: ""}
batch: {micro_batch: 4, total_tokens: $((128 * NP))}
train: {steps: $STEPS, eval_every: 0, sample_every: 0}
checkpoint: {every: 0, final: false}
metrics: {peak_gflops: 1, tensorboard: false, log_every: 100000}
YAML
run() { # run NAME EXTRA...: one job; prints seconds per step
    local name=$1; shift
    mpirun --allow-run-as-root --oversubscribe --bind-to none -np "$NP" ./train "$dir/tiny.yaml" \
        --set run.dir="$dir/$name" "$@" >"$dir/$name.log" 2>&1
    python3 - "$dir/$name/metrics.jsonl" <<'PY'
import json, sys
e = {d["step"]: d["elapsed_s"] for d in map(json.loads, open(sys.argv[1]))}
dt = sorted(e[s] - e[s - 1] for s in range(21, max(e) + 1))
print(dt[len(dt) // 2])
PY
}
median() { sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
declare -A t
points=(off on check)
for p in "${points[@]}"; do t[$p]=""; done
for r in $(seq "$REPS"); do
    t[off]+="$(run off$r --set monitor.flight_records=0)"$'\n'
    t[on]+="$(run on$r)"$'\n'
    t[check]+="$(run check$r --set monitor.check_collectives=true)"$'\n'
done
# per operation, without the rest of a step: the recorder alone, and the check
# on back-to-back all-reduces (ranks already in step: the agreement's own cost)
mpirun --allow-run-as-root --oversubscribe --bind-to none -np "$NP" build/test/bench_flight 2000 7
# collectives per step: rank 0 pauses at step 30 until SIGUSR2 has written its ring
KILN_TEST_FLIGHT_PAUSE=0:30 mpirun --allow-run-as-root --oversubscribe -np "$NP" -x KILN_TEST_FLIGHT_PAUSE ./train \
    "$dir/tiny.yaml" --set train.steps=31 --set run.dir="$dir/count" >"$dir/count.log" 2>&1 &
job=$!
hb() { python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])' "$dir/count/heartbeat/rank0.json" "$1" 2>/dev/null || echo 0; }
# the heartbeat's step is the last one done: from 29 on, step 28's collectives are all in the ring
for _ in $(seq 600); do [ "$(hb step)" -ge 29 ] && break; sleep 0.1; done
kill -USR2 "$(hb pid)"
wait $job
ncoll=$(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(sum(1 for o in d["ops"] if o["step"]==28 and o["op"] not in ("send","recv")))' "$dir/count/flight/rank0.json")
off=$(printf '%s' "${t[off]}" | median); on=$(printf '%s' "${t[on]}" | median); chk=$(printf '%s' "${t[check]}" | median)
echo "== flight recorder and check_collectives, $NP ranks x 1 thread, 2 x 32 model, $ncoll collectives per step, $(nproc) cores, median step of 21-$STEPS, median of $REPS runs =="
awk -v off="$off" -v on="$on" -v chk="$chk" -v n="$ncoll" 'BEGIN {
    printf "recorder off           %.3f ms/step\n", off * 1e3
    printf "recorder on (256)      %.3f ms/step  (%+.3f ms, %+.1f%%)\n", on * 1e3, (on - off) * 1e3, 100 * (on - off) / off
    printf "check_collectives on   %.3f ms/step  (%+.3f ms, %+.1f%%; %.1f us per collective)\n", chk * 1e3,
           (chk - on) * 1e3, 100 * (chk - on) / on, (chk - on) * 1e6 / n }'
