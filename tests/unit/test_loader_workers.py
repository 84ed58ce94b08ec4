"""DataLoader workers and stop signals: out of the trainer's process group (a Ctrl-C or a launcher's SIGTERM to
that group must not kill them mid-step), yet ended normally at interpreter exit."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from launch import REPO, test_env

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
