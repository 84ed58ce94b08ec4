"""The memory strategies behind one Strategy interface (DDP, FSDP2, DeepSpeed ZeRO-2/3), with their configs,
optimizer groups and activation checkpointing; make_strategy below is the only place that knows them all.
"""
from __future__ import annotations

from shardtrain.config.settings import Config
from shardtrain.runtime.distributed import DistInfo
from shardtrain.strategies.base import Strategy, StepResult


def make_strategy(cfg: Config, dist_info: DistInfo, workload=None) -> Strategy:
    """`workload` (a shardtrain.Workload) gives the block classes: FSDP units and activation-checkpointing targets."""
    kind = cfg.parallel.strategy
    if kind == "ddp":
        from shardtrain.strategies.ddp import DDPStrategy
        return DDPStrategy(cfg, dist_info, workload)
    if kind == "fsdp":
        from shardtrain.strategies.fsdp import FSDPStrategy
        return FSDPStrategy(cfg, dist_info, workload)
    if kind == "deepspeed":
        from shardtrain.strategies.zero import ZeroStrategy
        return ZeroStrategy(cfg, dist_info, workload)
    raise AssertionError(f"strategy {kind!r} should have been resolved before make_strategy")


def check_strategy_config(cfg: Config) -> None:
    """Read and check the strategy's own file before any process group, process or model exists.
    The checks that need the model (a policy that wraps nothing, fp16 with BatchNorm) come in setup."""
    kind = cfg.parallel.strategy
    if kind == "fsdp":
        from shardtrain.strategies.fsdp import load_policy
        load_policy(cfg.parallel.fsdp_policy)
    elif kind == "deepspeed":
        import os

        from shardtrain.runtime.launch import resolve_nproc, under_launcher
        from shardtrain.strategies.ds_config import resolve_ds_config
        env = os.environ
        world = (int(env.get("WORLD_SIZE") or env.get("SLURM_NTASKS") or 1) if under_launcher()
                 else resolve_nproc(cfg))
        resolve_ds_config(cfg, world)


__all__ = ["Strategy", "StepResult", "make_strategy", "check_strategy_config"]
