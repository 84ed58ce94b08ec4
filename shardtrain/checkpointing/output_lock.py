"""One run at a time in an output folder.

Two jobs in one folder (a job submitted twice, a rerun while the first still trains) would both resume from the
same checkpoint and write the same step folders, each overwriting the other's. The first run's rank 0 holds a
lock on OUT/.shardtrain.lock for as long as it trains; a second run is refused in one line that names the holder,
before it reads or clears anything. `shardtrain train` checks it before any process starts, and rank 0 takes it
before it reads a checkpoint (under torchrun, srun or deepspeed too).

POSIX record locks (lockf): the kernel drops one when its process ends however it ends (a SIGKILL, an OOM kill),
so a preempted or crashed job never leaves a stale lock behind; forked helpers (DataLoader workers) do not
inherit it; and they work on the NFS / Lustre mounts clusters share output folders on. A filesystem without
locks leaves the folder unguarded rather than refusing to train.
"""

from __future__ import annotations

import errno
import os
import socket
import time
from pathlib import Path

from shardtrain.config.settings import ConfigError, where

LOCK_FILE = ".shardtrain.lock"


class OutputLock:
    """Held until release() or the end of the process."""

    def __init__(self, fd: int):
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing drops the process's lock
            self.fd = None


def hold_output_dir(output_dir: str | os.PathLike) -> OutputLock | None:
    """The folder's lock, or a ConfigError naming the run that holds it; None where the filesystem has no locks."""
    import fcntl

    path = Path(output_dir) / LOCK_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "a process that wrote nothing yet"
        os.close(fd)
        if e.errno in (errno.EACCES, errno.EAGAIN):
            raise ConfigError(
                f"{where('output_dir')} {output_dir}: another run is training in it ({holder}); wait for it to "
                f"end or stop it, or choose another --output-dir"
            ) from None
        return None  # ENOLCK, ENOSYS, EOPNOTSUPP: no locks on this filesystem
    os.ftruncate(fd, 0)
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime())
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {since}\n".encode(), 0)
    return OutputLock(fd)


def check_output_dir_free(output_dir: str | os.PathLike) -> None:
    """Before any process starts: the same refusal, the lock not kept (rank 0 takes it), no folder made."""
    if not (Path(output_dir) / LOCK_FILE).exists():
        return  # no run has trained in it
    lock = hold_output_dir(output_dir)
    if lock is not None:
        lock.release()
