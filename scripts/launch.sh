#!/usr/bin/env bash
# kiln on one machine with several ranks, through Open MPI's mpirun:
#
#   scripts/launch.sh NP CONFIG.yaml [./train arguments ...]
#   scripts/launch.sh 4 configs/tiny.yaml --set parallel.dp=4
#
# Each rank gets its share of the cores (run.threads defaults to all cores, so
# OMP_NUM_THREADS is set to cores / NP unless already set). If one rank dies,
# mpirun ends the whole job within a couple of seconds and names the rank; a
# rank that hangs is ended by kiln's own deadline (parallel.timeout_s).
# Several machines: use Slurm (scripts/train.sbatch), or mpirun with a
# --hostfile and the same arguments.
set -eu
NP=${1:?usage: scripts/launch.sh NP CONFIG.yaml [./train arguments ...]}
shift
cd "$(dirname "$0")/.."
command -v mpirun >/dev/null 2>&1 || { echo "launch.sh: mpirun not found: make deps installs openmpi-bin" >&2; exit 2; }
[ -x ./train ] || { echo "launch.sh: ./train not built: run make" >&2; exit 2; }
CORES=$(nproc)
THREADS=${OMP_NUM_THREADS:-$(( CORES / NP > 0 ? CORES / NP : 1 ))}
ROOT=()
[ "$(id -u)" = 0 ] && ROOT=(--allow-run-as-root)
OVER=()
[ "$NP" -gt "$CORES" ] && OVER=(--oversubscribe)
# --bind-to none: kiln's OpenMP threads spread over the rank's share of cores
# themselves; Open MPI's default binding to one core would serialise them.
exec mpirun "${ROOT[@]}" "${OVER[@]}" --bind-to none -np "$NP" -x OMP_NUM_THREADS="$THREADS" \
    ${KILN_COMM_TIMEOUT_S:+-x KILN_COMM_TIMEOUT_S} ./train "$@"
