#!/usr/bin/env bash
# Make .venv-track (or $KILN_TRACK_VENV): a venv with the tools' own readers
# of what kiln writes, pinned: MLflow (the full package: its client, and the
# tracking server t_mlflow_rest starts) and prometheus_client (t_mlflow,
# t_mlflow_rest, t_prometheus), TensorBoard's event reader
# (t_metrics, t_arch_train, t_data_mix, t_straggler), tiktoken (the GPT-2
# encoder's reference, t_tokenizer_tiktoken) and Pillow (the report's
# screenshot, t_report). Run by `make test` before the suite, so no check
# skips for a package a fresh machine lacks (test/run.sh fails such a skip
# under CI=true), and by those tests when the venv is missing. Idempotent and
# quiet once made.
# Exit 0: ready; 3: the package index cannot be reached (the checks skip);
# 1: anything else (the checks fail: a broken pin must not pass as a skip).
set -u
cd "$(dirname "$0")/.."
venv=${KILN_TRACK_VENV:-.venv-track}
pins="mlflow==3.17.2 prometheus_client==0.26.0 tensorboard==2.21.0 tiktoken==0.14.0 pillow==13.0.0"
ready() {
    "$venv/bin/python" -c 'import mlflow, mlflow.server, sqlalchemy, alembic, prometheus_client.parser, tiktoken, PIL
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
assert mlflow.__version__ == "3.17.2", mlflow.__version__' 2>/dev/null
}
[ -x "$venv/bin/python" ] && ready && exit 0
# one installer at a time: test files run side by side (test/run.sh) and may
# each find the venv missing
exec 9>"$venv.lock"
flock 9
[ -x "$venv/bin/python" ] && ready && exit 0
py=/usr/bin/python3
[ -x "$py" ] || py=$(command -v python3)
if [ ! -x "$venv/bin/python" ]; then
    "$py" -m venv "$venv" 2>/dev/null || { echo "setup_track: $py -m venv $venv failed (apt-get install python3-venv)" >&2; exit 1; }
fi
if ! timeout 900 "$venv/bin/pip" install -q --disable-pip-version-check $pins >"$venv/pip.log" 2>&1; then
    # reachable at all? pip's own index, so no host is written down here
    if ! timeout 120 "$venv/bin/pip" download -q --no-deps --disable-pip-version-check -d "$venv/probe" \
        prometheus_client==0.26.0 >/dev/null 2>&1; then
        echo "setup_track: the package index cannot be reached: the reader checks (MLflow, Prometheus, TensorBoard, tiktoken, Pillow) will skip" >&2
        exit 3
    fi
    echo "setup_track: pip install $pins failed: $(tail -n 3 "$venv/pip.log" | tr '\n' ' ')" >&2
    exit 1
fi
ready || { echo "setup_track: $venv lacks one of $pins after install" >&2; exit 1; }
echo "setup_track: $venv ready ($pins)"
