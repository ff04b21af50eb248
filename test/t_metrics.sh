#!/usr/bin/env bash
# End-to-end checks of what a run reports about itself: metrics.jsonl parsed
# line by line, the TensorBoard event file read back by TensorBoard's own
# reader (the tools venv, test/lib.sh tools_python), the
# per-rank log, the heartbeat, the live bar on a terminal, train.on_nonfinite
# (skip leaves the parameters unchanged, stop exits 1), the watchdog catching a
# simulated stall, and ./train status. Prints one line per check.
set -u
cd "$(dirname "$0")/.."
T=${KILN_TEST_TMP:-$(mktemp -d)}/t_metrics
rm -rf "$T" && mkdir -p "$T"
. test/lib.sh

small_corpus "$T/data"
# A fixed peak keeps the start-up measurement out of most runs (one run below measures).
cat > "$T/small.yaml" <<EOF
run: {name: small, dir: "$T/run", seed: 7, threads: 1}
model: {n_layer: 2, n_head: 2, n_embd: 32, seq_len: 32, vocab_size: 256}
data: {train: "$T/data/train_*.bin", val: "$T/data/val_*.bin"}
batch: {micro_batch: 4, total_tokens: 256}
train: {steps: 12, eval_every: 6, eval_batches: 2, sample_every: 0}
schedule: {warmup_steps: 2}
metrics: {log_every: 4, peak_gflops: 50}
EOF

./train "$T/small.yaml" >"$T/out.txt" 2>"$T/err.txt"
rc=$?
[ $rc -eq 0 ] || fail metrics_run "exit $rc: $(tail -n 3 "$T/err.txt")"

# metrics.jsonl: every line a JSON object with the documented fields
if python3 - "$T/run/metrics.jsonl" <<'EOF'
import json, math, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
assert len(rows) == 12, len(rows)
need = ["step", "tokens", "loss", "lr", "grad_norm", "tok_per_s", "mfu", "step_time_s", "elapsed_s",
        "eta_s", "time", "peak_rss_mib", "nonfinite_skipped"]
for i, r in enumerate(rows):
    for k in need: assert k in r, (k, r)
    assert r["step"] == i + 1 and r["tokens"] == 256 * (i + 1), r
    assert ("val_loss" in r) == (r["step"] in (6, 12)), r
    assert r["nonfinite_skipped"] == 0 and r["peak_rss_mib"] > 1, r
    # tok_per_s and mfu are measured speeds, so no bound on them (MFU can pass
    # 1 against a fixed or noisy peak); check they follow docs/metrics.md's
    # formulas from the record and small.yaml: tok/s = 256 / step_time_s,
    # MFU = FLOPs/token * tok/s / 50 GFLOP/s. jsonl holds 6 significant digits.
    L, C, T, V = 2, 32, 32, 256  # V is already a multiple of 64 (the padding)
    fpt = 6 * (12 * L * C * C + C * V) + 6 * L * T * C
    assert math.isfinite(r["mfu"]) and r["mfu"] > 0 and r["step_time_s"] > 0, r
    assert math.isclose(r["tok_per_s"], 256 / r["step_time_s"], rel_tol=2e-5), r
    assert math.isclose(r["mfu"], fpt * r["tok_per_s"] / 50e9, rel_tol=2e-5), (fpt, r)
EOF
then ok metrics_jsonl_parsed; else fail metrics_jsonl_parsed "$(head -c 300 "$T/run/metrics.jsonl")"; fi

# progress lines: every log_every steps and at evaluations, same lines in the rank log
if [ "$(grep -c '^step' "$T/out.txt")" -eq 4 ] && grep -qE '^step  6/12 .*MFU.*ETA.*val [0-9.]+' "$T/out.txt" \
    && grep -q 'MFU against 0.05 TFLOP/s peak per device (metrics.peak_gflops)' "$T/out.txt"; then
    ok metrics_progress_lines
else fail metrics_progress_lines "$(cat "$T/out.txt")"; fi
if diff <(grep '^step' "$T/out.txt") <(grep '^step' "$T/run/log/rank0.txt") >/dev/null; then ok metrics_rank_log
else fail metrics_rank_log "log/rank0.txt differs from stdout"; fi

