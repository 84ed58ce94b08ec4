#!/usr/bin/env bash
# Start a single-node Slurm "cluster" on localhost for the test suite.
#
#   slurm/local-cluster/start.sh [STATE_DIR]
#
# STATE_DIR defaults to ${SHARDTRAIN_SLURM_DIR:-/tmp/shardtrain-slurm}.  Every
# config file, key, socket, pid file, log and spool directory lives there; the
# system's /etc/slurm and /etc/munge are never used.  Clients must be pointed at
# the config with SLURM_CONF (printed on success, also in STATE_DIR/env.sh).
#
# Node: NodeName=localhost, 32 CPUs, 256000 MB, 8 fake GPUs
# (gpu:a100:4 = STATE_DIR/dev/nvidia[0-3], gpu:v100:4 = STATE_DIR/dev/nvidia[4-7]),
# partition "debug".  The CPU/memory/GPU figures are declared, not real
# (SlurmdParameters=config_overrides), so realistic sbatch lines schedule on a
# small CI machine.
#
# Idempotent: with the cluster already up it only checks it and prints the env.
# Stale pid files from a crash are cleaned up and the dead daemons restarted.
# Needs root (installs packages, mknod, SlurmUser=root).
#
# Environment knobs:
#   SHARDTRAIN_SLURM_DIR          default STATE_DIR
#   SHARDTRAIN_SLURMCTLD_PORT     default 6817
#   SHARDTRAIN_SLURMD_PORT        default 6818
#   SHARDTRAIN_SLURM_TIMEOUT      seconds to wait for the node to be idle (60)
set -euo pipefail

STATE_DIR="${1:-${SHARDTRAIN_SLURM_DIR:-/tmp/shardtrain-slurm}}"
CTLD_PORT="${SHARDTRAIN_SLURMCTLD_PORT:-6817}"
SLURMD_PORT="${SHARDTRAIN_SLURMD_PORT:-6818}"
TIMEOUT="${SHARDTRAIN_SLURM_TIMEOUT:-60}"
NODE=localhost

# Exit codes: 0 up; 3 the packages are missing and could not be installed
# (tests skip on 3); 1 anything else.
DIE_RC=1
die() {
    # One clear line on stderr, then (optionally) the tail of log files.
    echo "start.sh: ERROR: $1" >&2
    local f
    for f in "${@:2}"; do
        if [[ -s "$f" ]]; then
            echo "----- last lines of $f -----" >&2
            tail -n 25 "$f" >&2
        fi
    done
    exit "$DIE_RC"
}

mkdir -p "$STATE_DIR"
STATE_DIR="$(cd "$STATE_DIR" && pwd -P)"
export SLURM_CONF="$STATE_DIR/slurm.conf"

# Serialise concurrent callers (e.g. several pytest workers).
exec 9>"$STATE_DIR/.start.lock"
flock -w 600 9 || die "timed out waiting for lock $STATE_DIR/.start.lock"

# ---------------------------------------------------------------- packages --
install_packages() {
    local need=0 b
    for b in munged slurmctld slurmd sinfo sbatch srun scontrol squeue scancel; do
        command -v "$b" >/dev/null 2>&1 || need=1
    done
    [[ $need -eq 1 ]] || return 0
    DIE_RC=3
    [[ $EUID -eq 0 ]] || die "munge/slurm not installed and cannot apt-get install them: not root"
    command -v apt-get >/dev/null 2>&1 || die "slurm/munge missing and apt-get not available"
    echo "start.sh: installing munge slurmctld slurmd slurm-client (apt-get) ..." >&2
    local pkgs=(munge slurmctld slurmd slurm-client)
    local log="$STATE_DIR/apt.log" added_policy=0
    # Keep the packages' init scripts from starting system-wide daemons.
    if [[ ! -e /usr/sbin/policy-rc.d ]]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod 755 /usr/sbin/policy-rc.d
        added_policy=1
    fi
    local rc=0
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y --no-install-recommends "${pkgs[@]}" >"$log" 2>&1 || rc=$?
    if [[ $rc -ne 0 ]]; then
        # Usually "Unable to locate package" on a machine with no lists yet.
        rc=0
        { apt-get update && apt-get install -y --no-install-recommends "${pkgs[@]}"; } >>"$log" 2>&1 || rc=$?
    fi
    [[ $added_policy -eq 1 ]] && rm -f /usr/sbin/policy-rc.d
    [[ $rc -eq 0 ]] || die "apt-get install ${pkgs[*]} failed (exit $rc)" "$log"
    for b in munged slurmctld slurmd sinfo sbatch; do
        command -v "$b" >/dev/null 2>&1 || die "$b still missing after apt-get install" "$log"
    done
    DIE_RC=1
}
[[ $EUID -eq 0 ]] || command -v slurmd >/dev/null 2>&1 || DIE_RC=3
[[ $EUID -eq 0 ]] || die "must run as root (installs packages, mknod, runs slurmd/munged as root)"
install_packages

