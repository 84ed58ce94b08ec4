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


def training_workers(root: int) -> list[int]:
    """Pids of the processes below `root` that run shardtrain/main.py, read from /proc (no psutil before the
    requirements are in). Only below it: another job on the same host runs the same script, and PID 1 of a
    container has every process of the container below it (orphans are re-parented to it)."""
    parent, runs_worker = {}, set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:  # exited meanwhile
            continue
        pid = int(name)
        parent[pid] = int(stat[stat.rindex(b")") + 2 :].split()[1])  # after "pid (comm) state"
        if any(a.decode(errors="replace").endswith(WORKER_SCRIPT) for a in args[1:3]):
            runs_worker.add(pid)
    children: dict[int, list[int]] = {}
    for pid, ppid in parent.items():
        children.setdefault(ppid, []).append(pid)
    below, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        below.append(pid)
        todo.extend(children.get(pid, []))
    return sorted(pid for pid in below if pid in runs_worker)


def check_proc_is_ours() -> None:
    """A /proc of another PID namespace (`unshare --pid` without --mount-proc) names other processes by the
    pids this one reads: a stop would signal the wrong ones, or none. A container always mounts its own."""
    if os.getpid() == 1 and os.readlink("/proc/self") != "1":
        raise SystemExit(
            "container_init: /proc belongs to another PID namespace, so a stop signal could not find the "
            "training workers: mount this namespace's own /proc (a container does; unshare --mount-proc)"
        )


def _status_code(status: int) -> int:
    return 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def run(cmd: list[str]) -> int:
    check_proc_is_ours()
    waited = {*STOP, signal.SIGCHLD}
    signal.pthread_sigmask(signal.SIG_BLOCK, waited)
    try:
        child = subprocess.Popen(
            cmd, process_group=0, preexec_fn=lambda: signal.pthread_sigmask(signal.SIG_UNBLOCK, waited)
        )
    except OSError as e:  # not found, not executable: one line, as a shell says it, and its status 127
        signal.pthread_sigmask(signal.SIG_UNBLOCK, waited)
        print(f"container_init: cannot run {cmd[0]}: {e.strerror}", file=sys.stderr)
        return 127
    code, stopping = None, False
    while True:
        info = signal.sigwaitinfo(waited)
        if info.si_signo in STOP:
            stopping = True
            workers = training_workers(root=os.getpid())
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


USAGE = "usage: python -m shardtrain.runtime.container_init CMD [ARG...]"


def main(argv: list[str]) -> int:
    if not argv:
        sys.exit(USAGE)
    if argv[0] in ("-h", "--help"):
        print(USAGE + "\n\n" + __doc__.split("\n\n", 1)[1].strip())  # why it exists, and what it does
        sys.exit(0)
    return run(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
