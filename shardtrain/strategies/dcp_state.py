"""Save/load for the strategies that speak torch.distributed.checkpoint (DDP and FSDP).

Both use the same per-parameter, fully-qualified-name layout, so a DDP checkpoint resumes under FSDP
at any world size and back. Small non-tensor state (schedule, loss scaler) goes to JSON on rank 0:
nothing of ours is ever unpickled.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

MODEL_DIR = "model_optim"
EXTRA_FILE = "strategy_state.json"


def save_dcp(ckpt_dir: Path, model, optimizer, extra: dict, is_rank0: bool) -> None:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(ckpt_dir / MODEL_DIR))
    if is_rank0:
        (ckpt_dir / EXTRA_FILE).write_text(json.dumps(extra))


def load_dcp(ckpt_dir: Path, model, optimizer, load_optimizer: bool = True) -> dict:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd} if load_optimizer else {"model": model_sd}
    dcp.load(state, checkpoint_id=str(ckpt_dir / MODEL_DIR))
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state.get("optim", optim_sd) if load_optimizer else {},
                   options=StateDictOptions(strict=True))
    extra = ckpt_dir / EXTRA_FILE
    return json.loads(extra.read_text()) if extra.exists() else {}
