"""A resume whose settings differ from the checkpoint's: the one line that says so, and the learning rate of
the first resumed step, which must come from the new schedule rather than the checkpoint."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from shardtrain.config.settings import Config, replace_fields
from shardtrain.loop.resume_changes import resume_changes
from shardtrain.strategies.base import Strategy, extra_state, load_extra_state
from shardtrain.strategies.optim import build_scheduler, lr_lambda


def saved_state(step: int, world_size: int = 2, **train) -> dict:
    return {"step": step, "world_size": world_size, "config": _cfg(**train).to_dict()}


def test_same_settings_say_nothing():
    changes = resume_changes(saved_state(20, max_steps=20), _cfg(max_steps=20), world_size=2)
    assert changes.changes == [] and not changes.schedule_changed


def test_a_longer_run_names_the_schedule_and_its_effect():
    cfg = _cfg(max_steps=26, warmup_steps=0, lr=1e-3)
    changes = resume_changes(saved_state(20, max_steps=20, warmup_steps=0, lr=1e-3), cfg, world_size=2)
    assert changes.schedule_changed
    assert changes.line(20) == (
        "resuming from step 20 with changed settings: --max-steps 20 -> 26; the learning "
        "rate follows the new schedule: 2.31e-04 at step 21, where the saved run's would "
        "be 0.00e+00"
    )


def test_batch_geometry_and_world_size_give_the_global_batch():
    cfg = _cfg(per_device_batch_size=8, grad_accum=2)
    changes = resume_changes(saved_state(5, world_size=4, per_device_batch_size=8, grad_accum=1), cfg, world_size=2)
    assert not changes.schedule_changed
    assert changes.changes == [
        "--grad-accum 1 -> 2, world size 4 -> 2: global batch unchanged at 32 (the data "
        "position carries over exactly: the epoch's samples seen by all ranks)"
    ]


def test_first_resumed_step_uses_the_new_schedule():
    """The checkpoint holds the rate its own schedule ended at (0 at the end of a linear decay); without
    follow_configured_schedule the first resumed step would train at that rate."""
    old, new = _cfg(max_steps=4, warmup_steps=0, lr=1e-3), _cfg(max_steps=6, warmup_steps=0, lr=1e-3)
    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([param], lr=old.train.lr)
    sched = build_scheduler(opt, old.train, None)
    for _ in range(4):
        opt.step()
        sched.step()
    saved = extra_state(sched, opt)
    assert saved["lrs"] == [0.0]

    opt2 = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=new.train.lr)
    sched2 = build_scheduler(opt2, new.train, None)
    load_extra_state(saved, sched2, opt2)
    assert opt2.param_groups[0]["lr"] == 0.0  # the checkpoint's rate, as an exact resume wants it
    Strategy.follow_configured_schedule(SimpleNamespace(scheduler=sched2, cfg=new))
    assert opt2.param_groups[0]["lr"] == new.train.lr * lr_lambda(new.train)(4) > 0


def _cfg(**train) -> Config:
    return replace_fields(Config(), **train)


def test_a_longer_run_keeps_each_parts_learning_rate_multiplier():
    """follow_configured_schedule set every group to --lr, dropping train.lr_multipliers after such a resume."""
    new = _cfg(max_steps=6, warmup_steps=0, lr=1e-3, lr_multipliers={"text": 0.1})
    slow, fast = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([{"params": [slow], "lr": 1e-4, "lr_multiplier": 0.1}, {"params": [fast], "lr": 1e-3}])
    sched = build_scheduler(opt, new.train, None)
    sched.last_epoch = 4
    Strategy.follow_configured_schedule(SimpleNamespace(scheduler=sched, cfg=new))
    factor = lr_lambda(new.train)(4)
    assert [g["lr"] for g in opt.param_groups] == [1e-3 * 0.1 * factor, 1e-3 * factor]
