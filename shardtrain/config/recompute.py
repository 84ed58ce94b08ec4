"""Which blocks recompute their activations in backward: what `--activation-checkpointing` asked for, and the
run's choice.

`true` checkpoints every block, `every-N` every N-th (the N-th, 2N-th, ..., as torchtitan's selective
checkpointing counts), and `auto` the fewest blocks that make the planner's predicted peak fit the device
(memory/recompute_choice.py chooses how many, spread evenly along the model). Which blocks a run checkpoints
is the run's state, like its batch geometry: the config keeps what the user wrote.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

EVERY = re.compile(r"every-(\d+)")


def every_n(value) -> int | None:
    """N of an `every-N` setting; None for true, false and auto."""
    m = EVERY.fullmatch(value) if isinstance(value, str) else None
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class RecomputePlan:
    every: int = 0  # checkpoint every N-th block (1: all of them; 0: none), unless count is set
    count: int | None = None  # this many blocks, spread evenly (auto's choice)
    why: str = ""  # auto's reasoning, for the banner

    @classmethod
    def configured(cls, setting) -> RecomputePlan:
        """What true, false and every-N say; auto is the run's to resolve first (its choice is a count)."""
        if setting == "auto":
            raise ValueError("activation_checkpointing auto is resolved by the run (memory/recompute_choice.py)")
        if isinstance(setting, bool):
            return cls(every=1 if setting else 0)
        return cls(every=every_n(setting))

    def selected(self, blocks: int) -> list[bool]:
        """For each of `blocks` blocks in module order, whether it is checkpointed."""
        if self.count is not None:
            k = min(self.count, blocks)
            # The i-th block is taken where the running share i*k/blocks passes a whole number: k blocks, evenly
            # spaced, the last one always among them (every-N's pattern when k divides blocks).
            return [(i + 1) * k // blocks > i * k // blocks for i in range(blocks)]
        return [self.every > 0 and (i + 1) % self.every == 0 for i in range(blocks)]

    def share(self, blocks: int) -> float:
        """The share of the blocks checkpointed (0 with no blocks)."""
        return sum(self.selected(blocks)) / blocks if blocks else 0.0

    def as_record(self, checkpointed: int, blocks: int) -> dict:
        """trainer_state / summary.json `resolved.recompute`: what the run checkpointed, and why."""
        return {"checkpointed_blocks": checkpointed, "blocks": blocks, **({"why": self.why} if self.why else {})}

    @property
    def any(self) -> bool:
        return bool(self.count) if self.count is not None else self.every > 0


def checkpointed_text(checkpointed: int, blocks: int) -> str:
    """off, on (all blocks), or "k of B blocks"."""
    if checkpointed == 0:
        return "off"
    return "on" if checkpointed >= blocks else f"{checkpointed} of {blocks} blocks"
