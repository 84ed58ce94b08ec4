"""One run at a time in an output folder.

Two jobs in one folder (a job submitted twice, a rerun while the first still trains) would both resume from the
same checkpoint and write the same step folders, each overwriting the other's. The first run's rank 0 holds a
lock on OUT/.shardtrain.lock for as long as it trains; a second run is refused in one line that names the holder,
before it reads or clears anything. `shardtrain train` checks it before any process starts, and rank 0 takes it
before it reads a checkpoint (under torchrun, srun or deepspeed too).

POSIX record locks (lockf): the kernel drops one when its process ends however it ends (a SIGKILL, an OOM kill),
so a preempted or crashed job never leaves a stale lock behind, and forked helpers (DataLoader workers) do not
inherit it. Shared filesystems implement them across hosts (NFS through its lock service, Lustre when mounted
with `flock`; neither is tested here). A filesystem without locks leaves the folder unguarded rather than
refusing to train.
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
    """The folder's lock, or a ConfigError naming the run that holds it; None where the filesystem has no locks.
    The lock file is created once and never written: a run that fails leaves a previous run's folder exactly as
    it was (tests/dist/test_bad_input.py compares it byte for byte)."""
    import fcntl

    path = Path(output_dir) / LOCK_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    # A lock that no process on this machine holds once it is looked up was either taken on another machine of a
    # shared filesystem, or held here for an instant and let go (another job's check_output_dir_free, below):
    # taken again for a second before another machine is named, so an instant check refuses nobody.
    deadline = time.monotonic() + VANISHED_HOLDER_SECONDS
    while True:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return OutputLock(fd)
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.EAGAIN):
                os.close(fd)
                return None  # ENOLCK, ENOSYS, EOPNOTSUPP: no locks on this filesystem
        holder = _local_holder(path)
        if holder is not None or time.monotonic() >= deadline:
            os.close(fd)
            raise ConfigError(
                f"{where('output_dir')} {output_dir}: another run is training in it "
                f"({holder or 'a process on another machine'}); wait for it to end or stop it, or choose another "
                f"--output-dir"
            )
        time.sleep(0.05)


VANISHED_HOLDER_SECONDS = 1.0


def _local_holder(path: Path) -> str | None:
    """Who holds the lock on this machine, from the kernel's table of its locks (/proc/locks: `N: POSIX ADVISORY
    WRITE PID MAJOR:MINOR:INODE ...`, the device numbers in hex); None where no process here holds it."""
    st = path.stat()
    file_id = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as table:
            for line in table:
                fields = line.split()
                if len(fields) > 5 and fields[1] == "POSIX" and fields[5] == file_id:
                    return f"pid {fields[4]} on {socket.gethostname()}"
    except OSError:
        pass
    return None


def check_output_dir_free(output_dir: str | os.PathLike) -> None:
    """Before any process starts: the same refusal, the lock not kept (rank 0 takes it), no folder made."""
    if not (Path(output_dir) / LOCK_FILE).exists():
        return  # no run has trained in it
    lock = hold_output_dir(output_dir)
    if lock is not None:
        lock.release()
