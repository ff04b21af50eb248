#!/usr/bin/env bash
# metrics.mlflow: the MLflow file store kiln writes, read back by MLflow's own
# client (mlflow-skinny, pinned, in .venv-track: scripts/setup_track.sh). A run
# killed with kill -9 mid-way and resumed stays one MLflow run whose metric
# history holds each step once, equal to metrics.jsonl; params are the
# resolved config's keys; tags and artifacts; a second run and a 2-rank run
# in the same experiment; a run stopped by SIGTERM is KILLED; bad values (a
# run id in mlflow.json leading out of the store among them)
# exit with one line. Prints one line per check.
set -u
cd "$(dirname "$0")/.."
T=${KILN_TEST_TMP:-$(mktemp -d)}/t_mlflow
rm -rf "$T" && mkdir -p "$T"
. test/lib.sh
. test/track_lib.sh

small_corpus "$T/data"
track_config "$T/a.yaml" a
ML="--set metrics.mlflow=$T/mlruns --set metrics.mlflow_experiment=kiln-test"

# a: killed (-9) while it waits after step 6 (checkpoint at 4), then resumed
KILN_TEST_PAUSE_AT_STEP=6 ./train "$T/a.yaml" $ML >"$T/a1.txt" 2>&1 &
pid=$!
wait_step "$T/a/metrics.jsonl" 6
kill -9 $pid 2>/dev/null
wait $pid 2>/dev/null
./train "$T/a.yaml" $ML --resume auto >"$T/a2.txt" 2>&1
rc=$?
if [ $rc -eq 0 ] && grep -q 'resumed from .*step_00000004' "$T/a2.txt" && [ "$(wc -l < "$T/a/metrics.jsonl")" -eq 12 ]; then
    ok mlflow_run_killed_and_resumed
else fail mlflow_run_killed_and_resumed "exit $rc: $(tail -n 2 "$T/a2.txt")"; fi
# b: a second run, another learning rate, in the same experiment
./train "$T/a.yaml" $ML --set run.name=b --set run.dir="$T/b" --set optim.lr=3e-3 >"$T/b.txt" 2>&1 \
    || fail mlflow_second_run "$(tail -n 2 "$T/b.txt")"
# c: two ranks; only rank 0 files the run
if have_mpi; then
    "${MPIRUN[@]}" -np 2 ./train "$T/a.yaml" $ML --set run.name=c --set run.dir="$T/c" >"$T/c.txt" 2>&1 \
        || fail mlflow_two_ranks "$(tail -n 3 "$T/c.txt")"
fi
# d: stopped by SIGTERM after step 3 (exit 75): the MLflow run is KILLED
KILN_TEST_PAUSE_AT_STEP=3 ./train "$T/a.yaml" $ML --set run.name=d --set run.dir="$T/d" >"$T/d.txt" 2>&1 &
pid=$!
wait_step "$T/d/metrics.jsonl" 3
kill -TERM $pid
wait $pid
rc=$?
[ $rc -eq 75 ] || fail mlflow_sigterm_run "exit $rc, wanted 75: $(tail -n 2 "$T/d.txt")"

track_python mlflow_client_reads_store || exit 0
export MLFLOW_ALLOW_FILE_STORE=true # mlflow 3.x reads file stores only when asked (docs/metrics.md)
MPI=0; have_mpi && MPI=1
"$PY" - "$T" "$MPI" >"$T/check.txt" 2>&1 <<'EOF'
import json, math, os, sys, warnings, yaml
warnings.filterwarnings("ignore")
from mlflow.tracking import MlflowClient
T, mpi = sys.argv[1], sys.argv[2] == "1"
client = MlflowClient(tracking_uri="file://" + os.path.abspath(T + "/mlruns"))
def check(name, cond, why=""):
    print(("ok " if cond else "FAIL ") + name + ("" if cond else ": " + str(why)))
exp = client.get_experiment_by_name("kiln-test")
check("mlflow_experiment_by_name", exp is not None and exp.lifecycle_stage == "active", exp)
runs = {r.data.tags.get("kiln.run_dir"): r for r in client.search_runs([exp.experiment_id])}
want = {os.path.realpath(T + "/" + n) for n in ("a", "b", "d") + (("c",) if mpi else ())}
check("mlflow_one_run_per_run_dir", set(runs) == want, sorted(runs))
a = runs.get(os.path.realpath(T + "/a"))
if a is None: sys.exit(0)
rid = a.info.run_id
check("mlflow_run_status_finished", a.info.status == "FINISHED" and a.info.run_name == "a"
      and a.info.end_time >= a.info.start_time, (a.info.status, a.info.run_name))
saved = json.load(open(T + "/a/mlflow.json"))
check("mlflow_run_id_remembered", saved["run_id"] == rid and saved["experiment_id"] == exp.experiment_id, saved)

