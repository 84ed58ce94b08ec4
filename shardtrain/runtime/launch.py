"""A plain `python -m shardtrain train` on a machine with several GPUs would use only GPU 0.
Instead it re-launches itself under torch's elastic launcher with one process per GPU."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from shardtrain.config.errors import as_seen_from_cwd
from shardtrain.config.settings import Config
from shardtrain.runtime.preemption import STOP_SIGNALS


def under_launcher() -> bool:
    env = os.environ
    return "RANK" in env or "LOCAL_RANK" in env or int(env.get("SLURM_NTASKS", "1")) > 1


def launcher_world_size() -> int:
    """The ranks the launcher started: WORLD_SIZE, or srun's SLURM_NTASKS (mapped later, as launch_rank); 1 outside
    a launcher."""
    env = os.environ
    return int(env.get("WORLD_SIZE") or env.get("SLURM_NTASKS") or 1)


def launch_rank() -> int:
    """This process's rank before any process group: the launcher's RANK, or srun's SLURM_PROCID (it sets no RANK;
    runtime/distributed.py maps it later), else 0."""
    env = os.environ
    if "RANK" in env:
        return int(env["RANK"])
    return int(env.get("SLURM_PROCID", "0")) if int(env.get("SLURM_NTASKS", "1")) > 1 else 0


def resolve_nproc(cfg: Config) -> int:
    if cfg.parallel.nproc != "auto":
        return int(cfg.parallel.nproc)
    import torch  # only here: the parent of `train --nproc N` never trains, and torch costs it seconds

    wants_gpu = cfg.parallel.device in ("auto", "cuda") and torch.cuda.is_available()
    return torch.cuda.device_count() if wants_gpu else 1


def launch_world_size(cfg: Config) -> int:
    """The ranks this job will have, before any process group: the launcher's count inside one (torchrun and the
    deepspeed launcher set WORLD_SIZE, srun SLURM_NTASKS), else what `--nproc` resolves to."""
    if under_launcher():
        return launcher_world_size()
    return resolve_nproc(cfg)


def maybe_relaunch(cfg: Config, argv: list[str]) -> int | None:
    """None: carry on in this process. Otherwise the launcher's exit code."""
    if under_launcher():
        return None
    nproc = resolve_nproc(cfg)
    if nproc <= 1:
        return None
    main_py = Path(__file__).parents[1] / "main.py"
    # The workers see RANK and never relaunch; torchrun's own parser would also reject `--nproc`
    # anywhere on its command line as an ambiguous prefix of --nproc-per-node.
    argv = without_flag(argv, "--nproc")
    return launch_local(nproc, [str(main_py), *argv], shown=f"{as_seen_from_cwd(main_py)} {shlex.join(argv)}")


def launch_local(nproc: int, program: list[str], shown: str, extra_env: dict | None = None) -> int:
    """`program` (a script and its arguments, or `-m module ...`) in `nproc` torchrun workers on this machine, as
    `train --nproc` and `predict --nproc` start them; `shown` is how the line printed names the program."""
    cmd = [sys.executable, "-m", "shardtrain.runtime.launch", "--standalone", f"--nproc_per_node={nproc}", *program]
    if os.environ.get("RANK", "0") == "0":
        print(
            f"shardtrain: starting {nproc} processes: torchrun --standalone --nproc_per_node={nproc} {shown}",
            flush=True,
        )
    from shardtrain.runtime.device_defaults import threads_per_rank

    # Each rank its share of the CPUs this process was given (CPU Adam under *_offload runs on them), not
    # torchrun's 1 for all; an OMP_NUM_THREADS of the caller's own wins.
    threads = os.environ.get("OMP_NUM_THREADS") or str(threads_per_rank(nproc))
    env = {**os.environ, "OMP_NUM_THREADS": threads, LAUNCHER_PID: str(os.getpid()), **(extra_env or {})}
    return run_forwarding_signals(cmd, env)


# The pid of the `shardtrain train` / `predict` process that started the agent, which the agent watches.
LAUNCHER_PID = "SHARDTRAIN_LAUNCHER_PID"
LAUNCHER_CHECK_SECONDS = 0.2


def run_forwarding_signals(cmd: list[str], env: dict) -> int:
    """A spot interruption (SageMaker) or a Slurm warning signals this parent process; the agent passes it
    on to the workers (quiet_torchrun below), which finish their step, save and exit. The agent runs in a
    session of its own, so a terminal's Ctrl-C, sent to this whole process group, reaches the workers once
    through this parent and not a second time through the agent (a second Ctrl-C means "stop at once")."""
    import signal

    agent = subprocess.Popen(cmd, env=env, start_new_session=True)
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda signum, frame: agent.send_signal(signum))
    return agent.wait()


