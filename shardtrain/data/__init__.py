"""Data in, batches out: every source (jsonl + images, hub names, files, folders, published layouts, streams)
as canonical splits, the tokenizer, collate, the resumable sampler, the image cache, make-data and check-data.

    splits = load_splits(cfg)                 # any source (sources.py) -> canonical datasets.Dataset splits

    tok = build_tokenizer(cfg, run_dir, is_rank0, barrier)
    train_ds, eval_ds = build_datasets(cfg, tok)
    loaders = build_loaders(cfg, tok, train_ds, eval_ds, rank, world_size, device.type)
    batch = loaders.train.next_batch()       # forever; loaders.train.state_dict() goes in the checkpoint
    batch = batch_to_device(batch, device)   # uint8 images become normalised floats on the device
"""
from shardtrain.data.check import check_data
from shardtrain.data.images import batch_to_device
from shardtrain.data.loaders import Loaders, TrainStream, build_loaders
from shardtrain.data.records import data_kind
from shardtrain.data.sources import Splits, load_splits
from shardtrain.data.splits import Collator, JsonlDataset, build_datasets
from shardtrain.data.synthetic import make_data
from shardtrain.data.tokenizer import build_tokenizer

__all__ = ["batch_to_device", "build_tokenizer", "build_datasets", "build_loaders", "Loaders", "TrainStream",
           "JsonlDataset", "Collator", "make_data", "check_data", "data_kind",
           "load_splits", "Splits"]
