"""Test-only fault injection: kill a rank at an exact point, so tests can prove that nothing is lost.

    SHARDTRAIN_FAULT="POINT@STEP:RANK[,POINT@STEP:RANK...][|...]"

POINT is where rank RANK fails while working on optimizer step STEP (1-based):
    step    SIGKILL itself after the step's backward, before the optimizer update (a mid-step crash)
    save    SIGKILL itself after writing its checkpoint shards, before COMMITTED (a torn save)
    stall   sleeps 120 s after the step's backward (a slow step, for signals that must act within one)
    write_stall  the DCP write of step STEP's checkpoint sleeps 300 s (with --async-save: in the background,
                 while training goes on), so a test can kill -9 the job while that write is in flight
And, for benchmarks, storage of a fixed speed: SHARDTRAIN_WRITE_DELAY=SECONDS delays every rank's DCP write of
every checkpoint by that much (sync or async alike), so a benchmark's result does not follow the disk cache.
SHARDTRAIN_FAULT_HOLD=PATH: while that file exists every step waits after its backward, until a stop signal
ends the wait and removes the file (an elastic test holds a run at one world size until the agent restarts it
for a node that joins). A step number N in the file holds only steps >= N; writing a larger one lets a held
step go on.
With SHARDTRAIN_FAULT_ONCE_DIR set, each fault fires once per job: it leaves a marker file there before killing,
so one `torchrun --max-restarts N` launch can crash at several points in turn and prove that every restart resumes
by itself (an extra restart, e.g. a slow rendezvous, does not shift the schedule).
Unset (always, outside tests) it costs one set lookup per call.
"""

from __future__ import annotations

import os
import signal
import time

ENV = "SHARDTRAIN_FAULT"
POINTS = ("step", "save", "stall", "write_stall")
WRITE_DELAY_ENV = "SHARDTRAIN_WRITE_DELAY"


def _parse() -> set[tuple[str, int, int]]:
    faults = set()
    for item in filter(None, (x.strip() for x in os.environ.get(ENV, "").split(","))):
        point, _, where = item.partition("@")
        step, _, rank = where.partition(":")
        if point not in POINTS:
            raise ValueError(f"{ENV}: unknown point {point!r} (one of {', '.join(POINTS)})")
        faults.add((point, int(step), int(rank or 0)))
    return faults


_FAULTS = _parse()


def armed(point: str, step: int, rank: int) -> bool:
    if not _FAULTS or (point, step, rank) not in _FAULTS:
        return False
    once = os.environ.get("SHARDTRAIN_FAULT_ONCE_DIR")
    if once:
        marker = os.path.join(once, f"{point}@{step}:{rank}")
        if os.path.exists(marker):
            return False
        os.makedirs(once, exist_ok=True)
        with open(marker, "w"):
            pass
    return True


def maybe_kill(point: str, step: int, rank: int) -> None:
    if armed(point, step, rank):
        print(f"[fault injection] rank {rank}: SIGKILL at {point}@{step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def mid_step(step: int, rank: int) -> None:
    maybe_kill("step", step, rank)
    if armed("stall", step, rank):
        print(f"[fault injection] rank {rank}: stalling at stall@{step}", flush=True)
        time.sleep(120)  # signal handlers still run: the sleep is interrupted for them, then goes on


def _holds(path: str, step: int) -> bool:
    try:
        with open(path) as f:
            text = f.read().strip()
    except FileNotFoundError:
        return False
    return not text.isdigit() or step >= int(text)


def hold(stop, step: int) -> None:
    """SHARDTRAIN_FAULT_HOLD: wait while the file holds this step and `stop` (the loop's StopFlag) is not raised."""
    path = os.environ.get("SHARDTRAIN_FAULT_HOLD")
    if not path or not _holds(path, step):
        return
    while _holds(path, step) and not stop.raised:
        time.sleep(0.05)
    if stop.raised:
        try:
            os.remove(path)  # the restarted workers run free
        except FileNotFoundError:
            pass


def write_delay(step: int, rank: int) -> float:
    """Seconds the checkpoint write of `step` on `rank` waits before writing (0.0 outside tests and benchmarks)."""
    delay = float(os.environ.get(WRITE_DELAY_ENV) or 0.0)
    if armed("write_stall", step, rank):
        print(f"[fault injection] rank {rank}: stalling the checkpoint write at write_stall@{step}", flush=True)
        delay += 300.0
    return delay


def maybe_nan(loss, step: int, steps: list[int], rank: int, world_size: int):
    """Test-only (train.inject_nan_at_steps): the last rank's loss turns NaN on those steps."""
    if steps and step in steps and rank == world_size - 1:
        return loss * float("nan")
    return loss


def after_backward(step: int, rank: int, stop) -> None:
    """The loop's one call into test-only faults, after a step's backward and before its update: SHARDTRAIN_FAULT's
    kill or stall there, then SHARDTRAIN_FAULT_HOLD. (The NaN loss and OOM injections are the loss's and OOM
    recovery's own, at the points they name.)"""
    mid_step(step, rank)
    hold(stop, step)
