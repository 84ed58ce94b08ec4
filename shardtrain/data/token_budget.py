"""--max-tokens-per-batch: training micro-batches sized by a token budget, the same budget on every rank.

The epoch's order is --group-by-length's (data/train_stream.py: DistributedSampler's permutation, each run of it
sorted longest first), so neighbours have similar lengths. That order is cut greedily into micro-batches:
as many texts as fit in the budget once padded to the longest of them (`len(batch) x longest <= budget`).
Micro-batch k goes to rank k mod W; where their number is not a multiple of W, the fullest are split in two
(rather than the epoch's last, shortest texts dropped), so every rank gets the same number per epoch and each
holds at most the budget's tokens: no rank waits long on a fatter batch.

Micro-batches now hold different numbers of samples, so a plain mean of their losses would weight a sample
of a small batch more than one of a big batch. Every rank knows every rank's batches (the cut is computed
from the lengths alone), so `step_share` gives each micro-batch its exact weight, n_i x W x accum / N, with
N the items of the whole optimizer step over all ranks: samples by default, or what `Workload.loss_items`
counts (the tokens of a token-level loss). The strategies divide by accum and average over W, so the
gradient is exactly that of the mean over the step's N items, with no collective of its own.

The position is kept in samples of the epoch's order seen by all ranks (the micro-batches of every rank
before it), as the plain stream keeps it: a resume at any world size, or at another budget, or after OOM
recovery halved the budget, cuts the rest of the epoch from there and sees every sample once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from torch.utils.data import DataLoader, Sampler

from shardtrain.config.settings import ConfigError, where
from shardtrain.data.train_stream import TrainStream


def pad_to_longest(lengths: list[int]) -> int:
    return len(lengths) * max(lengths)


def budget_batches(
    order: Sequence[int], lengths: Sequence[int], budget: int, padded: Callable[[list[int]], int] = pad_to_longest
) -> list[list[int]]:
    """`order` cut greedily into batches whose tokens once padded (`padded` of their texts' lengths) are at most
    `budget`; a text over the budget alone."""
    batches: list[list[int]] = []
    current: list[int] = []
    current_lengths: list[int] = []
    for i in order:
        n = lengths[i]
        if current and padded([*current_lengths, n]) > budget:
            batches.append(current)
            current, current_lengths = [], []
        current.append(i)
        current_lengths.append(n)
    if current:
        batches.append(current)
    return batches


def split_to_multiple(batches: list[list[int]], world: int) -> list[list[int]]:
    """`batches` with the fullest split in two until every rank gets as many (each half within the budget too).
    Without it the epoch's last few would be dropped, and those are the length-sorted order's shortest texts:
    the same ones every epoch where the data fits in one length group. Only single texts that cannot be split
    are left out (fewer than `world`)."""
    batches = list(batches)
    while len(batches) % world:
        i = max(range(len(batches)), key=lambda k: (len(batches[k]), k))
        if len(batches[i]) < 2:
            break
        half = len(batches[i]) // 2
        batches[i : i + 1] = [batches[i][:half], batches[i][half:]]
    return batches


@dataclass(frozen=True)
class StepShare:
    """What the next optimizer step holds: this rank's micro-batches' loss weights, and all ranks' samples."""

    weights: list[float]  # n_i x world x accum / N per micro-batch: the strategies' mean then weighs items alike
    samples: int  # samples in the step over every rank (what samples/s counts)


class _Batches(Sampler[list[int]]):
    """A batch sampler over index lists that the stream replaces before each `iter(loader)`."""

    def __init__(self):
        self.batches: list[list[int]] = []

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


@dataclass(frozen=True)
class Budget:
    """--max-tokens-per-batch and the workload's rules for it (Workload.loss_items, Workload.padded_tokens)."""

    max_tokens: int
    loss_items: Optional[Callable[[list[int]], float]] = None  # None: a micro-batch's items are its samples
    padded_tokens: Callable[[list[int]], int] = pad_to_longest
    workload_name: str = "Workload"  # errors name its methods


class TokenBudgetStream(TrainStream):
    """TrainStream's interface over token-budget micro-batches (`step_share` gives their loss weights)."""

    def __init__(self, *stream_args, budget: Budget, **stream_kwargs):
        """`stream_args` / `stream_kwargs`: TrainStream's, with the training set's lengths and a group_size of at
        least 2 (the cut follows the length-grouped order)."""
        self.max_tokens = self.budget = budget.max_tokens  # the budget: max_tokens scaled by OOM recovery
        self.loss_items, self.padded, self.workload_name = budget.loss_items, budget.padded_tokens, budget.workload_name
        self.batches_taken = 0  # this rank's micro-batches since epoch_start
        self.taken_by_all = 0  # the samples of every rank's micro-batches since epoch_start
        self._cut: dict[tuple, list[list[int]]] = {}
        self._batches = _Batches()
        super().__init__(*stream_args, **stream_kwargs)
        if self.lengths is None:
            raise ValueError("a token budget cuts the length-grouped order: give lengths and a group_size over 1")
        longest = max(self.lengths, default=0)
        alone = self._call("padded_tokens", [longest])
        if alone > self.max_tokens:
            raise ConfigError(
                f"{where('max_tokens_per_batch')}={self.max_tokens} is less than the longest training text "
                f"({longest} tokens, {alone} once padded), which could not be batched within it: raise it to at "
                f"least {alone}"
            )
        if self._share < 1:
            raise ConfigError(
                f"{where('max_tokens_per_batch')}={self.max_tokens}: the training set ({len(self.dataset)} examples) "
                f"makes {len(self.segment())} micro-batches of it, fewer than one per rank at world size "
                f"{self.world_size}"
            )
        self._check_loss_items()

    # ---- the cut --------------------------------------------------------------------------------------------
    def segment(self, epoch: Optional[int] = None, start: Optional[int] = None) -> list[list[int]]:
        """Every rank's micro-batches from `start` (a position in the epoch's order) to the epoch's end."""
        epoch = self.epoch if epoch is None else epoch
        start = self.epoch_start if start is None else start
        key = (epoch, start, self.budget)
        if key not in self._cut:
            self._cut = {k: v for k, v in self._cut.items() if k[0] >= self.epoch}  # the epochs still ahead
            saved, self.epoch = self.epoch, epoch
            try:
                order = self.epoch_order()
            finally:
                self.epoch = saved
            cut = budget_batches(order[start:], self.lengths, self.budget, self.padded)
            self._cut[key] = split_to_multiple(cut, self.world_size)
        return self._cut[key]

    @property
    def _share(self) -> int:
        """This rank's micro-batches in the rest of the epoch from epoch_start (the same on every rank)."""
        return len(self.segment()) // self.world_size

    @property
    def batches_per_epoch(self) -> int:
        """Micro-batches per rank in an epoch from its start (epochs differ a little: the cut follows the order)."""
        return len(self.segment(start=0)) // self.world_size

    def mine(self) -> list[list[int]]:
        """This rank's micro-batches of the rest of the epoch."""
        return self.segment()[self.rank :: self.world_size][: self._share][self.batches_taken :]

    # ---- TrainStream's interface ------------------------------------------------------------------------------
    def set_micro_batch_size(self, n: int) -> None:
        """OOM recovery's smaller micro-batch: the budget shrinks by the same factor (accumulation grows by it)."""
        if n == self.micro_batch_size:
            return
        if self.micro_batch_size:  # not the first call: keep the position, as the plain stream does
            self._restart_at(self._position_in_order())
        else:  # the configured micro-batch, whose budget is max_tokens
            self.configured_micro = n
        self.micro_batch_size = n
        self.budget = max(1, self.max_tokens * n // self.configured_micro)
        self._roll_over()
        self.close()
        kwargs = self.loader_kwargs
        self._loader = DataLoader(self.dataset, batch_sampler=self._batches, collate_fn=self.collate, **kwargs)

    def _start(self) -> None:
        self._batches.batches = self.mine()
        self._iter = iter(self._loader)

    def _took_batch(self) -> None:
        k, w = self.batches_taken, self.world_size
        self.taken_by_all += sum(len(b) for b in self.segment()[k * w : (k + 1) * w])
        self.batches_taken += 1

    def _roll_over(self) -> None:
        if self.batches_taken >= self._share:
            self.epoch += 1
            self.epoch_start = self.batches_taken = self.taken_by_all = 0
            self._iter = None

    def _position_in_order(self) -> int:
        """The epoch's samples that every rank's micro-batches so far took (counted as they are taken: OOM
        recovery reads the position at every step's start)."""
        return self.epoch_start + self.taken_by_all

    def _restart_at(self, position: int) -> None:
        self.epoch_start, self.batches_taken, self.taken_by_all = position, 0, 0
        self._iter = None

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "global_samples_in_epoch": self._position_in_order(),
            "world_size": self.world_size,
            "micro_batch_size": self.micro_batch_size,
            "length_group_size": self.group_size,
            "max_tokens_per_batch": self.budget,
        }

    def _order_mismatch(self, saved_groups: int, state: dict) -> str:
        if saved_groups:
            how = f"sorted by length in runs of {saved_groups}"
            fix = "the per_device_batch_size x grad_accum it was saved with"
        else:
            how = "in random order (saved without --group-by-length or a token budget)"
            fix = "no token budget, or train into a new --output-dir"
        return (
            f"{where('max_tokens_per_batch')} sorts the epoch by length in runs of {self.group_size}, but the "
            f"checkpoint's epoch was {how}: resume with {fix}"
        )

    def load_state_dict(self, state: dict) -> None:
        self.batches_taken = self.taken_by_all = 0
        super().load_state_dict(state)  # the order's checks, the epoch and the global position; rolls over

    # ---- the loss weights -------------------------------------------------------------------------------------
    def step_share(self, accum: int) -> StepShare:
        """The next `accum` micro-batches of every rank (into the next epoch where this one ends): their weights."""
        epoch, start, taken = self.epoch, self.epoch_start, self.batches_taken
        step: list[list[list[int]]] = []  # per micro-step, every rank's batch
        for _ in range(accum):
            cut = self.segment(epoch, start)
            if taken >= len(cut) // self.world_size:
                epoch, start, taken = epoch + 1, 0, 0
                cut = self.segment(epoch, start)
            step.append(cut[taken * self.world_size : (taken + 1) * self.world_size])
            taken += 1
        items = [[self._items(b) for b in ranks] for ranks in step]
        total = sum(map(sum, items))
        scale = self.world_size * accum / total
        return StepShare([row[self.rank] * scale for row in items], sum(len(b) for ranks in step for b in ranks))

    def _items(self, batch: list[int]) -> float:
        if self.loss_items is None:
            return len(batch)
        return self._call("loss_items", [self.lengths[i] for i in batch])

    def _call(self, method: str, lengths: list[int]) -> float:
        """The workload's method on a micro-batch's text lengths: a positive number, or one line naming it."""
        fn = self.padded if method == "padded_tokens" else self.loss_items
        try:
            n = fn(lengths)
        except Exception as e:  # noqa: BLE001 - any failure of the user's method is named, in one line
            raise ConfigError(f"{self.workload_name}.{method}(lengths) failed on {lengths[:4]}...: {e}") from None
        if not isinstance(n, (int, float)) or not n > 0:
            raise ConfigError(
                f"{self.workload_name}.{method}(lengths) must return a positive number for a micro-batch's text "
                f"lengths (--max-tokens-per-batch); got {n!r} for {len(lengths)} texts"
            )
        return n

    def _check_loss_items(self) -> None:
        if self.loss_items is not None:
            self._items(self.segment(start=0)[0])
