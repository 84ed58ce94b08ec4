"""DataLoaders: a resumable infinite training stream and an exactly-once evaluation shard.

Training order is DistributedSampler's (permutation seeded by seed + epoch, strided over ranks, tail dropped
so every rank has the same number of samples), then whole micro-batches only: every rank takes the same
number of steps per epoch and no collective waits on a rank that ran out.

The position is kept in *samples consumed by this rank within the epoch*, not in batches, so the micro-batch
size can change mid-epoch (OOM recovery halves it) and a resume still continues at the exact next sample.
Resuming skips by slicing the sampler's index list: no batch is loaded just to be thrown away.

The world size may change at a resume (an elastic job lost or regained a node). The epoch's permutation does
not depend on it (DistributedSampler seeds one permutation of the whole set by seed + epoch and gives rank r
its elements r, r+W, r+2W...), so after k samples per rank the samples seen by all ranks are exactly the
permutation's first k*W. The checkpoint keeps that global position; at any world size W' the rest of the
epoch is the permutation from there, strided over the W' ranks and cut, as drop_last cuts, to the same count
on every rank. Within an epoch no sample is then seen twice or skipped, except the permutation's last few
that every epoch leaves out: fewer than W' (drop_last) plus what does not fill a whole micro-batch per rank.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from shardtrain.config.geometry import BatchGeometry
from shardtrain.config.settings import Config, ConfigError, where
from shardtrain.data.splits import make_collator
from shardtrain.runtime.preemption import leave_stop_signals_to_parent


def init_worker(worker_id: int) -> None:
    # torch gives each worker base_seed + id (base_seed from the loader's generator); make numpy and
    # `random` follow it, so any augmentation in a worker is reproducible too.
    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)
    leave_stop_signals_to_parent()


def shut_down_workers(loader: Optional[DataLoader], iterator=None) -> None:
    """End the worker processes of `loader` (and of `iterator`, one of its iterators) now, as torch does when the
    last reference to them goes. Not left to that: anything that still refers to them (a reference cycle, freed
    only by the cyclic collector) would keep the workers past the trainer's exit, which is os._exit
    (runtime/distributed.teardown_and_exit). A later iter(loader) starts new workers."""
    cached = getattr(loader, "_iterator", None)  # persistent workers: the loader keeps its iterator for reuse
    if cached is not None:
        loader._iterator = None
    for it in (iterator, cached):
        shut_down = getattr(it, "_shutdown_workers", None)  # none without workers; a second call does nothing
        if shut_down is not None:
            shut_down()


class _Positions(Sampler[int]):
    """A sampler over an index list that TrainStream replaces before each `iter(loader)` (sampling runs in
    the main process, so persistent workers keep running across epochs)."""

    def __init__(self):
        self.indices: list[int] = []

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class TrainStream:
    """Endless micro-batches across epochs, with a restorable position. `next_batch()` is all the loop needs."""

    def __init__(
        self,
        dataset: Dataset,
        collate: Callable,
        micro_batch_size: int,
        rank: int,
        world_size: int,
        seed: int,
        loader_kwargs: dict,
        lengths: Optional[Sequence[int]] = None,
        group_size: int = 0,
    ):
        self.dataset, self.collate, self.loader_kwargs = dataset, collate, loader_kwargs
        # --group-by-length: each run of `group_size` samples of the permutation sorted by length, longest
        # first (HF's LengthGroupedSampler rule). The runs do not depend on the world size or the micro-batch,
        # so a resume at any world size, or after OOM recovery changed the micro-batch, continues the same order.
        self.lengths, self.group_size = (lengths, group_size) if lengths is not None and group_size > 1 else (None, 0)
        self.rank, self.world_size, self.seed = rank, world_size, seed
        # The whole epoch's permutation, the same at every world size: DistributedSampler's own, taken with one
        # replica; this rank's share is strided out of it (at the epoch's start, exactly what
        # DistributedSampler(num_replicas=world_size, rank=rank, drop_last=True) gives).
        self.order = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=seed, drop_last=True)
        self.samples_per_rank = len(dataset) // world_size  # a whole epoch's share, same on every rank (drop_last)
        self.epoch = 0
        self.epoch_start = 0  # the permutation's samples seen before this world size took the epoch over
        self.samples_in_epoch = 0  # this rank's samples since epoch_start
        self._positions = _Positions()
        self._iter: Optional[Iterator] = None
        self.micro_batch_size = 0
        self.set_micro_batch_size(micro_batch_size)

    @property
    def batches_per_epoch(self) -> int:
        return self.samples_per_rank // self.micro_batch_size

    def set_micro_batch_size(self, n: int) -> None:
        """Rebuild the loader for a new per-device batch size; the next batch starts at the same sample."""
        if n == self.micro_batch_size:
            return
        if n > self.samples_per_rank:
            raise ConfigError(
                f"{where('per_device_batch_size')}={n} is larger than this rank's share of the "
                f"training set ({len(self.dataset)} examples // world size {self.world_size} = "
                f"{self.samples_per_rank}): an epoch would have no batch"
            )
        self.micro_batch_size = n
        self._roll_over()  # the new size may not fit in what is left of the epoch
        self.close()  # the old loader's workers end before new ones start
        self._loader = DataLoader(
            self.dataset,
            batch_size=n,
            sampler=self._positions,
            drop_last=True,
            collate_fn=self.collate,
            **self.loader_kwargs,
        )

    @property
    def _share(self) -> int:
        """This rank's samples in the rest of the epoch from epoch_start (the same on every rank)."""
        return (len(self.dataset) - self.epoch_start) // self.world_size

    def epoch_indices(self) -> list[int]:
        """This rank's samples from epoch_start to the epoch's end."""
        # Same permutation as an uninterrupted run: DistributedSampler seeds with seed + epoch.
        end = self.epoch_start + self._share * self.world_size
        return self.epoch_order()[self.epoch_start + self.rank : end : self.world_size]

    def epoch_order(self) -> list[int]:
        """The whole epoch's sample order, the same at every world size."""
        self.order.set_epoch(self.epoch)
        order = list(self.order)
        if self.lengths is None:
            return order
        g, length = self.group_size, self.lengths.__getitem__
        return [i for k in range(0, len(order), g) for i in sorted(order[k : k + g], key=length, reverse=True)]

    def _start(self) -> None:
        self._positions.indices = self.epoch_indices()[self.samples_in_epoch :]
        self._iter = iter(self._loader)

    def next_batch(self) -> dict[str, torch.Tensor]:
        if self._iter is None:
            self._start()
        try:
            batch = next(self._iter)  # never exhausted: _roll_over() ends the epoch before that
        except ConfigError as e:
            # From a worker, the DataLoader re-raises with the worker's traceback in the message; the CLI
            # promises one line, which is the traceback's last:
            # "shardtrain.config.settings.ConfigError: file:line: ...".
            raise ConfigError(str(e).strip().splitlines()[-1].split("ConfigError: ", 1)[-1]) from None
        self.samples_in_epoch += self.micro_batch_size
        self._roll_over()
        return batch

    def close(self) -> None:
        """End the loader's worker processes; a later next_batch() starts new ones at the same position."""
        iterator, self._iter = self._iter, None
        shut_down_workers(getattr(self, "_loader", None), iterator)

    def _roll_over(self) -> None:
        # Move to the next epoch as soon as no whole batch is left (the tail is dropped), so a checkpoint
        # taken here reads (epoch + 1, 0) rather than "the end of epoch".
        if self._share - self.samples_in_epoch < self.micro_batch_size:
            self.epoch += 1
            self.epoch_start = self.samples_in_epoch = 0
            self._iter = None

    def checkpoint_state(self) -> dict:
        """What the checkpoint keeps (rank 0 writes it): the position is the same on every rank."""
        return self.state_dict()

    def state_dict(self) -> dict:
        """`global_samples_in_epoch`: the epoch's permutation seen by all ranks, what a resume at any world size
        continues from; `samples_in_epoch` / `batch_in_epoch`: this rank's since the world size last changed."""
        return {
            "epoch": self.epoch,
            "batch_in_epoch": self.samples_in_epoch // self.micro_batch_size,
            "samples_in_epoch": self.samples_in_epoch,
            "micro_batch_size": self.micro_batch_size,
            "world_size": self.world_size,
            "global_samples_in_epoch": self.epoch_start + self.samples_in_epoch * self.world_size,
            "length_group_size": self.group_size,
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("streaming"):
            raise ConfigError(f"the checkpoint was saved with {where('streaming')} on; resume with it on")
        saved_groups = int(state.get("length_group_size", 0))
        if saved_groups != self.group_size:
            # The position counts samples of the saved order; another order would repeat some, skip others.
            asked = f"on (runs of {self.group_size})" if self.group_size else "off"
            was = f"on (runs of {saved_groups})" if saved_groups else "off"
            raise ConfigError(
                f"{where('group_by_length')} is {asked}, but the checkpoint's epoch was ordered with it {was}; "
                "resume with the setting it was saved with (and the same per_device_batch_size x grad_accum)"
            )
        self.epoch = int(state["epoch"])
        seen = state.get("global_samples_in_epoch")
        if seen is None:  # saved before the global position was kept
            samples = state.get("samples_in_epoch")
            if samples is None:  # a (epoch, batch_in_epoch)-only state: batches of the size it was saved with
                samples = int(state["batch_in_epoch"]) * int(state.get("micro_batch_size", self.micro_batch_size))
            # Those streams always strided the permutation from the epoch's start over the ranks they had, so
            # samples per rank x their world size is the global position too, exactly.
            seen = int(samples) * int(state.get("world_size", self.world_size))
        # Continuing from the global position is the same at the saved world size and exact at any other.
        self.epoch_start, self.samples_in_epoch = min(int(seen), len(self.dataset)), 0
        self._iter = None
        self._roll_over()


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


def train_lengths(train_ds: Dataset) -> list[int]:
    if not callable(getattr(train_ds, "lengths", None)):
        raise ConfigError(
            f"{where('group_by_length')} needs the training set's lengths: give the train dataset that "
            f"Workload.datasets() returns a lengths() method (one token count per item); "
            f"{type(train_ds).__name__} has none"
        )
    lengths = list(train_ds.lengths())
    if len(lengths) != len(train_ds):
        raise ConfigError(
            f"{where('group_by_length')}: {type(train_ds).__name__}.lengths() gave {len(lengths)} lengths "
            f"for {len(train_ds)} items"
        )
    return lengths


def length_group_size(cfg: Config) -> int:
    """--group-by-length's runs: HF's 50 batches, of the configured micro-batch x accumulation, not of the world
    size (so that the order survives a resize)."""
    return 50 * cfg.train.per_device_batch_size * cfg.train.grad_accum if cfg.data.group_by_length else 0


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
) -> Loaders:
    """`collate`: the workload's (shardtrain.workloads.base.CheckedCollate); None tokenizes jsonl records with
    `tokenizer`. `eval_ds` None: no validation set, so no evaluation. `geometry`: the run's batch geometry (the
    flags' when None)."""
    geometry = geometry or BatchGeometry.configured(cfg, world_size)
    collate = collate or make_collator(cfg, tokenizer)
    workers = cfg.data.num_workers

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
