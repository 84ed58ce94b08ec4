#!/usr/bin/env bash
# Start a single-node Slurm "cluster" on localhost for the test suite.
#
#   slurm/local-cluster/start.sh [STATE_DIR]
#   slurm/local-cluster/start.sh [STATE_DIR] --hosts node1=ADDR1,node2=ADDR2 \
#                                --controller node3=ADDR3 --run-on PROGRAM
#
# The second form is a cluster across hosts: one slurmd per compute host (`slurmd -N nodeK`, NodeAddr its
# address) and slurmctld on a host of its own. `PROGRAM HOST CMD...` must run CMD on HOST, which must call
# itself HOST (hostname) and resolve every host's name to its address; the filesystem (STATE_DIR, the
# repository) must be shared. The test suite's hosts are network namespaces (tests/hosts.py, which writes such
# a PROGRAM: Hosts.run_on_script()). munged runs here, once: its socket is a file every host reaches.
# Clients (sbatch, squeue, scontrol) must then run on one of the hosts: `PROGRAM node1 sbatch ...`.
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

STATE_DIR="${SHARDTRAIN_SLURM_DIR:-/tmp/shardtrain-slurm}"
HOSTS_ARG="" CONTROLLER_ARG="" RUN_ON=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --hosts) HOSTS_ARG="$2"; shift 2 ;;
        --controller) CONTROLLER_ARG="$2"; shift 2 ;;
        --run-on) RUN_ON="$2"; shift 2 ;;
        -*) echo "start.sh: ERROR: unknown option $1" >&2; exit 1 ;;
        *) STATE_DIR="$1"; shift ;;
    esac
done
CTLD_PORT="${SHARDTRAIN_SLURMCTLD_PORT:-6817}"
SLURMD_PORT="${SHARDTRAIN_SLURMD_PORT:-6818}"
TIMEOUT="${SHARDTRAIN_SLURM_TIMEOUT:-60}"

# NODES: compute node names, ADDRS: their addresses, CTLD/CTLD_ADDR: the controller's.
if [[ -z "$HOSTS_ARG" ]]; then
    [[ -z "$CONTROLLER_ARG$RUN_ON" ]] || { echo "start.sh: ERROR: --controller/--run-on need --hosts" >&2; exit 1; }
    NODES=(localhost) ADDRS=(127.0.0.1) CTLD=localhost CTLD_ADDR=127.0.0.1
else
    [[ -n "$CONTROLLER_ARG" && -n "$RUN_ON" ]] \
        || { echo "start.sh: ERROR: --hosts needs --controller NAME=ADDR and --run-on PROGRAM" >&2; exit 1; }
    [[ -x "$RUN_ON" ]] || { echo "start.sh: ERROR: --run-on $RUN_ON: not an executable file" >&2; exit 1; }
    NODES=() ADDRS=()
    IFS=, read -r -a pairs <<<"$HOSTS_ARG"
    for pair in "${pairs[@]}"; do
        [[ "$pair" == *=* ]] || { echo "start.sh: ERROR: --hosts $pair: expected NAME=ADDR" >&2; exit 1; }
        NODES+=("${pair%%=*}") ADDRS+=("${pair#*=}")
    done
    [[ "$CONTROLLER_ARG" == *=* ]] || { echo "start.sh: ERROR: --controller $CONTROLLER_ARG: expected NAME=ADDR" >&2; exit 1; }
    CTLD="${CONTROLLER_ARG%%=*}" CTLD_ADDR="${CONTROLLER_ARG#*=}"
fi
# NAME(ADDR): every host reaches slurmctld at that address, whatever its own resolver says.
if [[ -n "$RUN_ON" ]]; then CTLD_HOST="$CTLD($CTLD_ADDR)"; else CTLD_HOST="$CTLD"; fi

# on HOST CMD...: run CMD on HOST (here, in the single-node layout).
on() {
    local host=$1; shift
    if [[ -n "$RUN_ON" ]]; then "$RUN_ON" "$host" "$@"; else "$@"; fi
}

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
         "$STATE_DIR/spool/ctld"
