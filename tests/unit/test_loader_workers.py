"""DataLoader workers and stop signals: out of the trainer's process group (a Ctrl-C or a launcher's SIGTERM to
that group must not kill them mid-step), yet ended normally at interpreter exit, at once when the training stream
closes, and within a fraction of a second of the trainer's os._exit."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import torch
from launch import REPO, test_env
from torch.utils.data import TensorDataset

from shardtrain.data.loaders import TrainStream, init_worker

SCRIPT = textwrap.dedent("""
    import os, signal, sys
    import torch
    from torch.utils.data import DataLoader, Dataset
    from shardtrain.data.loaders import init_worker

    class WhoAmI(Dataset):
        def __len__(self): return 4
        def __getitem__(self, i):
            return torch.tensor([os.getpid(), os.getpgrp(), signal.getsignal(signal.SIGINT) == signal.SIG_IGN])

    loader = DataLoader(WhoAmI(), batch_size=2, num_workers=2, persistent_workers=True, worker_init_fn=init_worker)
    KEEP = iter(loader)  # never exhausted nor shut down: interpreter exit has to end the workers
    pid, pgrp, ignores_int = next(KEEP)[0].tolist()
    print(pid != os.getpid(), pgrp == pid, pgrp != os.getpgrp(), bool(ignores_int), flush=True)
""")


def test_workers_leave_the_trainers_group_and_still_end_at_exit():
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=REPO, env=test_env(), capture_output=True, text=True, timeout=60
    )  # a worker that ignores multiprocessing's SIGTERM at exit hangs here
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "True", "True", "True"], done.stdout + done.stderr[-2000:]


ORPHANED = textwrap.dedent("""
    import os
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    from shardtrain.data.loaders import init_worker

    # More batches than the workers prefetch: next() hands one a new index, so torch's own check is 5 s away.
    loader = DataLoader(TensorDataset(torch.arange(64)), batch_size=2, num_workers=2, persistent_workers=True,
                        worker_init_fn=init_worker)
    it = iter(loader)
    next(it)
    print(*(w.pid for w in it._workers), flush=True)
    os._exit(0)  # how the trainer leaves (runtime/distributed.teardown_and_exit): no helper is ended
""")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def test_orphaned_workers_end_well_within_torchs_5_s():
    # torch's own check takes up to 5 s (its status interval): Slurm's KillWait can be as short, and the job step
    # counts as running until they are gone. Ours wakes every 0.2 s; 2 s leaves room for a loaded machine.
    # Popen, not run: the workers share the stdout pipe, whose end run() would wait for.
    with subprocess.Popen(
        [sys.executable, "-c", ORPHANED], cwd=REPO, env=test_env(), stdout=subprocess.PIPE, text=True
    ) as proc:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert proc.wait(timeout=60) == 0 and len(pids) == 2, pids
        deadline = time.monotonic() + 2.0
        while any(map(_alive, pids)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(map(_alive, pids)), f"workers {pids} still running 2 s after the trainer's exit"


def test_close_ends_the_workers_even_while_the_stream_is_referenced():
    # Still referenced, as OOMRecovery's reference cycle with its Injection held it on after train() returned:
    # close() ends the workers all the same.
    workers_kwargs = dict(num_workers=2, persistent_workers=True, worker_init_fn=init_worker)
    stream = TrainStream(
        TensorDataset(torch.arange(16)), None, 2, rank=0, world_size=1, seed=0, loader_kwargs=workers_kwargs
    )
    order = stream.epoch_indices()
    first = stream.next_batch()[0].tolist()
    workers = list(stream._iter._workers)
    assert all(w.is_alive() for w in workers)
    stream.close()
    assert not any(w.is_alive() for w in workers)
    assert first + stream.next_batch()[0].tolist() == order[:4]  # read on from the same position
    stream.close()


def test_unset_num_workers_leaves_each_rank_a_cpu_of_its_own(monkeypatch):
    """The default was 4 workers per rank whatever the machine: 2 ranks on 2 cores started 8 workers, and
    torch warned on every rank. Unset now means up to 4, as many as leave each rank a CPU of its own (what
    `shardtrain doctor` checks); a number given is used as given."""
    from shardtrain.config.settings import parse_cli
    from shardtrain.data.loaders import loader_workers
    from shardtrain.runtime import device_defaults

    assert parse_cli([]).data.num_workers is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    for cpus, want in ((2, 0), (4, 1), (8, 3), (32, 4)):
        monkeypatch.setattr(device_defaults, "allotted_cpus", lambda cpus=cpus: cpus)
        assert loader_workers(parse_cli([])) == want, cpus
    assert loader_workers(parse_cli(["--num-workers", "6"])) == 6
