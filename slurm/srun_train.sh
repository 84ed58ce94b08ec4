# shellcheck shell=bash
# Sourced by slurm/*.sbatch (not run directly): turns the job's allocation and the override variables
# into one `srun python shardtrain/main.py ...` with one task per GPU, prints it, runs it, and forwards
# a preemption signal that reached only the batch shell to the training tasks.
#
# Why one srun task per GPU rather than `srun torchrun`: Slurm then owns every training process, so
# `--signal=USR1@N` (delivered to job steps) reaches the processes that checkpoint, `scancel` and
# accounting see them, and multi-node needs no rendezvous service and no ssh/pdsh (DeepSpeed included).
# torchrun's agent, by contrast, dies of SIGUSR1 while its workers survive. shardtrain maps
# SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID onto RANK / WORLD_SIZE / LOCAL_RANK itself.
#
# Inputs (environment; all optional unless noted):
#   CONFIG          YAML config (required; the sbatch script sets its default)
#   STRATEGY        ddp | fsdp (ignored when DS_CONFIG is set)
#   DS_CONFIG       DeepSpeed JSON (selects DeepSpeed)
#   PRECISION       fp32 | bf16 | fp16 (default: the config's)
#   DEVICE          cuda | cpu | auto (default cuda: a GPU job must not silently train on CPU)
#   OUTPUT_DIR      --output-dir (default: the config's; keep it fixed so a requeued job resumes)
#   DATA_DIR        --data-dir
#   NPROC_PER_NODE  processes per node (default: the GPUs Slurm gave the job, SLURM_GPUS_ON_NODE)
#   EXTRA_ARGS      more shardtrain flags, split on spaces, e.g. "--max-steps 500 --save-every 100"
#   SRUN_ARGS       more srun flags
#   MASTER_ADDR / MASTER_PORT   default: the first host of the job, and 15000 + job id % 20000
# Arguments given to the sbatch script are appended to shardtrain's arguments.

shardtrain_die() {
    echo "shardtrain-slurm: error: $*" >&2
    exit 2
}