# heartbeat: complete JSON, last step, phase done
if python3 - "$T/run/heartbeat/rank0.json" <<'EOF'
import json, os, sys
h = json.load(open(sys.argv[1]))
assert h["rank"] == 0 and h["step"] == 12 and h["phase"] == "done" and h["pid"] > 0 and h["host"], h
assert not [f for f in os.listdir(os.path.dirname(sys.argv[1])) if f.endswith(".tmp")]
EOF
then ok metrics_heartbeat; else fail metrics_heartbeat "$(cat "$T/run/heartbeat/rank0.json")"; fi

# TensorBoard's own reader on the event file
if tools_python metrics_tensorboard_reader; then
    if "$TOOLS_PY" - "$T/run" >"$T/tb.txt" 2>&1 <<'EOF'
import glob, json, sys, struct
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
d = sys.argv[1]
files = glob.glob(d + "/events.out.tfevents.*")
assert len(files) == 1, files
ea = EventAccumulator(files[0]); ea.Reload()
rows = [json.loads(l) for l in open(d + "/metrics.jsonl")]
f32 = lambda x: struct.unpack("f", struct.pack("f", x))[0]
pairs = {"train/loss": "loss", "val/loss": "val_loss", "train/lr": "lr", "train/grad_norm": "grad_norm",
         "perf/tok_per_s": "tok_per_s", "perf/mfu": "mfu", "perf/step_time_s": "step_time_s"}
tags = ea.Tags()["scalars"]
for tag, key in pairs.items():
    assert tag in tags, (tag, tags)
    want = {r["step"]: r[key] for r in rows if key in r}
    got = {e.step: e.value for e in ea.Scalars(tag)}
    assert sorted(got) == sorted(want), (tag, sorted(got), sorted(want))
    for s in want:  # jsonl holds 6 significant digits, the event a float32
        assert abs(got[s] - f32(want[s])) <= 1e-5 * abs(want[s]) + 1e-12, (tag, s, got[s], want[s])
print("tags", len(tags))
EOF
    then ok metrics_tensorboard_reader; else fail metrics_tensorboard_reader "$(tail -n 5 "$T/tb.txt")"; fi
fi

# the live bar on a terminal (util-linux `script` gives the run a pty)
if command -v script >/dev/null 2>&1; then
    script -qec "./train '$T/small.yaml' --set run.dir='$T/tty' --set metrics.log_every=100" "$T/tty.txt" >/dev/null 2>&1
    if grep -q $'\r\033\[K\[#' "$T/tty.txt" && grep -q 'step 12/12 | loss' "$T/tty.txt"; then
        ok metrics_tty_progress_bar
    else fail metrics_tty_progress_bar "$(head -c 400 "$T/tty.txt" | cat -v)"; fi
else skip metrics_tty_progress_bar "no script(1)"; fi

# the measured peak: no metrics.peak_gflops, so the CPU's matmul rate is measured
./train "$T/small.yaml" --set metrics.peak_gflops=0 --set run.dir="$T/meas" --set train.steps=2 >"$T/out.txt" 2>&1
if grep -qE 'MFU against [0-9.e+-]+ TFLOP/s peak per device \(fp32 matmul rate measured at start-up\)' "$T/out.txt"; then
    ok metrics_peak_measured
else fail metrics_peak_measured "$(head -n 3 "$T/out.txt")"; fi

# peak_device_mib on the CPU: the bytes live through the backend's alloc at
# most (docs/metrics.md). Every line has it, never falling; a larger
# micro-batch takes more. model.recompute changes only the activation arena,
# so the peaks of none, gelu and norm_gelu differ by exactly the differences of
# --dry-run's activation lines (model_activation_bytes, what the arena
# allocates): 2e-5 MiB (21 bytes) is the rounding of those figures (6
# significant digits in jsonl, 0.01 KiB printed), far under any buffer.
# The run above measured the matmul rate: its three 1024 x 768 fp32 buffers
# (8.25 MiB exactly) are the floor, freed before this 1.4 MiB model allocates.
for v in none gelu norm_gelu; do
    ./train "$T/small.yaml" --set run.dir="$T/peak_$v" --set train.steps=2 --set train.eval_every=0 \
        --set model.recompute=$v >"$T/peak_$v.txt" 2>&1 || fail metrics_peak_device_run "recompute $v: $(tail -n 2 "$T/peak_$v.txt")"
    ./train "$T/small.yaml" --set model.recompute=$v --dry-run >"$T/dry_$v.txt" 2>&1
