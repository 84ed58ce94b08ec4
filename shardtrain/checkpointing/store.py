"""Checkpoints that never lose work.

Layout:  OUT/checkpoints/step-000120/{model_optim/ | engine/, strategy_state.json, trainer_state.json,
         rng/rank-00000.safetensors, COMMITTED}      OUT/checkpoints/latest  ("step-000120")
         OUT/checkpoints/best  ("step-000080": --metric-for-best-model's choice, loop/best.py)
A step directory counts only once COMMITTED exists; it is written last, after every rank has finished.
`latest` and `best` are replaced atomically; --keep-last never prunes the checkpoint that the committed trainer
state names as the best. Nothing here is ever unpickled: JSON and safetensors only.
With --async-save the shards are written in the background (start_save -> PendingSave); the commit waits until
every rank's write is on disk (finish_save, or commit_agreed from the loop's per-step agreement).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from shardtrain.runtime import faults

if TYPE_CHECKING:
    import torch

# torch, numpy and the process group are imported by the functions that save and load state, not here: the
# parent process of `train --nproc N` reads this module's folder layout (refuse_to_overwrite) without torch.

FORMAT_VERSION = 1
COMMIT_MARKER = "COMMITTED"
TRAINER_STATE = "trainer_state.json"
BEST = "best"  # the pointer file beside `latest`
STEP_DIR = re.compile(r"^step-(\d{6,})$")


def checkpoints_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def is_committed(path: Path) -> bool:
    return (path / COMMIT_MARKER).is_file() and (path / TRAINER_STATE).is_file()


def step_number(path: Path) -> int | None:
    """120 for `step-000120` (steps past 999,999 have more digits, so names do not sort as numbers)."""
    m = STEP_DIR.match(path.name)
    return int(m.group(1)) if m else None


def committed_steps(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and is_committed(p)]
    return [p for _, p in sorted(found)]


def cut_short(root: Path, after: Path | None) -> list[Path]:
    """Step directories newer than `after` (all of them for None) without COMMITTED: saves a kill cut short, which
    a resume passes over and the next save removes."""
    if not root.is_dir():
        return []
    newest = (step_number(after) if after is not None else None) or -1
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and not is_committed(p)]
    return [p for step, p in sorted(found) if step > newest]


def latest_committed(root: Path) -> Path | None:
    """`latest` if it points at a committed checkpoint, else the newest committed directory."""
    pointer = root / "latest"
    if pointer.is_file():
        candidate = root / pointer.read_text().strip()
        if is_committed(candidate):
            return candidate
    steps = committed_steps(root)
    return steps[-1] if steps else None


def best_committed(root: Path) -> Path | None:
    """The checkpoint `best` names, if it is committed (a run without --metric-for-best-model has none)."""
    pointer = root / BEST
    if not pointer.is_file():
        return None
    candidate = root / pointer.read_text().strip()
    return candidate if is_committed(candidate) else None


def best_step_dir(root: Path, trainer_state: dict) -> Path | None:
    """The step directory that a trainer state's best record (loop/best.py) names, or None."""
    step = (trainer_state.get("best") or {}).get("step")
    return root / step_dir_name(step) if step is not None else None


def point_best(root: Path, path: Path) -> None:
    """Rank 0: `best` names this committed step directory (atomically, as `latest`)."""
    if (root / BEST).is_file() and (root / BEST).read_text().strip() == path.name:
        return
    _write_atomic(root / BEST, path.name + "\n")


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rng_state() -> dict[str, torch.Tensor]:
    import torch

    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def save_rng(path: Path, rank: int) -> None:
    import numpy as np
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    py_state = random.getstate()
    np_state = np.random.get_state()
    meta = {
        "python": json.dumps([py_state[0], list(py_state[1]), py_state[2]]),
        "numpy": json.dumps([np_state[0], np_state[1].tolist(), *np_state[2:]]),
    }
    save_file(rng_state(), str(path / f"rank-{rank:05d}.safetensors"), metadata=meta)


