#!/usr/bin/env bash
# Bring up a real, private Slurm cluster on this machine for the tests:
# munge, slurmctld and NODES slurmd "nodes" (n1, n2, ...; each in its own UTS
# namespace with its own hostname, port and TmpFS), everything under one base
# directory. Prints the base directory; `source BASE/env` points the Slurm
# commands at this cluster. test/slurm/down.sh BASE stops it by pid and wipes
# it. Facts behind every setting: shared/notes/local-slurm-and-mpi.md.
#
#   test/slurm/up.sh [NODES]      NODES = 1 or 2 (default 2)
# Environment: KILN_SLURM_DIR (base; default $KILN_TEST_TMP/kiln-slurm or
# /tmp/kiln-slurm), KILN_SLURM_PORT (slurmctld port, default 16817; nodes use
# the next ones), KILN_SLURM_CPUS (CPUs each node claims, default 4).
set -euo pipefail
NODES=${1:-2}
B=${KILN_SLURM_DIR:-${KILN_TEST_TMP:-/tmp}/kiln-slurm}
PORT=${KILN_SLURM_PORT:-16817}
CPUS=${KILN_SLURM_CPUS:-4}
die() { echo "up.sh: $*" >&2; exit 1; }
for c in slurmctld slurmd scontrol sinfo munged unshare; do
    command -v $c >/dev/null 2>&1 || die "$c not found (make deps installs slurmctld slurmd slurm-client munge)"
done
[ "$(id -u)" = 0 ] || die "needs root (the daemons run as root here)"
[ -e "$B/slurmctld.pid" ] && die "$B already holds a cluster: test/slurm/down.sh $B first"
rm -rf "$B"
mkdir -p "$B"/{state,log,spool,tmp}
B=$(cd "$B" && pwd) # absolute: a relative path fails once a daemon forks

# munge: reuse a running one, else start ours and remember it for down.sh.
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    if [ ! -f /etc/munge/munge.key ]; then mungekey --create --keyfile=/etc/munge/munge.key; fi
    chown munge:munge /etc/munge/munge.key && chmod 0400 /etc/munge/munge.key
    install -d -o munge -g munge /run/munge
    runuser -u munge -- /usr/sbin/munged
    for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
    munge -n | unmunge >/dev/null 2>&1 || die "munged did not start"
    cp /run/munge/munged.pid "$B/munged.pid"
fi

HOST=$(hostname)
MEM=$(( $(free -m | awk '/^Mem:/ {print $7}') / NODES - 512 ))
[ $MEM -gt 256 ] || MEM=256
NODE_LIST=""
{
    echo "ClusterName=kiln"
    echo "SlurmctldHost=$HOST(127.0.0.1)"
    echo "SlurmctldPort=$PORT"
    echo "SlurmUser=root"
    echo "AuthType=auth/munge"
    echo "CredType=cred/munge"
    echo "AuthInfo=cred_expire=30"
    echo "MpiDefault=pmix"
    echo "ProctrackType=proctrack/linuxproc"
    echo "TaskPlugin=task/none"
    echo "JobAcctGatherType=jobacct_gather/none"
    echo "AccountingStorageType=accounting_storage/none"
    echo "SelectType=select/cons_tres"
    echo "SelectTypeParameters=CR_Core"
    echo "SlurmdParameters=config_overrides"
    echo "ReturnToService=2"
    echo "KillWait=10"
    echo "MinJobAge=10"
    echo "StateSaveLocation=$B/state"
    echo "SlurmdSpoolDir=$B/spool/slurmd-%n"
    echo "TmpFS=$B/tmp/%n"
    echo "SlurmctldPidFile=$B/slurmctld.pid"
    echo "SlurmdPidFile=$B/slurmd-%n.pid"
    echo "SlurmctldLogFile=$B/log/slurmctld.log"
    echo "SlurmdLogFile=$B/log/slurmd-%n.log"
    for i in $(seq 1 "$NODES"); do
        echo "NodeName=n$i NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$((PORT + i)) CPUs=$CPUS RealMemory=$MEM State=UNKNOWN"
        NODE_LIST="$NODE_LIST${NODE_LIST:+,}n$i"
        mkdir -p "$B/tmp/n$i" "$B/spool/slurmd-n$i"
    done
    echo "PartitionName=debug Nodes=$NODE_LIST Default=YES MaxTime=INFINITE State=UP"
} >"$B/slurm.conf"
cat >"$B/env" <<ENV
export SLURM_CONF=$B/slurm.conf
ENV
export SLURM_CONF=$B/slurm.conf

slurmctld -f "$B/slurm.conf" || die "slurmctld did not start: $(tail -n 5 "$B/log/slurmctld.log" 2>/dev/null)"
for _ in $(seq 100); do scontrol ping 2>/dev/null | grep -q 'is UP' && break; sleep 0.1; done
scontrol ping 2>/dev/null | grep -q 'is UP' || die "slurmctld not answering: $(tail -n 5 "$B/log/slurmctld.log")"

for i in $(seq 1 "$NODES"); do
    unshare --uts sh -c "hostname n$i && exec slurmd -f '$B/slurm.conf' -N n$i" ||
        die "slurmd n$i did not start: $(tail -n 5 "$B/log/slurmd-n$i.log" 2>/dev/null)"
done
for _ in $(seq 150); do
    idle=$(sinfo -h -N -o '%N %T' 2>/dev/null | grep -c ' idle$' || true)
    [ "$idle" -ge "$NODES" ] && break
    sleep 0.2
done
[ "$idle" -ge "$NODES" ] || die "nodes not idle: $(sinfo -h -N -o '%N %T' | tr '\n' ' ') $(tail -n 3 "$B"/log/slurmd-n1.log)"
echo "$B"
