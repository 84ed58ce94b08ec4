"""An elastic job (`torchrun --nnodes=1:2 --max-restarts=N`, docs/elastic.md) resumes at whatever world size its
rendezvous gives it. Across such a change the global batch is kept, and the change is recorded.

The global batch is the run's own: micro-batch x accumulation x the world size it first started with, as the
flags give it, then kept in the checkpoint. A resume at another world size takes the same number of samples
per rank from it, split as OOM recovery splits them (the largest micro-batch up to the configured one that
divides it, the rest as accumulation): the learning rate, the schedule and the gradient scale mean what they
meant. When the world size does not divide it, the nearest per-rank share is used and one line says so; the
next membership change aims at the kept global batch again. A resume whose flags change the micro-batch or
accumulation is the user's own choice of a new global batch (shardtrain/loop/resume_changes.py says so).

Each change (step, world size and hosts before and after, the geometry it got) goes into the checkpoint's
trainer state, so the final summary.json lists every one, and onto the first metrics.jsonl record after it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardtrain.config.geometry import BatchGeometry
from shardtrain.config.settings import Config
from shardtrain.loop.oom import geometry_for

KEYS = ("per_device_batch_size", "grad_accum")


@dataclass
class Membership:
    global_batch_size: int  # what every world size aims at
    configured: dict  # micro-batch and accumulation as the flags gave them (before this module or auto)
    hosts: list[str]  # this run's ranks' hosts, by rank
    geometry: BatchGeometry  # what this start trains at
    changes: list[dict] = field(default_factory=list)  # every membership change of the run, oldest first
    change: dict | None = None  # this start's change, when it is one
    line: str | None = None  # this start's change, said
    inexact: str | None = None  # the global batch could not be kept exactly, said

    def state(self) -> dict:
        """What the checkpoint's trainer state keeps (`elastic`)."""
        return {
            "global_batch_size": self.global_batch_size,
            "configured": self.configured,
            "hosts": self.hosts,
            "changes": self.changes,
        }


def membership(state: dict, cfg: Config, world: int, hosts: list[str]) -> Membership:
    """This start's batch geometry and membership, from the checkpoint's trainer state ({} on a fresh start)."""
    t = cfg.train
    configured = {k: getattr(t, k) for k in KEYS}
    flags = BatchGeometry.configured(cfg, world)
    ours = Membership(flags.global_batch, configured, hosts, flags)
    if not state:
        return ours
    saved_cfg = (state.get("config") or {}).get("train") or {}
    saved = state.get("elastic") or {}
    saved_world = int(state.get("world_size", world))
    # Before this module the flags' geometry was what ran, and the global batch followed from it.
    saved_configured = saved.get("configured") or {k: saved_cfg.get(k, configured[k]) for k in KEYS}
    ours.changes = list(saved.get("changes") or [])
    if configured == saved_configured:
        ours.global_batch_size = int(
            saved.get("global_batch_size")
            or saved_configured["per_device_batch_size"] * saved_configured["grad_accum"] * saved_world
        )
    # else: the flags changed the geometry, and with it the global batch (resume_changes names the change)
    target = ours.global_batch_size
    per_rank = max(1, round(target / world))
    g = ours.geometry = BatchGeometry(*geometry_for(per_rank, t.per_device_batch_size), world)
    actual = g.global_batch
    if actual != target:
        ours.inexact = (
            f"the global batch {target} cannot be kept at world size {world}: it is {actual} "
            f"(micro-batch {g.micro} x accum {g.accum} x {world} ranks) "
            f"until a world size that divides {target}"
        )
    if saved_world != world:
        step = int(state["step"])
        ours.change = {
            "step": step,
            "world_size_before": saved_world,
            "world_size_after": world,
            "hosts_before": saved.get("hosts"),
            "hosts_after": hosts,
            "micro_batch_size": g.micro,
            "grad_accum": g.accum,
            "global_batch_size": actual,
            "global_batch_kept": actual == target,
        }
        ours.changes.append(ours.change)
        ours.line = (
            f"world size {saved_world} -> {world} at step {step} (hosts: {', '.join(sorted(set(hosts)))}): "
            f"global batch {actual}{' kept' if actual == target else ''} as micro-batch "
            f"{g.micro} x accum {g.accum} x {world} ranks"
        )
    return ours
