"""`--oom-recovery` (on by default): an out-of-memory error in a micro-step halves the micro-batch, doubles
accumulation (same global batch) and redoes the optimizer step from its first sample.

A rank that runs out of memory does not leave the step: it carries on with the remaining micro-steps, so
every collective inside them (DDP's all-reduce, FSDP's all-gathers, ZeRO's reductions) still meets its
partners, and it says so through the loop's one all-reduce per optimizer step. Only then do all ranks know,
together: they drop the step's gradients (strategy.discard_gradients: the optimizer never steps), change the
batch geometry (strategy.set_batch_geometry: DeepSpeed's engine too), rewind the data stream to where the
step began and redo it. No collective is added per micro-step.

Limit: a rank that fails *inside* a pass with collectives in it (an FSDP forward between two all-gathers)
leaves its partners waiting in that collective; only the process-group timeout ends that. The OOMs this
catches are those raised between collectives: activations in a DDP/ZeRO-2 forward, the end of a backward.

Fault injection for tests (`--inject-oom-above N`): rank 0 raises a real torch.OutOfMemoryError at the end
of each micro-step's backward while the micro-batch is above N.
"""
from __future__ import annotations

import contextlib
import gc

import torch

from shardtrain.config.settings import where


def largest_divisor_at_most(n: int, limit: int) -> int | None:
    """The largest micro-batch up to `limit` that splits `n` samples into whole micro-batches."""
    for d in range(min(n, limit), 0, -1):
        if n % d == 0:
            return d
    return None


def smaller_micro_batch(micro: int) -> int | None:
    """The largest micro-batch below `micro` that divides it (half, when even): the global batch stays whole."""
    return largest_divisor_at_most(micro, micro // 2)


def geometry_for(samples_per_rank: int, max_micro: int) -> tuple[int, int]:
    """(micro-batch, accumulation) taking `samples_per_rank` per optimizer step with a micro-batch no larger than
    `max_micro` (what is known to fit): the largest one that divides it, as OOM recovery picks (elastic resumes)."""
    micro = largest_divisor_at_most(samples_per_rank, max_micro)
    return micro, samples_per_rank // micro


class OOMRecovery:
    def __init__(self, cfg, strategy, stream, dist_info, console):
        self.cfg, self.strategy, self.stream, self.dist, self.console = cfg, strategy, stream, dist_info, console
        self.enabled = cfg.train.oom_recovery
        self.events: list[dict] = []
        self.hit = False
        self._position: dict = {}

    def step_start(self) -> None:
        self.hit = False
        if self.enabled:
            self._position = self.stream.state_dict()  # a few ints: where this step's first sample is

    @contextlib.contextmanager
    def guard(self):
        """Wraps one micro-step; swallows an OOM (when enabled) after noting it and freeing the cache."""
        if not self.enabled:
            yield
            return
        try:
            yield
        except torch.OutOfMemoryError:
            self.hit = True
        if self.hit:
            gc.collect()  # the failed graph's tensors, now unreferenced
            if self.dist.device.type == "cuda":
                torch.cuda.empty_cache()

    def inject(self) -> None:
        above = self.cfg.train.inject_oom_above
        if above is not None and self.dist.is_rank0 and self.cfg.train.per_device_batch_size > above:
            raise torch.OutOfMemoryError(f"injected by {where('inject_oom_above')}={above} at micro-batch "
                                         f"{self.cfg.train.per_device_batch_size}")

    def recover(self, ranks_hit: float, step: int) -> bool:
        """Called by every rank with the all-reduced count of ranks that hit an OOM in this step.
        Returns True when the step must be redone."""
        if ranks_hit <= 0:
            return False
        t = self.cfg.train
        micro, accum = t.per_device_batch_size, t.grad_accum
        new = smaller_micro_batch(micro)
        if new is None:
            raise MemoryError(f"step {step}: out of memory on {int(ranks_hit)} rank(s) at micro-batch 1; "
                              f"--oom-recovery cannot go lower: use a sharded strategy or offload "
                              f"(`shardtrain plan` compares them), activation checkpointing, or a shorter "
                              f"{where('max_length')}")
        new_accum = accum * micro // new
        self.strategy.discard_gradients()
        self.strategy.set_batch_geometry(new, new_accum)
        self.stream.load_state_dict(self._position)
        self.stream.set_micro_batch_size(new)
        self.events.append({"step": step, "ranks": int(ranks_hit), "from": [micro, accum], "to": [new, new_accum]})
        self.console.info(f"step {step}: out of memory on {int(ranks_hit)} rank(s) at micro-batch {micro} x accum "
                          f"{accum}; redoing the step at micro-batch {new} x accum {new_accum} (global batch "
                          f"{new * new_accum * self.dist.world_size} unchanged)")
        return True

    def summary(self) -> dict:
        t = self.cfg.train
        return {"events": self.events, "micro_batch_size": t.per_device_batch_size, "grad_accum": t.grad_accum}
