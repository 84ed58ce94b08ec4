"""The training stream: endless micro-batches across epochs, with a position a checkpoint keeps.

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

from typing import Callable, Iterator, Optional, Sequence

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from shardtrain.config.geometry import no_batch_problem
from shardtrain.config.settings import ConfigError, where


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
        problem = no_batch_problem(n, len(self.dataset), self.world_size)
        if problem:
            raise ConfigError(problem)
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
        self._took_batch()
        self._roll_over()
        return batch

    def _took_batch(self) -> None:
        self.samples_in_epoch += self.micro_batch_size

    def step_share(self, accum: int):
        """None: every micro-batch holds the same number of samples, so the strategies' plain mean is exact
        (data/token_budget.py's stream returns each micro-batch's weight)."""
        return None

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

    def _order_mismatch(self, saved_groups: int, state: dict) -> str:
        """Why the checkpoint's epoch order is not this run's, naming the setting that made it."""
        if state.get("max_tokens_per_batch"):
            return (
                f"the checkpoint was saved with {where('max_tokens_per_batch')} {state['max_tokens_per_batch']}, "
                f"whose epoch is sorted by length in runs of {saved_groups}; resume with a token budget (any) and "
                f"the same per_device_batch_size x grad_accum"
            )
        asked = f"on (runs of {self.group_size})" if self.group_size else "off"
        was = f"on (runs of {saved_groups})" if saved_groups else "off"
        return (
            f"{where('group_by_length')} is {asked}, but the checkpoint's epoch was ordered with it {was}; "
            "resume with the setting it was saved with (and the same per_device_batch_size x grad_accum)"
        )

    def load_state_dict(self, state: dict) -> None:
        if state.get("streaming"):
            raise ConfigError(f"the checkpoint was saved with {where('streaming')} on; resume with it on")
        saved_groups = int(state.get("length_group_size", 0))
        if saved_groups != self.group_size:
            # The position counts samples of the saved order; another order would repeat some, skip others.
            raise ConfigError(self._order_mismatch(saved_groups, state))
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
