# Shared by the shell tests: result lines, `expect`, and a small prepared
# corpus. Source it from the repo root after setting T (the test's scratch
# directory).
ok() { echo "ok $1"; }
fail() { echo "FAIL $1: $2"; }
# The Python that has numpy: Debian's, whose python3-numpy `make deps`
# installs. `python3` on PATH may be another interpreter (pyenv) without it.
NPY=/usr/bin/python3
skip() { echo "skip $1: $2"; }
# tools_python NAME: set TOOLS_PY to the venv with the tools' own readers
# (mlflow with its server, prometheus_client, tensorboard, tiktoken, Pillow: pinned by
# scripts/setup_track.sh, which `make test` runs first and which is run here
# when the venv is missing; $KILN_TRACK_PY overrides). Returns 1 after
# printing "skip NAME" when the package index cannot be reached (a skip that
# test/run.sh fails under CI=true), or "FAIL NAME" when the install failed.
TOOLS_IMPORTS='import mlflow, sqlalchemy, alembic, prometheus_client.parser, tiktoken, PIL
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator'
tools_python() {
    TOOLS_PY=${KILN_TRACK_PY:-.venv-track/bin/python}
    if [ -x "$TOOLS_PY" ] && "$TOOLS_PY" -c "$TOOLS_IMPORTS" 2>/dev/null; then return 0; fi
    if [ -z "${KILN_TRACK_PY:-}" ]; then
        bash scripts/setup_track.sh >"$T/setup_track.txt" 2>&1
        local rc=$?
        if [ $rc -eq 0 ] && "$TOOLS_PY" -c "$TOOLS_IMPORTS" 2>/dev/null; then return 0; fi
        if [ $rc -eq 3 ]; then skip "$1" "package index unreachable: the tools venv (scripts/setup_track.sh) not installed"; return 1; fi
    fi
    fail "$1" "no tools venv at $TOOLS_PY: $(tail -n 2 "$T/setup_track.txt" 2>/dev/null | tr '\n' ' ')"
    return 1
}
# expect NAME CODE PATTERN -- CMD...: exit code and a line of output matching PATTERN
expect() {
    local name=$1 code=$2 pat=$3; shift 4
    "$@" >"$T/out.txt" 2>"$T/err.txt"
    local rc=$?
    if [ $rc -ne "$code" ]; then fail "$name" "exit $rc, wanted $code; stderr: $(tail -c 300 "$T/err.txt")"; return 1; fi
    if ! grep -qE -- "$pat" "$T/err.txt" "$T/out.txt"; then fail "$name" "no match for /$pat/ in: $(tail -c 300 "$T/err.txt")"; return 1; fi
    ok "$name"
}
# small_corpus DIR: the first 60 KB of the bundled text as byte-level shards
# DIR/train_*.bin and DIR/val_*.bin (10% validation).
small_corpus() {
    local dir=$1
    mkdir -p "$(dirname "$dir")"
    head -c 60000 data/austen.txt > "$dir.txt"
    ./train prepare --tokenizer byte --out "$dir" --val-fraction 0.1 "$dir.txt" >/dev/null 2>"$dir.err" \
        || { fail prepare_small_corpus "$(cat "$dir.err")"; return 1; }
}
# mpi_refuse PREFIX NAME NP PATTERN ARGS...: `./train $Y $S ARGS` on NP ranks
# (the caller's MPIRUN, Y, S, T) must exit 2 with a line matching PATTERN;
# prints "ok PREFIX_refuses_NAME" or a failure. Every rank checks a layout,
# but mpirun ends the others as soon as the first exits, so on a busy machine
# some are killed before they print: one line is enough, a hang is not.
mpi_refuse() {
    local prefix=$1 name=$2 np=$3 want=$4; shift 4
    local out rc lines
    out=$("${MPIRUN[@]}" -np $np ./train $Y $S "$@" --set run.dir=$T/$name 2>&1); rc=$?
    lines=$(printf '%s\n' "$out" | grep -o -- "$want" | wc -l) # ranks share stderr: count the messages
    if [ $rc -eq 2 ] && [ "$lines" -ge 1 ]; then ok ${prefix}_refuses_$name
    else fail ${prefix}_refuses_$name "rc $rc, $lines of $np ranks said '$want': $(printf '%s\n' "$out" | grep -m2 kiln)"; fi
}
# jget FILE EXPR: EXPR (Python, over the parsed JSON as d) of a JSON file such
# as RUN_DIR/summary.json; prints nothing if the file or the key is missing.
# Behaviour checks read these machine files rather than the log's wording.
jget() {
    python3 - "$1" "$2" <<'PY' 2>/dev/null
import json, sys
try:
    d = json.load(open(sys.argv[1]))
    v = eval(sys.argv[2], {"d": d})
except Exception:
    sys.exit(0)
print(str(v).lower() if isinstance(v, bool) else v)
PY
}
# resumed DIR: "STEP WORLD RESHARDED" of the last session of run directory
# DIR (summary.json's "resumed": the step it resumed at, the world that wrote
# the checkpoint, true/false); empty for a fresh start.
resumed() { jget "$1/summary.json" "'%d %d %s' % (d['resumed']['step'], d['resumed']['from']['world'], str(d['resumed']['resharded']).lower())"; }
# kill_rank1_paused RUN_DIR STEP MPIRUN_PID: a 2-rank run started with
# KILN_TEST_PAUSE_AT_STEP=STEP (every rank waits after that step until a
# signal, so it cannot end first however fast it is): once STEP is in its
# metrics.jsonl, rank 1 is killed (-9) and, once it is gone, rank 0 gets
# SIGUSR1 and leaves the pause into the stop agreement's collective with a
# dead peer. Every wait follows the run (or ends with its launcher's
# timeout), never a sleep. Prints rank 1's pid (empty if the run ended first).
kill_rank1_paused() {
    local dir=$1 step=$2 mp=$3 pid0 pid1
    while kill -0 "$mp" 2>/dev/null && [ "$(cat "$dir/metrics.jsonl" 2>/dev/null | wc -l)" -lt "$step" ]; do
        sleep 0.05
    done
    kill -0 "$mp" 2>/dev/null || return 0
    pid0=$(grep -o 'pid [0-9]*' "$dir/log/rank0.txt" 2>/dev/null | head -n 1 | cut -d' ' -f2)
    pid1=$(grep -o 'pid [0-9]*' "$dir/log/rank1.txt" 2>/dev/null | head -n 1 | cut -d' ' -f2)
    [ -n "$pid0" ] && [ -n "$pid1" ] || return 0
    kill -9 "$pid1"
    while kill -0 "$pid1" 2>/dev/null && kill -0 "$mp" 2>/dev/null; do sleep 0.05; done # reaped by its launcher
    kill -USR1 "$pid0"
    echo "$pid1"
}