def load_rng(path: Path, rank: int) -> None:
    import numpy as np
    import torch
    from safetensors import safe_open

    file = path / f"rank-{rank:05d}.safetensors"
    if not file.is_file():
        return  # a different world size: ranks without a saved state keep their fresh seeds
    with safe_open(str(file), framework="pt") as f:
        meta = f.metadata()
        torch.set_rng_state(f.get_tensor("torch"))
        if "cuda" in f.keys() and torch.cuda.is_available():
            torch.cuda.set_rng_state(f.get_tensor("cuda"))
    version, internal, gauss = json.loads(meta["python"])
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = json.loads(meta["numpy"])
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def save_checkpoint(strategy, trainer_state: dict, output_dir: str | Path, keep_last: int) -> Path:
    """Every rank calls this. Returns the committed directory."""
    return finish_save(strategy, start_save(strategy, trainer_state, output_dir, keep_last, background=False))


class AsyncWrite:
    """One rank's background checkpoint write (Strategy.save_async): done() without blocking, wait() until its
    files are on disk."""

    def __init__(self, future: Future):
        self.future = future
        self.started, self.finished = time.perf_counter(), None
        future.add_done_callback(self._finish)

    def _finish(self, _future) -> None:
        self.finished = time.perf_counter()

    def done(self) -> bool:
        return self.future.done()

    def wait(self) -> BaseException | None:
        """Blocks until the write ends; its error, or None once the files are written and fsynced."""
        from torch.distributed.checkpoint.api import CheckpointException

        # Any error: the caller agrees with the other ranks, then reports it. DCP's own is a BaseException.
        try:
            self.future.result()
            return None
        except (Exception, CheckpointException) as e:  # noqa: BLE001
            return e

    @property
    def seconds(self) -> float:
        """From the start of the write (after staging) until it ended (until now while it runs)."""
        return (self.finished or time.perf_counter()) - self.started


@dataclass
class PendingSave:
    """A checkpoint whose shards are written (or being written, --async-save) but not yet committed."""

    path: Path
    keep_last: int
    state: dict  # trainer_state.json of the snapshotted step, written at the commit
    write: AsyncWrite | None = None  # this rank's background write; None: written before start_save returned
    failure: BaseException | None = None  # this rank's error so far

    @property
    def step(self) -> int:
        return self.state["step"]

    def write_done(self) -> bool:
        """Without blocking: this rank has nothing left to write (written, or failed)."""
        return self.write is None or self.failure is not None or self.write.done()

    def write_failed(self) -> bool:
        """This rank's write failed; only meaningful once write_done()."""
        if self.failure is None and self.write is not None and self.write.done():
            self.failure = self.write.wait()
        return self.failure is not None


def start_save(strategy, trainer_state: dict, output_dir: str | Path, keep_last: int, background: bool) -> PendingSave:
    """Every rank calls this: the step's directory, the strategy's shards (`background`: staged to host memory
    and written by a thread, strategy.save_async) and this rank's RNG state, as of this step. Nothing is committed:
    finish_save or commit_agreed does that once every rank's shards are on disk."""
    from torch.distributed.checkpoint.api import CheckpointException

    from shardtrain.runtime.distributed import barrier

    root = checkpoints_root(output_dir)
    path = root / step_dir_name(trainer_state["step"])
    if strategy.dist.is_rank0:
        root.mkdir(parents=True, exist_ok=True)
        if path.exists():  # an earlier, interrupted save of this same step
            shutil.rmtree(path)
        path.mkdir()
    barrier()
    # The trainer state and RNG belong to the step that was snapshotted, not to the step its write finishes at.
    pending = PendingSave(
        path,
        keep_last,
        {
            **trainer_state,
            "format_version": FORMAT_VERSION,
            "strategy": strategy.describe(),
            "world_size": strategy.dist.world_size,
        },
    )
    try:
        if background:
            pending.write = strategy.save_async(path)
        else:
            strategy.save(path)
        save_rng(path / "rng", strategy.dist.rank)
    except (OSError, CheckpointException) as e:
        pending.failure = e
    return pending


