"""The portable checkpoint form: torch.distributed.checkpoint keyed by fully-qualified parameter name.

    model_optim/  {"model": {fqn: tensor}, "optim": {"state": {fqn: {step, exp_avg, exp_avg_sq}}}}
    strategy_state.json   scheduler, loss scaler and per-group learning rates (JSON)

DDP and FSDP save exactly this natively (FSDP: each rank its dim-0 shards), and under DeepSpeed each rank writes
the contiguous ranges of each parameter its partition holds (flat_chunks.py: rectangles of the parameter's own
shape at their global offsets), so any strategy at any world size reads any checkpoint: DCP reshards each
tensor to what the reader holds. Only tensors
go into DCP: its non-tensor entries are read back with torch.load(weights_only=False); optimizer
hyperparameters come from the config, and the learning rates from the JSON.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from shardtrain.checkpointing.flat_chunks import SavePlanner
from shardtrain.checkpointing.store import AsyncWrite, committed_steps, rank_error, step_number
from shardtrain.checkpointing.unpickle_guard import check_dcp_metadata
from shardtrain.config.settings import ConfigError
from shardtrain.runtime import faults

MODEL_DIR = "model_optim"
EXTRA_FILE = "strategy_state.json"


def save_dcp(ckpt_dir: Path, model, optimizer, extra: dict, is_rank0: bool, leave_out=frozenset()) -> None:
    """`leave_out`: parameter names not written (a LoRA model's frozen base, which build_model rebuilds)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    save_portable(ckpt_dir, _without(model_sd, leave_out), optim_sd["state"], extra, is_rank0)


def _without(model_sd: dict, leave_out) -> dict:
    return {k: v for k, v in model_sd.items() if k not in leave_out} if leave_out else model_sd


def save_portable(ckpt_dir: Path, model_sd: dict, optim_state: dict, extra: dict, is_rank0: bool) -> None:
    """Tensors, DTensors or FlatRange partitions (flat_chunks.py) by name."""
    dcp.save(
        {"model": model_sd, "optim": {"state": optim_state}},
        storage_writer=storage_writer(ckpt_dir),
        planner=SavePlanner(),
    )
    if is_rank0:
        (ckpt_dir / EXTRA_FILE).write_text(json.dumps(extra))


def save_dcp_async(
    ckpt_dir: Path, model, optimizer, extra: dict, is_rank0: bool, group, leave_out=frozenset()
) -> AsyncWrite:
    """The same files as save_dcp, written by a background thread. Returns once the state is copied off the live
    tensors into fresh host memory (the writer's own staging: training may then change the tensors); the
    returned write is done when this rank's files are written and fsynced and DCP's metadata is out.

    `group`: a process group used by nothing else. The write runs DCP's plan gather and metadata collectives
    in its thread; on the training group they would interleave with the training's own collectives (a trial
    run crashed once and hung once that way). The thread executor, not the process one: on CPU the staging copy
    is the same either way (shared-memory staging blocked no shorter, measured), and a thread dies with its rank
    on kill -9, leaving no writer process behind."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    future = dcp.async_save(
        {"model": _without(model_sd, leave_out), "optim": {"state": optim_sd["state"]}},
        storage_writer=storage_writer(ckpt_dir),
        process_group=group,
        async_checkpointer_type=AsyncCheckpointerType.THREAD,
    )
    if is_rank0:
        (ckpt_dir / EXTRA_FILE).write_text(json.dumps(extra))  # JSON of the snapshotted step, written now
    return AsyncWrite(future)


def save_portable_async(
    ckpt_dir: Path, model_sd: dict, optim_state: dict, extra: dict, is_rank0: bool, group
) -> AsyncWrite:
    """save_portable in the background, for tensors that are already this rank's private host copies (DeepSpeed's
    partitions): DCP stages nothing more, so the caller's copy was the whole snapshot. `group` as in
    save_dcp_async."""
    future = dcp.async_save(
        {"model": model_sd, "optim": {"state": optim_state}},
        storage_writer=storage_writer(ckpt_dir),
        process_group=group,
        planner=SavePlanner(),
        async_checkpointer_type=AsyncCheckpointerType.THREAD,
        async_stager=_AlreadyStaged(),
    )
    if is_rank0:
        (ckpt_dir / EXTRA_FILE).write_text(json.dumps(extra))
    return AsyncWrite(future)


class _AlreadyStaged(AsyncStager):
    """A stager for a state dict of private copies: nothing to copy, nothing to wait for."""

    _synchronize_after_execute = False

    def stage(self, state_dict):
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def storage_writer(ckpt_dir: Path) -> FileSystemWriter:
    """DCP's file writer (files fsynced); a fixed delay first when a test or benchmark asks for slow storage."""
    match = re.search(r"(\d+)$", ckpt_dir.name)
    delay = faults.write_delay(int(match.group(1)), dist_rank()) if match else 0.0
    if delay <= 0:
        return FileSystemWriter(str(ckpt_dir / MODEL_DIR))
    return _DelayedWriter(str(ckpt_dir / MODEL_DIR), delay=delay)


class _DelayedWriter(FileSystemWriter):
    """Storage of a known speed (faults.write_delay): sleeps, then writes as FileSystemWriter does."""

    def __init__(self, path: str, delay: float):
        super().__init__(path)
        self.delay = delay

    def write_data(self, plan, planner):
        time.sleep(self.delay)
        return super().write_data(plan, planner)


