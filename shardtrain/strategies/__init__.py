"""The memory strategies behind one Strategy interface (DDP, FSDP2, DeepSpeed ZeRO-2/3), with their configs,
optimizer groups and activation checkpointing; make_strategy below is the only place that knows them all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardtrain.config.settings import Config, ConfigError

if TYPE_CHECKING:
    from shardtrain.config.geometry import BatchGeometry
    from shardtrain.config.recompute import RecomputePlan
    from shardtrain.runtime.distributed import DistInfo
    from shardtrain.strategies.base import StepResult, Strategy


def make_strategy(
    cfg: Config,
    dist_info: DistInfo,
    workload=None,
    geometry: BatchGeometry | None = None,
    recompute: RecomputePlan | None = None,
) -> Strategy:
    """`workload` (a shardtrain.Workload) gives the block classes: FSDP units and activation-checkpointing targets;
    `geometry`: the run's batch geometry, `recompute`: the blocks it checkpoints (the flags' when None)."""
    kind = cfg.parallel.strategy
    if kind == "ddp":
        from shardtrain.strategies.ddp import DDPStrategy

        return DDPStrategy(cfg, dist_info, workload, geometry, recompute)
    if kind == "fsdp":
        from shardtrain.strategies.fsdp import FSDPStrategy

        return FSDPStrategy(cfg, dist_info, workload, geometry, recompute)
    if kind == "deepspeed":
        from shardtrain.strategies.zero import ZeroStrategy

        return ZeroStrategy(cfg, dist_info, workload, geometry, recompute)
    raise AssertionError(f"strategy {kind!r} should have been resolved before make_strategy")


def check_strategy_config(cfg: Config) -> None:
    """Read and check the strategy's own file before any process group, process or model exists.
    The checks that need the model (a policy that wraps nothing, fp16 with BatchNorm) come in setup."""
    kind = cfg.parallel.strategy
    if kind == "fsdp":
        from shardtrain.strategies.fsdp_policy import load_policy

        load_policy(cfg.parallel.fsdp_policy)
    elif kind == "deepspeed":
        from shardtrain.runtime.launch import launch_world_size
        from shardtrain.strategies.ds_config import resolve_ds_config

        ds = resolve_ds_config(cfg, launch_world_size(cfg))
        if cfg.parallel.device == "cpu" and (ds.get("fp16") or {}).get("enabled"):
            # deepspeed.initialize would say "Type fp16 is not supported on your device", after the processes,
            # the data and the model: a CPU smoke test of a V100 launch line (longformer_4096.yaml's fp16).
            raise ConfigError(
                f"--precision fp16 with DeepSpeed ({cfg.parallel.ds}) on --device cpu: DeepSpeed's fp16 engine runs "
                f"on GPUs only; on CPU use --precision bf16 or fp32, or --strategy ddp/fsdp, whose fp16 runs there"
            )


def __getattr__(name: str):
    # Strategy and StepResult import torch: only when asked for, so that the parent process of `train --nproc N`
    # can check the strategy's file (check_strategy_config) without paying for torch.
    if name in ("Strategy", "StepResult"):
        from shardtrain.strategies import base

        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Strategy", "StepResult", "make_strategy", "check_strategy_config"]
