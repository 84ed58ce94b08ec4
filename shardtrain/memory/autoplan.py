"""`--strategy auto`: the planner picks strategy, offload, activation checkpointing and micro-batch x
accumulation (same global batch) for the memory each rank has, before any strategy is built.

The memory is the GPU's (its total, from the driver) or `--memory-budget-gb`, which also stands in for it on
CPU so that the choice can be tested there. Rank 0 plans (the activation measurement builds small models)
and every rank adopts its choice, so all ranks build the same strategy.
"""

from __future__ import annotations

import dataclasses

import torch

from shardtrain.config.geometry import BatchGeometry
from shardtrain.config.recompute import checkpointed_text
from shardtrain.config.settings import Config, ConfigError, where
from shardtrain.memory.planner import GIB, REPO, VARIANTS, plan
from shardtrain.runtime.distributed import DistInfo, broadcast_object


def capacity_bytes(cfg: Config, dist_info: DistInfo, what: str = "--strategy auto") -> float:
    if cfg.parallel.memory_budget_gb is not None:
        return cfg.parallel.memory_budget_gb * GIB
    if dist_info.device.type == "cuda":
        return float(torch.cuda.get_device_properties(dist_info.device).total_memory)
    raise ConfigError(
        f"{what} on {dist_info.device.type} needs {where('memory_budget_gb')}: there is no device memory to plan for"
    )


def choose(cfg: Config, dist_info: DistInfo) -> dict:
    """The plan's recommendation for this job, as the config changes to make (computed on rank 0)."""
    capacity = capacity_bytes(cfg, dist_info)
    bf16_ok = dist_info.device.type != "cuda" or torch.cuda.is_bf16_supported(including_emulation=False)
    p = plan(cfg, dist_info.world_size, capacity, bf16_ok=bf16_ok, cuda=dist_info.device.type == "cuda")
    rec = p["recommendation"]
    if rec is None:
        raise ConfigError(
            f"--strategy auto: nothing fits in {capacity / GIB:.1f} GiB per rank even at micro-batch 1 "
            f"(shardtrain plan shows every option); use more ranks or a larger {where('memory_budget_gb')}"
        )
    strategy, path, _, _ = VARIANTS[rec["variant"]]
    rejected = sorted(
        {r["variant"] for r in p["rows"] if not r["fits"] and r["micro_batch_size"] == rec["micro_batch_size"]}
        - {rec["variant"]}
    )
    why = (
        f"fastest of the options that fit {capacity / GIB:.2f} GiB per rank: predicted "
        f"{rec['total_bytes'] / GIB:.2f} GiB (model states "
        f"{(rec['gpu_bytes']['params'] + rec['gpu_bytes']['grads'] + rec['gpu_bytes']['optimizer']) / GIB:.2f}, "
        f"activations {rec['gpu_bytes']['activations'] / GIB:.2f})"
        + (f"; too big: {', '.join(rejected)}" if rejected else "")
        + (f"; {p['note']}" if p["note"] else "")
    )
    return {
        "variant": rec["variant"],
        "strategy": strategy,
        "path": str(REPO / path) if path else None,
        "activation_checkpointing": rec["activation_checkpointing"],
        "checkpointed": checkpointed_text(rec["checkpointed_blocks"], rec["blocks"]),
        "micro": rec["micro_batch_size"],
        "accum": rec["grad_accum"],
        "why": why,
    }


def resolve_auto_strategy(cfg: Config, dist_info: DistInfo) -> tuple[Config, BatchGeometry | None, str | None]:
    """--strategy auto: (the config with the chosen strategy, its file and activation checkpointing, the batch
    geometry chosen, the line to print); the config as it is, None and None for any other strategy."""
    if cfg.parallel.strategy != "auto":
        return cfg, None, None
    choice = None
    error = None
    if dist_info.is_rank0:
        try:
            choice = choose(cfg, dist_info)
        except ConfigError as e:
            error = str(e)
    choice, error = broadcast_object((choice, error))
    if error:
        raise ConfigError(error)
    files = {"deepspeed": {"ds": choice["path"]}, "fsdp": {"fsdp_policy": choice["path"]}}.get(choice["strategy"], {})
    resolved = dataclasses.replace(
        cfg,
        parallel=dataclasses.replace(cfg.parallel, strategy=choice["strategy"], **files),
        train=dataclasses.replace(cfg.train, activation_checkpointing=choice["activation_checkpointing"]),
    )
    geometry = BatchGeometry(choice["micro"], choice["accum"], dist_info.world_size)
    line = (
        f"--strategy auto: {choice['variant']}, activation checkpointing {choice['checkpointed']}, "
        f"micro-batch {choice['micro']} x accum {choice['accum']}: {choice['why']}"
    )
    return resolved, geometry, line