def dist_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def read_metadata(ckpt_dir: Path):
    """The DCP metadata, after the unpickling guard, with every shard file it indexes checked to be whole. Shapes
    of every saved tensor, by flattened key."""
    path = ckpt_dir / MODEL_DIR
    check_dcp_metadata(path)
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    _check_shard_files(ckpt_dir, metadata)
    return metadata


def _check_shard_files(ckpt_dir: Path, metadata) -> None:
    """A shard file cut short (a host that died mid-copy, a partial sync from S3) or gone: one line naming it,
    before any rank reads. torch's own error names no file, and comes wrapped in every rank's traceback."""
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        name, end = getattr(info, "relative_path", None), getattr(info, "offset", 0) + getattr(info, "length", 0)
        if name is not None:
            needed[name] = max(needed.get(name, 0), end)
    for name, size in sorted(needed.items()):
        file = ckpt_dir / MODEL_DIR / name
        have = file.stat().st_size if file.is_file() else None
        if have is None or have < size:
            state = "is missing" if have is None else f"is truncated ({have:,} of the {size:,} bytes its index names)"
            raise ConfigError(f"checkpoint file {file} {state}{_earlier_checkpoint(ckpt_dir)}")


def load_shards(state: dict, ckpt_dir: Path, **options) -> None:
    """dcp.load of `ckpt_dir`'s model_optim/ into `state`; a shard it cannot read is one line: the error a rank
    hit, not DCP's CheckpointException (a BaseException) with every rank's traceback."""
    try:
        dcp.load(state, checkpoint_id=str(ckpt_dir / MODEL_DIR), **options)
    except (Exception, CheckpointException) as e:  # noqa: BLE001
        error = rank_error(e)
        msg = " ".join(f"{type(error).__name__}: {error}".split())[:300]
        raise ConfigError(
            f"checkpoint {ckpt_dir}: cannot read {MODEL_DIR}/ (corrupt?): {msg}{_earlier_checkpoint(ckpt_dir)}"
        ) from None


def _earlier_checkpoint(ckpt_dir: Path) -> str:
    """The way on from a damaged checkpoint: the newest committed one before it in the same run, if any."""
    step = step_number(ckpt_dir)
    earlier = [d for d in committed_steps(ckpt_dir.parent) if step is not None and step_number(d) < step]
    return f"; the run's previous checkpoint is whole: --resume {earlier[-1]}" if earlier else ""


def tensor_shapes(metadata) -> dict[str, tuple]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {k: tuple(v.size) for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


class ModelMismatch(ConfigError):
    """A checkpoint whose tensors are not the model's: the loop says which checkpoint, which settings changed
    since, and the way out (loop/train.py); anything else that loads one says this line."""

    def __init__(self, ckpt_dir: Path, detail: str):
        super().__init__(f"--resume {ckpt_dir}: checkpoint is from another model: {detail}")
        self.detail = detail


def check_model_fits(ckpt_dir: Path, wanted: dict[str, tuple], saved: dict[str, tuple], leave_out=frozenset()) -> None:
    """One line listing the parameters that are missing, unexpected or differently shaped. `leave_out`: names
    that may be in the checkpoint or not (a LoRA base: a full checkpoint has it, an adapter-only one not)."""
    want = {k: v for k, v in wanted.items() if k not in leave_out}
    have = {k[len("model.") :]: v for k, v in saved.items() if k.startswith("model.")}
    have = {k: v for k, v in have.items() if k not in leave_out}
    missing = sorted(set(want) - set(have))
    unexpected = sorted(set(have) - set(want))
    shapes = [f"{k} {list(have[k])} vs {list(want[k])}" for k in sorted(set(want) & set(have)) if have[k] != want[k]]
    if missing or unexpected or shapes:
        parts = [
            f"{label} ({len(items)}): {', '.join(items[:4])}{' ...' if len(items) > 4 else ''}"
            for label, items in (
                ("missing", missing),
                ("unexpected", unexpected),
                ("shape checkpoint vs model", shapes),
            )
            if items
        ]
        raise ModelMismatch(ckpt_dir, "; ".join(parts))


def load_dcp(ckpt_dir: Path, model, optimizer, load_optimizer: bool = True, warn=print, leave_out=frozenset()) -> dict:
    """`leave_out`: parameters kept as the model has them (a LoRA model's frozen base, as build_model built it),
    whether or not the checkpoint holds them."""
    metadata = read_metadata(ckpt_dir)
    shapes = tensor_shapes(metadata)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    model_sd = _without(model_sd, leave_out)
    check_model_fits(ckpt_dir, {k: tuple(v.shape) for k, v in model_sd.items()}, shapes, leave_out)
    state = {"model": model_sd}
    optim_state = optim_sd["state"]
    if load_optimizer:
        # by every saved key, not the tensors' alone: Adafactor's step is a Python int (bytes in the checkpoint)
        saved = metadata.state_dict_metadata
        have = {k: v for k, v in optim_state.items() if all(f"optim.state.{k}.{s}" in saved for s in v)}
        if len(have) < len(optim_state):
            skipped = sorted(set(optim_state) - set(have))
            warn(
                f"optimizer state for {len(skipped)} of {len(optim_state)} parameters is not in {ckpt_dir} "
                f"(e.g. {skipped[0]}): they start with fresh optimizer state"
            )
        state["optim"] = {"state": have}
    load_shards(state, ckpt_dir)
    if load_optimizer:
        optim_state.update(state["optim"]["state"])
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=optim_sd if load_optimizer else {},
        options=StateDictOptions(strict=not leave_out),
    )
    extra = ckpt_dir / EXTRA_FILE
    return json.loads(extra.read_text()) if extra.exists() else {}