shardtrain_srun() {
    local nnodes="${SLURM_NNODES:-1}"
    local per_node="${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-}}"
    [[ -n "$per_node" ]] || shardtrain_die "no GPUs in this allocation (SLURM_GPUS_ON_NODE is unset): request them" \
        "with --gres=gpu:N or --gpus-per-node=N, or set NPROC_PER_NODE for a CPU-only run"
    [[ "$per_node" =~ ^[1-9][0-9]*$ ]] || shardtrain_die "NPROC_PER_NODE must be a positive integer, got '$per_node'"
    local ntasks=$((nnodes * per_node))
    # The CPUs Slurm gave this node, shared evenly: each rank's DataLoader workers get their share.
    local cpus_node="${SLURM_CPUS_ON_NODE:-$per_node}"
    local cpus_per_task=$((cpus_node / per_node))
    ((cpus_per_task >= 1)) || cpus_per_task=1

    [[ -n "${CONFIG:-}" ]] || shardtrain_die "CONFIG is not set"
    [[ -f "$CONFIG" ]] || shardtrain_die "CONFIG=$CONFIG: file not found (relative to $PWD)"
    if [[ -n "${DS_CONFIG:-}" && ! -f "$DS_CONFIG" ]]; then
        shardtrain_die "DS_CONFIG=$DS_CONFIG: file not found (relative to $PWD)"
    fi

    # Slurm sets no MASTER_ADDR/MASTER_PORT. The first host of the allocation runs rank 0; the port comes
    # from the job id so two jobs sharing a node do not collide, and stays the same after a requeue.
    if [[ -z "${MASTER_ADDR:-}" ]]; then
        # `|| true`: under the sbatch scripts' `set -e` a failing scontrol (a container without slurm.conf) ended
        # the job here, silently, before the fallback below.
        MASTER_ADDR="$(scontrol show hostnames "${SLURM_JOB_NODELIST:-localhost}" 2>/dev/null | head -n1 || true)"
        # Without scontrol, the first host of the compressed list: gpu[01-04,07],cpu3 -> gpu01.
        local nodes="${SLURM_JOB_NODELIST:-localhost}"
        if [[ -z "$MASTER_ADDR" && "$nodes" =~ ^([^,\[]+)\[([0-9]+) ]]; then
            MASTER_ADDR="${BASH_REMATCH[1]}${BASH_REMATCH[2]}"
        fi
        MASTER_ADDR="${MASTER_ADDR:-${nodes%%,*}}"
    fi
    export MASTER_ADDR
    export MASTER_PORT="${MASTER_PORT:-$((15000 + ${SLURM_JOB_ID:-0} % 20000))}"
    # Each task its share of the node's CPUs (--cpus-per-task): CPU Adam under *_offload and CPU training run on
    # these threads. Unset, every rank would start one thread per core and they would fight; 1 (torchrun's)
    # would leave the rest of the allotment idle.
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$cpus_per_task}"

    local args=(--config "$CONFIG")
    if [[ -n "${DS_CONFIG:-}" ]]; then
        args+=(--ds "$DS_CONFIG")
    elif [[ -n "${STRATEGY:-}" ]]; then
        args+=(--strategy "$STRATEGY")
    fi
    [[ -n "${PRECISION:-}" ]] && args+=(--precision "$PRECISION")
    args+=(--device "${DEVICE:-cuda}")
    [[ -n "${DATA_DIR:-}" ]] && args+=(--data-dir "$DATA_DIR")
    [[ -n "${OUTPUT_DIR:-}" ]] && args+=(--output-dir "$OUTPUT_DIR")
    # Each task is one rank already: never let a task relaunch itself under torchrun.
    args+=(--nproc 1)
    # EXTRA_ARGS holds several flags: split it on whitespace (no globbing).
    local extra=() srun_extra=()
    read -r -a extra <<<"${EXTRA_ARGS:-}"
    read -r -a srun_extra <<<"${SRUN_ARGS:-}"
    args+=("${extra[@]}" "$@")

    # --kill-on-bad-exit: one rank failing ends the others at once instead of leaving them in a collective
    # until the process-group timeout.
    local cmd=(srun --ntasks="$ntasks" --ntasks-per-node="$per_node" --cpus-per-task="$cpus_per_task"
               --kill-on-bad-exit=1 "${srun_extra[@]}" python -u shardtrain/main.py "${args[@]}")

    echo "shardtrain-slurm: job ${SLURM_JOB_ID:-?} SLURM_RESTART_COUNT=${SLURM_RESTART_COUNT:-0} on $(hostname)" \
         "| nodes ${SLURM_JOB_NODELIST:-?} ($nnodes) | repo $PWD"
    echo "shardtrain-slurm: GPUs: CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-<unset>}" \
         "SLURM_GPUS_ON_NODE=${SLURM_GPUS_ON_NODE:-<unset>} SLURM_JOB_GPUS=${SLURM_JOB_GPUS:-<unset>}" \
         "-> $per_node per node x $nnodes nodes = world size $ntasks"
    echo "shardtrain-slurm: MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT OMP_NUM_THREADS=$OMP_NUM_THREADS"
    echo "shardtrain-slurm: launch: ${cmd[*]}"

    # Every check a mistake can fail (flags, config, data, the output folder), once, here, at the world size srun
    # will start: left to the tasks (task 0 says the error, the others wait to be stopped), --kill-on-bad-exit
    # would end the job as 143 (peers still checking terminated), not shardtrain's 2.
    local check_rc=0
    SLURM_NTASKS="$ntasks" python -u shardtrain/main.py "${args[@]}" --check-only || check_rc=$?
    if ((check_rc != 0)); then
        echo "shardtrain-slurm: the checks before a launch failed (exit $check_rc): no task started" >&2
        return "$check_rc"
    fi

    # srun runs in the background so the batch shell can react to signals while it trains: bash defers a
    # trap until its foreground child exits. A signal sent to the batch shell only (`--signal=B:USR1@N`,
    # or a site whose preemption signals the batch shell) is passed on to srun, which forwards it to every
    # task; the tasks then checkpoint at the next step boundary and rank 0 requeues the job. Signals that
    # reach the tasks directly (`--signal=USR1@N`, `scancel -s USR1 [--full]`) need no help; a duplicate
    # only sets the same flag again.
    "${cmd[@]}" &
    local srun_pid=$!
    # shellcheck disable=SC2064  # expand srun_pid now
    trap "echo 'shardtrain-slurm: batch shell got SIGUSR1: passing it to the training tasks' >&2; kill -USR1 $srun_pid 2>/dev/null" USR1
    # SIGTERM (scancel, preemption, requeue, time limit) reaches the tasks from Slurm itself; the batch
    # shell only has to outlive them so their last lines reach the log.
    trap "echo 'shardtrain-slurm: batch shell got SIGTERM; waiting for the tasks' >&2" TERM
    local rc=0
    wait "$srun_pid" || rc=$?
    # `wait` returns early (status > 128) when a trapped signal arrives: keep waiting for srun itself.
    while kill -0 "$srun_pid" 2>/dev/null; do
        rc=0
        wait "$srun_pid" || rc=$?
    done
    trap - USR1 TERM
    echo "shardtrain-slurm: srun exited with $rc"
    return "$rc"
}
