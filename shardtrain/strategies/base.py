"""The core every memory strategy implements; what a strategy may offer beyond it is in capabilities.py.

The loop calls, per optimizer step:
    for each micro-batch:  with strategy.micro_step(is_last): outputs = strategy.model(batch); strategy.backward(loss)
    share = strategy.grad_norm_share()      # rides on the loop's one all-reduce (step_health.agree)
    result = strategy.step(skip=..., grad_norm=...)
`save` / `load` for checkpoints (`save_async` with --async-save), `train` / `eval` around evaluation and `autocast`.
`strategy.model` is the wrapped root (root.py): its forward is `Workload.forward(model, batch)`, so DDP's, FSDP's and
DeepSpeed's own forward machinery sees whatever submodules the workload calls. Everything backend-specific lives
behind these methods.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ContextManager

import torch
import torch.distributed as dist
from torch import nn

from shardtrain.checkpointing.store import AsyncWrite
from shardtrain.config.geometry import BatchGeometry
from shardtrain.config.recompute import RecomputePlan
from shardtrain.config.settings import Config, ConfigError, where
from shardtrain.runtime.distributed import DistInfo, broadcast_, new_gloo_group
from shardtrain.strategies.optim import (
    build_optimizer,
    build_scheduler,
    device_problem,
    idle_keys,
    param_groups,
    part_prefixes,
    set_lr,
)
from shardtrain.strategies.recompute import apply_activation_checkpointing
from shardtrain.workloads.base import Workload, resolve_block_classes

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class StepResult:
    grad_norm: float  # global, before clipping (inf/nan when the gradients were not finite)
    applied: bool
    overflow: bool = False  # fp16: the loss scaler found inf/nan and skipped the update


class Strategy(ABC):
    name: str = "base"
    # train.optim values this strategy cannot run, with the reason (checked before anything is built)
    refused_optimizers: dict[str, str] = {}

    def __init__(
        self,
        cfg: Config,
        dist_info: DistInfo,
        workload=None,
        geometry: BatchGeometry | None = None,
        recompute: RecomputePlan | None = None,
    ):
        """`geometry`: the run's batch geometry, `recompute`: the blocks it checkpoints (the Trainer's; the flags'
        when None)."""
        self.cfg = cfg
        self.geometry = geometry or BatchGeometry.configured(cfg, dist_info.world_size)
        self.recompute = recompute or RecomputePlan.configured(cfg.train.activation_checkpointing)
        self.workload = workload if workload is not None else Workload(cfg)
        self.dist = dist_info
        self.device = dist_info.device
        self.precision = cfg.train.precision
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler = None
        self._is_last = True
        check_precision_supported(self.precision, self.device)
        device_reason = device_problem(cfg.train.optim, self.device)
        if device_reason:
            raise ConfigError(f"{where('optim')} {cfg.train.optim} on {self.device.type}: {device_reason}")
        if cfg.train.optim in self.refused_optimizers:
            raise ConfigError(
                f"{where('optim')} {cfg.train.optim} does not work under {self.name}: "
                f"{self.refused_optimizers[cfg.train.optim]}"
            )

    # ---- the core: what the loop calls every step, at checkpoints and around evaluation -----------------
    @abstractmethod
    def setup(self, build_model: Callable[..., nn.Module], frozen_names: set[str]):
        """Build, wrap and move the model, then the optimizer and scheduler (after wrapping).
        `build_model()` returns the full, initialised model with its pretrained weights loaded; strategies
        decide on which ranks and devices it is materialised. `build_model(on_meta=True)` (meta device) and
        `build_model(load_weights=False)` give the same architecture with nothing loaded, for copies that
        receive their weights from rank 0. Returns (model, optimizer, scheduler)."""

    def micro_step(self, is_last: bool) -> ContextManager:
        """Context for one micro-batch's forward + backward; gradients sync only on the last."""
        self._is_last = is_last
        return self.autocast()

    @abstractmethod
    def backward(self, loss: torch.Tensor) -> None: ...

    def grad_norm_share(self) -> torch.Tensor | None:
        """This rank's share of the squared global gradient norm (the shares sum to it over ranks), or None
        when step() computes the norm itself (DeepSpeed; the fp16 loss scaler). The loop sums the shares in
        its one all-reduce, so clipping needs no collective or host sync of its own."""
        return None

    @abstractmethod
    def step(self, skip: bool = False, grad_norm: float | None = None) -> StepResult:
        """Clip, apply (unless `skip` or an fp16 overflow), advance the schedule, zero the grads."""

    @abstractmethod
    def save(self, ckpt_dir: Path) -> None:
        """Collective. Writes the strategy's own form plus, where that is not already it, the portable
        FQN-keyed form (`model_optim/`, checkpointing/dcp_state.py) any other strategy can read."""

    def save_async(self, ckpt_dir: Path) -> AsyncWrite:
        """Collective, --async-save: what save writes, copied off the live tensors before it returns (the loop
        then trains on) and written by a background thread; the returned write says when it is on disk. Checkpoint
        writes go over a process group of their own (checkpoint_group), made at setup when --async-save is on."""
        raise NotImplementedError(f"{self.name} has no asynchronous save")

    @abstractmethod
    def load(self, ckpt_dir: Path, saved: dict | None = None) -> None:
        """Collective. `saved` is the checkpoint's trainer_state.json (strategy, world size): a strategy
        that cannot read its own form from it goes through the portable form."""

    def follow_configured_schedule(self) -> None:
        """After a load: take every group's learning rate from the configured schedule at the resumed step.
        The checkpoint's own rates would otherwise drive the first resumed step, and the new schedule only
        the ones after it (a resume with another --max-steps, --lr or warmup). The scheduler drives the
        optimizer the strategy was built with, under DeepSpeed too, so this works for every backend."""
        scheduler, lr = self.scheduler, self.cfg.train.lr
        groups = scheduler.optimizer.param_groups
        # each part's own rate (train.lr_multipliers, strategies/optim.py)
        scheduler.base_lrs = [lr * group.get("lr_multiplier", 1.0) for group in groups]
        for group, base, factor in zip(groups, scheduler.base_lrs, scheduler.lr_lambdas):
            group["initial_lr"] = base
            set_lr(group, base * factor(scheduler.last_epoch))

    def train(self) -> None:
        self.model.train()

    def eval(self) -> None:
        self.sync_buffers()
        self.model.eval()

    def close(self) -> None:
        """The run is over: what the strategy changed in the process for it goes back, so that a later run in the
        same process (shardtrain.fit called again) trains as it would in a process of its own. Only ZeRO-3 changes
        anything (strategies/zero.py)."""
        return None

    def autocast(self) -> ContextManager:
        if self.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=DTYPES[self.precision])

    # ---- what every strategy says of itself -------------------------------------------------------------
    @property
    def unwrapped(self) -> nn.Module:
        return self.model

    def named_parameters(self):
        return self.unwrapped.named_parameters()

    def full_numel(self, p: torch.Tensor) -> int:
        """The element count of the whole (unsharded) parameter. A DTensor's numel is already global; ZeRO-3,
        whose parameters are empty between uses, overrides this."""
        return p.numel()

    def full_ndim(self, p: torch.Tensor) -> int:
        """The whole parameter's number of dimensions (it decides weight decay: strategies/optim.py)."""
        return p.ndim

    def block_classes(self, model: nn.Module) -> tuple[type, ...]:
        """The workload's repeated blocks, as classes that occur in `model` (else one line listing its classes)."""
        return resolve_block_classes(
            model, self.workload.block_classes(), f"{type(self.workload).__name__}.block_classes()"
        )

    def describe(self) -> dict:
        return {"strategy": self.name, "offload": False}

    # ---- helpers for the backends ------------------------------------------------------------------------
    def _warn(self, msg: str) -> None:
        if self.dist.is_rank0:
            print(f"[shardtrain] warning: {msg}", flush=True)

    def sync_buffers(self) -> None:
        """BatchNorm running stats drift apart per rank where the backend does not broadcast them
        (FSDP, ZeRO). Rank 0's copy wins, as under DDP, before eval and before saving."""
        if self.dist.world_size == 1:
            return
        for buf in self.unwrapped.buffers():
            if buf.is_floating_point() or buf.dtype in (torch.int64, torch.long):
                broadcast_(buf.data, src=0)

    def _apply_recompute(self, model: nn.Module, classes: tuple[type, ...]) -> int:
        self.block_count = sum(isinstance(m, classes) for m in model.modules())  # the banner's "k of B"
        if not self.recompute.any:
            return 0
        return apply_activation_checkpointing(model, classes, self.recompute)

    def _compile(self, module: nn.Module) -> nn.Module:
        """torch.compile per --compile (train.compile); the module itself when that is 'none'."""
        backend = self.cfg.train.compile
        return module if backend == "none" else torch.compile(module, backend=backend)

    def _optimizer_and_scheduler(self, named_params, frozen_names: set[str], model_names: list[str] | None = None):
        """`frozen_names`: what --freeze-layers froze (they train from --unfreeze-at-step, if given). `model_names`:
        every parameter of the model, trainable or not, where `named_params` leaves some out (ZeRO's, the frozen
        ones): a --lr-multipliers key may name any of them, the same under every strategy."""
        named_params = list(named_params)
        prefixes = None
        if self.cfg.train.lr_multipliers:
            names = model_names if model_names is not None else [n for n, _ in named_params]
            prefixes = part_prefixes(self.cfg.train.lr_multipliers, self.workload.parts(), names)
            training = {n for n, p in named_params if p.requires_grad and n not in frozen_names}
            if self.cfg.model.unfreeze_at_step is not None:  # no unfreeze reaches what build_model froze itself
                training |= set(frozen_names) - getattr(self, "user_frozen", frozenset())
            for key in idle_keys(prefixes, training):
                self._warn(
                    f"{where('lr_multipliers')}: '{key}' names only parameters that do not train in this run (frozen "
                    f"by {type(self.workload).__name__}.build_model() or --freeze-layers): its factor changes nothing"
                )
        groups = param_groups(
            named_params, self.cfg.train.weight_decay, frozen_names, self.cfg.train.lr, prefixes, self.full_ndim
        )
        optimizer = build_optimizer(groups, self.cfg.train, self.device)
        scheduler = build_scheduler(optimizer, self.cfg.train, self.cfg.model.unfreeze_at_step)
        return optimizer, scheduler


