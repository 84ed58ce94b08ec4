"""DistributedDataParallel: every rank holds the whole model, optimizer and gradients."""

from __future__ import annotations

import contextlib

from torch.nn.parallel import DistributedDataParallel

from shardtrain.strategies.native import NativeStrategy
from shardtrain.strategies.root import workload_root


class DDPStrategy(NativeStrategy):
    name = "ddp"

    def setup(self, build_model, frozen_names):
        # Every rank builds the model; DDP broadcasts rank 0's weights when it wraps.
        self.inner = build_model().to(self.device)
        self._freeze(self.inner, frozen_names)
        self.recompute_count = self._apply_recompute(self.inner, self.block_classes(self.inner))
        self.model = self._wrap()
        return self._finish_setup(frozen_names)

    def _wrap(self):
        root = workload_root(self.inner, self.workload)  # DDP's forward (its reducer) sees the workload's forward
        self.ddp = (
            root
            if self.dist.world_size == 1
            else DistributedDataParallel(
                root,
                device_ids=[self.dist.local_rank] if self.device.type == "cuda" else None,
                gradient_as_bucket_view=True,
            )
        )
        # Compiled after wrapping: dynamo then splits the graph at DDP's bucket boundaries, so the
        # all-reduces still overlap the backward.
        return self._compile(self.ddp)

    @property
    def unwrapped(self):
        return self.inner

    def micro_step(self, is_last):
        stack = contextlib.ExitStack()
        if not is_last and isinstance(self.ddp, DistributedDataParallel):
            # no_sync must cover the forward too: DDP prepares its reducer there.
            stack.enter_context(self.ddp.no_sync())
        stack.enter_context(super().micro_step(is_last))
        return stack

    def collectives_in(self, phase, is_last):
        # DDP's forward broadcasts buffers before it calls the model, and its backward all-reduces only when it
        # syncs (the last micro-step; no_sync before).
        return phase == "backward" and is_last and isinstance(self.ddp, DistributedDataParallel)

    def discard_gradients(self):
        super().discard_gradients()
        if isinstance(self.ddp, DistributedDataParallel):
            # In an abandoned step the ranks' reducers differ: one that finished the last micro-step's forward
            # expects its backward (and would all-reduce in the next no_sync backward), one that failed inside
            # that forward or skipped it does not; the next forward's buffer broadcast follows the same state.
            # A new reducer, as at the start of the run, puts every rank in the same state. Only on recovery.
            self._new_reducer()

    def save(self, ckpt_dir):
        super().save(ckpt_dir)
        self._reducer_as_a_resume_has_it()

    def save_async(self, ckpt_dir):
        pending = super().save_async(ckpt_dir)  # the state is staged: the new wrapper changes none of it
        self._reducer_as_a_resume_has_it()
        return pending

    def _reducer_as_a_resume_has_it(self):
        """After each checkpoint, the reducer a run resumed from it starts with.

        DDP all-reduces its first step in one bucket of every gradient, then rebuilds its buckets in the order
        the gradients became ready. A bucket's layout decides, element by element, the order in which the
        ranks' values are summed: with two ranks the sum is the same either way (a + b == b + a), with three or
        more it is not ((a + b) + c != a + (b + c) in floating point). A run resumed at a checkpoint starts with
        a fresh reducer, so without this its first step would sum in another order than the uninterrupted run
        did, and drift from it by ~1e-7 from there on (3 ranks, the first report's 3 x A100). A new wrapper
        costs one broadcast of the weights per checkpoint, and the step after it overlaps no all-reduce with
        its backward. Not under --compile: a new wrapper is a new module to compile."""
        if isinstance(self.ddp, DistributedDataParallel) and self.cfg.train.compile == "none":
            self._new_reducer()

    def _new_reducer(self):
        import gc

        self.model = self.ddp = None
        gc.collect()  # the old buckets first: a new reducer allocates its own
        self.model = self._wrap()

    def set_frozen(self, names, frozen):
        super().set_frozen(names, frozen)
        # DDP fixes the set of parameters it reduces when it is built; re-wrap to include them.
        self._new_reducer()

    def describe(self):
        return {
            "strategy": "ddp",
            "offload": False,
            "recompute_blocks": self.recompute_count,
            "blocks": self.block_count,
        }