# One slurmd per node: its own pid file, log and spool directory on the shared filesystem (slurmd expands %n,
# its node name, in those three settings). The single-node layout keeps its plain names.
if [[ -z "$RUN_ON" ]]; then PER_NODE=""; else PER_NODE="-%n"; fi
slurmd_file() {  # slurmd_file TEMPLATE NODE -> the path with %n expanded
    echo "${1//%n/$2}"
}
for n in "${NODES[@]}"; do mkdir -p "$(slurmd_file "$STATE_DIR/spool/slurmd$PER_NODE" "$n")"; done
NODE_LINES="" NODE_LIST="" GRES_LINES=""
for i in "${!NODES[@]}"; do
    NODE_LINES+="NodeName=${NODES[$i]} NodeAddr=${ADDRS[$i]} CPUs=32 RealMemory=256000 Gres=gpu:a100:4,gpu:v100:4 State=UNKNOWN"$'\n'
    NODE_LIST+="${NODE_LIST:+,}${NODES[$i]}"
    GRES_LINES+="NodeName=${NODES[$i]} Name=gpu Type=a100 File=$DEV_DIR/nvidia[0-3]"$'\n'
    GRES_LINES+="NodeName=${NODES[$i]} Name=gpu Type=v100 File=$DEV_DIR/nvidia[4-7]"$'\n'
done
GRES_LINES="${GRES_LINES%$'\n'}"
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
SlurmctldHost=$CTLD_HOST
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire=5: a requeued job may restart after ~6 s instead of ~127 s.
AuthInfo=socket=$MUNGE_SOCK,cred_expire=5
StateSaveLocation=$STATE_DIR/spool/ctld
SlurmdSpoolDir=$STATE_DIR/spool/slurmd$PER_NODE
SlurmctldPidFile=$RUN_DIR/slurmctld.pid
SlurmdPidFile=$RUN_DIR/slurmd$PER_NODE.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd$PER_NODE.log
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
${NODE_LINES}PartitionName=debug Nodes=$NODE_LIST Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF

write_if_changed "$STATE_DIR/gres.conf" <<EOF && changed=1 || true
# Generated by shardtrain slurm/local-cluster/start.sh -- fake GPUs.
AutoDetect=off
$GRES_LINES
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
slurmd_pid() { slurmd_file "$RUN_DIR/slurmd$PER_NODE.pid" "$1"; }
slurmd_log() { slurmd_file "$LOG_DIR/slurmd$PER_NODE.log" "$1"; }
all_slurmds_alive() {
    local n
    for n in "${NODES[@]}"; do alive slurmd "$(slurmd_pid "$n")" slurmd || return 1; done
}
any_slurmd_alive() {
    local n
    for n in "${NODES[@]}"; do alive slurmd "$(slurmd_pid "$n")" slurmd && return 0; done
    return 1
}

# Clients talk to slurmctld, so they run where it can be reached: on its host.
node_state() {  # node_state NODE
    on "$CTLD" timeout 10 sinfo -h -N -n "$1" -o '%T' 2>/dev/null | head -n1 || true
}
usable() {
    case "$1" in idle|mixed|allocated|completing|idle+*|mixed+*|allocated+*) return 0 ;; esac
    return 1
}
all_nodes_usable() {
    local n
    for n in "${NODES[@]}"; do usable "$(node_state "$n")" || return 1; done
}

print_env() {
    echo "Slurm is up (state dir $STATE_DIR). Use:"
    echo "export SLURM_CONF=$SLURM_CONF"
    if [[ -n "$RUN_ON" ]]; then
        echo "and run clients on a host of the cluster, e.g.: $RUN_ON ${NODES[0]} sinfo"
    fi
}

# Fast path: everything running with the current config and the nodes usable.
if [[ $changed -eq 0 ]] && alive munged "$MUNGE_PID" munged && alive slurmctld "$CTLD_PID" slurmctld \
        && all_slurmds_alive && all_nodes_usable; then
    print_env; exit 0
fi

if [[ $changed -eq 1 ]] && { alive slurmctld "$CTLD_PID" slurmctld || any_slurmd_alive; }; then
    echo "start.sh: configuration changed, restarting slurm daemons" >&2
    "$(dirname "${BASH_SOURCE[0]}")/stop.sh" "$STATE_DIR" --keep-munge 9>&- >&2 || true
