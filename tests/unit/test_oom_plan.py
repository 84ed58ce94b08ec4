"""Where an out-of-memory error is recovered and where the ranks meet to learn of it (`plan` in shardtrain/loop/oom.py),
per strategy as its Strategy.collectives_in says; what counts as out of memory; the --inject-oom spelling.
The runs themselves: tests/dist/test_oom_points.py."""

from __future__ import annotations

import pytest
import torch

from shardtrain.config.settings import ConfigError, parse_cli
from shardtrain.loop.oom import PHASES, is_out_of_memory, plan


def phases(accum: int, forward, backward) -> list[bool]:
    """Collectives per phase (forward, backward, gap per micro-step) from per-phase rules of (is_last)."""
    return [rule(m == accum - 1) if rule else False for m in range(accum) for rule in (forward, backward, None)]


def named(flags: list[bool], accum: int) -> list[str]:
    return [f"{PHASES[i % 3]}{i // 3}" for i, f in enumerate(flags) if f]


DDP = (lambda last: False, lambda last: last)
ZERO2 = (lambda last: False, lambda last: True)
SHARDED = (lambda last: True, lambda last: True)  # FSDP, ZeRO-3


@pytest.mark.parametrize("accum", [1, 2, 4])
def test_ddp_meets_once_per_step_before_the_syncing_backward(accum):
    meet, safe = plan(phases(accum, *DDP))
    assert named(meet, accum) == [f"backward{accum - 1}"]
    # Everything but the last backward (which all-reduces as it goes) is recovered.
    assert named([not s for s in safe], accum) == [f"backward{accum - 1}"]


@pytest.mark.parametrize("accum", [1, 3])
def test_zero2_meets_before_every_backward_and_recovers_forwards(accum):
    meet, safe = plan(phases(accum, *ZERO2))
    assert named(meet, accum) == [f"backward{m}" for m in range(accum)]
    assert named(safe, accum) == [p for m in range(accum) for p in (f"forward{m}", f"gap{m}")]


@pytest.mark.parametrize("accum", [1, 2])
def test_fsdp_and_zero3_never_meet_and_recover_only_after_the_last_backward(accum):
    meet, safe = plan(phases(accum, *SHARDED))
    assert not any(meet)
    assert named(safe, accum) == [f"gap{accum - 1}"]


def test_one_rank_recovers_everything_without_meeting():
    meet, safe = plan([False] * 6)
    assert not any(meet) and all(safe)


def test_out_of_memory_is_cudas_error_and_the_cpu_allocators():
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    with pytest.raises(RuntimeError) as real:  # what torch raises for a host allocation that fails
        torch.empty(2**50, dtype=torch.uint8)
    assert not isinstance(real.value, torch.OutOfMemoryError) and is_out_of_memory(real.value)
    assert not is_out_of_memory(RuntimeError("Expected all tensors to be on the same device"))
    assert not is_out_of_memory(MemoryError("Python's own"))


def test_inject_oom_is_point_at_step_colon_rank():
    assert parse_cli(["--inject-oom", "forward@2:1,step@1:0"]).train.inject_oom == ["forward@2:1", "step@1:0"]
    for bad in ("forward@0:1", "middle@1:0", "forward@1"):
        with pytest.raises(ConfigError, match=r"--inject-oom \(train.inject_oom\): .*POINT@STEP:RANK"):
            parse_cli(["--inject-oom", bad])