done
./train "$T/small.yaml" --set run.dir="$T/peak_b8" --set train.steps=2 --set train.eval_every=0 \
    --set batch.micro_batch=8 >"$T/peak_b8.txt" 2>&1 || fail metrics_peak_device_run "micro_batch 8: $(tail -n 2 "$T/peak_b8.txt")"
if python3 - "$T" <<'EOF'
import json, re, sys
t = sys.argv[1]
def peaks(run):
    return [json.loads(l)["peak_device_mib"] for l in open(f"{t}/{run}/metrics.jsonl")]
unit = {"B": 1 / 1048576, "KiB": 1 / 1024, "MiB": 1, "GiB": 1024}
def act(v):
    m = re.search(r"^  activations +([0-9.]+) (B|KiB|MiB|GiB)$", open(f"{t}/dry_{v}.txt").read(), re.M)
    return float(m.group(1)) * unit[m.group(2)]
for run in ("run", "peak_none", "peak_b8"):
    p = peaks(run)
    assert p[0] > 0 and p == sorted(p), (run, p)
assert peaks("meas")[-1] == 8.25, peaks("meas")
none, b8 = peaks("peak_none")[-1], peaks("peak_b8")[-1]
assert b8 > none, (none, b8)
for v in ("gelu", "norm_gelu"):
    got, want = none - peaks(f"peak_{v}")[-1], act("none") - act(v)
    assert want > 0 and abs(got - want) < 2e-5, (v, got, want)
EOF
then ok metrics_peak_device_cpu; else fail metrics_peak_device_cpu "peak_device_mib on the CPU backend (see above)"; fi

# train.on_nonfinite: skip -- step 5's gradient is poisoned (test hook); the
# parameters after step 5 equal those after step 4, and step 6 updates again
KILN_TEST_INJECT_NAN_STEP=5 ./train "$T/small.yaml" --set run.dir="$T/skip" --set train.on_nonfinite=skip \
    >"$T/out.txt" 2>"$T/err.txt"
rc=$?
if [ $rc -eq 0 ] && grep -q 'warning: step 5: non-finite gradient norm' "$T/err.txt" && python3 - "$T/skip/metrics.jsonl" <<'EOF'
import json, sys
r = {x["step"]: x for x in map(json.loads, open(sys.argv[1]))}
assert len(r) == 12
assert r[5].get("skipped") is True and r[5]["grad_norm"] is None and r[5]["nonfinite_skipped"] == 1, r[5]
assert r[5]["param_hash"] == r[4]["param_hash"] != r[6]["param_hash"], (r[4], r[5], r[6])
assert r[4]["param_hash"] != r[3]["param_hash"] and r[12]["nonfinite_skipped"] == 1
assert all(not r[s].get("skipped") for s in r if s != 5)
EOF
then ok metrics_nonfinite_skip_leaves_params; else fail metrics_nonfinite_skip_leaves_params "exit $rc: $(tail -n 2 "$T/err.txt")"; fi
if grep -q 'skipped' "$T/skip/log/rank0.txt" && grep -q '1 step(s) skipped' "$T/out.txt"; then ok metrics_nonfinite_skip_reported
else fail metrics_nonfinite_skip_reported "$(tail -n 3 "$T/out.txt")"; fi

# a run that stays non-finite is stopped: NaN from step 3 on, at most 4 skips in a row
KILN_TEST_INJECT_NAN_STEP=3+ ./train "$T/small.yaml" --set run.dir="$T/skips" --set train.on_nonfinite=skip \
    --set train.max_consecutive_skips=4 >"$T/out.txt" 2>"$T/err.txt"
rc=$?
if [ $rc -eq 1 ] && grep -q 'kiln: error: step 6: 4 steps in a row were non-finite' "$T/err.txt"; then
    ok metrics_nonfinite_skip_cap_stops
else fail metrics_nonfinite_skip_cap_stops "exit $rc: $(tail -n 2 "$T/err.txt")"; fi
# the skip count survives a resume: one skip at step 5, checkpoint at 8, resumed to 12
KILN_TEST_INJECT_NAN_STEP=5 ./train "$T/small.yaml" --set run.dir="$T/skipres" --set train.on_nonfinite=skip \
    --set train.steps=8 >/dev/null 2>&1
