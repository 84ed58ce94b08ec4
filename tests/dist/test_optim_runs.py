"""--optim on the strategies that run it, as a user would pick it (2 CPU ranks, tiny multimodal model, fp32,
dropout 0), in one launch of tests/dist/matrix_driver.py:
- sgd under ddp, fsdp, zero2 and zero3: the same losses as DDP's, and the zero2 run's step-2 checkpoint resumed
  under fsdp continues it (SGD keeps no state, so the checkpoints hold none, under ZeRO too);
- adafactor under ddp, and its step-2 checkpoint resumed under ddp continues it exactly (the factored moments
  are in the checkpoint).
The choices a strategy cannot run are one line each (tests/unit/test_optim_choice.py)."""

from __future__ import annotations

import json

import pytest
from launch import run_plan, tiny_args

from shardtrain.checkpointing.portable import read_portable

STRATEGIES = {
    "ddp": ["--strategy", "ddp"],
    "fsdp": ["--strategy", "fsdp"],
    "zero2": ["--ds", "ds_configs/zero2.json"],
    "zero3": ["--ds", "ds_configs/zero3.json"],
}
RTOL = 1e-4


def run_args(data, out, strategy, optim, *extra):
    return tiny_args(
        "multimodal",
        data,
        out,
        *STRATEGIES[strategy],
        "--optim",
        optim,
        "--max-steps",
        "4",
        "--save-every",
        "2",
        "--per-device-batch-size",
        "8",
        "--dropout",
        "0.0",
        "--lr",
        "3e-3",
        *extra,
    )


def _moved(run_dir) -> bool:
    """Every weight matrix changed between the step-2 and step-4 checkpoints: the optimizer stepped them."""
    a, b = (read_portable(run_dir / "checkpoints" / f"step-{n:06d}")["model"] for n in (2, 4))
    return all(not a[k].equal(b[k]) for k in a if a[k].ndim == 2)


@pytest.fixture(scope="module")
def runs(mm_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("optim")
    plan = [{"name": f"sgd_{s}", "args": run_args(mm_data, root / f"sgd_{s}", s, "sgd")} for s in STRATEGIES]
    step2 = root / "sgd_zero2" / "checkpoints" / "step-000002"
    plan.append(
        {
            "name": "sgd_fsdp_from_zero2",
            "args": run_args(mm_data, root / "sgd_fsdp_from_zero2", "fsdp", "sgd", "--resume", str(step2)),
        }
    )
    plan.append({"name": "adafactor_ddp", "args": run_args(mm_data, root / "adafactor_ddp", "ddp", "adafactor")})
    step2 = root / "adafactor_ddp" / "checkpoints" / "step-000002"
    plan.append(
        {
            "name": "adafactor_ddp_resumed",
            "args": run_args(mm_data, root / "adafactor_resumed", "ddp", "adafactor", "--resume", str(step2)),
        }
    )
    _, results = run_plan(plan, root, timeout=900)
    return root, results


def test_sgd_trains_alike_on_every_strategy_and_resumes_across_them(runs):
    root, results = runs
    ref = results["sgd_ddp"]["losses"]
    assert len(ref) == 4
    assert _moved(root / "sgd_ddp")
    for s in STRATEGIES:
        assert results[f"sgd_{s}"]["losses"] == pytest.approx(ref, rel=RTOL), s
    assert results["sgd_fsdp_from_zero2"]["losses"] == pytest.approx(ref[2:], rel=RTOL)
    for s in ("ddp", "zero3"):  # SGD without momentum has no state to keep
        assert not [
            k
            for k in read_portable(root / f"sgd_{s}" / "checkpoints" / "step-000004", optimizer=True)["optim"]
            if ".state." in k
        ], s
    summary = json.loads((root / "sgd_zero2" / "summary.json").read_text())
    assert summary["config"]["train"]["optim"] == "sgd"


def test_adafactor_keeps_its_factored_moments_and_resumes_exactly(runs):
    root, results = runs
    losses = results["adafactor_ddp"]["losses"]
    assert len(losses) == 4 and _moved(root / "adafactor_ddp")
    assert results["adafactor_ddp_resumed"]["losses"] == losses[2:]  # bit-exact: the same ranks, the same state
    state = read_portable(root / "adafactor_ddp" / "checkpoints" / "step-000002", optimizer=True)["optim"]
    assert any(k.endswith("exp_avg_sq_row") for k in state) and any(k.endswith("exp_avg_sq_col") for k in state)
