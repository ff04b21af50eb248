#!/usr/bin/env bash
# metrics.mlflow: http://HOST:PORT — kiln against a real MLflow tracking
# server (`mlflow server`, sqlite store, artifact proxy; the full mlflow
# package, pinned in .venv-track by scripts/setup_track.sh), read back by
# MLflow's own client: every step's metrics equal metrics.jsonl (as written
# there, 6 digits) and are there once, params are the resolved config, tags,
# artifacts, FINISHED. The server killed at step 4 and started again at step
# 12 (KILN_TEST_GATE holds the run at those steps, so nothing races): the run
# never stops, and every point reaches the server once, with every batch sent
# twice (KILN_TEST_MLFLOW_RESEND: a reply lost after the server wrote it).
# kill -9 and a resume: the same MLflow run, no step twice. A server that
# never answers: the run ends on time, the points stay in the spool, a resume
# sends them. A 401 gets one line (exit 2), or no tracking when not
# required; bad URLs; no secret in any file of the run directories.
set -u
cd "$(dirname "$0")/.."
T=${KILN_TEST_TMP:-$(mktemp -d)}/t_mlflow_rest
rm -rf "$T" && mkdir -p "$T"
. test/lib.sh
. test/track_lib.sh

if ! ldd ./train | grep -q libcurl; then
    expect mlflow_rest_needs_curl 2 "built without libcurl" -- ./train configs/tiny.yaml --set metrics.mlflow=http://127.0.0.1:1
    skip mlflow_rest_server "./train built without libcurl (make deps installs libcurl4-openssl-dev)"
    exit 0
fi
# bad values first: they need no server
expect mlflow_rest_unknown_scheme 2 "key 'metrics.mlflow': unknown scheme 'ftp://'" -- \
    ./train configs/tiny.yaml --set metrics.mlflow=ftp://host:1
expect mlflow_rest_bad_port 2 "key 'metrics.mlflow': 'http://host:99999' is not a tracking server URL" -- \
    ./train configs/tiny.yaml --set metrics.mlflow=http://host:99999
expect mlflow_rest_no_host 2 "is not a tracking server URL" -- ./train configs/tiny.yaml --set metrics.mlflow=http://:5000
if expect mlflow_rest_password_in_url 2 "set MLFLOW_TRACKING_USERNAME" -- \
    ./train configs/tiny.yaml --set metrics.mlflow=https://me:hunter2@host:5000; then
    grep -q hunter2 "$T/err.txt" && fail mlflow_rest_password_not_echoed "$(cat "$T/err.txt")"
fi

track_python mlflow_rest_server || exit 0
if ! "$PY" -c 'import sqlalchemy, alembic, mlflow.server' 2>/dev/null; then
    fail mlflow_rest_server "$PY has no MLflow server (the full mlflow package: scripts/setup_track.sh)"
    exit 0
fi
small_corpus "$T/data"
track_config "$T/a.yaml" a
port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
PORT=$(port)
URL=http://127.0.0.1:$PORT
SRV=
# server_start: `mlflow server` in its own process group (it starts uvicorn
# workers), then its /health polled until it answers (90 s at most).
server_start() {
    setsid "$PY" -m mlflow server --backend-store-uri "sqlite:///$T/mlflow.db" --artifacts-destination "$T/artifacts" \
        --host 127.0.0.1 --port "$PORT" --workers 1 >>"$T/server.log" 2>&1 &
    SRV=$!
    "$PY" - "$URL/health" <<'EOF'
import sys, time, urllib.request
for _ in range(900):
    try:
        if urllib.request.urlopen(sys.argv[1], timeout=2).status == 200: sys.exit(0)
    except Exception: time.sleep(0.1)
sys.exit(1)
EOF
}
server_stop() { [ -n "$SRV" ] && kill -9 -- -"$SRV" 2>/dev/null; wait "$SRV" 2>/dev/null; SRV=; }
trap server_stop EXIT
if ! server_start; then fail mlflow_rest_server "mlflow server did not answer on $URL/health: $(tail -n 3 "$T/server.log")"; exit 0; fi
ok mlflow_rest_server_started
SECRET=kiln-test-secret-7d1c93
export MLFLOW_TRACKING_TOKEN=$SECRET
ML="--set metrics.mlflow=$URL --set metrics.mlflow_experiment=kiln-rest"

