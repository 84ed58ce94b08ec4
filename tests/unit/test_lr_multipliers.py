"""train.lr_multipliers: each part of the model its own learning rate under the one schedule, weight-decay groups
kept; a key that names nothing is one line that lists what would."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardtrain.config.settings import ConfigError, parse_cli
from shardtrain.strategies.optim import base_lr, build_scheduler, idle_keys, param_groups, part_prefixes

TINY = ["--config", "configs/multimodal_tiny.yaml"]


class Fusion(nn.Module):
    def __init__(self):
        super().__init__()
        self.text = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
        self.image = nn.Linear(4, 4)
        self.head = nn.Linear(8, 3)


PARTS = {"text": "text", "image": "image", "fusion": "head"}


def groups_of(model, multipliers, frozen=frozenset(), lr=1e-3):
    names = [n for n, _ in model.named_parameters()]
    prefixes = part_prefixes(multipliers, PARTS, names)
    return param_groups(model.named_parameters(), 0.01, set(frozen), lr, prefixes)


def test_each_part_gets_lr_times_its_factor_and_keeps_its_weight_decay_groups():
    model = Fusion()
    groups = groups_of(model, {"text": 0.1, "fusion": 2.0})
    by_name = {g["group_name"]: g for g in groups}
    assert set(by_name) == {"text.decay", "text.no_decay", "fusion.decay", "fusion.no_decay", "decay", "no_decay"}
    assert by_name["text.decay"]["lr"] == pytest.approx(1e-4) and by_name["text.no_decay"]["weight_decay"] == 0.0
    assert by_name["fusion.decay"]["lr"] == 2e-3 and by_name["fusion.decay"]["weight_decay"] == 0.01
    assert by_name["decay"]["lr"] == 1e-3  # image: not named, x1
    # every parameter in exactly one group
    assert sorted(id(p) for g in groups for p in g["params"]) == sorted(id(p) for p in model.parameters())


def test_the_schedule_scales_every_part_alike_and_the_logged_rate_is_the_unmultiplied_one():
    cfg = parse_cli([*TINY, "--max-steps", "10", "--warmup-steps", "2", "--lr", "1e-3"])
    model = Fusion()
    optimizer = torch.optim.AdamW(groups_of(model, {"text": 0.1, "image": 0.5, "fusion": 1.0}), lr=1e-3)
    scheduler = build_scheduler(optimizer, cfg.train, None)
    for _ in range(4):
        optimizer.step()
        scheduler.step()
    rates = {g["group_name"]: g["lr"] for g in optimizer.param_groups}
    assert rates["text.decay"] == pytest.approx(0.1 * rates["fusion.decay"], rel=1e-12)
    assert rates["image.no_decay"] == pytest.approx(0.5 * rates["fusion.decay"], rel=1e-12)
    assert base_lr(optimizer) == pytest.approx(rates["fusion.decay"], rel=1e-12)


def test_the_longest_prefix_wins_and_a_plain_prefix_needs_no_part_name():
    groups = groups_of(Fusion(), {"text": 0.1, "text.1": 0.0})
    by_name = {g["group_name"]: g for g in groups}
    assert by_name["text.1.no_decay"]["lr"] == 0.0  # the LayerNorm (text.1.*)
    assert by_name["text.decay"]["lr"] == pytest.approx(1e-4)  # text.0.weight


def test_a_key_that_matches_nothing_lists_the_parts_and_modules():
    with pytest.raises(ConfigError) as e:
        groups_of(Fusion(), {"txt": 0.1})
    line = str(e.value)
    assert "lr_multipliers" in line and "'txt'" in line and "text, image, fusion" in line and "head" in line
    assert "\n" not in line


def test_a_key_whose_parameters_all_stay_frozen_is_idle():
    names = [n for n, _ in Fusion().named_parameters()]
    prefixes = part_prefixes({"text": 0.1, "text.1": 0.5, "fusion": 2.0}, PARTS, names)
    training = {n for n in names if not n.startswith("text.1.")}  # the LayerNorm frozen for the whole run
    assert idle_keys(prefixes, training) == ["text.1"]
    assert idle_keys(prefixes, set(names)) == []


def test_no_multipliers_leaves_the_groups_as_they_were():
    groups = param_groups(Fusion().named_parameters(), 0.01, set())
    assert [g["group_name"] for g in groups] == ["decay", "no_decay"] and all("lr" not in g for g in groups)


@pytest.mark.parametrize("value", ['{"text": -1}', '{"text": true}', '{"text": "fast"}', '{"": 1}'])
def test_a_bad_factor_is_one_line_naming_the_key(value):
    with pytest.raises(ConfigError, match=r"lr_multipliers"):
        parse_cli([*TINY, "--lr-multipliers", value])
