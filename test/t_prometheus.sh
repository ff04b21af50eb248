#!/usr/bin/env bash
# monitor.prometheus_file: the node-exporter textfile rank 0 keeps, parsed by
# prometheus_client's own text parser (pinned, in .venv-track:
# scripts/setup_track.sh). While a run waits after step 6 the file says
# running at step 6; after the end it says running 0 with the exit code and
# the last step's figures, equal to metrics.jsonl; every family has HELP and
# TYPE; no temporary file is left; a 2-rank run adds the straggler gauges;
# bad values exit 2 naming the key. Prints one line per check.
set -u
cd "$(dirname "$0")/.."
T=${KILN_TEST_TMP:-$(mktemp -d)}/t_prometheus
rm -rf "$T" && mkdir -p "$T/textfile"
. test/lib.sh
. test/track_lib.sh

small_corpus "$T/data"
track_config "$T/p.yaml" p
P="$T/textfile/kiln.prom"
PR="--set monitor.prometheus_file=$P --set monitor.prometheus_every=3"

# a run that waits after step 6 (a multiple of prometheus_every) until SIGTERM
KILN_TEST_PAUSE_AT_STEP=6 ./train "$T/p.yaml" $PR >"$T/p1.txt" 2>&1 &
pid=$!
wait_step "$T/p/metrics.jsonl" 6
cp "$P" "$T/mid.prom" 2>/dev/null
kill -TERM $pid
wait $pid
rc1=$?
cp "$P" "$T/stopped.prom" 2>/dev/null
./train "$T/p.yaml" $PR --resume auto >"$T/p2.txt" 2>&1
rc2=$?
if [ $rc1 -eq 75 ] && [ $rc2 -eq 0 ]; then ok prometheus_runs
else fail prometheus_runs "exits $rc1 and $rc2, wanted 75 and 0: $(tail -n 2 "$T/p2.txt")"; fi
if [ -z "$(ls "$T/textfile" | grep -v '^kiln.prom$')" ]; then ok prometheus_no_temporary_files_left
else fail prometheus_no_temporary_files_left "$(ls "$T/textfile")"; fi
if have_mpi; then
    "${MPIRUN[@]}" -np 2 ./train "$T/p.yaml" --set run.name=p2 --set run.dir="$T/p2" \
        --set monitor.prometheus_file="$T/textfile/two.prom" >"$T/two.txt" 2>&1 || fail prometheus_two_ranks "$(tail -n 3 "$T/two.txt")"
fi

if track_python prometheus_client_parses_file; then
    MPI=0; have_mpi && MPI=1
    "$PY" - "$T" "$MPI" >"$T/check.txt" 2>&1 <<'EOF'
import json, math, sys
from prometheus_client.parser import text_string_to_metric_families
T, mpi = sys.argv[1], sys.argv[2] == "1"
def check(name, cond, why=""):
    print(("ok " if cond else "FAIL ") + name + ("" if cond else ": " + str(why)))
def parse(path):
    text = open(path).read()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    val = {}
    for f in fams.values():
        for s in f.samples:
            assert s.labels.get("run"), s
            val[(s.name, s.labels.get("phase"))] = s.value
    return text, fams, val
g = lambda v, name: v.get((name, None))

text, fams, v = parse(T + "/mid.prom")
check("prometheus_mid_run_snapshot", g(v, "kiln_running") == 1 and g(v, "kiln_step") == 6 and g(v, "kiln_steps_planned") == 12
      and "kiln_exit_code" not in fams, {k: x for k, x in v.items() if k[1] is None})
_, _, v = parse(T + "/stopped.prom")
check("prometheus_stopped_snapshot", g(v, "kiln_running") == 0 and g(v, "kiln_exit_code") == 75 and g(v, "kiln_step") == 6, v)

text, fams, v = parse(T + "/textfile/kiln.prom")
helps = [l for l in text.splitlines() if l.startswith("# HELP ")]
types = [l for l in text.splitlines() if l.startswith("# TYPE ")]
check("prometheus_help_and_type_lines", len(helps) == len(types) == len(fams)
      and all(f.documentation and f.type in ("gauge", "counter") for f in fams.values()), (len(helps), len(types), len(fams)))
need = ["kiln_running", "kiln_exit_code", "kiln_step", "kiln_steps_planned", "kiln_tokens", "kiln_loss", "kiln_val_loss",
        "kiln_tokens_per_second", "kiln_mfu_ratio", "kiln_step_seconds", "kiln_start_timestamp_seconds",
        "kiln_last_progress_timestamp_seconds", "kiln_seconds_since_progress", "kiln_phase_seconds",
        "kiln_checkpoint_age_seconds", "kiln_checkpoint_step", "kiln_world_size", "kiln_nonfinite_skipped"]
check("prometheus_families_present", all(n in fams for n in need), sorted(set(need) - set(fams)))
check("prometheus_counters_typed", fams["kiln_phase_seconds"].type == "counter" and fams["kiln_nonfinite_skipped"].type == "counter")
last = [json.loads(l) for l in open(T + "/p/metrics.jsonl")][-1]
# jsonl holds 6 significant digits, the file 10: rel 1e-5
close = lambda a, b: math.isclose(a, b, rel_tol=1e-5)
check("prometheus_final_values_match_jsonl", g(v, "kiln_running") == 0 and g(v, "kiln_exit_code") == 0
      and g(v, "kiln_step") == 12 and g(v, "kiln_tokens") == last["tokens"] and close(g(v, "kiln_loss"), last["loss"])
      and close(g(v, "kiln_val_loss"), last["val_loss"]) and close(g(v, "kiln_tokens_per_second"), last["tok_per_s"])
      and close(g(v, "kiln_mfu_ratio"), last["mfu"]) and close(g(v, "kiln_step_seconds"), last["step_time_s"]), (v, last))
phases = {k[1] for k in v if k[0] == "kiln_phase_seconds_total"}
check("prometheus_phase_seconds", {"data", "forward", "backward", "optimizer", "eval", "checkpoint"} <= phases
      and all(x >= 0 for k, x in v.items() if k[0] == "kiln_phase_seconds_total"), phases)
check("prometheus_checkpoint_age", g(v, "kiln_checkpoint_step") == 12 and 0 <= g(v, "kiln_checkpoint_age_seconds") < 3600, v)
check("prometheus_progress_clock", abs(g(v, "kiln_last_progress_timestamp_seconds") - last["time"]) < 600
      and g(v, "kiln_seconds_since_progress") >= 0)
if mpi:
    _, fams2, v2 = parse(T + "/textfile/two.prom")
    check("prometheus_two_ranks", g(v2, "kiln_world_size") == 2 and "kiln_slowest_rank" in fams2
          and g(v2, "kiln_slowest_rank") in (0, 1) and g(v2, "kiln_straggler_factor") > 0, v2)
EOF
    rc=$?
    grep -E '^(ok|FAIL|skip) ' "$T/check.txt"
    [ $rc -eq 0 ] || fail prometheus_client_parses_file "python exited $rc: $(tail -n 4 "$T/check.txt" | tr '\n' ' ')"
    have_mpi || skip prometheus_two_ranks "no MPI build or mpirun"
fi

expect prometheus_every_zero 2 "key 'monitor.prometheus_every': expected an integer in \[1," -- \
    ./train "$T/p.yaml" --set monitor.prometheus_every=0
expect prometheus_file_unwritable 0 "monitor.prometheus_file: $T/nodir/x.prom: cannot write" -- \
    ./train "$T/p.yaml" --set run.dir="$T/q" --set monitor.prometheus_file="$T/nodir/x.prom" --set train.steps=2
