"""DataLoaders: the training stream (data/train_stream.py; data/token_budget.py's under --max-tokens-per-batch)
and an exactly-once evaluation shard."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from shardtrain.config.geometry import BatchGeometry
from shardtrain.config.settings import Config, ConfigError, where
from shardtrain.data.splits import make_collator
from shardtrain.data.token_budget import Budget, TokenBudgetStream
from shardtrain.data.train_stream import TrainStream, shut_down_workers
from shardtrain.runtime.preemption import leave_stop_signals_to_parent


def init_worker(worker_id: int) -> None:
    # torch gives each worker base_seed + id (base_seed from the loader's generator); make numpy and
    # `random` follow it, so any augmentation in a worker is reproducible too.
    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)
    leave_stop_signals_to_parent()


def eval_shard(n: int, rank: int, world_size: int) -> range:
    """This rank's contiguous slice; sizes differ by at most one, every example in exactly one slice."""
    return range(rank * n // world_size, (rank + 1) * n // world_size)


def even_batches(shard: range, n_batches: int) -> list[list[int]]:
    """Split a shard into `n_batches` near-equal consecutive batches (fewer only if the shard is smaller)."""
    n_batches = min(n_batches, len(shard))
    bounds = [i * len(shard) // n_batches for i in range(n_batches + 1)] if n_batches else [0]
    return [list(shard[a:b]) for a, b in zip(bounds, bounds[1:])]


@dataclass
class Loaders:
    train: TrainStream  # or data.streaming.StreamingTrainStream: the same interface
    eval: Optional[DataLoader]  # None: the workload has no validation set
    steps_per_epoch: Optional[
        int
    ]  # optimizer steps per epoch (micro-batches // grad_accum, at least 1); None: a stream
    train_size: Optional[int]  # examples in the training set (all ranks); None: a stream, length unknown
    eval_size: int  # examples in the validation set (all ranks)
    # Eval batches every rank yields. Ranks normally all yield exactly this many, so collectives inside forward
    # (FSDP all-gathers, ZeRO-3) stay matched; a rank with fewer examples than this (tiny sets, batch size 1)
    # yields fewer and must run extra throw-away forwards to keep the others company.
    eval_batches: int

    def close(self) -> None:
        """End every worker process of the training stream and of the validation loader (persistent workers)."""
        self.train.close()
        shut_down_workers(self.eval)


def train_lengths(train_ds: Dataset, setting: str = "group_by_length") -> list[int]:
    """The training set's token counts, one per item, from its lengths() method (what `setting` needs)."""
    if not callable(getattr(train_ds, "lengths", None)):
        raise ConfigError(
            f"{where(setting)} needs the training set's lengths: give the train dataset that "
            f"Workload.datasets() returns a lengths() method (one token count per item); "
            f"{type(train_ds).__name__} has none"
        )
    lengths = list(train_ds.lengths())
    if len(lengths) != len(train_ds):
        raise ConfigError(
            f"{where(setting)}: {type(train_ds).__name__}.lengths() gave {len(lengths)} lengths "
            f"for {len(train_ds)} items"
        )
    return lengths


def budget_of(max_tokens: int, workload) -> Budget:
    """--max-tokens-per-batch with the workload's rules for it; samples padded to the longest without one."""
    if workload is None:
        return Budget(max_tokens)
    return Budget(max_tokens, workload.loss_items, workload.padded_tokens, type(workload).__name__)


def length_group_size(cfg: Config) -> int:
    """--group-by-length's runs (a token budget cuts the same order): HF's 50 batches, of the configured
    micro-batch x accumulation, not of the world size (so that the order survives a resize)."""
    grouped = cfg.data.group_by_length or cfg.data.max_tokens_per_batch
    return 50 * cfg.train.per_device_batch_size * cfg.train.grad_accum if grouped else 0


# Unset --num-workers: at most this many per rank (what keeps a GPU fed with decoded JPEGs at 224 px).
DEFAULT_MAX_WORKERS = 4


def loader_workers(cfg: Config, world_size: int = 1) -> int:
    """--num-workers, or unset: up to DEFAULT_MAX_WORKERS per rank, as many as leave each rank of this host a
    CPU of its own (the CPUs this job may use: a Slurm task's or a container's share), as `shardtrain doctor`
    checks. 2 ranks on 2 cores load in the training processes rather than start 8 workers."""
    import os

    from shardtrain.runtime import device_defaults

    if cfg.data.num_workers is not None:
        return cfg.data.num_workers
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or world_size)
    return max(0, min(DEFAULT_MAX_WORKERS, device_defaults.allotted_cpus() // max(1, local) - 1))


def build_loaders(
    cfg: Config,
    tokenizer,
    train_ds: Dataset,
    eval_ds: Optional[Dataset],
    rank: int,
    world_size: int,
    device_type: str,
    collate: Optional[Callable] = None,
    geometry: Optional[BatchGeometry] = None,
    workload=None,
) -> Loaders:
    """`collate`: the workload's (shardtrain.workloads.base.CheckedCollate); None tokenizes jsonl records with
    `tokenizer`. `eval_ds` None: no validation set, so no evaluation. `geometry`: the run's batch geometry (the
    flags' when None). `workload`: its loss_items and padded_tokens size and weigh --max-tokens-per-batch's
    micro-batches (None: samples, padded to the longest)."""
    geometry = geometry or BatchGeometry.configured(cfg, world_size)
    collate = collate or make_collator(cfg, tokenizer)
    workers = loader_workers(cfg, world_size)

    def loader_kwargs(salt: int) -> dict:
        return dict(
            num_workers=workers,
            pin_memory=cfg.data.pin_memory and device_type == "cuda",
            persistent_workers=workers > 0,
            worker_init_fn=init_worker if workers > 0 else None,
            # Only seeds the workers (shuffling is the sampler's): per rank, so ranks differ.
            generator=torch.Generator().manual_seed(cfg.train.seed * 1000 + rank * 10 + salt),
        )

    if isinstance(train_ds, torch.utils.data.IterableDataset):
        train = streaming_train(train_ds, collate, cfg, rank, world_size, geometry.micro)
        train_size, steps_per_epoch = None, None  # a stream's length is unknown until it has been read
    elif cfg.data.max_tokens_per_batch:
        train = TokenBudgetStream(
            train_ds, collate, geometry.micro, rank, world_size, cfg.train.seed, loader_kwargs(0),
            train_lengths(train_ds, "max_tokens_per_batch"), length_group_size(cfg),
            budget=budget_of(cfg.data.max_tokens_per_batch, workload),
        )  # fmt: skip
    else:
        lengths = train_lengths(train_ds) if cfg.data.group_by_length else None
        train = TrainStream(
            train_ds,
            collate,
            geometry.micro,
            rank,
            world_size,
            cfg.train.seed,
            loader_kwargs(0),
            lengths,
            length_group_size(cfg),
        )
    if not isinstance(train_ds, torch.utils.data.IterableDataset):
        train_size, steps_per_epoch = len(train_ds), max(1, train.batches_per_epoch // geometry.accum)

    if eval_ds is None:
        return Loaders(
            train=train, eval=None, steps_per_epoch=steps_per_epoch, train_size=train_size, eval_size=0, eval_batches=0
        )
    n_eval = len(eval_ds)
    per_rank_max = -(-n_eval // world_size)
    eval_batches = -(-per_rank_max // cfg.eval_batch_size)
    # A batch sampler (a list of index lists) instead of Subset + batch_size: batches balanced so that every
    # rank yields the same number of them, with no padding and no duplicated example.
    eval_loader = DataLoader(
        eval_ds,
        batch_sampler=even_batches(eval_shard(n_eval, rank, world_size), eval_batches),
        collate_fn=collate,
        **loader_kwargs(1),
    )
    return Loaders(
        train=train,
        eval=eval_loader,
        steps_per_epoch=steps_per_epoch,
        train_size=train_size,
        eval_size=n_eval,
        eval_batches=eval_batches,
    )


def streaming_train(train_ds, collate: Callable, cfg: Config, rank: int, world_size: int, micro: int):
    """A `datasets.IterableDataset` (what --streaming gives) as a resumable stream; any other iterable
    dataset has no position to save, so no exact resume: refused by name."""
    import datasets

    from shardtrain.data.streaming import StreamingTrainStream

    if not isinstance(train_ds, datasets.IterableDataset):
        raise ConfigError(
            f"Workload.datasets() returned a {type(train_ds).__name__} (a torch IterableDataset) for "
            f"training; a stream must be a datasets.IterableDataset, whose state_dict() is the "
            f"position a checkpoint keeps (or return a map-style dataset)"
        )
    return StreamingTrainStream(train_ds, collate, micro, rank, world_size, cfg.train.seed)
