"""A plain `python -m shardtrain train` on a machine with several GPUs would use only GPU 0.
Instead it re-launches itself under torch's elastic launcher with one process per GPU."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from shardtrain.config import Config


def under_launcher() -> bool:
    env = os.environ
    return "RANK" in env or "LOCAL_RANK" in env or int(env.get("SLURM_NTASKS", "1")) > 1


def resolve_nproc(cfg: Config) -> int:
    if cfg.parallel.nproc != "auto":
        return int(cfg.parallel.nproc)
    wants_gpu = cfg.parallel.device in ("auto", "cuda") and torch.cuda.is_available()
    return torch.cuda.device_count() if wants_gpu else 1


def maybe_relaunch(cfg: Config, argv: list[str]) -> int | None:
    """None: carry on in this process. Otherwise the launcher's exit code."""
    if under_launcher():
        return None
    nproc = resolve_nproc(cfg)
    if nproc <= 1:
        return None
    main_py = Path(__file__).with_name("main.py")
    # The workers see RANK and never relaunch; torchrun's own parser would also reject `--nproc`
    # anywhere on its command line as an ambiguous prefix of --nproc-per-node.
    argv = without_flag(argv, "--nproc")
    cmd = [sys.executable, "-m", "shardtrain.launch", "--standalone", f"--nproc_per_node={nproc}",
           str(main_py), *argv]
    if os.environ.get("RANK", "0") == "0":
        print(f"shardtrain: starting {nproc} processes: torchrun --standalone --nproc_per_node={nproc} "
              f"shardtrain/main.py {' '.join(argv)}", flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return run_forwarding_signals(cmd, env)


def run_forwarding_signals(cmd: list[str], env: dict) -> int:
    """A spot interruption (SageMaker) or a Slurm warning signals this parent process; the workers must
    hear it to checkpoint. SIGTERM goes to the torchrun agent, which passes it on to its workers; SIGUSR1
    goes to the workers themselves, because the agent dies of SIGUSR1 (measured: exit 138)."""
    import signal

    import psutil

    agent = subprocess.Popen(cmd, env=env)

    def forward(signum, frame):
        if signum == signal.SIGUSR1:
            for worker in psutil.Process(agent.pid).children():
                if any(part.endswith("main.py") for part in worker.cmdline()):
                    worker.send_signal(signum)
        else:
            agent.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, forward)
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
    or data error), as a user's script would expect."""
    import logging

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        run(parse_args(args))
    except ChildFailedError as e:
        code = e.get_first_failure()[1].exitcode
        return code if code > 0 else 1  # negative: killed by a signal
    return 0


if __name__ == "__main__":
    sys.exit(quiet_torchrun(sys.argv[1:]))
