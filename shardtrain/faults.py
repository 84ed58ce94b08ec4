"""Test-only fault injection: kill a rank at an exact point, so tests can prove that nothing is lost.

    SHARDTRAIN_FAULT="POINT@STEP:RANK[,POINT@STEP:RANK...][|...]"

POINT is where rank RANK fails while working on optimizer step STEP (1-based):
    step    SIGKILL itself after the step's backward, before the optimizer update (a mid-step crash)
    save    SIGKILL itself after writing its checkpoint shards, before COMMITTED (a torn save)
    enospc  its checkpoint write fails with "No space left on device" (a full disk, simulated)
Groups separated by "|" apply to successive torchrun attempts (TORCHELASTIC_RESTART_COUNT), so one
`torchrun --max-restarts N` launch can crash at several points and prove each restart resumes.
Unset (always, outside tests) it costs one dictionary lookup per call.
"""
from __future__ import annotations

import errno
import os
import signal

ENV = "SHARDTRAIN_FAULT"
POINTS = ("step", "save", "enospc")


def _parse() -> set[tuple[str, int, int]]:
    spec = os.environ.get(ENV, "").strip()
    if not spec:
        return set()
    attempts = spec.split("|")
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt >= len(attempts):
        return set()
    faults = set()
    for item in filter(None, (x.strip() for x in attempts[attempt].split(","))):
        point, _, where = item.partition("@")
        step, _, rank = where.partition(":")
        if point not in POINTS:
            raise ValueError(f"{ENV}: unknown point {point!r} (one of {', '.join(POINTS)})")
        faults.add((point, int(step), int(rank or 0)))
    return faults


_FAULTS = _parse()


def armed(point: str, step: int, rank: int) -> bool:
    return bool(_FAULTS) and (point, step, rank) in _FAULTS


def maybe_kill(point: str, step: int, rank: int) -> None:
    if armed(point, step, rank):
        print(f"[fault injection] rank {rank}: SIGKILL at {point}@{step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def maybe_disk_full(step: int, rank: int) -> None:
    if armed("enospc", step, rank):
        raise OSError(errno.ENOSPC, "No space left on device (fault injection)")