def finish_save(strategy, pending: PendingSave) -> Path:
    """Every rank calls this: wait for this rank's write, agree that every rank's is on disk, commit. Returns the
    committed directory."""
    from shardtrain.runtime.distributed import any_rank

    if pending.write is not None and pending.failure is None:
        pending.failure = pending.write.wait()
    # Ranks agree before anything is committed: one rank's full disk must not leave the others waiting.
    failed = any_rank(pending.failure is not None, strategy.device)
    return _commit(strategy, pending, failed, agreed_in_loop=False)


def commit_agreed(strategy, pending: PendingSave, any_failed: bool) -> Path:
    """Every rank calls this once the loop's one all-reduce per step (step_health.agree) said that no rank is still
    writing: that all-reduce already synchronised the ranks, so rank 0 commits without a collective of its own."""
    return _commit(strategy, pending, any_failed, agreed_in_loop=True)


def _commit(strategy, pending: PendingSave, failed: bool, agreed_in_loop: bool) -> Path:
    from shardtrain.runtime.distributed import all_reduce_max, barrier

    rank0, path, failure = strategy.dist.is_rank0, pending.path, pending.failure
    root = path.parent
    if failed:
        # Every rank says the same thing: the highest errno seen anywhere (ENOSPC, EDQUOT, EIO...).
        error = rank_error(failure) if failure else None
        code = all_reduce_max(float(_errno_of(error, path) or (-1 if error else 0)), strategy.device)
        _abandon(path, root, rank0)
        from shardtrain.config.settings import ConfigError

        previous = latest_committed(root)
        cause = (
            _cause(error)
            if error and getattr(error, "errno", None) == code
            else os.strerror(int(code))
            if code > 0
            else "a rank failed to write its shards"
        )
        kept = f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint exists"
        raise ConfigError(f"saving checkpoint {path} failed ({cause}); {kept}; {_remedy(int(code), root)}")
    faults.maybe_kill("save", pending.step, strategy.dist.rank)
    if not agreed_in_loop:
        barrier()  # every rank's shards are on disk before the commit marker
    if rank0:
        _write_atomic(path / TRAINER_STATE, json.dumps(pending.state, indent=1))
        _write_atomic(path / COMMIT_MARKER, "ok\n")
        _fsync_dir(path)
        _write_atomic(root / "latest", path.name + "\n")
        # After `latest`: a kill between the two leaves `best` at the previous best, which the resume repairs.
        best = best_step_dir(root, pending.state)
        if best == path:
            point_best(root, path)
        prune(root, pending.keep_last, keep=path, best=best)
    if not agreed_in_loop:
        barrier()  # the caller may read the commit on any rank (final_model.write_final_model does)
    return path


def _abandon(path: Path, root: Path, rank0: bool) -> None:
    """A failed save leaves no partial directory (a later start would also ignore it: no COMMITTED)."""
    from shardtrain.runtime.distributed import barrier

    barrier()
    if rank0:
        shutil.rmtree(path, ignore_errors=True)


def _errno_of(error: BaseException | None, path: Path) -> int | None:
    """The failed write's errno. torch's own stream writer, under DCP, reports a full disk as a RuntimeError
    ("file write failed") with none: a filesystem left (almost) without space then says ENOSPC. Read before
    the partial folder is removed, which frees that space again."""
    import errno

    code = getattr(error, "errno", None)
    if code or error is None:
        return code
    try:
        full = shutil.disk_usage(path if path.exists() else path.parent).free < FULL_BELOW_BYTES
    except OSError:
        return None
    return errno.ENOSPC if full else None


