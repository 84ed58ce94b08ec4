"""Optimizer parameter groups, the optimizer (--optim) and the warmup + decay schedule, shared by every strategy.

`train.lr_multipliers` splits the groups further by part of the model (a name from Workload.parts, or a
parameter-name prefix; the longest prefix wins), each part's groups with its own rate: lr x factor, under the
same schedule. The groups are the same on every strategy, so the per-group rates a checkpoint keeps
(base.extra_state) carry across strategies like the rest.

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

from shardtrain.config.settings import ConfigError, TrainConfig, where
from shardtrain.workloads.adapters import PEFT_PREFIX

NO_DECAY_MARKERS = ("bias", "LayerNorm.weight", "layer_norm.weight", "norm.weight", "bn", ".norm")


def _no_decay(name: str, ndim: int) -> bool:
    return ndim <= 1 or any(marker in name for marker in NO_DECAY_MARKERS)


def part_prefixes(multipliers: dict[str, float], parts: dict[str, str], names: Iterable[str]) -> dict[str, tuple]:
    """{parameter-name prefix: (the part as the user named it, factor)} for train.lr_multipliers. A key names a
    part of the workload's (Workload.parts) or is a prefix itself; one that matches no parameter is an error that
    lists what would."""
    names = list(names)
    out = {}

    def covers(prefix: str) -> bool:
        return any(_covers(prefix, n) for n in names)

    for key, factor in multipliers.items():
        prefix = parts.get(key, key).rstrip(".")
        if not covers(prefix) and covers(PEFT_PREFIX + prefix):  # the same part inside a LoRA model (--peft lora)
            prefix = PEFT_PREFIX + prefix
        if not covers(prefix):
            top = sorted({n.split(".")[0] for n in names})
            named = f"the workload's parts: {', '.join(parts)}; " if parts else ""
            raise ConfigError(
                f"{where('lr_multipliers')}: '{key}' matches no parameter of the model ({named}"
                f"its top-level modules: {', '.join(top)}; or any parameter-name prefix)"
            )
        out[prefix] = (key, float(factor))
    return out


def idle_keys(prefixes: dict[str, tuple], training: set[str]) -> list[str]:
    """The lr_multipliers keys whose prefix covers no parameter in `training` (those that train in the run at some
    step): a factor that changes nothing, such as one on a part the workload's build_model() froze itself."""
    return [key for prefix, (key, _) in prefixes.items() if not any(_covers(prefix, n) for n in training)]