fi
# For stop.sh: where the daemons run and how to reach them.
if [[ -n "$RUN_ON" ]]; then
    printf 'RUN_ON=%q\nCTLD=%q\nNODES=(%s)\n' "$RUN_ON" "$CTLD" "${NODES[*]}" >"$STATE_DIR/layout.sh"
else
    rm -f "$STATE_DIR/layout.sh"
fi

# (Daemons get "9>&-" so they do not inherit, and hold forever, the lock.)
# Tag our daemons' environment so stop.sh can find leftover slurmstepds.
export SHARDTRAIN_SLURM_STATE="$STATE_DIR"

# munged needs no network: one here serves every host through its socket file (the filesystem is shared).
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
for n in "$CTLD" "${NODES[@]}"; do
    if ! on "$n" sh -c 'munge -n --socket="$1" </dev/null | unmunge --socket="$1" >/dev/null 2>&1' sh "$MUNGE_SOCK"
    then
        die "munge/unmunge round trip failed on $MUNGE_SOCK (from host $n)" "$LOG_DIR/munged.log"
    fi
done

if ! alive slurmctld "$CTLD_PID" slurmctld; then
    rm -f "$CTLD_PID"
    # -i: ignore unreadable state files left by a crash.
    on "$CTLD" slurmctld -i -f "$SLURM_CONF" 9>&- >>"$LOG_DIR/slurmctld.out" 2>&1 \
        || die "slurmctld failed to start on $CTLD" "$LOG_DIR/slurmctld.out" "$LOG_DIR/slurmctld.log"
fi
ping_ctld() {
    on "$CTLD" timeout 5 scontrol ping 2>/dev/null | grep -q 'is UP'
}
for _ in $(seq 100); do
    ping_ctld && break
    alive slurmctld "$CTLD_PID" slurmctld || sleep 0.5
    alive slurmctld "$CTLD_PID" slurmctld || die "slurmctld exited during startup" "$LOG_DIR/slurmctld.log"
    sleep 0.2
done
ping_ctld || die "slurmctld on $CTLD not answering 'scontrol ping' (port $CTLD_PORT in use?)" \
    "$LOG_DIR/slurmctld.log"

for n in "${NODES[@]}"; do
    if ! alive slurmd "$(slurmd_pid "$n")" slurmd; then
        rm -f "$(slurmd_pid "$n")"
        on "$n" slurmd -f "$SLURM_CONF" -N "$n" 9>&- >>"$LOG_DIR/slurmd.out" 2>&1 \
            || die "slurmd failed to start on $n" "$LOG_DIR/slurmd.out" "$(slurmd_log "$n")"
    fi
done

# Wait for the nodes to become usable.
deadline=$((SECONDS + TIMEOUT))
declare -A resumed=()
for n in "${NODES[@]}"; do
    while :; do
        st="$(node_state "$n")"
        usable "$st" && break
        case "$st" in
            *drain*|*inval*|down*)
                # e.g. left DOWN/DRAIN by a previous crash; slurmd is up now.
                if [[ -z "${resumed[$n]:-}" ]] && alive slurmd "$(slurmd_pid "$n")" slurmd; then
                    sleep 1
                    on "$CTLD" scontrol update nodename="$n" state=resume >/dev/null 2>&1 || true
                    resumed[$n]=1
                fi ;;
        esac
        alive slurmd "$(slurmd_pid "$n")" slurmd || { sleep 0.5; alive slurmd "$(slurmd_pid "$n")" slurmd; } \
            || die "slurmd on $n exited during startup" "$(slurmd_log "$n")"
        if (( SECONDS >= deadline )); then
            reason="$(on "$CTLD" timeout 5 sinfo -h -N -n "$n" -o '%T %E' 2>/dev/null || true)"
            die "node $n not idle after ${TIMEOUT}s (sinfo: ${reason:-no answer})" \
                "$(slurmd_log "$n")" "$LOG_DIR/slurmctld.log"
        fi
        sleep 0.5
    done
done

print_env