./train "$T/small.yaml" --set run.dir="$T/skipres" --set train.on_nonfinite=skip --resume auto >"$T/out.txt" 2>&1
if grep -q '"step":12,.*"nonfinite_skipped":1' "$T/skipres/metrics.jsonl"; then ok metrics_skip_count_survives_resume
else fail metrics_skip_count_survives_resume "$(tail -n 1 "$T/skipres/metrics.jsonl")"; fi

# train.on_nonfinite: stop (the default) -- exit 1 with one clear line, also in the log
KILN_TEST_INJECT_NAN_STEP=5 ./train "$T/small.yaml" --set run.dir="$T/stop" >"$T/out.txt" 2>"$T/err.txt"
rc=$?
if [ $rc -eq 1 ] && grep -q 'kiln: error: step 5: non-finite gradient.*train.on_nonfinite: stop' "$T/err.txt" \
    && grep -q 'error: step 5: non-finite' "$T/stop/log/rank0.txt" && [ "$(wc -l < "$T/stop/metrics.jsonl")" -eq 5 ]; then
    ok metrics_nonfinite_stop_exits_1
else fail metrics_nonfinite_stop_exits_1 "exit $rc: $(tail -n 2 "$T/err.txt")"; fi

# the watchdog: a hang in step 4's forward phase (test hook) with a 2 s timeout
# is caught within the timeout plus a few seconds, exit 1, phases in the log
start=$(date +%s.%N)
KILN_TEST_STALL_AT_STEP=4 timeout 60 ./train "$T/small.yaml" --set run.dir="$T/stall" \
    --set monitor.stall_timeout_s=2 >"$T/out.txt" 2>"$T/err.txt"
rc=$?
took=$(python3 -c "import time; print(round(time.time() - $start, 1))")
# exit 1 is the watchdog's (the outer `timeout 60` would give 124), and its
# line gives its own measure of the stall, at least the 2 s timeout (more
# when its thread is scheduled late): neither that nor the wall time is
# bounded above (a loaded machine may take any time)
if [ $rc -eq 1 ] \
    && grep -qE "watchdog: rank 0 made no progress for ([2-9]|[1-9][0-9]+)\.[0-9] s.*phase 'forward' of step 4" "$T/err.txt" \
    && grep -q 'forward .*<- stuck here' "$T/err.txt" && grep -q 'backward' "$T/stall/log/rank0.txt" \
    && grep -q '"stalled":true' "$T/stall/heartbeat/rank0.json"; then
    ok metrics_watchdog_catches_stall
else fail metrics_watchdog_catches_stall "exit $rc after ${took}s: $(head -c 400 "$T/err.txt")"; fi

# ./train status: last step, loss, checkpoints (complete ones only), stale ranks
rm -rf "$T/run/checkpoints"  # made-up checkpoints, whatever checkpoint.every wrote
mkdir -p "$T/run/checkpoints/step_00000006" "$T/run/checkpoints/step_00000012.tmp"
echo step_00000006 > "$T/run/checkpoints/latest"
./train status "$T/run" >"$T/st.txt" 2>&1
rc=$?
if [ $rc -eq 0 ] && grep -qE 'last step +12 of 12 \(100.0%\)' "$T/st.txt" && grep -qE 'loss +[0-9.]+ \| val [0-9.]+ at step 12' "$T/st.txt" \
    && grep -q 'tokens/s' "$T/st.txt" && grep -q 'ETA done' "$T/st.txt" \
    && grep -qE 'checkpoints +step_00000006 \| latest: step_00000006$' "$T/st.txt" && grep -q 'stale ranks  none' "$T/st.txt"; then
    ok status_finished_run
else fail status_finished_run "exit $rc: $(cat "$T/st.txt")"; fi
sleep 1.2
./train status "$T/stall" --stale-after 1 >"$T/st.txt" 2>&1
if grep -qE 'last step +3 of 12' "$T/st.txt" && grep -q 'stale ranks  0' "$T/st.txt" && grep -q 'watchdog fired' "$T/st.txt"; then
    ok status_stale_rank
else fail status_stale_rank "$(cat "$T/st.txt")"; fi
./train status "$T/nothing" >"$T/st.txt" 2>&1
rc=$?
if [ $rc -eq 2 ] && grep -q 'nothing: not a run directory' "$T/st.txt"; then ok status_bad_dir
else fail status_bad_dir "exit $rc: $(cat "$T/st.txt")"; fi
