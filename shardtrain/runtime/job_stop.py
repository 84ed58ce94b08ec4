"""Stop every rank of the job within seconds, from any one rank, while the others may be blocked in a collective.

A rank that cannot go on safely (an out-of-memory error inside a pass whose collectives its partners are already
waiting in: shardtrain/loop/oom.py) cannot reach them through the process group: they wait for it there. So every
rank of a multi-rank job runs one daemon thread that polls the job's c10d store (the one the process group was
made with) for a stop key. The rank that stops sets it, says its one line, waits until every other rank has seen
it and leaves; each other rank leaves as soon as its thread sees the key (exit 1, nothing said, nothing saved).
This does not depend on the launcher: torchrun's SIGTERM cannot interrupt a rank blocked inside an NCCL wait (the
loop's handler only runs between Python bytecodes), and srun without --kill-on-bad-exit sends none at all.
Committed checkpoints are untouched: a step directory counts only once COMMITTED is written
(shardtrain/checkpointing/store.py), and an interrupted write never writes it.

Cost: one store lookup every POLL_SECONDS per rank, off the training thread (the store client releases the GIL).
"""

from __future__ import annotations

import os
import sys
import threading
import time

KEY = "shardtrain/stop/line"
SPEAKERS = "shardtrain/stop/speakers"
SEEN = "shardtrain/stop/seen"
POLL_SECONDS = 0.5
WAIT_FOR_OTHERS_SECONDS = 5.0

_watching = False
_speaking = False  # this rank set the key: its own watcher leaves the exit to stop_job


def _store():
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    # The store the default process group was made with: torchrun's (maybe per-attempt prefixed) or env://'s.
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def watch() -> None:
    """Start this process's watcher thread (once; a no-op in one process)."""
    global _watching
    store = _store()
    if store is None or _watching:
        return
    _watching = True
    # A connection of its own: a lookup blocked on a silent link must not hold the client the process group and
    # the loop's error reporting use (Store.clone is torch's way to use one store from several threads).
    store = store.clone()
    threading.Thread(target=_poll, args=(store,), name="shardtrain-stop-watch", daemon=True).start()


def _poll(store) -> None:
    while True:
        time.sleep(POLL_SECONDS)
        try:
            if store.check([KEY]) and not _speaking:
                _leave(store)
        except Exception:  # noqa: BLE001 - the store is gone: the job is ending anyway, and the loop will say why
            return


def _leave(store) -> None:
    try:
        store.add(SEEN, 1)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def stop_job(line: str, rank: int, world_size: int) -> None:
    """Says `line` (the first rank to call this does; any other one that fails at the same moment stays quiet),
    then ends this process and, through the watchers, every other rank of the job. Never returns. In one process
    it raises MemoryError(line) instead, which the CLI reports as its one line."""
    global _speaking
    store = _store()
    if store is None:
        raise MemoryError(line)
    _speaking = True
    first = store.add(SPEAKERS, 1) == 1
    if not first:
        _leave(store)  # another rank says it
    where = "" if rank == 0 else f" (rank {rank})"
    print(f"shardtrain: error{where}: {line}", file=sys.stderr, flush=True)
    store.set(KEY, line)
    # The others leave on their own; waiting for them first keeps their collectives from failing (and speaking)
    # because this rank left.
    deadline = time.monotonic() + WAIT_FOR_OTHERS_SECONDS
    while time.monotonic() < deadline and store.add(SEEN, 0) < world_size - 1:
        time.sleep(0.05)
    sys.stdout.flush()
    os._exit(1)
