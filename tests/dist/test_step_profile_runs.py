"""--profile-steps under ddp (with activation checkpointing), fsdp and zero2 on 2 CPU ranks: a torch.profiler
trace per rank in OUT/profile/, and summary.json's `profile`, where each rank's step time splits into data,
compute, communication, recompute, host syncs, optimizer and the rest, which add up to the step; the marked
parts cover it (the unmarked rest under 10%). Steps 3-4: step 2 also gathers the memory table (unmarked). One
launch of tests/dist/matrix_driver.py for the three runs, and one through torchrun shardtrain/main.py, the
user's entry, for the console table and report.html."""

from __future__ import annotations

import json

import pytest
from launch import run_plan, tiny_args, torchrun

STRATEGIES = {
    "ddp": ["--strategy", "ddp", "--activation-checkpointing"],
    "fsdp": ["--strategy", "fsdp"],
    "zero2": ["--ds", "ds_configs/zero2.json"],
}


def run_args(data, out, *extra):
    return tiny_args("longformer", data, out, "--max-steps", "4", "--profile-steps", "3-4", "--eval-every", "0",
                     *extra)  # fmt: skip


@pytest.fixture(scope="module")
def runs(ld_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("profile")
    plan = [{"name": s, "args": run_args(ld_data, root / s, *a)} for s, a in STRATEGIES.items()]
    run_plan(plan, root, timeout=900)
    return {s: json.loads((root / s / "summary.json").read_text()) for s in STRATEGIES} | {"root": root}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_rank_has_a_trace_and_parts_that_cover_its_step(runs, strategy):
    profile = runs[strategy]["profile"]
    assert profile["steps"] == [3, 4] and [r["rank"] for r in profile["ranks"]] == [0, 1]
    for r in profile["ranks"]:
        parts, step = r["parts_ms"], r["step_ms"]
        assert r["profiled_steps"] == 2 and step > 0, r
        assert sum(parts.values()) == pytest.approx(step, rel=1e-6), r
        assert parts["other"] < 0.10 * step, r  # the marked parts are the step
        for part in ("data", "compute", "host_sync", "optimizer", "communication"):
            assert parts[part] > 0, (part, r)
        assert (parts["recompute"] > 0) == (strategy == "ddp"), r  # only the ddp run checkpoints activations
        trace = json.loads(open(r["trace"]).read())
        names = {e.get("name") for e in trace["traceEvents"]}
        assert {"shardtrain::step", "shardtrain::forward", "shardtrain::backward", "shardtrain::optimizer"} <= names
    assert profile["slowest_rank"] == max(profile["ranks"], key=lambda r: r["step_ms"])["rank"]


def test_the_users_entry_prints_the_table_and_the_report_shows_it(ld_data, tmp_path):
    out = tmp_path / "run"
    run = torchrun(run_args(ld_data, out, "--strategy", "ddp", "--report", "true"))
    lines = [line for line in run.output.splitlines() if "profile of steps 3-4" in line]
    assert len(lines) == 1, run.tail()  # from rank 0 only
    assert sorted(p.name for p in (out / "profile").iterdir()) == ["rank-00000.json", "rank-00001.json"]
    assert "where a step's time went" in (out / "report.html").read_text()
