"""Read a DeepSpeed JSON config and fill its "auto" fields from the shardtrain config.

An explicit value that contradicts the shardtrain config is an error naming both, raised before
`deepspeed.initialize`. DeepSpeed's own identity: train_batch_size = micro * accum * dp_world.
"""

from __future__ import annotations

import json
from pathlib import Path

from shardtrain.config.geometry import BatchGeometry
from shardtrain.config.settings import Config, ConfigError, where

STAGES = (1, 2, 3)


def read_json(path: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{where('ds')}: file not found: {p}")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where('ds')} {p}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None
    except OSError as e:
        raise ConfigError(f"{where('ds')} {p}: cannot read: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where('ds')} {p}: not UTF-8 text (byte {e.start}): is this the JSON file?") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where('ds')} {p}: the top level must be a JSON object")
    return data


def _fill(ds: dict, key: str, ours, flag: str, path: str) -> None:
    theirs = ds.get(key, "auto")
    if theirs == "auto":
        ds[key] = ours
    elif theirs != ours:
        raise ConfigError(f'{path}: "{key}": {theirs} contradicts {flag}={ours}; set it to "auto" or make them agree')


def resolve_ds_config(
    cfg: Config, world_size: int, has_batchnorm: bool = False, geometry: BatchGeometry | None = None
) -> dict:
    """`geometry`: the run's batch geometry (the flags' when None: the check before any process starts)."""
    path = cfg.parallel.ds
    ds = read_json(path)
    t = cfg.train
    g = geometry or BatchGeometry.configured(cfg, world_size)
    for section in ("optimizer", "scheduler"):
        if section in ds:
            raise ConfigError(
                f'{path}: remove the "{section}" section: shardtrain builds the optimizer (--optim) and its '
                f"schedule from --lr, --weight-decay, --warmup-steps and --lr-scheduler for every strategy"
            )
    _fill(ds, "train_micro_batch_size_per_gpu", g.micro, "--per-device-batch-size", path)
    _fill(ds, "gradient_accumulation_steps", g.accum, "--grad-accum", path)
    global_batch = g.global_batch
    theirs = ds.get("train_batch_size", "auto")
    if theirs == "auto":
        ds["train_batch_size"] = global_batch
    elif theirs != global_batch:
        raise ConfigError(
            f'{path}: "train_batch_size": {theirs} != per-device batch {g.micro} '
            f"x grad accum {g.accum} x world size {g.world} = {global_batch}"
        )
    _fill(ds, "gradient_clipping", t.max_grad_norm, "--max-grad-norm", path)

    zero = ds.setdefault("zero_optimization", {})
    stage = zero.get("stage", 0)
    if stage not in STAGES:
        raise ConfigError(
            f"{path}: zero_optimization.stage={stage!r} is not one of 1, 2, 3"
            + ("; for no sharding use --strategy ddp" if stage == 0 else "")
        )
    offload_param = (zero.get("offload_param") or {}).get("device", "none")
    offload_opt = (zero.get("offload_optimizer") or {}).get("device", "none")
    for name, value in (("offload_param", offload_param), ("offload_optimizer", offload_opt)):
        if value not in ("none", "cpu", "nvme"):
            raise ConfigError(f"{path}: zero_optimization.{name}.device={value!r} is not one of none, cpu, nvme")
    if offload_param != "none" and stage != 3:
        raise ConfigError(
            f"{path}: zero_optimization.offload_param needs stage 3 (this file says stage {stage}); "
            f"use ds_configs/zero3_offload.json or drop offload_param"
        )

    _resolve_precision(ds, cfg.train.precision, path, has_batchnorm)
    # Our client AdamW works on CPU partitions too; without this DeepSpeed insists on building its own.
    ds.setdefault("zero_allow_untested_optimizer", True)
    ds.setdefault("zero_force_ds_cpu_optimizer", False)
    ds.setdefault("steps_per_print", 10**9)
    ds.setdefault("wall_clock_breakdown", False)
    return ds


def _resolve_precision(ds: dict, precision: str, path: str, has_batchnorm: bool) -> None:
    explicit = {
        k for k in ("bf16", "fp16", "torch_autocast") if (ds.get(k) or {}).get("enabled", "auto") not in ("auto", False)
    }
    wanted = {"fp32": set(), "bf16": {"bf16", "torch_autocast"}, "fp16": {"fp16", "torch_autocast"}}[precision]
    conflict = explicit - wanted
    if conflict:
        raise ConfigError(
            f'{path}: "{sorted(conflict)[0]}" is enabled but --precision is {precision}; '
            f'set "enabled": "auto" there or change --precision'
        )
    for key in ("bf16", "fp16", "torch_autocast"):
        if (ds.get(key) or {}).get("enabled") == "auto":
            ds[key]["enabled"] = False
    if precision == "bf16" and "bf16" not in explicit:
        # torch autocast keeps fp32 master weights and leaves BatchNorm in fp32, exactly as under DDP/FSDP;
        # DeepSpeed's own "bf16" mode casts BatchNorm too and fails on the ResNet (measured here).
        ds["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    elif precision == "fp16" and "torch_autocast" not in explicit:
        if has_batchnorm:
            raise ConfigError(
                f"--precision fp16 with {path}: DeepSpeed's fp16 mode casts BatchNorm to fp16, which "
                f"this CNN cannot train in; use --precision bf16 (A100/H100) or --strategy fsdp"
            )
        fp16 = ds.setdefault("fp16", {})
        fp16["enabled"] = True
        fp16.setdefault("loss_scale", 0)  # 0 = dynamic loss scaling
        fp16.setdefault("initial_scale_power", 16)


def describe_ds(ds: dict) -> dict:
    zero = ds.get("zero_optimization", {})
    return {
        "stage": zero.get("stage"),
        "offload_optimizer": (zero.get("offload_optimizer") or {}).get("device", "none"),
        "offload_param": (zero.get("offload_param") or {}).get("device", "none"),
    }
