"""The batch geometry a run trains at: micro-batch x accumulation x world size.

The flags give the first one (`--per-device-batch-size`, `--grad-accum`); the run may then decide another and
keep the global batch: an elastic resume at another world size (loop/elastic.py), `--strategy auto`
(memory/autoplan.py), OOM recovery (loop/oom.py). What the run decides is the run's state, held by the Trainer
and handed to the strategy and the loaders; the config keeps what the user asked for.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from shardtrain.config.settings import where


@dataclass(frozen=True)
class BatchGeometry:
    micro: int  # samples per rank per forward
    accum: int  # forwards per optimizer step
    world: int  # ranks

    @classmethod
    def configured(cls, cfg, world: int) -> BatchGeometry:
        """What the flags say, at `world` ranks."""
        return cls(cfg.train.per_device_batch_size, cfg.train.grad_accum, world)

    @property
    def global_batch(self) -> int:
        return self.micro * self.accum * self.world

    def at_micro(self, micro: int) -> BatchGeometry:
        """The same samples per rank and step at a smaller micro-batch that divides this one."""
        return dataclasses.replace(self, micro=micro, accum=self.accum * self.micro // micro)

    def applied_to(self, cfg):
        """`cfg` as if its flags had asked for this geometry: for code that predicts from flags (the planner)."""
        train = dataclasses.replace(cfg.train, per_device_batch_size=self.micro, grad_accum=self.accum)
        return dataclasses.replace(cfg, train=train)

    def at_token_budget(self, cfg) -> BatchGeometry:
        """What memory is predicted at: under --max-tokens-per-batch a micro-batch holds up to the budget's
        tokens, so as many max_length texts as that (rounded up); else this geometry."""
        budget = cfg.data.max_tokens_per_batch
        return dataclasses.replace(self, micro=-(-budget // cfg.data.max_length)) if budget else self

    def as_record(self) -> dict:
        return {
            "micro_batch_size": self.micro,
            "grad_accum": self.accum,
            "world_size": self.world,
            "global_batch_size": self.global_batch,
        }


def no_batch_problem(micro: int, examples: int, world: int) -> str | None:
    """Why an epoch of `examples` training examples at `world` ranks has no micro-batch of `micro` (each rank
    takes an equal share, the rest left out as DistributedSampler's drop_last leaves it); None when it has one.
    Said before any process starts (data/precheck.py) and by the loop when OOM recovery or a resize changes the
    micro-batch (data/train_stream.py)."""
    share = examples // world
    if micro <= share:
        return None
    return (
        f"{where('per_device_batch_size')}={micro} is larger than each rank's share of the training set "
        f"({examples} examples // world size {world} = {share}): an epoch would have no batch"
    )
