"""What DDP and FSDP share: PyTorch's own optimizer step, loss scaling and DCP checkpoints."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from shardtrain.checkpointing.dcp_state import load_dcp, save_dcp, save_dcp_async
from shardtrain.strategies.base import (
    StepResult,
    Strategy,
    checkpoint_group,
    clip_and_norm,
    clip_to,
    extra_state,
    load_extra_state,
    local_grads,
    squared_norm,
)
from shardtrain.strategies.capabilities import Freezing, MemoryIntrospection, Resizing, ShardGuard


class NativeStrategy(Freezing, Resizing, MemoryIntrospection, ShardGuard, Strategy):
    scaler = None
    # DDP holds the whole (all-reduced) gradient on every rank: rank 0's share is all of it. FSDP overrides.
    grads_sharded = False

    def _make_scaler(self):
        return torch.amp.GradScaler(self.device.type)

    def _finish_setup(self, frozen_names):
        self.optimizer, self.scheduler = self._optimizer_and_scheduler(self.unwrapped.named_parameters(), frozen_names)
        self.scaler = self._make_scaler() if self.precision == "fp16" else None
        if self.cfg.checkpoint.async_save:
            self._save_group = checkpoint_group()
        return self.model, self.optimizer, self.scheduler

    def backward(self, loss):
        loss = loss / self.geometry.accum
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def grad_norm_share(self):
        if self.scaler:
            return None  # scaled gradients: the norm is taken after unscale_, in step()
        if self.grads_sharded or self.dist.rank == 0:
            return squared_norm(local_grads(self.unwrapped.parameters()), self.device)
        return torch.zeros((), dtype=torch.float64, device=self.device)

    def step(self, skip=False, grad_norm=None):
        params = self.unwrapped.parameters
        max_norm = self.cfg.train.max_grad_norm
        overflow = False
        if self.scaler:
            # The scaler syncs in step() anyway (it reads found_inf); one more read of the norm costs nothing.
            self.scaler.unscale_(self.optimizer)
            grad_norm = float(clip_and_norm(params(), max_norm))
            overflow = not math.isfinite(grad_norm)
            if not skip:
                self.scaler.step(self.optimizer)  # skips the update itself on inf/nan
            self.scaler.update()
        else:
            # A finite loss can still give inf/nan gradients; clipping would not save the weights. The norm
            # is global (the loop summed every rank's share), so every rank skips together.
            skip = skip or not math.isfinite(grad_norm)
            if not skip:
                clip_to(params(), max_norm, grad_norm)
                self.optimizer.step()
        applied = not skip and not overflow
        if applied:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(grad_norm=grad_norm, applied=applied, overflow=overflow)

    def save(self, ckpt_dir: Path):
        self.sync_buffers()
        save_dcp(
            ckpt_dir,
            self.unwrapped,
            self.optimizer,
            extra_state(self.scheduler, self.optimizer, self.scaler),
            self.dist.is_rank0,
            leave_out=self.base_not_saved,
        )

    def save_async(self, ckpt_dir: Path):
        self.sync_buffers()  # before the snapshot, as in save
        return save_dcp_async(
            ckpt_dir,
            self.unwrapped,
            self.optimizer,
            extra_state(self.scheduler, self.optimizer, self.scaler),
            self.dist.is_rank0,
            self._save_group,
            leave_out=self.base_not_saved,
        )

    def load(self, ckpt_dir: Path, saved: dict | None = None, load_optimizer: bool = True):
        # Every checkpoint has the portable model_optim/ (DeepSpeed writes it too), so one path serves
        # DDP, FSDP and foreign checkpoints at any world size.
        extra = load_dcp(
            ckpt_dir, self.unwrapped, self.optimizer, load_optimizer, warn=self._warn, leave_out=self.base_not_saved
        )
        load_extra_state(extra if load_optimizer else {}, self.scheduler, self.optimizer, self.scaler)