# a: killed (-9) while it waits after step 6 (checkpoint at 4), once the
# server has step 6; resumed: the same MLflow run, steps 5 and 6 not twice
wait_server_step() { # RUN_DIR STEP: until the server's loss history of the run reaches STEP
    "$PY" - "$URL" "$1" "$2" <<'EOF'
import json, sys, time, warnings
warnings.filterwarnings("ignore")
from mlflow.tracking import MlflowClient
c = MlflowClient(tracking_uri=sys.argv[1])
for _ in range(600):
    try:
        rid = json.load(open(sys.argv[2] + "/mlflow.json"))["run_id"]
        if max([m.step for m in c.get_metric_history(rid, "loss")] or [0]) >= int(sys.argv[3]): sys.exit(0)
    except Exception: pass
    time.sleep(0.1)
sys.exit(1)
EOF
}
KILN_TEST_PAUSE_AT_STEP=6 ./train "$T/a.yaml" $ML >"$T/a1.txt" 2>&1 &
pid=$!
wait_step "$T/a/metrics.jsonl" 6 && wait_server_step "$T/a" 6 || fail mlflow_rest_first_part "$(tail -n 3 "$T/a1.txt")"
kill -9 $pid 2>/dev/null
wait $pid 2>/dev/null
./train "$T/a.yaml" $ML --resume auto >"$T/a2.txt" 2>&1
rc=$?
[ $rc -eq 0 ] && grep -q 'resumed from .*step_00000004' "$T/a2.txt" || fail mlflow_rest_resume "exit $rc: $(tail -n 2 "$T/a2.txt")"

# b: 20 steps; the server killed at step 4 and started again at step 12
sed -e 's/steps: 12, eval_every: 6/steps: 20, eval_every: 10/' -e "s|name: a, dir: \"$T/a\"|name: b, dir: \"$T/b\"|" \
    "$T/a.yaml" > "$T/b.yaml"
KILN_TEST_MLFLOW_RESEND=1 KILN_TEST_GATE="4:$T/gate4,12:$T/gate12" ./train "$T/b.yaml" $ML >"$T/b.txt" 2>&1 &
pid=$!
wait_step "$T/b/metrics.jsonl" 4
server_stop
touch "$T/gate4"
wait_step "$T/b/metrics.jsonl" 12
behind=$(jget "$T/b/heartbeat/rank0.json" "d['mlflow_pending']")
./train status "$T/b" >"$T/status_down.txt" 2>&1
server_start || fail mlflow_rest_server_restart "$(tail -n 3 "$T/server.log")"
touch "$T/gate12"
wait $pid
rc=$?
if [ $rc -eq 0 ] && [ "$(wc -l < "$T/b/metrics.jsonl")" -eq 20 ] && [ "${behind:-0}" -gt 0 ] \
    && grep -q "points not on the tracking server now" "$T/status_down.txt"; then
    ok mlflow_rest_run_goes_on_while_server_down
else fail mlflow_rest_run_goes_on_while_server_down "exit $rc, $behind behind at step 12: $(tail -n 2 "$T/b.txt") $(cat "$T/status_down.txt")"; fi
grep -q "mlflow .* behind" "$T/b.txt" && ok mlflow_rest_progress_says_behind || fail mlflow_rest_progress_says_behind "$(grep '^step' "$T/b.txt" | tail -n 2)"
./train status "$T/b" >"$T/status_b.txt" 2>&1
grep -q "every point on the tracking server at the end" "$T/status_b.txt" && [ ! -s "$T/b/mlflow-spool.jsonl" ] \
    && ok mlflow_rest_status_all_sent || fail mlflow_rest_status_all_sent "$(grep mlflow "$T/status_b.txt")"

# c: the server never answers (a port nobody listens on), flush_s 1: the
# run ends, its points stay in the spool; stopped at step 6 (exit 75), a
# resume on the real server sends them, into one MLflow run
DEAD=http://127.0.0.1:$(port)
sed -e "s|name: a, dir: \"$T/a\"|name: c, dir: \"$T/c\"|" "$T/a.yaml" > "$T/c.yaml"
KILN_TEST_PAUSE_AT_STEP=6 ./train "$T/c.yaml" $ML --set metrics.mlflow=$DEAD --set metrics.mlflow_flush_s=1 >"$T/c1.txt" 2>&1 &
pid=$!
wait_step "$T/c/metrics.jsonl" 6
kill -TERM $pid
wait $pid
rc=$?
left=$(jget "$T/c/summary.json" "d['mlflow']['unsent']")
if [ $rc -eq 75 ] && [ "${left:-0}" -gt 0 ] && [ "$(wc -l < "$T/c/mlflow-spool.jsonl")" -eq "$left" ] \
    && grep -q "points stay in .*mlflow-spool.jsonl" "$T/c1.txt"; then ok mlflow_rest_dead_server_spools