# ------------------------------------------------------------ layout/config --
MUNGE_DIR="$STATE_DIR/munge"
MUNGE_SOCK="$MUNGE_DIR/run/munge.socket.2"
LOG_DIR="$STATE_DIR/log"
RUN_DIR="$STATE_DIR/run"
DEV_DIR="$STATE_DIR/dev"

# munged insists on: key 0600 owned by the daemon user, its dirs not
# group/world-writable, socket dir 0755.
mkdir -p "$MUNGE_DIR/run" "$MUNGE_DIR/lib" "$LOG_DIR" "$RUN_DIR" "$DEV_DIR" \
         "$STATE_DIR/spool/ctld" "$STATE_DIR/spool/slurmd"
chmod 755 "$STATE_DIR" "$MUNGE_DIR" "$MUNGE_DIR/run" "$DEV_DIR"
chmod 700 "$MUNGE_DIR/lib"
if [[ ! -s "$MUNGE_DIR/munge.key" ]]; then
    ( umask 077; dd if=/dev/urandom of="$MUNGE_DIR/munge.key" bs=1024 count=1 status=none )
fi
chmod 600 "$MUNGE_DIR/munge.key"

# Fake GPUs: slurmd only needs existing character devices for File=.
for i in 0 1 2 3 4 5 6 7; do
    d="$DEV_DIR/nvidia$i"
    if [[ ! -c "$d" ]]; then
        rm -f "$d"
        mknod "$d" c 195 "$i" || die "mknod $d failed (need root and a filesystem allowing device nodes)"
    fi
done

write_if_changed() {  # write_if_changed FILE  (content on stdin); returns 0 if changed
    local tmp="$1.new.$$"
    cat >"$tmp"
    if [[ -f "$1" ]] && cmp -s "$tmp" "$1"; then
        rm -f "$tmp"; return 1
    fi
    mv -f "$tmp" "$1"; return 0
}

changed=0
write_if_changed "$STATE_DIR/slurm.conf" <<EOF && changed=1 || true
# Generated by shardtrain slurm/local-cluster/start.sh -- do not edit.
ClusterName=shardtrain
SlurmctldHost=localhost
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire=5: a requeued job may restart after ~6 s instead of ~127 s.
AuthInfo=socket=$MUNGE_SOCK,cred_expire=5
StateSaveLocation=$STATE_DIR/spool/ctld
SlurmdSpoolDir=$STATE_DIR/spool/slurmd
SlurmctldPidFile=$RUN_DIR/slurmctld.pid
SlurmdPidFile=$RUN_DIR/slurmd.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
MpiDefault=none
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=1
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
# MinJobAge<=4 keeps "sbatch --wait" polling every 2 s.
MinJobAge=4
KillWait=5
InactiveLimit=0
Waittime=0
MessageTimeout=10
SlurmctldTimeout=30
SlurmdTimeout=60
GresTypes=gpu
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=32 RealMemory=256000 Gres=gpu:a100:4,gpu:v100:4 State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF

write_if_changed "$STATE_DIR/gres.conf" <<EOF && changed=1 || true
# Generated by shardtrain slurm/local-cluster/start.sh -- fake GPUs.
AutoDetect=off
NodeName=$NODE Name=gpu Type=a100 File=$DEV_DIR/nvidia[0-3]
NodeName=$NODE Name=gpu Type=v100 File=$DEV_DIR/nvidia[4-7]
EOF

write_if_changed "$STATE_DIR/cgroup.conf" <<EOF && changed=1 || true
# Generated by shardtrain slurm/local-cluster/start.sh.  No cgroup plugins are
# configured (proctrack/linuxproc, task/none); present so slurmd never falls
# back to /etc/slurm/cgroup.conf.
CgroupAutomount=no
ConstrainCores=no
ConstrainDevices=no
ConstrainRAMSpace=no
EOF

cat >"$STATE_DIR/env.sh" <<EOF
export SLURM_CONF=$SLURM_CONF
export SHARDTRAIN_SLURM_DIR=$STATE_DIR
EOF

# ---------------------------------------------------------------- daemons --
# A killed daemon can stay a zombie for a while (pid 1 may not reap it
# promptly); kill -0 still succeeds on zombies, so check the state.
is_zombie() {
    local st
    st="$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null || true)"
    [[ -z "$st" || "$st" == Z || "$st" == X ]]
}

# alive NAME PIDFILE COMM -> 0 if the pid file names a live process called COMM
alive() {
    local pid
    [[ -s "$2" ]] || return 1
    pid="$(tr -dc 0-9 <"$2")"
    [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null || return 1
    [[ "$(cat "/proc/$pid/comm" 2>/dev/null)" == "$3" ]] || return 1
    ! is_zombie "$pid"
}

MUNGE_PID="$RUN_DIR/munged.pid"
CTLD_PID="$RUN_DIR/slurmctld.pid"
SLURMD_PID="$RUN_DIR/slurmd.pid"

node_state() {
    timeout 10 sinfo -h -N -n "$NODE" -o '%T' 2>/dev/null | head -n1 || true
}

print_env() {
    echo "Slurm is up (state dir $STATE_DIR). Use:"
    echo "export SLURM_CONF=$SLURM_CONF"
}

# Fast path: everything running with the current config and the node usable.
if [[ $changed -eq 0 ]] && alive munged "$MUNGE_PID" munged && alive slurmctld "$CTLD_PID" slurmctld \
        && alive slurmd "$SLURMD_PID" slurmd; then
    case "$(node_state)" in
        idle|mixed|allocated|completing|idle+*|mixed+*|allocated+*)
            print_env; exit 0 ;;
    esac
