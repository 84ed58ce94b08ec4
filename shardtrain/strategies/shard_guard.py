"""A parameter read outside the model's forward (a loss that uses `model.weight`).

FSDP2 and ZeRO-3 hold only this rank's shard of a parameter between forwards: an FSDP2 unit's parameters are
DTensor shards again after its forward, a ZeRO-3 parameter above the persistence threshold has shape [0]
(`ds_status` NOT_AVAILABLE). Code that reads one there computes with a fragment, and fails far from the cause
(measured: FSDP2 "aten.nll_loss_backward.default got mixed torch.Tensor and DTensor", ZeRO-3 "PowBackward0
returned an invalid gradient ... got [0]"). Around the workload code that runs outside forward
(loss, metric_sums), a torch function mode looks at every tensor handed to a torch function and turns the
first such shard into one line naming the method and the parameter.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from shardtrain.config.settings import ConfigError


class ShardReadGuard(TorchFunctionMode):
    def __init__(
        self, names: Callable[[], dict[int, str]], is_shard: Callable[[torch.Tensor], bool], what: str, strategy: str
    ):
        super().__init__()
        self.names, self.is_shard, self.what, self.strategy = names, is_shard, what, strategy

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for leaf in tree_leaves((args, kwargs)):
            if isinstance(leaf, nn.Parameter) and self.is_shard(leaf):
                name = self.names().get(id(leaf), "a parameter")
                raise ConfigError(
                    f"{self.what} reads {name} outside the model's forward, where {self.strategy} holds "
                    f"only this rank's shard of it: read parameters inside forward and return what "
                    f"the loss needs among its outputs"
                )
        return func(*args, **kwargs)
