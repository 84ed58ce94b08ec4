"""--oom-recovery and --strategy auto, in one launch of 2 CPU ranks (tests/dist/matrix_driver.py runs each
configuration through parse_cli -> train).

OOM: rank 0 raises a real torch.OutOfMemoryError (--inject-oom-above 8) at micro-batch 16; the run must
finish at micro-batch 8 x accum 2 with the same global batch and the same losses and gradient norms (fp32,
1e-5) as a run started at micro-batch 8 x accum 2. At micro-batch 1 it must give up with a clear message.
Auto: two --memory-budget-gb values lead to two different choices, each recorded in summary.json.
"""
from __future__ import annotations

import json

import pytest

import launch
from launch import REPO, tiny_args, torchrun

DRIVER = REPO / "tests" / "dist" / "matrix_driver.py"
STRATEGIES = {
    "ddp": ["--strategy", "ddp"],
    "fsdp": ["--strategy", "fsdp", "--fsdp-policy", str(REPO / "fsdp_policies/default.yaml")],
    "zero2": ["--ds", str(REPO / "ds_configs/zero2.json")],
}
COMMON = ["--max-steps", "3", "--max-length", "16", "--max-eval-samples", "8", "--report", "false", "--log-every", "100"]
BUDGETS = {"roomy": "1.0", "tight": "0.06"}  # GiB per rank; the tiny model needs ~0.08 under DDP


@pytest.fixture(scope="module")
def runs(mm_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("oom_auto")
    plan = []

    def add(name, *flags, **opts):
        plan.append({"name": name, "args": tiny_args("multimodal", mm_data, root / name, *COMMON, *flags), **opts})

    for s, flags in STRATEGIES.items():
        add(f"oom-{s}", *flags, "--per-device-batch-size", "16", "--inject-oom-above", "8")
        add(f"ref-{s}", *flags, "--per-device-batch-size", "8", "--grad-accum", "2")
    for name, gb in BUDGETS.items():
        add(f"auto-{name}", "--strategy", "auto", "--memory-budget-gb", gb)
    # Last: it ends with an error (every rank raises the same one after the step's all-reduce).
    add("oom-gives-up", *STRATEGIES["ddp"], "--per-device-batch-size", "2", "--inject-oom-above", "0",
        expect_error=True)
    (root / "plan.json").write_text(json.dumps(plan))
    run = torchrun([str(root / "plan.json"), str(root)], script=DRIVER, timeout=600, env=launch.test_env(),
                   check=False)
    assert run.returncode == 0, run.tail(80)
    results = json.loads((root / "results.json").read_text())
    summaries = {p["name"]: json.loads((root / p["name"] / "summary.json").read_text())
                 for p in plan if (root / p["name"] / "summary.json").exists()}
    return results, summaries, run.output


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_oom_recovery_keeps_global_batch_and_trajectory(runs, strategy):
    results, summaries, output = runs
    got, ref = results[f"oom-{strategy}"], results[f"ref-{strategy}"]
    s = summaries[f"oom-{strategy}"]
    assert s["oom_recovery"]["events"] == [{"step": 1, "ranks": 1, "from": [16, 1], "to": [8, 2]}]
    assert (s["oom_recovery"]["micro_batch_size"], s["oom_recovery"]["grad_accum"]) == (8, 2)
    assert s["global_batch_size"] == summaries[f"ref-{strategy}"]["global_batch_size"] == 32
    assert len(got["losses"]) == 3
    for a, b in zip(got["losses"], ref["losses"]):
        assert rel(a, b) < 1e-5, (strategy, got["losses"], ref["losses"])
    for a, b in zip(got["grad_norms"], ref["grad_norms"]):
        assert rel(a, b) < 1e-5, (strategy, got["grad_norms"], ref["grad_norms"])


def test_oom_is_logged_once_per_event_and_gives_up_at_micro_batch_1(runs):
    results, _, output = runs
    assert output.count("out of memory on 1 rank(s) at micro-batch 16 x accum 1; redoing") == len(STRATEGIES)
    r = results["oom-gives-up"]
    assert not r["ok"] and r["error"].startswith("MemoryError: step 1: out of memory on 1 rank(s) at micro-batch 1")


def test_auto_picks_differently_for_two_budgets(runs):
    _, summaries, output = runs
    roomy, tight = summaries["auto-roomy"], summaries["auto-tight"]
    assert roomy["strategy"] == "ddp", roomy["strategy"]
    assert tight["strategy"] != "ddp"
    for s in (roomy, tight):  # the global batch of the config (16 x 1 x 2) is kept
        assert s["global_batch_size"] == 32
    assert output.count("--strategy auto: ") == 2
    assert "--strategy auto: ddp" in output and "fits 1.00 GiB per rank" in output
