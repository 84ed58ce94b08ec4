"""--profile-steps: the step range, and how a rank's profiler events become parts that add up to its step."""

from types import SimpleNamespace

import pytest
import torch

from shardtrain.config.settings import ConfigError, parse_cli, profile_range
from shardtrain.observability.step_profile import PARTS, StepProfiler, format_profile, summarise


def test_the_range_is_checked_at_start_up_naming_the_flag():
    assert profile_range(None, 10) is None
    assert profile_range("3-5", 10) == (3, 5) and profile_range("4", 10) == (4, 4)
    for bad, why in (
        ("x-2", "not a step range"),
        ("5-3", "1 <= A <= B"),
        ("0-2", "1 <= A <= B"),
        ("8-12", "--max-steps"),
    ):
        with pytest.raises(ConfigError, match=r"--profile-steps \(log.profile_steps\)") as e:
            profile_range(bad, 10)
        assert why in str(e.value)
    with pytest.raises(ConfigError, match="--profile-steps"):
        parse_cli(["--config", "configs/multimodal_tiny.yaml", "--max-steps", "4", "--profile-steps", "3-9"])


def _event(name: str, start: float, end: float):
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end))


def test_parts_split_the_step_and_add_up_to_it():
    # Two steps of 100 us: data 10, forward 30 (a 5 us all-gather in it), backward 40 (recompute 8, an all-reduce
    # 6, and a nested all-reduce op inside it counted once), step sync 5, optimizer 10, 5 unmarked.
    events = []
    for t0 in (0, 1000):
        events += [
            _event("shardtrain::step", t0, t0 + 100),
            _event("shardtrain::data", t0, t0 + 10),
            _event("shardtrain::forward", t0 + 10, t0 + 40),
            _event("c10d::allgather_", t0 + 20, t0 + 25),
            _event("shardtrain::backward", t0 + 40, t0 + 80),
            _event("shardtrain::recompute", t0 + 41, t0 + 49),
            _event("c10d::allreduce_", t0 + 60, t0 + 66),
            _event("gloo:all_reduce", t0 + 61, t0 + 65),
            _event("aten::mm", t0 + 50, t0 + 58),
            _event("shardtrain::step_sync", t0 + 80, t0 + 85),
            _event("c10d::allreduce_", t0 + 81, t0 + 84),  # the step's own all-reduce: host_sync, not comm
            _event("shardtrain::optimizer", t0 + 85, t0 + 95),
        ]
    s = summarise(events)
    assert s["profiled_steps"] == 2 and s["step_ms"] == pytest.approx(0.1)
    assert s["parts_ms"] == pytest.approx(
        {
            "data": 0.010,
            "compute": 0.051,
            "communication": 0.011,
            "recompute": 0.008,
            "host_sync": 0.005,
            "optimizer": 0.010,
            "other": 0.005,
        }  # fmt: skip
    )
    assert sum(s["parts_ms"].values()) == pytest.approx(s["step_ms"])
    summary = {"steps": [1, 2], "ranks": [{"rank": 0, "trace": "/r/profile/rank-00000.json", **s},
                                          {"rank": 1, "trace": "/r/profile/rank-00001.json", **s, "step_ms": 0.2}],
               "slowest_rank": 1}  # fmt: skip
    lines = format_profile(summary)
    assert lines[0].startswith("profile of steps 1-2") and all(p in lines[1] for p in PARTS)
    assert lines[3].endswith("slowest") and not lines[2].endswith("slowest")


def test_the_profiler_records_only_its_steps_and_writes_a_trace(tmp_path):
    said = []
    prof = StepProfiler((2, 3), 0, "cpu", tmp_path, SimpleNamespace(info=said.append))
    x = torch.randn(64, 64)
    for step in range(1, 5):
        with prof.step(step):
            with prof.phase("forward"):
                y = x @ x
            with prof.phase("optimizer"):
                y.sum().item()
        assert prof.active == (step == 2)
    (rank,) = prof.summary()["ranks"]
    assert rank["profiled_steps"] == 2 and (tmp_path / "profile" / "rank-00000.json").is_file()
    assert rank["parts_ms"]["compute"] > 0 and rank["parts_ms"]["optimizer"] > 0
    assert said and said[0].startswith("profile of steps 2-3")


def test_a_run_that_stops_inside_the_range_keeps_what_it_profiled(tmp_path):
    """A preemption or an early stop (every rank at the same step) ends the loop before the range does: the
    trainer's end closes the profiler, which writes the trace and the summary of the steps it saw."""
    prof = StepProfiler((2, 9), 0, "cpu", tmp_path, SimpleNamespace(info=lambda line: None))
    for step in range(1, 4):
        with prof.step(step), prof.phase("forward"):
            torch.randn(32, 32).sum()
    assert prof.active and prof.summary() == {}
    prof.close()
    assert not prof.active and prof.summary()["steps"] == [2, 3]
    assert prof.summary()["ranks"][0]["profiled_steps"] == 2 and (tmp_path / "profile" / "rank-00000.json").is_file()
    prof.close()  # once only
    assert prof.summary()["steps"] == [2, 3]
