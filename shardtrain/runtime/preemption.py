"""What happens after a preemption checkpoint: under Slurm, rank 0 puts the job back in the queue.

The signal side is StopFlag below: SIGUSR1/SIGTERM (preemption) and a first Ctrl-C set a flag; the loop
finishes its step, saves and exits (0 on a preemption signal, 130 on Ctrl-C).
How the signal reaches the training processes under each launcher: docs/checkpoints.md, "Preemption".
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import threading


def slurm_job_to_requeue(env: dict | None = None) -> str | None:
    """The id `scontrol requeue` needs: for an array task `<array job>_<task>`, else the job id."""
    env = os.environ if env is None else env
    array_job, task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    if array_job and task:
        return f"{array_job}_{task}"
    return env.get("SLURM_JOB_ID") or None


def requeue_if_slurm(log=print) -> bool:
    """Rank 0 only, after the checkpoint is committed. True when Slurm accepted the requeue."""
    job = slurm_job_to_requeue()
    if job is None:
        return False
    try:
        proc = _run_through_sigterm(["scontrol", "requeue", job])
    except (OSError, subprocess.SubprocessError) as e:
        log(f"[shardtrain] warning: could not requeue Slurm job {job}: {e}")
        return False
    if proc.returncode != 0:
        log(
            f"[shardtrain] warning: `scontrol requeue {job}` failed ({proc.returncode}): "
            f"{(proc.stderr or proc.stdout).strip()[:300]}; resubmit the job to resume"
        )
        return False
    log(f"requeued Slurm job {job}; it resumes from the checkpoint (--resume auto)")
    return True


def _run_through_sigterm(cmd: list[str]) -> subprocess.CompletedProcess:
    """`cmd` with SIGTERM ignored, which the child inherits through exec. An accepted requeue makes Slurm
    SIGTERM every process of the job at once, scontrol among them: across hosts it often died of that (-15)
    before it could exit 0, and a requeue that worked was reported as failed. Slurm's SIGKILL after KillWait
    still ends everything. Our own StopFlag is put back afterwards; this process is stopping already."""
    try:
        previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    except ValueError:  # not the main thread: signal dispositions cannot be changed here
        previous = None
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)
# Whether any StopFlag of this process has been raised: read by the error guard (cli.report_once), for which a
# lost peer after a stop signal is that stop's consequence, not news. A plain bool: set in a signal handler.
_stop_received = False


def stop_received() -> bool:
    return _stop_received


class StopFlag:
    """Set by SIGUSR1/SIGTERM (preemption) or SIGINT (Ctrl-C). The handler only sets a flag: no I/O, no
    collective. The loop folds it into its one per-step all-reduce, so every rank stops at the same step."""

    def __init__(self):
        self.raised = False
        # Only SIGUSR1 (the `--signal=USR1@N` warning of the slurm/ scripts) asks for a requeue: SIGTERM is
        # also what `scancel` sends, and a requeue then would bring back a job the user just cancelled.
        self.requeue = False
        self.interrupted = False  # Ctrl-C: the user's own stop, which ends in exit code 130 like any CLI
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        global _stop_received
        self.raised = _stop_received = True
        self.requeue = self.requeue or signum == signal.SIGUSR1
        if signum == signal.SIGINT:
            self.interrupted = True
            # The second Ctrl-C must stop at once, even inside a long collective or kernel, where a Python
            # handler would only run once it returns: the default action ends the process right away.
            signal.signal(signal.SIGINT, signal.SIG_DFL)

    @property
    def reason(self) -> str:
        return "Ctrl-C" if self.interrupted else "a preemption signal"


def leave_stop_signals_to_parent() -> None:
    """For a helper process the trainer forked (a DataLoader worker), called in its main thread as it starts.

    Stop signals are the trainer's to act on: it finishes its step, saves, and then ends its helpers itself. A
    helper that died of one would fail the very step being finished. A process group of its own keeps out what
    is sent to the trainer's group (a terminal's Ctrl-C; torchrun's agent, which signals each worker's whole
    group). SIGINT and SIGUSR1 (which Slurm sends to every process of a job step) are ignored outright.

    SIGTERM reaches every process at once under `scancel` or a cgroup stop, so it is taken by a thread that
    asks who sent it: the trainer (ending its helpers, as DataLoader shutdown and multiprocessing do at exit)
    ends this process at once, as torch's own worker handler does; anyone else is ignored. Ignoring SIGTERM
    outright would hang the trainer's exit, which waits for the helpers it terminates.

    The same thread ends this process within PARENT_CHECK_SECONDS once the trainer is gone, however it went
    (its exit is os._exit, which ends no helper). torch's worker notices only at its next 5 s status check,
    and until then Slurm counts the job step as running: past a short KillWait, the step is SIGKILLed."""
    os.setpgrp()
    for sig in (signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    # The pid of the process that started this one, from multiprocessing: os.getppid() here would already be
    # init's if the trainer died while this worker was starting, and then the worker would wait for torch's check.
    trainer = multiprocessing.parent_process()
    parent = trainer.pid if trainer is not None else os.getppid()
    # Blocked before the thread starts, so every thread (it included) inherits the mask and only
    # sigtimedwait below receives SIGTERM; torch's C handler for it never runs.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    threading.Thread(target=_end_on_sigterm_from, args=(parent,), name="shardtrain-sigterm", daemon=True).start()


PARENT_CHECK_SECONDS = 0.2


def _end_on_sigterm_from(parent: int) -> None:
    while True:
        info = signal.sigtimedwait({signal.SIGTERM}, PARENT_CHECK_SECONDS)  # None: no SIGTERM meanwhile
        if os.getppid() != parent or (info is not None and info.si_pid == parent):  # gone, or the trainer's
            os._exit(0)
