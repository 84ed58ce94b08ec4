"""PID 1 of a training container: `python -m shardtrain.runtime.container_init CMD [ARG...]`.

SageMaker stops a job (a spot interruption, StopTrainingJob, the max runtime) as `docker stop` does: SIGTERM to
PID 1 only, SIGKILL some time later. Under the SDK v3's `Torchrun()` PID 1 is the bash running its
sm_train.sh, and the kernel drops every signal to a namespace's init that has no handler for it: the stop
never reaches the training processes, which are killed mid-run with no checkpoint. examples/sagemaker/launch.py
therefore has sm_train.sh `exec` this module, which then runs the SDK's own torchrun driver (CMD) as its child.

On SIGTERM, SIGUSR1 or SIGINT it signals the training workers (every process whose command line runs
shardtrain/main.py, wherever they sit below it: driver -> torchrun -> workers), and nothing above them: they
finish their step, save and exit 0, and torchrun and the driver then exit 0 as after any finished run. Before
any worker has started there is nothing to save, and CMD's process group gets the signal. Signals are taken
with sigwaitinfo, not a handler: nothing here runs re-entrantly, and two signals in a row are just two turns
of the loop. As an init must, it reaps every orphan. It exits with CMD's status (128 + N after signal N)
once CMD has exited; after a stop signal, only once every process left has exited too, because this
process exiting would kill the rest of the container at once, mid-save.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

STOP = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
WORKER_SCRIPT = os.path.join("shardtrain", "main.py")


def training_workers(exclude: int) -> list[int]:
    """Pids of the processes running shardtrain/main.py (read from /proc: no psutil before requirements are in)."""
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == exclude:
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:  # exited meanwhile
            continue
        if any(a.decode(errors="replace").endswith(WORKER_SCRIPT) for a in args[1:3]):
            pids.append(int(name))
    return pids


def _status_code(status: int) -> int:
    return 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def run(cmd: list[str]) -> int:
    waited = {*STOP, signal.SIGCHLD}
    signal.pthread_sigmask(signal.SIG_BLOCK, waited)
    child = subprocess.Popen(
        cmd, process_group=0, preexec_fn=lambda: signal.pthread_sigmask(signal.SIG_UNBLOCK, waited)
    )
    code, stopping = None, False
    while True:
        info = signal.sigwaitinfo(waited)
        if info.si_signo in STOP:
            stopping = True
            workers = training_workers(exclude=os.getpid())
            if workers:
                for pid in workers:
                    try:
                        os.kill(pid, info.si_signo)
                    except ProcessLookupError:
                        pass
            elif code is None:
                try:
                    os.killpg(child.pid, info.si_signo)
                except ProcessLookupError:
                    pass
            continue
        while True:  # SIGCHLD: reap whatever exited (signals of one kind merge while pending)
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:  # nothing left in the container
                return code if code is not None else 0
            if pid == 0:
                break
            if pid == child.pid:
                child.returncode = code = _status_code(status)
        if code is not None and not stopping:
            return code


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python -m shardtrain.runtime.container_init CMD [ARG...]")
    sys.exit(run(sys.argv[1:]))
