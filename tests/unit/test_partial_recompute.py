"""--activation-checkpointing every-N and auto: the setting, which blocks are chosen, the planner's fewest blocks,
and the one-line refusals. In one process; the runs are in tests/dist/test_memory.py."""

from __future__ import annotations

import pytest
from launch import REPO
from torch import nn

from shardtrain.config.recompute import RecomputePlan
from shardtrain.config.settings import ConfigError, from_dict, parse_cli, validate
from shardtrain.memory.planner import GIB, count_model, fewest_blocks, format_plan, gpu_bytes, plan
from shardtrain.strategies.recompute import apply_activation_checkpointing

LONGFORMER = str(REPO / "configs/longformer_tiny.yaml")
FOUR_LAYERS = '{"hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 2, "intermediate_size": 64}'


def test_every_n_takes_the_nth_blocks_and_a_count_spreads_them_evenly():
    assert RecomputePlan.configured(True).selected(4) == [True] * 4
    assert RecomputePlan.configured(False).selected(4) == [False] * 4
    assert RecomputePlan.configured("every-2").selected(5) == [False, True, False, True, False]
    assert RecomputePlan.configured("every-3").selected(6) == [False, False, True, False, False, True]
    assert RecomputePlan(count=2).selected(4) == [False, True, False, True]  # every-2's blocks
    assert RecomputePlan(count=3).selected(12) == [(i + 1) % 4 == 0 for i in range(12)]
    assert RecomputePlan(count=0).selected(3) == [False] * 3 and not RecomputePlan(count=0).any
    assert sum(RecomputePlan(count=5).selected(12)) == 5
    assert RecomputePlan(count=9).selected(4) == [True] * 4
    with pytest.raises(ValueError, match="resolved by the run"):
        RecomputePlan.configured("auto")


@pytest.mark.parametrize(
    "flag, value",
    [
        ([], False),
        (["--activation-checkpointing"], True),
        (["--activation-checkpointing", "false"], False),
        (["--activation-checkpointing", "every-3"], "every-3"),
        (["--gradient-checkpointing=every-1"], "every-1"),
    ],
)
def test_the_flag_takes_true_false_and_every_n(flag, value, tmp_path):
    cfg = parse_cli(["--config", LONGFORMER, "--output-dir", str(tmp_path), *flag])
    assert cfg.train.activation_checkpointing == value


def test_the_yaml_key_takes_every_n_and_auto(tmp_path):
    cfg = validate(
        from_dict(
            {
                "train": {"activation_checkpointing": "auto"},
                "parallel": {"device": "cpu", "memory_budget_gb": 1.0},
                "checkpoint": {"output_dir": str(tmp_path)},
            }
        )
    )
    assert cfg.train.activation_checkpointing == "auto"
    cfg = from_dict({"train": {"activation_checkpointing": "every-4"}})
    assert cfg.train.activation_checkpointing == "every-4"


@pytest.mark.parametrize("value", ["every-0", "sometimes", "every-two", "2"])
def test_anything_else_is_one_line_naming_the_flag(value, tmp_path):
    with pytest.raises(ConfigError) as e:
        parse_cli(["--config", LONGFORMER, "--output-dir", str(tmp_path), "--activation-checkpointing", value])
    msg = str(e.value)
    assert "--activation-checkpointing" in msg and "expected true, false, auto or every-N" in msg, msg
    assert "\n" not in msg


def test_auto_on_cpu_needs_a_budget(tmp_path):
    """(A workload without a memory model is refused where the workload is known: tests/unit/
    test_workload_commands.py.)"""
    base = ["--config", LONGFORMER, "--output-dir", str(tmp_path), "--activation-checkpointing", "auto"]
    with pytest.raises(ConfigError, match=r"auto on cpu needs --memory-budget-gb"):
        parse_cli(base)


def test_a_plan_checkpoints_only_the_blocks_it_selects_and_keeps_their_names():
    model = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(6)])
    names = [n for n, _ in model.named_parameters()]
    assert apply_activation_checkpointing(model, (nn.Sequential,), RecomputePlan(count=2)) == 2
    wrapped = [getattr(m, "_shardtrain_recompute", False) for m in model]
    assert wrapped == [False, False, True, False, False, True]
    assert [n for n, _ in model.named_parameters()] == names


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan")
    cfg = parse_cli(["--config", LONGFORMER, "--output-dir", str(out), "--text-config", FOUR_LAYERS])
    return cfg, count_model(cfg)


def test_the_planner_picks_the_fewest_blocks_that_fit(four_layers):
    cfg, m = four_layers
    assert (m.blocks, m.layers) == (4, 4)
    totals = [sum(gpu_bytes(cfg, "ddp", m, 2, 8, "fp32", k / 4, False)[0].values()) for k in range(5)]
    assert totals == sorted(totals, reverse=True)  # each checkpointed block saves
    for k in range(5):  # a budget just above k blocks' prediction: k blocks (no fewer fit)
        budget = (totals[k] + 0.01 * (totals[k - 1] - totals[k] if k else totals[0])) / 0.95
        assert fewest_blocks(cfg, "ddp", m, 2, 8, "fp32", budget, False) == k
    assert fewest_blocks(cfg, "ddp", m, 2, 8, "fp32", totals[4] * 0.9, False) is None


def test_plan_offers_the_fewest_blocks_and_recommends_auto(four_layers):
    cfg, m = four_layers
    totals = [sum(gpu_bytes(cfg, "ddp", m, 2, 8, "fp32", k / 4, False)[0].values()) for k in range(5)]
    budget = (totals[2] + totals[1]) / 2 / 0.95  # 2 blocks fit, 1 does not (under DDP)
    p = plan(cfg, 2, budget, cuda=False)
    rec = p["recommendation"]
    assert (rec["variant"], rec["activation_checkpointing"], rec["checkpointed_blocks"]) == ("ddp", "auto", 2)
    partial = [r for r in p["rows"] if r["activation_checkpointing"] == "auto"]
    assert partial and all(0 < r["checkpointed_blocks"] < 4 and r["fits"] for r in partial)
    full = next(r for r in p["rows"] if r["variant"] == "ddp" and r["checkpointed_blocks"] == 4)
    assert rec["relative_cost"] < full["relative_cost"]
    text = format_plan(p, "test")
    assert "activation checkpointing 2 of 4 blocks" in text and " 2/4 " in text


def test_a_model_whose_blocks_differ_is_checkpointed_all_or_none(tmp_path):
    cfg = parse_cli(["--config", str(REPO / "configs/multimodal_tiny.yaml"), "--output-dir", str(tmp_path)])
    m = count_model(cfg)
    assert m.blocks > m.layers  # the text layers and the CNN's blocks
    totals = [sum(gpu_bytes(cfg, "ddp", m, 2, 8, "fp32", s, False)[0].values()) for s in (0.0, 1.0)]
    budget = (totals[0] + totals[1]) / 2 / 0.95
    assert fewest_blocks(cfg, "ddp", m, 2, 8, "fp32", budget, False) == m.blocks
    assert fewest_blocks(cfg, "ddp", m, 2, 8, "fp32", 2 * totals[0], False) == 0
    assert budget < GIB
