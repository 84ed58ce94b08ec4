"""`--activation-checkpointing auto`: the fewest blocks whose checkpointing makes the planner's predicted peak fit
the memory each rank has (the GPU's, or --memory-budget-gb), for the strategy and batch geometry the run trains
with. Rank 0 chooses (the activation measurement builds small models) and every rank adopts its choice, so all
ranks checkpoint the same blocks. Any other setting is taken as it is (config/recompute.py).
"""

from __future__ import annotations

from shardtrain.config.geometry import BatchGeometry
from shardtrain.config.recompute import RecomputePlan
from shardtrain.config.settings import Config, ConfigError, where
from shardtrain.memory.autoplan import capacity_bytes
from shardtrain.memory.planner import GIB, count_model, fewest_blocks, gpu_bytes, recompute_time_share, variant_of
from shardtrain.runtime.distributed import DistInfo, broadcast_object


def resolve_recompute(cfg: Config, dist_info: DistInfo, geometry: BatchGeometry) -> RecomputePlan:
    if cfg.train.activation_checkpointing != "auto":
        return RecomputePlan.configured(cfg.train.activation_checkpointing)
    choice = error = None
    if dist_info.is_rank0:
        try:
            choice = choose_blocks(cfg, dist_info, geometry)
        except ConfigError as e:
            error = str(e)
    choice, error = broadcast_object((choice, error))
    if error:
        raise ConfigError(error)
    return choice


def choose_blocks(cfg: Config, dist_info: DistInfo, geometry: BatchGeometry) -> RecomputePlan:
    capacity = capacity_bytes(cfg, dist_info, "--activation-checkpointing auto")
    cuda = dist_info.device.type == "cuda"
    geometry = geometry.at_token_budget(cfg)  # the largest micro-batch the run can meet
    c = geometry.applied_to(cfg)
    precision, micro, n = c.train.precision, geometry.micro, geometry.world
    m = count_model(c)
    variant = variant_of(c)
    k = fewest_blocks(c, variant, m, n, micro, precision, capacity, cuda)
    if k is None:
        g, _ = gpu_bytes(c, variant, m, n, micro, precision, 1.0, cuda)
        raise ConfigError(
            f"{where('activation_checkpointing')}=auto: even with all {m.blocks} blocks checkpointed the predicted "
            f"peak is {sum(g.values()) / GIB:.2f} GiB per rank, over the {capacity / GIB:.2f} GiB there are "
            f"({variant}, micro-batch {micro}, {c.data.max_length} tokens); shardtrain plan shows what fits"
        )
    share = k / m.blocks if m.blocks else 0.0
    g, _ = gpu_bytes(c, variant, m, n, micro, precision, share, cuda)
    kinds = "" if m.blocks == m.layers else "; its blocks are of different kinds, so all or none"
    peak, room, act = _in_one_unit(sum(g.values()), capacity, g["activations"])
    why = (
        f"{k} of {m.blocks} blocks: predicted peak {peak} of {room} per rank (activations {act}), "
        f"recompute ~{100 * recompute_time_share(share):.0f}% of step time{kinds}"
    )
    return RecomputePlan(count=k, why=why)


def _in_one_unit(*sizes: float) -> list[str]:
    """GiB, or MiB where the budget is under one GiB (a CPU smoke test's), where GiB would print 0.02 of 0.03."""
    unit, name = (GIB, "GiB") if max(sizes) >= GIB else (2**20, "MiB")
    return [f"{s / unit:.2f} {name}" for s in sizes]
