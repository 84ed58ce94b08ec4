"""Pick the strategy from the config: the only place that knows all of them."""
from __future__ import annotations

from shardtrain.config import Config
from shardtrain.distributed import DistInfo
from shardtrain.strategies.base import Strategy, StepResult


def make_strategy(cfg: Config, dist_info: DistInfo) -> Strategy:
    kind = cfg.parallel.strategy
    if kind == "ddp":
        from shardtrain.strategies.ddp import DDPStrategy
        return DDPStrategy(cfg, dist_info)
    if kind == "fsdp":
        from shardtrain.strategies.fsdp import FSDPStrategy
        return FSDPStrategy(cfg, dist_info)
    if kind == "deepspeed":
        from shardtrain.models import uses_batchnorm
        from shardtrain.strategies.zero import ZeroStrategy
        return ZeroStrategy(cfg, dist_info, has_batchnorm=uses_batchnorm(cfg.model))
    raise AssertionError(f"strategy {kind!r} should have been resolved before make_strategy")


__all__ = ["Strategy", "StepResult", "make_strategy"]
