"""One run at a time in an output folder (checkpointing/output_lock.py): a second run is refused in one line naming
the first, before any process starts; the lock dies with its process, however it ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
from launch import test_env

from shardtrain import cli
from shardtrain.checkpointing.output_lock import LOCK_FILE, hold_output_dir
from shardtrain.config.settings import ConfigError

# A run's rank 0 holding its folder, as the Trainer does, until it is killed.
HOLDER = """
import sys, time
from shardtrain.checkpointing.output_lock import hold_output_dir
lock = hold_output_dir(sys.argv[1])
print("held", flush=True)
time.sleep(600)
"""

TASK = textwrap.dedent("""
    import torch
    from torch import nn
    from shardtrain import Workload

    class Tiny(Workload):
        def build_model(self):
            return nn.Linear(4, 2)

        def datasets(self):
            rows = [{"x": torch.zeros(4), "labels": torch.tensor(0)}] * 8
            return rows, None
""")


@pytest.fixture
def holder(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], env=test_env(), stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    yield out, proc
    proc.kill()
    proc.wait()


def test_a_second_run_in_a_held_folder_is_one_line_before_any_process_starts(holder, tmp_path, capsys, monkeypatch):
    out, proc = holder
    with pytest.raises(ConfigError, match=rf"another run is training in it \(pid {proc.pid} on "):
        hold_output_dir(out)
    (tmp_path / "tiny_task.py").write_text(TASK)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    code = cli.main(["train", "--workload", "tiny_task:Tiny", "--nproc", "2", "--output-dir", str(out)])
    printed, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1, err
    assert f"--output-dir (checkpoint.output_dir) {out}: another run is training in it (pid {proc.pid}" in err
    assert "starting 2 processes" not in printed and sorted(os.listdir(out)) == [LOCK_FILE]


def test_the_lock_dies_with_its_process_and_taking_it_changes_nothing(holder):
    out, proc = holder
    proc.send_signal(signal.SIGKILL)  # a preempted or OOM-killed job never leaves a stale lock behind
    proc.wait()
    lock_file = out / LOCK_FILE
    before = (lock_file.read_bytes(), lock_file.stat().st_mtime_ns)
    lock = hold_output_dir(out)
    assert lock is not None
    # A run that then fails leaves a previous run's folder byte for byte as it was (tests/dist/test_bad_input.py).
    assert (lock_file.read_bytes(), lock_file.stat().st_mtime_ns) == before
    lock.release()


@pytest.mark.parametrize("procid", ["0", "1"])
def test_under_srun_only_rank_0_checks_the_folder(holder, tmp_path, capsys, monkeypatch, procid):
    """srun sets SLURM_PROCID, not RANK. A task 1 that took the lock for an instant to check it refused its own
    rank 0, which was taking it to train (CI: a requeued job ended with "another run is training in it")."""
    out, proc = holder  # here the holder stands in for this job's rank 0, already training
    (tmp_path / "tiny_task.py").write_text(TASK)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SLURM_PROCID", procid)
    code = cli.main(["train", "--workload", "tiny_task:Tiny", "--output-dir", str(out), "--check-only"])
    err = capsys.readouterr().err
    if procid == "0":  # rank 0, or the batch shell's one check before srun: a run in the folder is refused
        assert code == 2 and f"another run is training in it (pid {proc.pid}" in err, err
    else:
        assert code == 0 and err == "", err


def test_a_lock_held_for_an_instant_refuses_nobody_and_one_held_elsewhere_is_named(tmp_path, monkeypatch):
    """A lock that no process here holds once /proc/locks is read was let go in between (another job's instant
    check before its launch) or is held on another machine of a shared filesystem. The first refused a run that
    could have trained, naming "a process on another machine"; it is now taken again, and only a lock that stays
    held for a second is refused as another machine's."""
    import errno
    import fcntl
    import time

    from shardtrain.checkpointing import output_lock

    real_lockf, refusals = fcntl.lockf, []

    def held_elsewhere(times):
        def lockf(fd, how):
            if len(refusals) < times:
                refusals.append(how)
                raise OSError(errno.EAGAIN, "Resource temporarily unavailable")
            return real_lockf(fd, how)

        return lockf

    monkeypatch.setattr(fcntl, "lockf", held_elsewhere(1))  # let go before /proc/locks was read
    lock = hold_output_dir(tmp_path / "run")
    assert lock is not None and len(refusals) == 1
    lock.release()

    refusals.clear()
    monkeypatch.setattr(fcntl, "lockf", held_elsewhere(10**6))  # held on another machine throughout
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"another run is training in it \(a process on another machine\)"):
        hold_output_dir(tmp_path / "run")
    assert output_lock.VANISHED_HOLDER_SECONDS <= time.monotonic() - started < 3 * output_lock.VANISHED_HOLDER_SECONDS
