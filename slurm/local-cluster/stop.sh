#!/usr/bin/env bash
# Stop the local Slurm cluster started by start.sh.  Idempotent.
#
#   slurm/local-cluster/stop.sh [STATE_DIR] [--keep-munge]
#
# Cancels all jobs, then stops slurmd, slurmctld and munged via their pid files
# in STATE_DIR (TERM, then KILL after 10 s): every slurmd of a cluster across hosts
# (start.sh --hosts) too, whose clients run on the controller's host (STATE_DIR/layout.sh
# says which).  STATE_DIR is left in place (logs stay readable); delete it yourself for a
# fully fresh start.
set -euo pipefail

STATE_DIR="${SHARDTRAIN_SLURM_DIR:-/tmp/shardtrain-slurm}"
KEEP_MUNGE=0
for a in "$@"; do
    case "$a" in
        --keep-munge) KEEP_MUNGE=1 ;;
        *) STATE_DIR="$a" ;;
    esac
done

if [[ ! -d "$STATE_DIR" ]]; then
    echo "stop.sh: $STATE_DIR does not exist; nothing to stop"
    exit 0
fi
STATE_DIR="$(cd "$STATE_DIR" && pwd -P)"
export SLURM_CONF="$STATE_DIR/slurm.conf"
RUN_DIR="$STATE_DIR/run"
RUN_ON="" CTLD=""
# shellcheck source=/dev/null
[[ -f "$STATE_DIR/layout.sh" ]] && source "$STATE_DIR/layout.sh"
client() {  # client CMD...: on the controller's host (a host of start.sh --hosts may be gone: then nothing)
    if [[ -n "$RUN_ON" ]]; then "$RUN_ON" "$CTLD" "$@"; else "$@"; fi
}

# A killed daemon can stay a zombie for a while (pid 1 may not reap it
# promptly); kill -0 still succeeds on zombies, so check the state.
is_zombie() {
    local st
    st="$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null || true)"
    [[ -z "$st" || "$st" == Z || "$st" == X ]]
}

pid_of() {  # pid_of PIDFILE COMM -> prints pid if it is a live COMM process
    local pid
    [[ -s "$1" ]] || return 1
    pid="$(tr -dc 0-9 <"$1")"
    [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null || return 1
    [[ "$(cat "/proc/$pid/comm" 2>/dev/null)" == "$2" ]] || return 1
    ! is_zombie "$pid" || return 1
    echo "$pid"
}

stop_pid() {  # stop_pid PID : TERM, wait up to 10 s, KILL
    local pid=$1 i
    kill -TERM "$pid" 2>/dev/null || return 0
    for i in $(seq 100); do
        { kill -0 "$pid" 2>/dev/null && ! is_zombie "$pid"; } || return 0
        sleep 0.1
    done
    kill -KILL "$pid" 2>/dev/null || true
    sleep 0.2
}

# 1. Cancel every job while slurmctld is still up, give them a moment to end.
if [[ -f "$SLURM_CONF" ]] && pid_of "$RUN_DIR/slurmctld.pid" slurmctld >/dev/null; then
    jobs="$(client timeout 10 squeue -h -o '%A' 2>/dev/null || true)"
    if [[ -n "$jobs" ]]; then
        # shellcheck disable=SC2086
        client timeout 10 scancel $jobs 2>/dev/null || true
        for _ in $(seq 50); do
            [[ -z "$(client timeout 5 squeue -h -o '%A' 2>/dev/null || true)" ]] && break
            sleep 0.2
        done
    fi
fi

# 2. Daemons, in reverse start order: slurmd.pid, or slurmd-<node>.pid for each host of start.sh --hosts.
for f in "$RUN_DIR"/slurmd.pid "$RUN_DIR"/slurmd-*.pid "$RUN_DIR/slurmctld.pid"; do
    [[ -e "$f" ]] || continue
    d="$(basename "$f")"; d="${d%%[.-]*}"
    if pid="$(pid_of "$f" "$d")"; then
        stop_pid "$pid"
    fi
    rm -f "$f"
done

# 3. Leftover slurmstepd processes of this cluster (tagged by start.sh).
for envf in /proc/[0-9]*/environ; do
    p="${envf#/proc/}"; p="${p%/environ}"
    [[ "$(cat "/proc/$p/comm" 2>/dev/null)" == slurmstepd ]] || continue
    if tr '\0' '\n' 2>/dev/null <"$envf" | grep -qxF "SHARDTRAIN_SLURM_STATE=$STATE_DIR"; then
        kill -KILL "$p" 2>/dev/null || true
    fi
done

if [[ $KEEP_MUNGE -eq 0 ]]; then
    if pid="$(pid_of "$RUN_DIR/munged.pid" munged)"; then
        stop_pid "$pid"
    fi
    rm -f "$RUN_DIR/munged.pid"
fi

echo "stop.sh: local Slurm in $STATE_DIR stopped"
