"""Read a checkpoint's portable form in one process, no process group: export and checks use it.

Every checkpoint (any strategy) holds `model_optim/` (checkpointing/dcp_state.py). This gathers it into
full tensors on the CPU, after the unpickling guard.
"""

from __future__ import annotations

from pathlib import Path

import torch

from shardtrain.checkpointing.dcp_state import MODEL_DIR, load_shards, read_metadata, tensor_shapes
from shardtrain.config.settings import ConfigError


def read_portable(ckpt_dir: str | Path, optimizer: bool = False) -> dict[str, dict]:
    """-> {"model": {fqn: tensor}, "optim": {flattened key: tensor}} (optim only when asked)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    ckpt_dir = Path(ckpt_dir)
    if not (ckpt_dir / MODEL_DIR).is_dir():
        raise ConfigError(
            f"{ckpt_dir}: no {MODEL_DIR}/ folder: not a shardtrain checkpoint (or written "
            f"before the portable form existed)"
        )
    metadata = read_metadata(ckpt_dir)
    shapes = tensor_shapes(metadata)
    wanted = [k for k in shapes if k.startswith("model.") or (optimizer and k.startswith("optim.state."))]
    flat = {}
    for key in wanted:
        meta = metadata.state_dict_metadata[key]
        assert isinstance(meta, TensorStorageMetadata)
        flat[key] = torch.empty(shapes[key], dtype=meta.properties.dtype)
    load_shards(flat, ckpt_dir, no_dist=True)
    model = {k[len("model.") :]: v for k, v in flat.items() if k.startswith("model.")}
    optim = {k[len("optim.state.") :]: v for k, v in flat.items() if k.startswith("optim.state.")}
    return {"model": model, "optim": optim}