fi

if [[ $changed -eq 1 ]] && { alive slurmctld "$CTLD_PID" slurmctld || alive slurmd "$SLURMD_PID" slurmd; }; then
    echo "start.sh: configuration changed, restarting slurm daemons" >&2
    "$(dirname "${BASH_SOURCE[0]}")/stop.sh" "$STATE_DIR" --keep-munge 9>&- >&2 || true
fi

# (Daemons get "9>&-" so they do not inherit, and hold forever, the lock.)
# Tag our daemons' environment so stop.sh can find leftover slurmstepds.
export SHARDTRAIN_SLURM_STATE="$STATE_DIR"

if ! alive munged "$MUNGE_PID" munged; then
    rm -f "$MUNGE_PID" "$MUNGE_SOCK" "$MUNGE_SOCK.lock"
    munged --key-file="$MUNGE_DIR/munge.key" --socket="$MUNGE_SOCK" \
           --pid-file="$MUNGE_PID" --log-file="$LOG_DIR/munged.log" \
           --seed-file="$MUNGE_DIR/lib/munged.seed" --force \
        9>&- >>"$LOG_DIR/munged.out" 2>&1 \
        || die "munged failed to start" "$LOG_DIR/munged.out" "$LOG_DIR/munged.log"
fi
for _ in $(seq 50); do [[ -S "$MUNGE_SOCK" ]] && break; sleep 0.1; done
[[ -S "$MUNGE_SOCK" ]] || die "munged socket $MUNGE_SOCK did not appear" "$LOG_DIR/munged.log"
if ! munge -n --socket="$MUNGE_SOCK" </dev/null | unmunge --socket="$MUNGE_SOCK" >/dev/null 2>&1; then
    die "munge/unmunge round trip failed on $MUNGE_SOCK" "$LOG_DIR/munged.log"
fi

if ! alive slurmctld "$CTLD_PID" slurmctld; then
    rm -f "$CTLD_PID"
    # -i: ignore unreadable state files left by a crash.
    slurmctld -i -f "$SLURM_CONF" 9>&- >>"$LOG_DIR/slurmctld.out" 2>&1 \
        || die "slurmctld failed to start" "$LOG_DIR/slurmctld.out" "$LOG_DIR/slurmctld.log"
fi
for _ in $(seq 100); do
    timeout 5 scontrol ping 2>/dev/null | grep -q 'is UP' && break
    alive slurmctld "$CTLD_PID" slurmctld || sleep 0.5
    alive slurmctld "$CTLD_PID" slurmctld || die "slurmctld exited during startup" "$LOG_DIR/slurmctld.log"
    sleep 0.2
done
timeout 5 scontrol ping 2>/dev/null | grep -q 'is UP' \
    || die "slurmctld not answering 'scontrol ping' (port $CTLD_PORT in use?)" "$LOG_DIR/slurmctld.log"

if ! alive slurmd "$SLURMD_PID" slurmd; then
    rm -f "$SLURMD_PID"
    slurmd -f "$SLURM_CONF" -N "$NODE" 9>&- >>"$LOG_DIR/slurmd.out" 2>&1 \
        || die "slurmd failed to start" "$LOG_DIR/slurmd.out" "$LOG_DIR/slurmd.log"
fi

# Wait for the node to become usable.
deadline=$((SECONDS + TIMEOUT))
resumed=0
while :; do
    st="$(node_state)"
    case "$st" in
        idle|mixed|allocated|completing|idle+*|mixed+*|allocated+*) break ;;
        *drain*|*inval*|down*)
            # e.g. left DOWN/DRAIN by a previous crash; slurmd is up now.
            if [[ $resumed -eq 0 ]] && alive slurmd "$SLURMD_PID" slurmd; then
                sleep 1
                scontrol update nodename="$NODE" state=resume >/dev/null 2>&1 || true
                resumed=1
            fi ;;
    esac
    alive slurmd "$SLURMD_PID" slurmd || { sleep 0.5; alive slurmd "$SLURMD_PID" slurmd; } \
        || die "slurmd exited during startup" "$LOG_DIR/slurmd.log"
    if (( SECONDS >= deadline )); then
        reason="$(timeout 5 sinfo -h -N -n "$NODE" -o '%T %E' 2>/dev/null || true)"
        die "node $NODE not idle after ${TIMEOUT}s (sinfo: ${reason:-no answer})" \
            "$LOG_DIR/slurmd.log" "$LOG_DIR/slurmctld.log"
    fi
    sleep 0.5
done

print_env
