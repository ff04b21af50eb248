#!/usr/bin/env bash
# Stop the cluster test/slurm/up.sh started under BASE (default as up.sh):
# cancel its jobs, stop slurmd(s), slurmctld and (only if up.sh started it)
# munged by the pids in their pid files, never by name; then wipe BASE.
set -u
B=${1:-${KILN_SLURM_DIR:-${KILN_TEST_TMP:-/tmp}/kiln-slurm}}
[ -d "$B" ] || exit 0
export SLURM_CONF=$B/slurm.conf
if [ -f "$B/slurmctld.pid" ] && [ -f "$SLURM_CONF" ]; then
    scancel --full --quiet --user="$(id -un)" 2>/dev/null || true
    for _ in $(seq 50); do [ -z "$(squeue -h 2>/dev/null)" ] && break; sleep 0.2; done
fi
stop() { # pid file: TERM, up to 10 s, then KILL
    local f=$1 pid
    [ -f "$f" ] || return 0
    pid=$(cat "$f" 2>/dev/null)
    [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null || return 0
    kill -TERM "$pid" 2>/dev/null
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null
}
for f in "$B"/slurmd-*.pid; do [ -e "$f" ] && stop "$f"; done
stop "$B/slurmctld.pid"
stop "$B/munged.pid"
rm -rf "$B"
