"""AdamW parameter groups and the warmup + decay schedule, shared by every strategy.

Frozen parameters get groups of their own whose learning rate is zero until `unfreeze_at_step`. What freezes
them is `requires_grad=False` (no gradient, so AdamW never creates their state); the zero rate only keeps the
schedule's groups alike everywhere. DeepSpeed allocates partitions only for parameters that require grad when
its engine is built: ZeRO leaves the frozen groups out until the unfreeze and then builds a new engine with them
(strategies/zero.py), so every strategy ends up with these same groups.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

import torch
from torch import nn

from shardtrain.config.settings import TrainConfig

NO_DECAY_MARKERS = ("bias", "LayerNorm.weight", "layer_norm.weight", "norm.weight", "bn", ".norm")


def _no_decay(name: str, param: torch.Tensor) -> bool:
    return param.ndim <= 1 or any(marker in name for marker in NO_DECAY_MARKERS)


def param_groups(
    named_params: Iterable[tuple[str, nn.Parameter]], weight_decay: float, frozen_names: set[str]
) -> list[dict]:
    buckets: dict[tuple[bool, bool], list] = {}
    for name, p in named_params:
        buckets.setdefault((name in frozen_names, _no_decay(name, p)), []).append(p)
    groups = []
    for (frozen, no_decay), params in sorted(buckets.items()):
        groups.append(
            {
                "params": params,
                "weight_decay": 0.0 if no_decay else weight_decay,
                "frozen": frozen,
                "group_name": ("frozen_" if frozen else "") + ("no_decay" if no_decay else "decay"),
            }
        )
    return groups


def lr_lambda(tcfg: TrainConfig) -> Callable[[int], float]:
    warmup, total, kind = tcfg.warmup_steps, tcfg.max_steps, tcfg.lr_scheduler

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if kind == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if kind == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return max(0.0, 1.0 - progress)

    return factor


def build_scheduler(
    optimizer: torch.optim.Optimizer, tcfg: TrainConfig, unfreeze_at_step: int | None
) -> torch.optim.lr_scheduler.LambdaLR:
    base = lr_lambda(tcfg)

    # A pure function of the step: the schedule needs no state of its own to resume exactly.
    def frozen(step: int) -> float:
        return base(step) if unfreeze_at_step is not None and step >= unfreeze_at_step else 0.0

    lambdas = [frozen if g.get("frozen") else base for g in optimizer.param_groups]
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambdas)


def adamw(groups: list[dict], lr: float, device: torch.device, fused: bool = True) -> torch.optim.AdamW:
    # fused kernels exist on CUDA only; foreach is the fast path on CPU (and on CUDA with fused=False).
    fused = fused and device.type == "cuda"
    return torch.optim.AdamW(
        groups, lr=lr, betas=(0.9, 0.999), eps=1e-8, fused=fused or None, foreach=None if fused else True
    )
