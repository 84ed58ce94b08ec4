"""What a strategy may offer beyond the core (base.py's Strategy): one mixin per capability, as Lightning Fabric
composes its strategies from the core and mixins such as `_Sharded`.

- `Freezing`: --freeze-layers and unfreeze_at_step; what build_model returned frozen stays frozen all run.
- `Resizing`: what OOM recovery needs (loop/oom.py): a new micro-batch and accumulation, an abandoned step's
  gradients dropped, and where a failing rank would leave its partners waiting in a collective.
- `MemoryIntrospection`: every tensor a rank holds for training, for the memory accounting (memory/accounting.py).
- `ShardGuard`: a parameter read outside forward where it is only this rank's shard (shard_guard.py).

Each mixin's defaults are written against the core's attributes (`model`, `unwrapped`, `named_parameters`,
`optimizer`, `cfg`, `name`). A concrete strategy lists the mixins before Strategy
(`class NativeStrategy(Freezing, Resizing, MemoryIntrospection, ShardGuard, Strategy)`), so that an override here
(Freezing's train) comes before the core's and its own overrides call these through super(). Every strategy has
all four today.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager

import torch
from torch import nn

from shardtrain.config.geometry import BatchGeometry
from shardtrain.workloads.adapters import frozen_base


class Freezing:
    # What the user's build_model returned frozen (requires_grad False: a pretrained encoder frozen by hand, a
    # PEFT model's base weights). It stays frozen for the whole run, under every strategy: setup keeps it so
    # and set_frozen (--freeze-layers' unfreeze_at_step) never unfreezes it.
    user_frozen: frozenset[str] = frozenset()
    # A LoRA model's frozen base (workloads/adapters.py, frozen_base): checkpoints leave it out, since
    # build_model rebuilds it; they hold the adapters, the head and their optimizer state.
    base_not_saved: frozenset[str] = frozenset()
    _frozen_norms: list = []

    def set_frozen(self, names: set[str], frozen: bool) -> None:
        for name, p in self.named_parameters():
            if name in names and name not in self.user_frozen:
                p.requires_grad_(not frozen)
        self.hold_frozen_norms(names if frozen else set())

    def _freeze(self, model: nn.Module, frozen_names: set[str]) -> set[str]:
        """Setup's freezing of the model build_model returned: `frozen_names` (--freeze-layers) on top of what
        it came frozen with (recorded as user_frozen); every other parameter trains. Returns both together."""
        self.user_frozen = frozenset(n for n, p in model.named_parameters() if not p.requires_grad)
        self.base_not_saved = frozen_base(model)
        frozen = set(frozen_names) | self.user_frozen
        for name, p in model.named_parameters():
            p.requires_grad_(name not in frozen)
        return frozen

    def hold_frozen_norms(self, frozen_names: set[str]) -> None:
        """BatchNorm layers whose parameters are all frozen (`frozen_names` or user_frozen) normalise with their
        running statistics and stop updating them (eval mode), as torchvision's FrozenBatchNorm2d does; an empty
        set releases those of `frozen_names`."""
        frozen_names = set(frozen_names) | self.user_frozen
        norms = []
        for prefix, m in self.unwrapped.named_modules():
            own = [f"{prefix}.{n}" if prefix else n for n, _ in m.named_parameters(recurse=False)]
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and own and all(n in frozen_names for n in own):
                norms.append(m)
        self._frozen_norms = norms
        if self.model is not None and self.model.training:
            self.train()

    def train(self) -> None:
        super().train()
        for m in self._frozen_norms:
            m.eval()


class Resizing:
    def set_batch_geometry(self, geometry: BatchGeometry) -> None:
        """Micro-batch and accumulation changed mid-run (OOM recovery); the global batch is unchanged."""
        self.geometry = geometry

    def discard_gradients(self) -> None:
        """Drop the partial gradients of an abandoned optimizer step, so it can be redone from scratch."""
        self.optimizer.zero_grad(set_to_none=True)

    def collectives_in(self, phase: str, is_last: bool) -> bool:
        """Whether a micro-step's `phase` ("forward": the forward and the loss; "backward") can run a collective
        once user code has started in it: then a rank that fails inside it leaves its partners waiting in that
        collective (OOM recovery, shardtrain/loop/oom.py). `is_last`: the step's last micro-step, whose backward
        reduces gradients. True unless a strategy knows better: FSDP gathers each unit's shards in both passes."""
        return True


class MemoryIntrospection:
    def memory_tensors(self):
        """(category, tensor) for every tensor this rank holds for training; shardtrain.memory.accounting dedupes
        storages and sums them. Categories: params, grads, optimizer, buffers, comm. DTensors count their
        local shard. Backends that keep state outside the module and the torch optimizer override this."""
        for p in self.unwrapped.parameters():
            yield "params", p
        for p in self.unwrapped.parameters():
            yield "grads", p.grad
        for b in self.unwrapped.buffers():
            yield "buffers", b
        for state in self.optimizer.state.values():
            for v in state.values():
                yield "optimizer", v


class ShardGuard:
    # Strategies whose parameters are only shards between forwards set this and say which tensors are shards.
    shards_outside_forward = False

    def is_shard(self, p: torch.Tensor) -> bool:
        return False

    def shard_read_guard(self, what: str) -> ContextManager:
        """Around workload code that runs outside forward (`what`: the method, e.g. MyTask.loss): reading a
        parameter that is only a shard there is one line naming the method and the parameter (shard_guard.py)."""
        if not self.shards_outside_forward:
            return contextlib.nullcontext()
        from shardtrain.strategies.shard_guard import ShardReadGuard

        def names() -> dict[int, str]:  # only when reporting: the parameter's name
            return {id(p): n for n, p in self.named_parameters()}

        return ShardReadGuard(names, self.is_shard, what, self.name)
