"""train.lr_multipliers on every strategy, the way the issue's user sets it: a pretrained encoder learns slower than
the new head. One launch of tests/dist/matrix_driver.py (2 CPU ranks, tiny multimodal model, fp32, dropout 0):
`{"text": 0, "image": 0.5}` under ddp, fsdp, zero2 and zero3, and the zero2 run's step-2 checkpoint resumed under
fsdp. A factor of 0 is the sharpest check that each strategy applies the part's rate: AdamW with a zero rate
(decoupled weight decay included) leaves the text encoder bit-identical, while the image encoder and the fusion head
train. The per-group rates are in every checkpoint and survive the cross-strategy resume."""

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
MULTIPLIERS = '{"text": 0, "image": 0.5}'
RTOL = 1e-4


def run_args(data, out, strategy, *extra):
    return tiny_args(
        "multimodal",
        data,
        out,
        *STRATEGIES[strategy],
        "--max-steps",
        "4",
        "--save-every",
        "2",
        "--per-device-batch-size",
        "8",
        "--dropout",
        "0.0",
        "--lr",
        "1e-3",
        "--lr-multipliers",
        MULTIPLIERS,
        *extra,
    )


@pytest.fixture(scope="module")
def runs(mm_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("lr_multipliers")
    plan = [{"name": s, "args": run_args(mm_data, root / s, s)} for s in STRATEGIES]
    plan[0]["weights"] = True  # the initial weights, rebuilt as train() builds them
    z2_step2 = root / "zero2" / "checkpoints" / "step-000002"
    plan.append(
        {
            "name": "fsdp_from_zero2",
            "args": run_args(mm_data, root / "fsdp_from_zero2", "fsdp", "--resume", str(z2_step2)),
        }
    )
    _, results = run_plan(plan, root, timeout=900)
    return root, results


def final_weights(run_dir):
    return read_portable(run_dir / "checkpoints" / "step-000004")["model"]


def group_rates(run_dir, step):
    state = json.loads((run_dir / "checkpoints" / f"step-{step:06d}" / "strategy_state.json").read_text())
    return state["lrs"]


@pytest.mark.parametrize("strategy", [*STRATEGIES, "fsdp_from_zero2"])
def test_a_zero_factor_freezes_its_part_and_the_others_train(runs, strategy):
    from safetensors.torch import load_file

    root, results = runs
    init = load_file(results["ddp"]["weights"]["init"])
    final = final_weights(root / strategy)
    for prefix, moves in (("text.", False), ("image.", True), ("head.", True)):
        names = [n for n in init if n.startswith(prefix)]
        assert names, prefix
        changed = [n for n in names if not final[n].float().equal(init[n].float())]
        if moves:
            assert len(changed) > len(names) // 2, f"{strategy}: {prefix} barely trained ({len(changed)}/{len(names)})"
        else:
            assert changed == [], f"{strategy}: {prefix} has a zero rate but moved: {changed[:3]}"


def test_every_strategy_follows_ddp_and_keeps_each_groups_rate(runs):
    root, results = runs
    ref = results["ddp"]
    # six groups: text, image and the rest (the fusion head), each with and without weight decay
    ddp_rates = group_rates(root / "ddp", 4)
    assert len(ddp_rates) == 6 and sorted(set(ddp_rates))[0] == 0.0
    for name in [*STRATEGIES, "fsdp_from_zero2"]:
        got = results[name]
        assert got["losses"] == pytest.approx(ref["losses"][-len(got["losses"]) :], rel=RTOL), name
        assert got["lrs"] == pytest.approx(ref["lrs"][-len(got["lrs"]) :], rel=1e-12), name
        assert group_rates(root / name, 4) == pytest.approx(ddp_rates, rel=1e-12), name
    assert len(results["fsdp_from_zero2"]["losses"]) == 2  # steps 3 and 4: it resumed at 2