def without_flag(argv: list[str], flag: str) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == flag:
            skip = True
        elif not arg.startswith(flag + "="):
            out.append(arg)
    return out


def quiet_torchrun(args: list[str]) -> int:
    """torchrun, without its own traceback and failure report when a worker fails: the failed worker has
    already said what went wrong in one line. Exits with the first failed worker's code (2 for a config
    or data error, 130 after Ctrl-C), or 128 + N for a worker killed by signal N, as a shell reports it.

    Stop signals go to the workers, and the agent goes on watching them: they finish their step, save and
    exit (0 after SIGTERM/SIGUSR1, 130 after Ctrl-C), and the agent exits with their code. torchrun's own
    handling would stop the workers itself and exit 1 with a traceback (SIGTERM, SIGINT), or die (SIGUSR1)."""
    import logging
    import signal

    from shardtrain.runtime.startup_gc import defer_collections, restore_collections

    defer_collections()  # torch's imports ahead cost ~0.2 s less CPU (runtime/startup_gc.py)
    import psutil
    from torch.distributed.elastic.multiprocessing.api import SignalException, _terminate_process_handler
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    restore_collections()  # the agent lives as long as the job: its collector back, the imported heap frozen

    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)

    agent = psutil.Process()

    def pass_to_workers(signum, frame):
        # Re-entrant and importing nothing: `scancel` or a cgroup stop signals every process at once, so
        # this agent gets SIGTERM twice (directly, and relayed by the `shardtrain train` parent), and the
        # second runs inside the first. Everything here is local to the call; a worker signalled twice
        # only sets its stop flag twice.
        workers = _workers_of(agent, psutil)
        for worker in workers:
            try:
                worker.send_signal(signum)
            except psutil.Error:  # exited meanwhile
                pass
        if not workers:  # none started yet: stop as torchrun would, with one line below
            _terminate_process_handler(signum, frame)

    for sig in STOP_SIGNALS:
        signal.signal(sig, pass_to_workers)
    end_with_the_launcher(agent, psutil)
    try:
        run(parse_args(["--signals-to-handle", "SIGHUP,SIGQUIT", *args]))
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = failure.exitcode
        if code < 0:  # killed by a signal: the worker itself could say nothing, and the log just stopped
            print(f"shardtrain: error: {_killed_line(rank, failure.pid, -code)}", file=sys.stderr, flush=True)
        return code if code > 0 else 128 - code
    except SignalException as e:
        print(f"shardtrain: the launcher got {e.sigval.name} before its workers started, and stopped", file=sys.stderr)
        return 128 + int(e.sigval)
    return 0


def _killed_line(rank: int, pid: int, signum: int) -> str:
    import signal

    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    why = " (kill -9, or the host's out-of-memory killer: see dmesg)" if signum == signal.SIGKILL else ""
    return (
        f"rank {rank} (pid {pid}) was killed by {name}{why}, and the job stopped; rerun the same command to go on "
        f"from the last committed checkpoint (--resume auto)"
    )


def end_with_the_launcher(agent, psutil) -> None:
    """A SIGKILL of `shardtrain train` (`kill -9`, `timeout -s KILL`, an OOM kill) cannot be passed on, and the
    agent runs in a session of its own: without this the job trained on as orphans, wrote checkpoints, and a
    rerun into the same folder raced them. The job dies with its launcher, as SIGKILL says: the agent kills
    every process it started and exits 137; `--resume auto` continues from the last committed checkpoint
    (DataLoader workers end by themselves within 0.2 s of their trainer, runtime/preemption.py)."""
    import threading

    launcher = int(os.environ.get(LAUNCHER_PID) or os.getppid())

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(LAUNCHER_CHECK_SECONDS)
        for process in agent.children(recursive=True):
            try:
                process.kill()
            except psutil.Error:  # exited meanwhile
                pass
        os._exit(128 + 9)

    threading.Thread(target=watch, name="shardtrain-launcher-watch", daemon=True).start()


def _workers_of(agent, psutil) -> list:
    """The agent's training workers (psutil imported by the caller: this runs in a signal handler)."""
    workers = []
    for child in agent.children():
        try:
            if any(part.endswith("main.py") for part in child.cmdline()):
                workers.append(child)
        except psutil.Error:  # exited meanwhile
            pass
    return workers


if __name__ == "__main__":
    sys.exit(quiet_torchrun(sys.argv[1:]))