def extra_state(scheduler, optimizer, scaler=None) -> dict:
    """Non-tensor training state, as JSON: the schedule position, each group's current learning rate
    (set again on load: a LambdaLR only recomputes it at its next step) and the loss scaler."""
    state = {
        "scheduler": {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"},
        "lrs": [float(g["lr"]) for g in optimizer.param_groups],
    }
    if scaler:
        state["scaler"] = scaler.state_dict()
    return state


def load_extra_state(extra: dict, scheduler, optimizer, scaler=None) -> None:
    lrs = extra.get("lrs")
    same_groups = lrs is not None and len(lrs) == len(optimizer.param_groups)
    if "scheduler" in extra:
        sd = scheduler.state_dict()
        # Another group layout (DeepSpeed leaves frozen parameters' groups out until they unfreeze): only the
        # schedule's position carries over; its per-group lists stay this optimizer's.
        sd.update(
            extra["scheduler"]
            if same_groups
            else {k: v for k, v in extra["scheduler"].items() if k in ("last_epoch", "_step_count")}
        )
        scheduler.load_state_dict(sd)
        if not same_groups:  # each group's rate at that position, as LambdaLR computes it
            for group, base, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
                set_lr(group, float(base) * factor(scheduler.last_epoch))
    if same_groups:
        for group, lr in zip(optimizer.param_groups, lrs):
            set_lr(group, lr)
    if scaler and "scaler" in extra:
        scaler.load_state_dict(extra["scaler"])


def checkpoint_group():
    """A gloo group of all ranks for the background checkpoint writes alone (dcp_state.save_dcp_async), created
    once at setup: new_group is itself collective, so every rank makes it at the same point. None in one process."""
    if not dist.is_initialized():
        return None
    return new_gloo_group()


def check_precision_supported(precision: str, device: torch.device) -> None:
    if device.type != "cuda" or precision != "bf16":
        return
    if not torch.cuda.is_bf16_supported(including_emulation=False):
        name = torch.cuda.get_device_name(device)
        raise ConfigError(
            f"{where('precision')}=bf16: {name} has no bf16 support (compute capability < 8.0); use --precision fp16"
        )


def squared_norm(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """sum of squares of all elements, float64, without a host sync."""
    if not tensors:
        return torch.zeros((), dtype=torch.float64, device=device)
    return torch.stack(torch._foreach_norm(tensors)).double().square().sum()


def local_grads(params) -> list[torch.Tensor]:
    """The gradients this rank holds (an FSDP DTensor's local shard)."""
    return [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params if p.grad is not None]


def clip_to(params, max_norm: float, total_norm: float) -> None:
    """torch.nn.utils.clip_grad_norm_'s scaling, given the global norm: no collective, no host sync."""
    coef = max_norm / (total_norm + 1e-6)
    if max_norm > 0 and coef < 1.0:
        torch._foreach_mul_(local_grads(params), coef)


def clip_and_norm(params, max_norm: float) -> torch.Tensor:
    """Total gradient norm before clipping; clipping only when max_norm > 0."""
    params = [p for p in params if p.grad is not None]
    if not params:
        return torch.zeros(())
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"), foreach=True)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