# ranks_comm_why RUN_DIR GROUP NRANKS: empty when RUN_DIR/ranks.jsonl has, at
# every logged step, comm_GROUP_s with NRANKS non-negative times (the blocked
# time in GROUP's collectives, per rank: the data behind the end-of-run
# "% of step time blocked" line, the report and the summary); else why not.
ranks_comm_why() {
    $NPY - "$1/ranks.jsonl" "comm_$2_s" "$3" <<'PY' 2>&1
import json, sys
path, key, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
rows = [json.loads(l) for l in open(path)]
bad = [r["step"] for r in rows if len(r.get(key, [])) != n or min(r[key]) < 0]
if not rows or bad: print("%s: %d lines, %s missing or negative at steps %s" % (path, len(rows), key, bad))
PY
}

# resumed_why SUMMARY_JSON KEY=V...: empty when the run behind SUMMARY_JSON
# (a run directory's summary.json, or a copy taken right after one resume of
# several into one directory) resumed from a checkpoint of another layout
# ("resumed": {"resharded": true}) whose "from" KEY (world, pp, dp, tp, ep) is
# V, and whose own layout's KEY is V for each to.KEY=V; else why not. The
# data summary.json writes for machines, not the wording of the resume line.
resumed_why() {
    $NPY - "$@" <<'PY' 2>&1
import json, sys
path, want = sys.argv[1], sys.argv[2:]
try:
    s = json.load(open(path))
except Exception as e:
    print(f"{path}: {e}"); sys.exit(0)
r = s.get("resumed")
if not r or not r.get("resharded"):
    print(f"{path}: not resharded on resume: {r}"); sys.exit(0)
for kv in want:
    k, v = kv.split("=")
    got = s.get("layout", {}).get(k[3:]) if k.startswith("to.") else r.get("from", {}).get(k)
    if str(got) != v: print(f"{path}: {k} is {got}, want {v} (from {r.get('from')}, layout {s.get('layout')})")
PY
}
