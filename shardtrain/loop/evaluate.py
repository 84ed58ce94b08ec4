"""Evaluation during and after training: the workload's metrics over every validation example exactly once."""

from __future__ import annotations

import torch

from shardtrain.data import batch_to_device
from shardtrain.runtime.distributed import DistInfo, all_reduce_sum
from shardtrain.workloads.base import Workload


@torch.no_grad()
def evaluate(workload: Workload, strategy, loaders, dist_info: DistInfo, spare_batch: dict) -> dict:
    """The workload's metrics over every validation example exactly once across ranks.

    Sharded strategies gather parameters collectively in each forward, so every rank runs the same number of
    forwards; a rank whose shard ran out repeats its last batch and counts nothing from it (its sums are
    multiplied by 0: the same keys and shapes on every rank, so the one all-reduce per key matches).
    """
    if loaders.eval is None:
        return {}
    strategy.eval()
    sums: dict[str, torch.Tensor] = {}
    batches = iter(loaders.eval)
    last = spare_batch  # a rank with no validation example at all still joins every forward
    for _ in range(loaders.eval_batches):
        batch = next(batches, None)
        real = batch is not None
        batch = batch if real else last
        last = batch
        batch = batch_to_device(batch, dist_info.device)
        with strategy.autocast():
            outputs = strategy.model(batch)  # the root's forward is Workload.forward (strategies/root.py)
        with strategy.shard_read_guard(f"{type(workload).__name__}.metric_sums"):
            metric_sums = workload.metric_sums(outputs, batch)
        for key, value in metric_sums.items():
            value = value.detach().double() * (1.0 if real else 0.0)
            sums[key] = sums[key] + value if key in sums else value
    sums = {key: all_reduce_sum(sums[key], dist_info.device).cpu() for key in sorted(sums)}
    strategy.train()
    if dist_info.device.type == "cuda":
        torch.cuda.empty_cache()  # eval activations are a different shape: give their blocks back
    return workload.metrics(sums)