else fail mlflow_rest_dead_server_spools "exit $rc, unsent $left: $(tail -n 2 "$T/c1.txt")"; fi
./train "$T/c.yaml" $ML --resume auto >"$T/c2.txt" 2>&1 || fail mlflow_rest_spool_resume "$(tail -n 2 "$T/c2.txt")"

# d: killed (-9) at step 6 (checkpoint at 4) with every point still in the
# queue (KILN_TEST_MLFLOW_HOLD: the sender takes none, as when the server is
# slow and the kill comes first): the resume sends steps 1 to 4 from
# metrics.jsonl (the server has none of them, the spool is empty) and runs
# 5 to 12 again: every step once
sed -e "s|name: a, dir: \"$T/a\"|name: d, dir: \"$T/d\"|" "$T/a.yaml" > "$T/d.yaml"
KILN_TEST_MLFLOW_HOLD=1 KILN_TEST_PAUSE_AT_STEP=6 ./train "$T/d.yaml" $ML >"$T/d1.txt" 2>&1 &
pid=$!
wait_step "$T/d/metrics.jsonl" 6 || fail mlflow_rest_hold_first_part "$(tail -n 3 "$T/d1.txt")"
kill -9 $pid 2>/dev/null
wait $pid 2>/dev/null
./train "$T/d.yaml" $ML --resume auto >"$T/d2.txt" 2>&1
rc=$?
[ $rc -eq 0 ] && grep -q "points of steps up to 4 were in metrics.jsonl but not on" "$T/d2.txt" \
    && ok mlflow_rest_resume_sends_lost_queue || fail mlflow_rest_resume_sends_lost_queue "exit $rc: $(grep -m2 'mlflow\|error' "$T/d2.txt")"

# what the server holds, read by MLflow's client
"$PY" - "$T" "$URL" >"$T/check.txt" 2>&1 <<'EOF'
import json, os, sys, warnings, yaml
warnings.filterwarnings("ignore")
from mlflow.tracking import MlflowClient
T, url = sys.argv[1], sys.argv[2]
c = MlflowClient(tracking_uri=url)
def check(name, cond, why=""):
    print(("ok " if cond else "FAIL ") + name + ("" if cond else ": " + str(why)[:400]))
exp = c.get_experiment_by_name("kiln-rest")
runs = {r.data.tags.get("kiln.run_dir"): r for r in c.search_runs([exp.experiment_id])}
check("mlflow_rest_one_run_per_run_dir", set(runs) == {os.path.realpath(T + "/" + n) for n in "abcd"}, sorted(runs))
TIMED = ("tok_per_s", "mfu", "step_time_s", "peak_rss_mib")
KEYS = ("loss", "val_loss", "lr", "grad_norm", "tok_per_s", "mfu", "step_time_s", "peak_rss_mib", "nonfinite_skipped")
def history_matches(name):
    run = runs.get(os.path.realpath(T + "/" + name))
    if run is None: return ["no run"]
    rows = [json.loads(l) for l in open(T + "/" + name + "/metrics.jsonl")]
    bad = []
    for key in KEYS:
        got = {}
        for m in c.get_metric_history(run.info.run_id, key):
            if m.step in got: bad.append((key, "step twice", m.step))
            got[m.step] = m.value
        want = {r["step"]: r[key] for r in rows if r.get(key) is not None}
        if sorted(got) != sorted(want): bad.append((key, sorted(got), sorted(want)))
        # metrics.jsonl writes %.6g of the double MLflow holds whole: the same number, as written there
        # (a's steps 5 and 6 keep the timings the killed process sent: the resume's are new measurements)
        else: bad += [(key, s, got[s], want[s]) for s in want if float("%.6g" % got[s]) != want[s]
                      and not (name == "a" and s in (5, 6) and key in TIMED)]
    return bad
for name, why in (("a", "killed_and_resumed"), ("b", "server_killed_and_restarted"), ("c", "spool_sent_by_resume"),
                  ("d", "queue_lost_by_kill_sent_by_resume")):
    bad = history_matches(name)
    check("mlflow_rest_history_" + why, not bad, bad[:4])