# Free space under which a write error without an errno is taken for a full disk (the failed write filled it).
FULL_BELOW_BYTES = 1 << 20


def _remedy(code: int, root: Path) -> str:
    """What to do about a failed write, by its errno: a full disk and a permission problem are fixed differently."""
    import errno

    if code in (errno.ENOSPC, errno.EDQUOT):
        fix = f"free space under {root}"
    elif code in (errno.EACCES, errno.EPERM, errno.EROFS):
        fix = f"make {root} writable"
    else:
        fix = "fix the cause"
    return f"{fix} and rerun with --resume auto"


def rank_error(e: BaseException) -> BaseException:
    """The error a rank hit, out of DCP's CheckpointException, which wraps every failing rank's (with its
    traceback) and carries no errno of its own: a real full disk reaches the caller that way."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        return first[0] if isinstance(first, tuple) else first
    return e


def _cause(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    text = " ".join(str(e).split())
    return ("No space left on device" if "No space left" in text else text[:200]) or type(e).__name__


def prune(root: Path, keep_last: int, keep: Path, best: Path | None = None) -> None:
    """Drop old committed checkpoints beyond keep_last (never `keep`, nor the `best` one) and abandoned partial
    ones."""
    committed = committed_steps(root)
    for old in committed[:-keep_last] if keep_last > 0 else []:
        if old not in (keep, best):
            shutil.rmtree(old, ignore_errors=True)
    for p in root.iterdir():
        if STEP_DIR.match(p.name) and not is_committed(p) and p != keep:
            shutil.rmtree(p, ignore_errors=True)


def read_trainer_state(path: Path) -> dict:
    from shardtrain.config.settings import ConfigError

    try:
        state = json.loads((path / TRAINER_STATE).read_text())
    except FileNotFoundError:
        raise ConfigError(f"--resume {path}: not a committed shardtrain checkpoint (no {TRAINER_STATE})") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"--resume {path / TRAINER_STATE}: corrupt JSON at line {e.lineno}: {e.msg}") from None
    if state.get("format_version", 0) > FORMAT_VERSION:
        raise ConfigError(
            f"--resume {path}: checkpoint format {state['format_version']} is newer than this "
            f"shardtrain understands ({FORMAT_VERSION}); upgrade shardtrain"
        )
    return state


def checkpoints_root_given(path: Path) -> Path | None:
    """The checkpoints folder of a run folder (OUT) or the folder itself (OUT/checkpoints); None for another
    folder (a step directory). A run folder comes first, whatever its name: SageMaker's is /opt/ml/checkpoints."""
    if (path / "checkpoints").is_dir():
        return path / "checkpoints"
    return path if path.name == "checkpoints" else None


def find_resume_dir(resume: str, output_dir: str | Path, label: str = "--resume") -> Path | None:
    if resume == "none":
        return None
    if resume == "auto":
        return latest_committed(checkpoints_root(output_dir))
    path = Path(resume)
    root = checkpoints_root_given(path)
    if root is not None:
        path = latest_committed(root) or path
    if not is_committed(path):
        from shardtrain.config.settings import ConfigError

        if path.is_dir() and not STEP_DIR.match(path.name):
            raise ConfigError(
                f"{label} {resume}: no committed checkpoint in this run folder "
                f"(a run writes one at its end unless --save-final false, and every --save-every N steps)"
            )
        raise ConfigError(f"{label} {resume}: not a committed checkpoint (missing {COMMIT_MARKER})")
    return path


