"""The portable checkpoint form: torch.distributed.checkpoint keyed by fully-qualified parameter name.

    model_optim/  {"model": {fqn: tensor}, "optim": {"state": {fqn: {step, exp_avg, exp_avg_sq}}}}
    strategy_state.json   scheduler, loss scaler and per-group learning rates (JSON)

DDP and FSDP save exactly this natively, and DeepSpeed writes it beside its engine files, so any strategy
at any world size reads any checkpoint: DCP reshards each tensor to what the reader holds. Only tensors
go into DCP: its non-tensor entries are read back with torch.load(weights_only=False); optimizer
hyperparameters come from the config, and the learning rates from the JSON.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from shardtrain.checkpointing.unpickle_guard import check_dcp_metadata
from shardtrain.config.settings import ConfigError

MODEL_DIR = "model_optim"
EXTRA_FILE = "strategy_state.json"


def save_dcp(ckpt_dir: Path, model, optimizer, extra: dict, is_rank0: bool) -> None:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    save_portable(ckpt_dir, model_sd, optim_sd["state"], extra, is_rank0)


def save_portable(ckpt_dir: Path, model_sd: dict, optim_state: dict, extra: dict, is_rank0: bool) -> None:
    dcp.save({"model": model_sd, "optim": {"state": optim_state}}, checkpoint_id=str(ckpt_dir / MODEL_DIR))
    if is_rank0:
        (ckpt_dir / EXTRA_FILE).write_text(json.dumps(extra))


def read_metadata(ckpt_dir: Path):
    """The DCP metadata, after the unpickling guard. Shapes of every saved tensor, by flattened key."""
    path = ckpt_dir / MODEL_DIR
    check_dcp_metadata(path)
    return dcp.FileSystemReader(str(path)).read_metadata()


def tensor_shapes(metadata) -> dict[str, tuple]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    return {k: tuple(v.size) for k, v in metadata.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata)}


def check_model_fits(ckpt_dir: Path, wanted: dict[str, tuple], saved: dict[str, tuple]) -> None:
    """One line listing the parameters that are missing, unexpected or differently shaped."""
    want = {k: v for k, v in wanted.items()}
    have = {k[len("model."):]: v for k, v in saved.items() if k.startswith("model.")}
    missing = sorted(set(want) - set(have))
    unexpected = sorted(set(have) - set(want))
    shapes = [f"{k} {list(have[k])} vs {list(want[k])}" for k in sorted(set(want) & set(have)) if have[k] != want[k]]
    if missing or unexpected or shapes:
        parts = [f"{label} ({len(items)}): {', '.join(items[:4])}{' ...' if len(items) > 4 else ''}"
                 for label, items in (("missing", missing), ("unexpected", unexpected),
                                      ("shape checkpoint vs model", shapes)) if items]
        raise ConfigError(f"--resume {ckpt_dir}: checkpoint is from another model: " + "; ".join(parts))


def load_dcp(ckpt_dir: Path, model, optimizer, load_optimizer: bool = True, warn=print) -> dict:
    shapes = tensor_shapes(read_metadata(ckpt_dir))
    model_sd, optim_sd = get_state_dict(model, optimizer)
    check_model_fits(ckpt_dir, {k: tuple(v.shape) for k, v in model_sd.items()}, shapes)
    state = {"model": model_sd}
    optim_state = optim_sd["state"]
    if load_optimizer:
        have = {k: v for k, v in optim_state.items()
                if all(f"optim.state.{k}.{s}" in shapes for s in v)}
        if len(have) < len(optim_state):
            skipped = sorted(set(optim_state) - set(have))
            warn(f"optimizer state for {len(skipped)} of {len(optim_state)} parameters is not in {ckpt_dir} "
                 f"(e.g. {skipped[0]}): they start with fresh Adam moments")
        state["optim"] = {"state": have}
    try:
        dcp.load(state, checkpoint_id=str(ckpt_dir / MODEL_DIR))
    except Exception as e:  # noqa: BLE001 - DCP wraps per-rank read errors; one line is what users need
        msg = " ".join(str(e).split())[:300]
        raise ConfigError(f"--resume {ckpt_dir}: cannot read {MODEL_DIR}/ (corrupt or truncated?): {msg}") from None
    if load_optimizer:
        optim_state.update(state["optim"]["state"])
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=optim_sd if load_optimizer else {},
                   options=StateDictOptions(strict=True))
    extra = ckpt_dir / EXTRA_FILE
    return json.loads(extra.read_text()) if extra.exists() else {}
