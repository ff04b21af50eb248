#!/usr/bin/env bash
# RUN_DIR/summary.json, the job summary scripts and trackers read: after a run
# that completes (figures equal to metrics.jsonl), one stopped by SIGTERM
# (exit 75, "stopped"), its resumed continuation (best losses carried over the
# resume), one stopped by a non-finite gradient (exit 1 through kiln_fail),
# one ended by the watchdog, and a 2-rank run (rank 0 writes it). Prints one
# line per check.
set -u
cd "$(dirname "$0")/.."
T=${KILN_TEST_TMP:-$(mktemp -d)}/t_summary
rm -rf "$T" && mkdir -p "$T"
. test/lib.sh
. test/track_lib.sh

small_corpus "$T/data"
track_config "$T/s.yaml" s
# summary NAME DIR RC ASSERTIONS: python assertions on s (summary.json) and
# rows (metrics.jsonl) of DIR; RC is the run's exit code, for the message
summary() {
    local name=$1 dir=$2 rc=$3
    if python3 -c '
import json, math, os, sys
d, want = sys.argv[1], sys.argv[2]
s = json.load(open(d + "/summary.json"))
rows = [json.loads(l) for l in open(d + "/metrics.jsonl")]
assert not [f for f in os.listdir(d) if f.startswith("summary.json.")], os.listdir(d)
close = lambda a, b: a is not None and math.isclose(a, b, rel_tol=1e-5)  # both 6 significant digits
for k in ("run", "run_dir", "status", "exit_code", "exit_reason", "steps", "steps_planned", "tokens", "elapsed_s",
          "final_loss", "best_loss", "tok_per_s", "mfu", "checkpoints", "world", "host", "commit", "started", "ended"):
    assert k in s, (k, s)
exec(want)
' "$dir" "$4" >"$T/$name.py.txt" 2>&1
    then ok "$name"; else fail "$name" "exit $rc; $(tail -n 2 "$T/$name.py.txt" | tr '\n' ' ')"; fi
}

./train "$T/s.yaml" >"$T/a.txt" 2>&1
summary summary_completed "$T/s" $? '
assert s["status"] == "completed" and s["exit_code"] == 0 and s["exit_reason"] == "completed", s
assert s["steps"] == 12 == s["steps_planned"] and s["tokens"] == rows[-1]["tokens"] and s["start_step"] == 0, s
assert close(s["final_loss"], rows[-1]["loss"]) and close(s["best_loss"], min(r["loss"] for r in rows)), s
vals = [(r["val_loss"], r["step"]) for r in rows if "val_loss" in r]
assert close(s["final_val_loss"], vals[-1][0]) and s["final_val_step"] == 12, s
assert close(s["best_val_loss"], min(vals)[0]) and s["best_val_step"] == min(vals)[1], s
assert s["checkpoints"]["written"] == 3 and s["checkpoints"]["latest"] == "step_00000012", s["checkpoints"]
assert s["mfu"] > 0 and s["tok_per_s"] > 0 and s["world"] == 1 and s["elapsed_s"] >= 0, s
'

KILN_TEST_PAUSE_AT_STEP=5 ./train "$T/s.yaml" --set run.dir="$T/sig" >"$T/b1.txt" 2>&1 &
pid=$!
wait_step "$T/sig/metrics.jsonl" 5
kill -TERM $pid
wait $pid
summary summary_stopped_by_signal "$T/sig" $? '
assert s["status"] == "stopped" and s["exit_code"] == 75 and s["steps"] == 5, s
assert "after step 5" in s["exit_reason"] and "resume" in s["exit_reason"], s["exit_reason"]
assert s["checkpoints"]["latest_step"] == 5, s
'
./train "$T/s.yaml" --set run.dir="$T/sig" --resume auto >"$T/b2.txt" 2>&1
summary summary_resumed_carries_best "$T/sig" $? '
assert s["status"] == "completed" and s["start_step"] == 5 and s["steps"] == 12, s
assert len(rows) == 12 and close(s["best_loss"], min(r["loss"] for r in rows)), s
assert s["best_loss_step"] == min(rows, key=lambda r: r["loss"])["step"], s
assert s["elapsed_s"] >= rows[4]["elapsed_s"], s
'

KILN_TEST_INJECT_NAN_STEP=4 ./train "$T/s.yaml" --set run.dir="$T/nan" >"$T/c.txt" 2>&1
summary summary_failed_nonfinite "$T/nan" $? '
assert s["status"] == "failed" and s["exit_code"] == 1 and s["steps"] == 4, s
assert "step 4: non-finite gradient" in s["exit_reason"], s["exit_reason"]
assert close(s["final_loss"], rows[2]["loss"]), s  # the last step that updated the parameters
'

KILN_TEST_STALL_AT_STEP=3 timeout 60 ./train "$T/s.yaml" --set run.dir="$T/stall" --set monitor.stall_timeout_s=1 >"$T/d.txt" 2>&1
summary summary_watchdog "$T/stall" $? '
assert s["status"] == "failed" and s["exit_code"] == 1 and s["exit_reason"].startswith("watchdog: rank 0 made no progress"), s
assert s["steps"] == 2, s
'

if have_mpi; then
    "${MPIRUN[@]}" -np 2 ./train "$T/s.yaml" --set run.dir="$T/two" >"$T/e.txt" 2>&1
    summary summary_two_ranks "$T/two" $? '
# stragglers: a list of {"rank", "host"} (who is slow depends on the load of the machine: not asserted empty)
assert s["status"] == "completed" and s["world"] == 2 and s["steps"] == 12, s
assert isinstance(s["stragglers"], list) and all(set(w) == {"rank", "host"} for w in s["stragglers"]), s
'
else skip summary_two_ranks "no MPI build or mpirun"; fi