# metrics: each step once after the kill and resume, equal to metrics.jsonl
# (jsonl holds 6 significant digits, MLflow the full double: rel 1e-5)
rows = [json.loads(l) for l in open(T + "/a/metrics.jsonl")]
bad = []
for key in ("loss", "val_loss", "lr", "grad_norm", "tok_per_s", "mfu", "step_time_s"):
    hist = client.get_metric_history(rid, key)
    got = {}
    for m in hist:
        if m.step in got: bad.append((key, "step twice", m.step))
        got[m.step] = m.value
    want = {r["step"]: r[key] for r in rows if r.get(key) is not None}
    if sorted(got) != sorted(want): bad.append((key, sorted(got), sorted(want)))
    else: bad += [(key, s, got[s], want[s]) for s in want if not math.isclose(got[s], want[s], rel_tol=1e-5)]
check("mlflow_metrics_match_jsonl", not bad and len(client.get_metric_history(rid, "loss")) == 12, bad[:4])
check("mlflow_val_loss_at_evaluations", sorted(m.step for m in client.get_metric_history(rid, "val_loss")) == [6, 12])

# params: every key of the resolved config.yaml, flattened, same value
def flat(d, pre=""):
    for k, v in d.items():
        if isinstance(v, dict): yield from flat(v, pre + k + ".")
        else: yield pre + k, v
cfg = dict(flat(yaml.safe_load(open(T + "/a/config.yaml"))))
p = a.data.params
diff = [(k, v, p.get(k)) for k, v in cfg.items()
        if k not in p or (p[k] != v if isinstance(v, str) else yaml.safe_load(p[k]) != v)]
check("mlflow_params_are_config_keys", not diff and set(p) == set(cfg), (diff[:4], set(p) ^ set(cfg)))
check("mlflow_params_values", p["optim.lr"] == "0.0006" and p["batch.total_tokens"] == "512" and p["run.name"] == "a", p.get("optim.lr"))
b = runs.get(os.path.realpath(T + "/b"))
check("mlflow_second_run_params", b is not None and b.data.params["optim.lr"] == "0.003" and b.info.run_id != rid
      and b.info.status == "FINISHED")

t = a.data.tags
check("mlflow_tags", t.get("mlflow.runName") == "a" and t.get("kiln.resumed_from_step") == "4" and t.get("kiln.exit_code") == "0"
      and t.get("mlflow.source.git.commit") and t.get("mlflow.source.type") == "LOCAL", t)
arts = sorted(x.path for x in client.list_artifacts(rid))
check("mlflow_artifacts_listed", arts == ["config.yaml", "report.html", "summary.json"], arts)
local = client.download_artifacts(rid, "config.yaml", T + "/dl")
check("mlflow_artifact_config_is_resolved_config", open(local).read() == open(T + "/a/config.yaml").read())
summ = json.load(open(client.download_artifacts(rid, "summary.json", T + "/dl")))
check("mlflow_artifact_summary", summ["status"] == "completed" and summ["steps"] == 12 and summ["mlflow"]["run_id"] == rid, summ)

if mpi:
    c = runs.get(os.path.realpath(T + "/c"))
    steps = sorted(m.step for m in client.get_metric_history(c.info.run_id, "loss")) if c else []
    check("mlflow_two_ranks_one_run", c is not None and c.info.status == "FINISHED" and steps == list(range(1, 13)), steps)
d = runs.get(os.path.realpath(T + "/d"))
check("mlflow_sigterm_run_killed", d is not None and d.info.status == "KILLED" and d.data.tags.get("kiln.exit_code") == "75",
      d and (d.info.status, d.data.tags.get("kiln.exit_code")))
EOF
rc=$?
grep -E '^(ok|FAIL|skip) ' "$T/check.txt"
if [ $rc -ne 0 ]; then fail mlflow_client_reads_store "python exited $rc: $(grep -v '^ok ' "$T/check.txt" | tail -n 4 | tr '\n' ' ')"; fi
[ "$MPI" = 1 ] || skip mlflow_two_ranks_one_run "no MPI build or mpirun"

# bad values: one line each, naming what is wrong
touch "$T/afile"
expect mlflow_store_not_a_directory 1 "metrics.mlflow: $T/afile.*cannot create directory" -- \
    ./train "$T/a.yaml" --set run.dir="$T/e" --set metrics.mlflow="$T/afile"
expect mlflow_experiment_empty 2 "key 'metrics.mlflow_experiment': expected an experiment name" -- \
    ./train "$T/a.yaml" --set run.dir="$T/e" --set metrics.mlflow="$T/mlruns" --set 'metrics.mlflow_experiment=""'
expect mlflow_key_typo 2 "did you mean 'metrics.mlflow'" -- ./train "$T/a.yaml" --set metrics.mlfow=x
# a resume whose RUN_DIR/mlflow.json names a run outside the store (run_id
# ../../escaped, where a meta.yaml waits): refused, nothing written there
mkdir -p "$T/escaped" && printf 'start_time: 1\n' > "$T/escaped/meta.yaml"
sed -i -E 's/"run_id":"[^"]*"/"run_id":"..\/..\/escaped"/' "$T/d/mlflow.json"
expect mlflow_run_id_outside_store 2 "mlflow.json: key 'run_id': expected an MLflow id .*got '../../escaped'" -- \
    ./train "$T/a.yaml" $ML --set run.name=d --set run.dir="$T/d" --resume auto
[ "$(ls -A "$T/escaped")" = meta.yaml ] || fail mlflow_run_id_outside_store_untouched "$(ls -A "$T/escaped" | tr '\n' ' ')"
