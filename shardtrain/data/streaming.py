"""`--streaming`: the training split read as a `datasets.IterableDataset`, for data bigger than RAM.

Each rank reads its own part of the stream (`datasets.distributed.split_dataset_by_node`: whole shards when
their number divides the world size, else every world-size-th example). The parts may differ in size, and no
rank knows the others' lengths, so epochs are per rank: a rank whose part runs out starts its next pass at
once, and every rank always has a next batch. Every rank thus takes the same number of steps (the loop's),
and no collective waits on a rank that ran out. `epoch` is how many passes this rank has finished over its
part; a batch may span two passes. A stream has no length until it is read, so there are no steps per epoch
unless the source knows its size.

Order: a shuffle buffer, as `IterableDataset.shuffle(seed, buffer_size)` keeps, but our own, because
datasets' buffer is lost on resume ("examples from shuffle buffers are lost when resuming and the buffers are
refilled", its `state_dict` docs) and resume must be exact. The position that goes into the checkpoint is
`IterableDataset.state_dict()` taken just before the oldest example still in the buffer, plus which of the
examples read since are still buffered, in buffer order, and the buffer's RNG state: a resume rereads that
short window and is where the uninterrupted run was, example for example. The buffer is seeded by
(seed, epoch), so each pass has its own order, the same in every run.

Reading happens in the training process (no DataLoader workers): the stream's state is this process's, which
is what `IterableDataset.state_dict` needs without torchdata's StatefulDataLoader (not installed here).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from shardtrain.config.settings import ConfigError, where

# Examples held for shuffling, as datasets' own default for IterableDataset.shuffle.
SHUFFLE_BUFFER = 1000


def stream_split(path: Path):
    """The training split file as a stream: one loader for `--streaming` that other sources can route to."""
    import datasets

    return datasets.load_dataset("json", data_files=str(path), split="train", streaming=True)


def jsonl_train_stream(cfg):
    """The training split of the jsonl folder as a stream of canonical rows (text, label[, image path]).

    The file is checked line by line first, as the in-memory path checks it (file:line messages), holding no
    record: a bad line must fail before training, not hours into a stream. --skip-bad-samples leaves the bad
    lines out of the stream by row; an invalid JSON line cannot be left out (datasets' json reader stops at it).
    Images are not decoded here (that is a second pass over every image); a corrupt one fails in collate."""
    from shardtrain.data.records import config_split_path, data_kind, has_images, iter_split

    path, kind = config_split_path(cfg, "train"), data_kind(cfg)
    bad_rows, skipped = set(), []
    good = 0
    for row, (_, problem) in enumerate(iter_split(path, kind, cfg.model.num_labels)):
        if problem is None:
            good += 1
            continue
        if not cfg.data.skip_bad_samples:
            raise ConfigError(problem)
        if ": invalid JSON: " in problem:
            raise ConfigError(
                f"{problem} ({where('streaming')} reads the file with datasets' json reader, which "
                f"cannot skip invalid JSON: fix or delete that line)"
            )
        bad_rows.add(row)
        skipped.append(problem)
    if not good:
        raise ConfigError(f"{where('data_dir')}: no usable records in {path}")
    stream = stream_split(path)
    if bad_rows:
        stream = stream.filter(lambda _, i: i not in bad_rows, with_indices=True)
    if cfg.data.max_train_samples is not None:
        stream = stream.take(cfg.data.max_train_samples)
    stream = stream.select_columns(["text", "label", "image"] if has_images(kind) else ["text", "label"])
    stream.skipped = skipped  # what the run's banner and summary count, as for the in-memory splits
    return stream


class StreamingTrainStream:
    """TrainStream's interface (`next_batch`, `state_dict`/`load_state_dict`, `set_micro_batch_size`) over a
    `datasets.IterableDataset`. The position is counted in examples, so a new micro-batch size (OOM recovery
    halves it) continues at the exact next example."""

    def __init__(
        self,
        dataset,
        collate: Callable,
        micro_batch_size: int,
        rank: int,
        world_size: int,
        seed: int,
        buffer_size: int = SHUFFLE_BUFFER,
    ):
        from datasets.distributed import split_dataset_by_node

        self.source = split_dataset_by_node(dataset, rank=rank, world_size=world_size)
        self.collate, self.rank, self.world_size = collate, rank, world_size
        self.seed, self.buffer_size = seed, buffer_size
        self.micro_batch_size = micro_batch_size
        self.examples_seen = 0  # by this rank, over all passes
        # Position zero, loaded explicitly at each new pass: an earlier load_state_dict (a resume, an OOM
        # redo) stays armed inside the IterableDataset for its epoch and must never be what a pass starts from.
        self._pass_start = copy.deepcopy(self.source.state_dict())
        self._start_epoch(0)

    @property
    def batches_per_epoch(self) -> Optional[int]:
        return None  # unknown: a stream's length is only known once read

    def set_micro_batch_size(self, n: int) -> None:
        self.micro_batch_size = n

    def step_share(self, accum: int):
        """None: micro-batches of equal size (see TrainStream.step_share)."""
        return None

    def close(self) -> None:
        """Nothing to end: the stream is read in this process, with no DataLoader workers."""

    def _start_epoch(self, epoch: int, source_state: Optional[dict] = None) -> None:
        self.epoch = epoch
        self.source.set_epoch(epoch)
        if source_state is None:
            source_state = {**copy.deepcopy(self._pass_start), "epoch": epoch}
        self.source.load_state_dict(source_state)
        self._rng = np.random.default_rng([self.seed, epoch])
        self._read = 0  # examples read from this rank's part in this pass
        self._exhausted = False
        self._buffer: list[tuple[int, dict, dict]] = []  # (read index, source state just before it, example)
        self._state_before = source_state
        self._iter = iter(self.source)

    def _read_one(self) -> Optional[dict]:
        example = next(self._iter, None)
        if example is None:
            self._exhausted = True
            return None
        self._buffer.append((self._read, self._state_before, example))
        self._read += 1
        self._state_before = self.source.state_dict()
        return example

    def _next_example(self) -> dict:
        while len(self._buffer) < self.buffer_size and not self._exhausted:
            self._read_one()
        if not self._buffer:
            if self._read == 0:
                raise ConfigError(
                    f"{where('streaming')}: rank {self.rank} of {self.world_size} got no training "
                    f"example from the stream: the split has fewer examples than processes"
                )
            self._start_epoch(self.epoch + 1)
            return self._next_example()
        j = int(self._rng.integers(len(self._buffer)))
        self._buffer[j], self._buffer[-1] = self._buffer[-1], self._buffer[j]
        return self._buffer.pop()[2]

    def next_batch(self) -> dict[str, torch.Tensor]:
        examples = [self._next_example() for _ in range(self.micro_batch_size)]
        self.examples_seen += len(examples)
        return self.collate(examples)

    def state_dict(self) -> dict:
        """This rank's position (no collective: OOM recovery takes one every step)."""
        oldest = min(self._buffer, key=lambda b: b[0]) if self._buffer else None
        return {
            "epoch": self.epoch,
            "examples_seen": self.examples_seen,
            "read": self._read,
            "exhausted": self._exhausted,
            "buffer": [b[0] for b in self._buffer],
            "reread_from": oldest[0] if oldest else self._read,
            "source": oldest[1] if oldest else self._state_before,
            "rng": self._rng.bit_generator.state,
            "micro_batch_size": self.micro_batch_size,
            "rank": self.rank,
            "world_size": self.world_size,
        }

    def checkpoint_state(self) -> dict:
        """Every rank's position, for the checkpoint rank 0 writes (each rank reads a different part).
        A collective: every rank calls it, at a save."""
        from shardtrain.runtime.distributed import all_gather_object

        states = all_gather_object(self.state_dict())
        return {"streaming": True, "ranks": states, "world_size": len(states), "epoch": self.epoch}

    def load_state_dict(self, state: dict) -> None:
        if "ranks" in state:  # a checkpoint's: this rank's own entry
            if int(state["world_size"]) != self.world_size:
                raise ConfigError(
                    f"{where('streaming')}: the checkpoint's stream positions are for "
                    f"{state['world_size']} processes, this run has {self.world_size}; a streamed "
                    f"run resumes exactly only on as many processes as it was saved with"
                )
            state = state["ranks"][self.rank]
        elif "examples_seen" not in state:
            raise ConfigError(
                f"{where('streaming')} is on, but the checkpoint was saved without it; resume with "
                f"the setting it was saved with"
            )
        self._start_epoch(int(state["epoch"]), state["source"])
        self._read = int(state["reread_from"])
        for _ in range(int(state["read"]) - self._read):
            if self._read_one() is None:
                raise ConfigError(
                    f"{where('streaming')}: the data ended before the checkpoint's stream position "
                    f"(did the training data change since it was saved?)"
                )
        reread = {b[0]: b for b in self._buffer}
        self._buffer = [reread[i] for i in state["buffer"]]
        self._exhausted = bool(state["exhausted"])
        self._rng.bit_generator.state = state["rng"]
        self.examples_seen = int(state["examples_seen"])