def find_checkpoint(source: str | Path, which: str, label: str) -> Path:
    """`export` / `predict` / the final model: `which` is final (a run folder's newest committed checkpoint, or
    the step directory given) or best (the checkpoint `best` names in a run folder or its checkpoints/)."""
    path = Path(source)
    if which == "final":
        return find_resume_dir(str(path), path, label=label)
    from shardtrain.config.settings import ConfigError

    root = checkpoints_root_given(path)
    if root is None or not root.is_dir():
        raise ConfigError(
            f"{label} --checkpoint best: {path} is not a run's folder (OUT or OUT/checkpoints); a step "
            f"directory is one checkpoint already: name it without --checkpoint"
        )
    best = best_committed(root)
    if best is None:
        raise ConfigError(
            f"{label} --checkpoint best: {root} has no best checkpoint ({BEST}); a run keeps one with "
            f"--metric-for-best-model NAME or --early-stopping-patience N"
        )
    return best


# What a run writes into its output dir; --overwrite-output-dir removes exactly these, nothing of the user's.
RUN_ARTIFACTS = (
    "checkpoints",
    "tokenizer",
    "metrics.jsonl",
    "eval.jsonl",
    "summary.json",
    "report.html",
    "labels.json",
    "curves.png",
    "throughput.png",
    "memory.png",
)


def previous_run(output_dir: str | Path) -> str | None:
    """The first sign that output_dir already holds a run, or None."""
    out = Path(output_dir)
    latest = latest_committed(checkpoints_root(out))
    if latest is not None:
        return f"checkpoint {latest.name}"
    if (out / "metrics.jsonl").is_file():
        return "metrics.jsonl"
    return None


def refuse_to_overwrite(cfg) -> None:
    """A fresh run (--resume none) in a folder that holds a run would overwrite its metrics and checkpoints:
    only with --overwrite-output-dir. Checked by `train` before any process starts."""
    from shardtrain.config.settings import ConfigError, where

    c = cfg.checkpoint
    found = previous_run(c.output_dir) if c.resume == "none" and not c.overwrite_output_dir else None
    if found:
        raise ConfigError(
            f"{where('output_dir')} {c.output_dir} already holds a run ({found}) and --resume is "
            f"none: --resume auto continues it, --overwrite-output-dir starts over in it "
            f"(deleting its checkpoints and metrics), or choose another --output-dir"
        )


def refuse_another_workloads_checkpoint(cfg) -> None:
    """The checkpoint this run would resume from (its folder's newest under --resume auto, or the one --resume
    names) holds the other built-in's model: not this run's to resume. In its own folder it said "nothing to
    train" at --max-steps and exited 0, the model never trained; a --resume PATH was refused only by the weights'
    names, after the data and a tokenizer folder were made. Checked by `train` before any process starts. (A
    user's workload under a new module path is the same workload renamed: its weights are checked when they load.)"""
    from shardtrain.config.settings import (
        BUILTIN_WORKLOADS,
        ConfigError,
        recorded_workload_target,
        where,
        workload_target,
    )

    c = cfg.checkpoint
    found = find_resume_dir(c.resume, c.output_dir)
    if found is None:
        return
    theirs = recorded_workload_target(read_trainer_state(found).get("config") or {})
    ours = workload_target(cfg)
    builtins = set(BUILTIN_WORKLOADS.values())
    if not theirs or theirs == ours or not (theirs in builtins or ours in builtins):
        return
    shown = {target: short for short, target in BUILTIN_WORKLOADS.items()}
    theirs, ours = shown.get(theirs, theirs), shown.get(ours, ours)
    if found.parent.resolve() == checkpoints_root(c.output_dir).resolve():
        raise ConfigError(
            f"{where('output_dir')} {c.output_dir} holds a run of {theirs} ({found.name}), and this run trains "
            f"{ours}: choose another --output-dir, or start over in it with --resume none --overwrite-output-dir"
        )
    raise ConfigError(
        f"{where('resume')} {c.resume}: a checkpoint of {theirs} ({found.name}), and this run trains {ours}: "
        f"name a checkpoint of {ours}, or start afresh with --resume none"
    )


def clear_previous_run(output_dir: str | Path) -> None:
    """Rank 0, before anything of the new run is written (--overwrite-output-dir)."""
    out = Path(output_dir)
    for name in RUN_ARTIFACTS:
        path = out / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
