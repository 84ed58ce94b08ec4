"""Every visible GPU used, exactly once.

A plain `python train.py` on a 4-GPU machine trains on GPU 0 alone (and hits OOM there); a launcher
that gives every process LOCAL_RANK=0 stacks all ranks on GPU 0. Both look like a working run.
After start-up every rank holds the same table of (host, local rank, device) - distributed.gather_rank_info()
- so every rank reaches the same verdict and an error stops them all at the same point, without a hang.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from shardtrain.config.sagemaker_env import TORCHRUN_HINT
from shardtrain.config.settings import ConfigError


@dataclass
class Verdict:
    error: str | None = None
    warnings: list[str] = field(default_factory=list)


def _gpu_key(row: dict) -> str:
    # Ranks pinned by CUDA_VISIBLE_DEVICES all call their GPU cuda:0; the UUID tells them apart.
    return row.get("device_uuid") or row["device"]


def check_rank_table(table: list[dict]) -> Verdict:
    """The verdict on a gathered table; pure, so the CUDA cases are testable on a CPU machine."""
    verdict = Verdict()
    world = len(table)
    # A host is its name and, where the launcher numbers nodes, its node: nodes may share one hostname.
    by_node: dict[tuple, list[dict]] = defaultdict(list)
    for row in table:
        by_node[(row["host"], row.get("node"))].append(row)
    shared_names = len({name for name, _ in by_node}) < len(by_node)

    for (name, node), rows in by_node.items():
        host = f"{name} (node {node})" if shared_names else name
        on_gpu = [r for r in rows if r["device"].startswith("cuda")]
        users: dict[str, list[int]] = defaultdict(list)
        for r in on_gpu:
            users[_gpu_key(r)].append(r["rank"])
        shared = {key: ranks for key, ranks in users.items() if len(ranks) > 1}
        if shared and verdict.error is None:
            key, ranks = next(iter(shared.items()))
            device = next(r["device"] for r in on_gpu if _gpu_key(r) == key)
            verdict.error = (
                f"ranks {', '.join(map(str, sorted(ranks)))} on {host} all use {device}: each process "
                f"needs its own LOCAL_RANK; launch with torchrun --nproc_per_node=N (or srun with one "
                f"task per GPU) instead of setting RANK/WORLD_SIZE by hand"
            )

        visible = max(r.get("visible_gpus", 0) for r in rows)
        used = len(users)
        if visible and not on_gpu:
            verdict.warnings.append(
                f"{host}: {visible} GPU(s) visible but training runs on CPU; drop --device cpu to use them"
            )
        elif visible > used:
            verdict.warnings.append(
                f"{host}: only {used} of {visible} visible GPUs are used (world size {world}); "
                f"{visible - used} sit idle. Start one process per GPU: `shardtrain train --nproc auto ...`, "
                f"`torchrun --nproc_per_node={visible} shardtrain/main.py ...`, or on SageMaker "
                f"{TORCHRUN_HINT}"
            )
    return verdict


def check_devices(table: list[dict], is_rank0: bool, warn) -> None:
    """Raise on a shared device (every rank raises; the CLI prints rank 0's line); rank 0 warns about idle GPUs."""
    verdict = check_rank_table(table)
    if verdict.error:
        raise ConfigError(verdict.error)
    if is_rank0:
        for line in verdict.warnings:
            warn("!" * 20 + " " + line)
