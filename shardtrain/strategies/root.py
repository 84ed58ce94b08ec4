"""The one module every strategy wraps: its forward is `Workload.forward(model, batch)`.

DDP prepares its reducer in its own forward, FSDP2 runs its root unit's lazy init, pre-forward unshard and
post-backward callback from the root module's hooks, and the DeepSpeed engine applies autocast and resets ZeRO-3's
parameter trace in its forward. All of that happens only when the wrapped module itself is called. A workload whose
forward calls submodules (`model["text"](...)`, `model["img"](...)` on an `nn.ModuleDict`, which has no forward of
its own) would bypass it. So the strategies wrap `WorkloadRoot`, and the loop calls it with the batch: whatever
the workload's forward calls happens inside one forward of the wrapped module (as Lightning runs `training_step`
through `_LightningModuleWrapperBase`).

Names: the root shares the user's model's own tables of submodules, parameters and buffers (the same dict
objects, not copies), so it has exactly the model's names, with no prefix: `named_parameters()`, `state_dict()`,
DDP's and FSDP's parameter names, and the DeepSpeed engine's files (checkpoints written before the root existed
load unchanged). Nothing has a prefix to strip. The model object itself is no submodule of the root (it would
be its own child): `WorkloadRoot.model` holds it, and the workload's forward receives it, so its own forward,
its own hooks and its `training` flag are what a plain call sees.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

from shardtrain.workloads.adapters import forwarded_model


class WorkloadRoot(nn.Module):
    def __init__(self, model: nn.Module, forward: Callable[[nn.Module, Any], Any], forwarded: nn.Module):
        super().__init__()
        # The model's own tables: a parameter FSDP2 or ZeRO-3 replaces on either is replaced on both.
        for table in ("_parameters", "_buffers", "_non_persistent_buffers_set", "_modules"):
            object.__setattr__(self, table, getattr(model, table))
        object.__setattr__(self, "model", model)  # a plain attribute: not registered, so no "model." prefix
        object.__setattr__(self, "workload_forward", forward)
        object.__setattr__(self, "forwarded", forwarded)  # the model, or under --peft lora the base inside it
        self.training = model.training

    def forward(self, batch):
        return self.workload_forward(self.forwarded, batch)

    def train(self, mode: bool = True):
        super().train(mode)  # the shared submodules
        self.model.training = mode  # the model object itself is no child of the root
        return self

    def extra_repr(self) -> str:
        return f"model={type(self.model).__name__}"


def workload_root(model: nn.Module, workload) -> WorkloadRoot:
    """What every strategy's setup wraps (DDP, fully_shard, deepspeed.initialize) instead of the model."""
    return WorkloadRoot(model, workload.forward, forwarded_model(workload, model))
