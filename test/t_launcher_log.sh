#!/usr/bin/env bash
# metrics.progress under launchers: Open MPI hands ranks a pseudo-terminal, so
# a 2-rank `mpirun ... > log` once wrote the live bar (carriage returns,
# ESC[K) into the log. With `auto` (the default) the log holds plain lines
# only; `bar` forces the bar; on a real terminal (script(1)) `auto` draws it
# and `lines` does not. Prints one line per check.
set -u
cd "$(dirname "$0")/.."
T=${KILN_TEST_TMP:-$(mktemp -d)}/t_launcher_log
rm -rf "$T" && mkdir -p "$T"
. test/lib.sh
. test/track_lib.sh

small_corpus "$T/data"
track_config "$T/l.yaml" l
CR=$'\r' ESCK=$'\033[K'
if have_mpi; then
    "${MPIRUN[@]}" -np 2 ./train "$T/l.yaml" --set metrics.log_every=4 >"$T/mpi.log" 2>&1
    rc=$?
    # 12 steps, a line every 4 and at the evaluation of step 6: 4 step lines
    if [ $rc -eq 0 ] && ! grep -q "$CR" "$T/mpi.log" && ! grep -qF "$ESCK" "$T/mpi.log" \
        && [ "$(grep -c '^step' "$T/mpi.log")" -eq 4 ]; then
        ok launcher_log_mpirun_plain_lines
    else fail launcher_log_mpirun_plain_lines "exit $rc: $(head -c 300 "$T/mpi.log" | cat -v)"; fi
    "${MPIRUN[@]}" -np 2 ./train "$T/l.yaml" --set run.dir="$T/bar" --set metrics.progress=bar >"$T/bar.log" 2>&1
    if grep -qF "$CR$ESCK[#" "$T/bar.log"; then ok launcher_log_progress_bar_forced
    else fail launcher_log_progress_bar_forced "no bar in: $(head -c 300 "$T/bar.log" | cat -v)"; fi
else
    skip launcher_log_mpirun_plain_lines "no MPI build or mpirun"
    skip launcher_log_progress_bar_forced "no MPI build or mpirun"
fi
if command -v script >/dev/null 2>&1; then
    script -qec "./train '$T/l.yaml' --set run.dir='$T/tty' --set metrics.log_every=100" "$T/tty.txt" >/dev/null 2>&1
    script -qec "./train '$T/l.yaml' --set run.dir='$T/ttyl' --set metrics.log_every=100 --set metrics.progress=lines" \
        "$T/ttyl.txt" >/dev/null 2>&1
    if grep -qF "$CR$ESCK[#" "$T/tty.txt" && ! grep -qF "$ESCK" "$T/ttyl.txt" && grep -q 'step 12/12' "$T/ttyl.txt"; then
        ok launcher_log_terminal_auto_and_lines
    else fail launcher_log_terminal_auto_and_lines "$(head -c 200 "$T/ttyl.txt" | cat -v)"; fi
else skip launcher_log_terminal_auto_and_lines "no script(1)"; fi
expect launcher_log_progress_bad_value 2 "key 'metrics.progress': expected one of auto, bar, lines, got 'live'" -- \
    ./train "$T/l.yaml" --set metrics.progress=live