def _covers(prefix: str, name: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _part_of(name: str, prefixes: dict[str, tuple]) -> str:
    """The longest prefix that covers `name`; "" for none."""
    matches = [p for p in prefixes if _covers(p, name)]
    return max(matches, key=len) if matches else ""


def param_groups(
    named_params: Iterable[tuple[str, nn.Parameter]],
    weight_decay: float,
    frozen_names: set[str],
    lr: float | None = None,
    prefixes: dict[str, tuple] | None = None,
    ndim_of: Callable[[torch.Tensor], int] = lambda p: p.ndim,
) -> list[dict]:
    """`prefixes` (part_prefixes) with `lr`: each part's groups get lr x its factor; the others, and every group
    without them, the optimizer's own lr. `ndim_of`: the whole parameter's dimensions (Strategy.full_ndim), which
    decide weight decay: under ZeRO-3 every parameter here is a flat partition."""
    prefixes = prefixes or {}
    buckets: dict[tuple[bool, bool, str], list] = {}
    for name, p in named_params:
        key = (name in frozen_names, _no_decay(name, ndim_of(p)), _part_of(name, prefixes))
        buckets.setdefault(key, []).append(p)
    groups = []
    for (frozen, no_decay, prefix), params in sorted(buckets.items()):
        part, factor = prefixes.get(prefix, ("", 1.0))
        group = {
            "params": params,
            "weight_decay": 0.0 if no_decay else weight_decay,
            "frozen": frozen,
            "group_name": f"{part}." * bool(part) + "frozen_" * frozen + ("no_decay" if no_decay else "decay"),
        }
        if prefixes:
            group.update(lr=lr * factor, lr_multiplier=factor)
        groups.append(group)
    return groups


def base_lr(optimizer: torch.optim.Optimizer) -> float:
    """The schedule's rate now, as --lr names it: that of a group with no multiplier (metrics.jsonl's `lr`)."""
    for group in optimizer.param_groups:
        factor = group.get("lr_multiplier", 1.0)
        if factor > 0 and not group.get("frozen"):
            return float(group["lr"]) / factor
    return float(optimizer.param_groups[0]["lr"])


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


def device_problem(optim: str, device: torch.device) -> str | None:
    """Why `optim` cannot run on this device, or None."""
    if optim == "adamw_8bit" and device.type != "cuda":
        # Measured on the 2-core dev machine, tiny multimodal model: DDP had not finished its first step after 7
        # minutes of inductor C++ builds (one per parameter shape); FSDP2's DTensor step failed in the compiler
        # ("incorrect fake kernel for a custom op").
        return (
            "torchao's AdamW8bit compiles its update for every parameter shape with torch.compile, which on CPU "
            "takes minutes of C++ builds (and fails on FSDP's sharded parameters); it is for CUDA runs"
        )
    return None


def build_optimizer(groups: list[dict], t: TrainConfig, device: torch.device) -> torch.optim.Optimizer:
    """`train.optim` over the groups. HF TrainingArguments' choices and settings: Adafactor with an external
    rate (scale_parameter, relative_step off, as `optim="adafactor"`), SGD without momentum."""
    if t.optim == "adamw":
        return adamw(groups, t.lr, device, fused=t.fused_adamw)
    if t.optim == "sgd":
        return torch.optim.SGD(groups, lr=t.lr, foreach=True)
    if t.optim == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(groups, lr=t.lr, scale_parameter=False, relative_step=False, warmup_init=False)
    # torchao's, not bitsandbytes': its state is tensor subclasses that DTensor shards, so FSDP2 shards it as it
    # shards the parameters (torchao documents FSDP2 support), and it needs no extra package.
    from torchao.optim import AdamW8bit

    for group in groups:  # it takes the rate as a tensor (changed in place, never replaced: set_lr)
        if "lr" in group:
            group["lr"] = torch.tensor(group["lr"])
    return AdamW8bit(groups, lr=t.lr, betas=(0.9, 0.999), eps=1e-8)


def set_lr(group: dict, lr: float) -> None:
    """A group's rate, in place where it is a tensor (torchao's optimizers refuse a replaced one)."""
    if torch.is_tensor(group["lr"]):
        group["lr"].fill_(lr)
    else:
        group["lr"] = lr


# Per parameter, the optimizer state's bytes (the planner's model states): AdamW's two fp32 moments; AdamW8bit's
# two 8-bit ones, with an fp32 scale per block of 256; SGD without momentum none. Adafactor's factored moments
# are a row and a column per matrix (optim_state_bytes counts them from the shapes).
STATE_BYTES_PER_PARAM = {"adamw": 8.0, "adamw_8bit": 2.0 + 2 * 4 / 256, "sgd": 0.0}


def optim_state_bytes(optim: str, shapes: Iterable[tuple[int, ...]]) -> int:
    """The optimizer state of trainable parameters of these shapes, in bytes (whole, not per rank)."""
    shapes = list(shapes)
    if optim != "adafactor":
        return int(sum(math.prod(s) for s in shapes) * STATE_BYTES_PER_PARAM[optim])
    # transformers' Adafactor without beta1: a 2-D+ weight keeps fp32 row and column means of the squared
    # gradient, a vector its own fp32 second moment
    return sum(
        4 * (math.prod(s[:-1]) + math.prod(s[:-2] + s[-1:])) if len(s) >= 2 else 4 * math.prod(s) for s in shapes
    )


def adamw(groups: list[dict], lr: float, device: torch.device, fused: bool = True) -> torch.optim.AdamW:
    # fused kernels exist on CUDA only; foreach is the fast path on CPU (and on CUDA with fused=False).
    fused = fused and device.type == "cuda"
    return torch.optim.AdamW(
        groups, lr=lr, betas=(0.9, 0.999), eps=1e-8, fused=fused or None, foreach=None if fused else True
    )