a = runs.get(os.path.realpath(T + "/a"))
if a is None: sys.exit(0)
rid = a.info.run_id
check("mlflow_rest_status_finished", all(r.info.status == "FINISHED" for r in runs.values()),
      [(k, r.info.status) for k, r in runs.items()])
check("mlflow_rest_resume_same_run", json.load(open(T + "/a/mlflow.json"))["run_id"] == rid
      and a.data.tags.get("kiln.resumed_from_step") == "4", a.data.tags)
def flat(d, pre=""):
    for k, v in d.items():
        if isinstance(v, dict): yield from flat(v, pre + k + ".")
        else: yield pre + k, v
cfg = dict(flat(yaml.safe_load(open(T + "/a/config.yaml"))))
p = a.data.params
diff = [(k, v, p.get(k)) for k, v in cfg.items()
        if k not in p or (p[k] != v if isinstance(v, str) else yaml.safe_load(p[k]) != v)]
check("mlflow_rest_params_are_config", not diff and set(p) == set(cfg), (diff[:4], set(p) ^ set(cfg)))
t = a.data.tags
check("mlflow_rest_tags", t.get("mlflow.runName") == "a" and t.get("kiln.exit_code") == "0" and t.get("mlflow.source.type") == "LOCAL"
      and t.get("mlflow.source.git.commit") and t.get("kiln.run_dir") == os.path.realpath(T + "/a"), t)
arts = sorted(x.path for x in c.list_artifacts(rid))
check("mlflow_rest_artifacts", arts == ["config.yaml", "report.html", "summary.json"], arts)
got = open(c.download_artifacts(rid, "config.yaml", T + "/dl")).read()
check("mlflow_rest_artifact_config", got == open(T + "/a/config.yaml").read())
EOF
rc=$?
grep -E '^(ok|FAIL|skip) ' "$T/check.txt"
[ $rc -eq 0 ] || fail mlflow_rest_client_reads_server "python exited $rc: $(grep -v '^ok ' "$T/check.txt" | tail -n 4 | tr '\n' ' ')"

# a server that refuses: one line naming its answer, exit 2; or, not
# required, a run without tracking
"$PY" - "$T/p401" <<'EOF' &
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def refuse(self):
        body = b'{"error_code": "UNAUTHENTICATED", "message": "invalid token"}'
        self.send_response(401); self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body))); self.end_headers(); self.wfile.write(body)
    do_GET = do_POST = refuse
    def log_message(self, *a): pass
s = http.server.HTTPServer(("127.0.0.1", 0), H)
open(sys.argv[1] + ".tmp", "w").write(str(s.server_address[1])); __import__("os").rename(sys.argv[1] + ".tmp", sys.argv[1])
s.serve_forever()
EOF
p401=$!
for _ in $(seq 600); do [ -s "$T/p401" ] && break; sleep 0.05; done
U401=http://127.0.0.1:$(cat "$T/p401")
expect mlflow_rest_wrong_token 2 "metrics.mlflow: $U401 refused the run: HTTP 401 UNAUTHENTICATED: invalid token" -- \
    ./train "$T/a.yaml" --set run.dir="$T/d" --set metrics.mlflow=$U401
[ "$(grep -c 'kiln: error' "$T/err.txt")" -eq 1 ] || fail mlflow_rest_wrong_token_one_line "$(cat "$T/err.txt")"
if ./train "$T/a.yaml" --set run.dir="$T/e" --set metrics.mlflow=$U401 --set metrics.mlflow_required=false >"$T/e.txt" 2>&1 \
    && grep -q "mlflow_required is false: this run is not tracked" "$T/e.txt" && [ "$(wc -l < "$T/e/metrics.jsonl")" -eq 12 ]; then
    ok mlflow_rest_not_required_goes_on
else fail mlflow_rest_not_required_goes_on "$(tail -n 2 "$T/e.txt")"; fi
kill $p401 2>/dev/null; wait $p401 2>/dev/null
# the token never written: not in the run directories, their logs or checkpoints
hits=$(grep -rl -- "$SECRET" "$T/a" "$T/b" "$T/c" "$T/d" "$T/e" 2>/dev/null | head -n 3)
[ -z "$hits" ] && ok mlflow_rest_secret_in_no_file || fail mlflow_rest_secret_in_no_file "$hits"
exit 0
