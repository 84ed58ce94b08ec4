"""The config's slot for the workloads the package ships (config/shipped.py): config/ names no model, and a third
built-in adds its settings, name and rules in its own module, touching nothing in config/."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from shardtrain.builtin_workloads.settings import BUILTINS, BuiltinModelConfig, Builtins
from shardtrain.config.settings import (
    FIELDS,
    ConfigError,
    build_arg_parser,
    from_dict,
    parse_cli,
    reads_images,
    section_class,
    setting,
    ship,
    where,
    workload_target,
)
from shardtrain.config.shipped import ShippedWorkloads


@pytest.fixture
def reship():
    """Whatever a test ships, the built-ins are back in the slot afterwards."""
    yield ship
    ship(BUILTINS)


@dataclass(frozen=True)
class WithExperts(BuiltinModelConfig):
    num_experts: int = setting(8, "experts per mixture-of-experts layer", compared_as="experts")


class WithAThirdBuiltin(Builtins):
    sections = {**Builtins.sections, "model": WithExperts}
    targets = {**Builtins.targets, "moe": "my_moe.workload:MoeWorkload"}

    def check(self, cfg) -> None:
        super().check(cfg)
        if cfg.model.num_experts < 2:
            raise ConfigError(f"{where('num_experts')} must be at least 2, got {cfg.model.num_experts}")


def test_a_third_builtin_brings_its_flag_yaml_key_name_and_check_through_the_slot(reship, tmp_path):
    reship(WithAThirdBuiltin())
    cfg = parse_cli(["--workload", "moe", "--num-experts", "4", "--output-dir", str(tmp_path)])
    assert cfg.model.num_experts == 4 and workload_target(cfg) == "my_moe.workload:MoeWorkload"
    assert "--num-experts" in build_arg_parser().format_help() and FIELDS["num_experts"][0] == "model"
    assert from_dict({"model": {"num_experts": 16}}).model.num_experts == 16
    with pytest.raises(ConfigError, match=r"^--num-experts \(model.num_experts\) must be at least 2, got 1$"):
        parse_cli(["--workload", "moe", "--num-experts", "1", "--output-dir", str(tmp_path)])
    # the built-ins' own settings are still there beside it
    assert parse_cli(["--attention-window", "64", "--output-dir", str(tmp_path)]).model.attention_window == 64


def test_a_framework_that_ships_no_workload_has_none_of_their_settings(reship, tmp_path):
    reship(ShippedWorkloads())
    assert section_class("model").__name__ == "ModelConfig" and "image_model" not in FIELDS
    with pytest.raises(ConfigError, match=r"unknown argument '--image-model'"):
        parse_cli(["--image-model", "resnet18"])
    cfg = parse_cli(["--workload", "my_pkg.tasks:MyTask", "--output-dir", str(tmp_path)])
    assert cfg.model.name is None and workload_target(cfg) == "my_pkg.tasks:MyTask" and not reads_images(cfg)
    assert cfg.data.tokenizer is None  # no pretrained text model to take it from


def test_the_builtins_are_in_the_slot_in_every_process_that_imports_the_package():
    assert section_class("model") is BuiltinModelConfig and FIELDS["attention_window"][0] == "model"


def test_a_section_that_does_not_extend_the_configs_own_is_refused(reship):
    class Loose(ShippedWorkloads):
        sections = {"model": type("Loose", (), {})}

    with pytest.raises(TypeError, match="must extend the config's ModelConfig"):
        reship(Loose())
