"""What every rank must agree on after a step's backward, and what to do about bad steps.

All of it rides on one all-reduce per optimizer step (the loop's only collective and host sync beyond
the strategy's own): the summed loss, the squared gradient norm (each rank's share; DDP and FSDP then clip
without a collective or sync of their own), whether any rank was signalled to stop, which ranks saw a
non-finite loss, whether any rank ran out of memory, and how many ranks are still writing a checkpoint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from shardtrain.config.settings import ConfigError
from shardtrain.runtime.distributed import DistInfo, all_reduce_sum


@dataclass
class Agreement:
    loss_mean: float
    stop: bool  # a preemption signal reached some rank
    bad_ranks: list  # ranks whose own loss was non-finite
    oom_ranks: int  # how many ranks hit an out-of-memory error
    grad_norm: Optional[float] = None  # global, from the strategy's shares; None: the strategy has its own
    writing: int = 0  # ranks whose background checkpoint write (--async-save) is still running
    write_failed: bool = False  # some rank's finished background write failed

    @property
    def finite(self) -> bool:
        return math.isfinite(self.loss_mean)


# The slots of agree's one tensor, in order; after them one slot per rank: 1 where that rank's loss was not finite.
FLAG_SLOTS = ("stop", "oom", "writing", "write_failed")
SLOTS = ("loss_sum", *FLAG_SLOTS, "grad_norm_sq")


def agree(
    loss_sum: torch.Tensor,
    micro_steps: int,
    stop: bool,
    oom: bool,
    info: DistInfo,
    grad_norm_share: Optional[torch.Tensor] = None,
    writing: bool = False,
    write_failed: bool = False,
) -> Agreement:
    """`writing` / `write_failed`: this rank's background checkpoint write is still running / ended in an error.
    When no rank is writing any more, every rank learns it here at once, so the save commits with no collective
    of its own (shardtrain/loop/saves.py)."""
    world, device = info.world_size, info.device
    # The host flags go to the device as one tensor (one copy); the loss and the norm share are there already.
    flags = {"stop": stop, "oom": oom, "writing": writing, "write_failed": write_failed}
    host = torch.tensor([float(flags[name]) for name in FLAG_SLOTS], dtype=torch.float64, device=device)
    share = (
        torch.zeros(1, dtype=torch.float64, device=device)
        if grad_norm_share is None
        else grad_norm_share.to(device, torch.float64).reshape(1)
    )
    slots = [loss_sum.double().reshape(1), host, share]  # in SLOTS' order
    own_bad = torch.zeros(world, dtype=torch.float64, device=device)
    own_bad[info.rank] = (~torch.isfinite(loss_sum)).double()
    totals = all_reduce_sum(torch.cat([*slots, own_bad]), device).tolist()
    total = dict(zip(SLOTS, totals))
    return Agreement(
        loss_mean=total["loss_sum"] / (micro_steps * world),
        stop=total["stop"] > 0,
        bad_ranks=[r for r, v in enumerate(totals[len(SLOTS) :]) if v > 0],
        oom_ranks=int(total["oom"]),
        grad_norm=None if grad_norm_share is None else math.sqrt(total["grad_norm_sq"]),  # nan/inf pass through
        writing=int(total["writing"]),
        write_failed=total["write_failed"] > 0,
    )


class BadStepPolicy:
    """Counts skipped updates and applies --nan-policy / --max-bad-steps.

    A non-finite loss or gradient norm is bad in any precision; an fp16 overflow with a finite loss is the
    loss scaler's normal business and is counted apart."""

    def __init__(
        self,
        nan_policy: str,
        max_bad_steps: int,
        console,
        is_rank0: bool,
        first_step: int | None = None,
        loss_method: str = "Workload.loss",
    ):
        """`first_step`: the step a fresh run starts at (None when resumed): no update precedes it, so a
        non-finite loss there comes from `loss_method` or its inputs, not from training, and no policy helps."""
        self.nan_policy, self.max_bad_steps = nan_policy, max_bad_steps
        self.console, self.is_rank0 = console, is_rank0
        self.first_step, self.loss_method = first_step, loss_method
        self.skipped = self.nonfinite = self.overflow = self.in_a_row = 0

    def update(self, step: int, applied: bool, overflow: bool, agreed: Agreement, grad_norm: float) -> None:
        if step == self.first_step and agreed.bad_ranks:
            raise ConfigError(
                f"step {step}: {self.loss_method} returned a non-finite loss ({agreed.loss_mean}) on rank "
                f"{', '.join(map(str, agreed.bad_ranks))} before any update, so no learning rate or "
                f"--nan-policy is the cause: check {self.loss_method} and the outputs of the first batch "
                f"(--nan-policy handles losses that turn non-finite later)"
            )
        if applied:
            self.in_a_row = 0
            return
        self.skipped += 1
        bad = not agreed.finite or not overflow
        if not bad:
            self.overflow += 1
            self.in_a_row = 0
            return
        self.nonfinite += 1
        self.in_a_row += 1
        if self.is_rank0:
            what = f"loss on rank {', '.join(map(str, agreed.bad_ranks))}" if agreed.bad_ranks else "grad norm"
            self.console.warn(
                f"step {step}: non-finite {what} (loss {agreed.loss_mean}, grad norm {grad_norm}); "
                f"update skipped on every rank ({self.in_a_row} in a row, {self.nonfinite} in all)"
            )
        if self.nan_policy == "abort":
            raise FloatingPointError(
                f"non-finite loss/grad norm at step {step} with --nan-policy abort; "
                f"--nan-policy skip skips such steps (up to --max-bad-steps in a row)"
            )
        if self.in_a_row >= self.max_bad_steps:
            raise FloatingPointError(
                f"{self.in_a_row} consecutive non-finite steps up to step {step} reached "
                f"--max-bad-steps {self.max_bad_steps}: lower --lr or check the data"
            )

    def counts(self) -> dict:
        return {"skipped_steps": self.skipped, "nonfinite_steps": self.nonfinite, "overflow_steps": self.overflow}
