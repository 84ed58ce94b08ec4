"""Data in, batches out: every source (jsonl + images, hub names, files, folders, published layouts, streams)
as canonical splits, the tokenizer, collate, the resumable sampler, the image cache, make-data and check-data.

    splits = load_splits(cfg)                 # any source (sources.py) -> canonical datasets.Dataset splits

    tok = build_tokenizer(cfg, run_dir, is_rank0, barrier)
    train_ds, eval_ds = build_datasets(cfg, tok)
    loaders = build_loaders(cfg, tok, train_ds, eval_ds, rank, world_size, device.type)
    batch = loaders.train.next_batch()       # forever; loaders.train.state_dict() goes in the checkpoint
    batch = batch_to_device(batch, device)   # uint8 images become normalised floats on the device
"""

from importlib import import_module

# name -> the module that defines it, imported on first use: the parent process of `train --nproc N` runs the
# pre-launch data check (precheck.py) without the loaders' torch import (seconds it would only wait for).
_EXPORTS = {
    "check_data": "shardtrain.data.check",
    "batch_to_device": "shardtrain.data.images",
    "Loaders": "shardtrain.data.loaders",
    "TrainStream": "shardtrain.data.loaders",
    "build_loaders": "shardtrain.data.loaders",
    "data_kind": "shardtrain.data.records",
    "Splits": "shardtrain.data.sources",
    "load_splits": "shardtrain.data.sources",
    "Collator": "shardtrain.data.splits",
    "JsonlDataset": "shardtrain.data.splits",
    "build_datasets": "shardtrain.data.splits",
    "make_data": "shardtrain.data.synthetic",
    "build_tokenizer": "shardtrain.data.tokenizer",
}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


__all__ = [
    "batch_to_device",
    "build_tokenizer",
    "build_datasets",
    "build_loaders",
    "Loaders",
    "TrainStream",
    "JsonlDataset",
    "Collator",
    "make_data",
    "check_data",
    "data_kind",
    "load_splits",
    "Splits",
]
