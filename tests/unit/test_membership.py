"""An elastic job's resume at another world size (shardtrain/loop/elastic.py): the global batch kept through
micro-batch x accumulation, said in one line when it cannot be, and every membership change recorded."""

from __future__ import annotations

from shardtrain.config.geometry import BatchGeometry
from shardtrain.config.settings import Config, replace_fields
from shardtrain.loop.elastic import membership
from shardtrain.loop.oom import geometry_for, smaller_micro_batch
from shardtrain.loop.resume_changes import resume_changes


def cfg_of(micro: int, accum: int) -> Config:
    cfg = Config()
    cfg = replace_fields(cfg, per_device_batch_size=micro, grad_accum=accum)
    return cfg


def start(state: dict, world: int, micro: int = 2, accum: int = 1, step: int = 0):
    """One start of the job with the same flags, as torchrun's agent restarts it; returns (membership, the
    trainer state its checkpoint at `step` would hold)."""
    cfg = cfg_of(micro, accum)
    hosts = [f"node{r + 1}" for r in range(world)]
    m = membership(state, cfg, world, hosts)
    return m, m.geometry, {"step": step, "world_size": world, "config": cfg.to_dict(), "elastic": m.state()}


def geometry(g: BatchGeometry) -> tuple[int, int]:
    """The micro-batch and accumulation the start trains at (the run's state: the config keeps the flags)."""
    return g.micro, g.accum


def test_losing_and_regaining_a_node_keeps_the_global_batch():
    first, cfg, saved = start({}, world=2, step=6)
    assert first.global_batch_size == 4 and first.change is None and geometry(cfg) == (2, 1)

    alone, cfg, saved = start(saved, world=1, step=10)
    assert geometry(cfg) == (2, 2) and alone.inexact is None
    assert alone.change == {
        "step": 6,
        "world_size_before": 2,
        "world_size_after": 1,
        "hosts_before": ["node1", "node2"],
        "hosts_after": ["node1"],
        "micro_batch_size": 2,
        "grad_accum": 2,
        "global_batch_size": 4,
        "global_batch_kept": True,
    }
    assert alone.line == (
        "world size 2 -> 1 at step 6 (hosts: node1): global batch 4 kept as micro-batch 2 x accum 2 x 1 ranks"
    )

    # The worker restarted again at the same world size (another failure): still accumulating 2, no change.
    again, cfg, saved = start(saved, world=1, step=12)
    assert geometry(cfg) == (2, 2) and again.change is None and len(again.changes) == 1

    back, cfg, _ = start(saved, world=2, step=12)
    assert geometry(cfg) == (2, 1) and back.global_batch_size == 4
    assert [(c["step"], c["world_size_before"], c["world_size_after"]) for c in back.changes] == [(6, 2, 1), (12, 1, 2)]


def test_the_micro_batch_shrinks_when_the_share_does_not_divide_into_it():
    _, _, saved = start({}, world=1, micro=4, accum=3)  # global batch 12
    m, cfg, _ = start(saved, world=2, micro=4, accum=3)
    assert geometry(cfg) == (3, 2) and m.change["global_batch_kept"]  # 6 per rank, micro-batch at most 4


def test_a_global_batch_the_world_size_does_not_divide_is_said_and_aimed_at_again():
    _, _, saved = start({}, world=2)  # global batch 4
    three, cfg, saved = start(saved, world=3)
    assert geometry(cfg) == (1, 1) and not three.change["global_batch_kept"]
    assert three.inexact == (
        "the global batch 4 cannot be kept at world size 3: it is 3 (micro-batch 1 x accum 1 x "
        "3 ranks) until a world size that divides 4"
    )
    two, cfg, _ = start(saved, world=2)
    assert geometry(cfg) == (2, 1) and two.inexact is None and two.change["global_batch_size"] == 4


def test_changed_flags_set_a_new_global_batch_and_say_so():
    _, _, saved = start({}, world=2)
    _, _, saved = start(saved, world=1)  # ran at accum 2 to keep 4
    cfg = cfg_of(2, 3)
    changes = resume_changes(saved, cfg, 2)  # against the flags (accum 1), not the geometry the resume ran with
    m = membership(saved, cfg, 2, ["node1", "node2"])
    cfg = m.geometry
    assert geometry(cfg) == (2, 3) and m.global_batch_size == 12
    assert changes.changes == [
        "--grad-accum 1 -> 3, world size 1 -> 2: global batch 4 -> 12 samples per step (the "
        "data position carries over exactly: the epoch's samples seen by all ranks)"
    ]


def test_a_world_size_change_alone_is_the_membership_line_not_a_changed_setting():
    _, _, saved = start({}, world=2)
    assert resume_changes(saved, cfg_of(2, 1), 1).changes == []


def test_a_checkpoint_from_before_elastic_keeps_its_flags_global_batch():
    old = {"step": 4, "world_size": 2, "config": cfg_of(2, 2).to_dict()}  # no `elastic`: global batch 8
    m, cfg, _ = start(old, world=1, micro=2, accum=2)
    assert geometry(cfg) == (2, 4) and m.change["hosts_before"] is None and m.global_batch_size == 8


def test_the_arithmetic_is_oom_recoverys():
    assert smaller_micro_batch(8) == 4 and smaller_micro_batch(6) == 3 and smaller_micro_batch(1) is None
    assert geometry_for(8, 8) == (8, 1) and geometry_for(8, 3) == (2, 4) and geometry_for(7, 4) == (1, 7)
