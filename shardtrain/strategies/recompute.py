"""Activation checkpointing by module class, non-reentrant, without renaming any parameter.

Wrapping `forward` in place (instead of torch's CheckpointWrapper module) keeps parameter names stable,
so checkpoints, freezing and FSDP policies see the same names with checkpointing on or off.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from shardtrain.config.recompute import RecomputePlan


@contextlib.contextmanager
def _batchnorm_stats_frozen(module: nn.Module):
    """Recomputing a BatchNorm block in train mode would update its running stats a second time
    per step. Momentum 0 leaves them exactly as they are; the batch counter is restored after."""
    norms = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    saved = [
        (m, m.momentum, m.num_batches_tracked.clone() if m.num_batches_tracked is not None else None) for m in norms
    ]
    for m in norms:
        m.momentum = 0.0
    try:
        yield
    finally:
        for m, momentum, tracked in saved:
            m.momentum = momentum
            if tracked is not None:
                m.num_batches_tracked.copy_(tracked)


@contextlib.contextmanager
def _recomputing(module: nn.Module, has_batchnorm: bool):
    """Around the recomputation in the backward (entered then, not when the forward makes it)."""
    with contextlib.ExitStack() as stack:
        if has_batchnorm:
            stack.enter_context(_batchnorm_stats_frozen(module))
        if torch.autograd._profiler_enabled():  # --profile-steps: the recomputation is a part of its own
            stack.enter_context(torch.profiler.record_function("shardtrain::recompute"))
        yield


def _checkpointed_forward(module: nn.Module, forward):
    has_batchnorm = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())

    def contexts():
        return contextlib.nullcontext(), _recomputing(module, has_batchnorm)

    @functools.wraps(forward)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, context_fn=contexts, **kwargs)

    return run


def apply_activation_checkpointing(
    model: nn.Module, classes: tuple[type, ...], plan: RecomputePlan | None = None
) -> int:
    """Checkpoint the modules that are instances of `classes`: all of them, or those `plan` selects in module
    order (--activation-checkpointing every-N / auto); returns how many were wrapped."""
    blocks = [m for m in model.modules() if isinstance(m, classes) and not getattr(m, "_shardtrain_recompute", False)]
    chosen = plan.selected(len(blocks)) if plan is not None else [True] * len(blocks)
    for module, wrap in zip(blocks, chosen):
        if wrap:
            module.forward = _checkpointed_forward(module, module.forward)
            module._shardtrain_recompute = True
    return sum(chosen)
