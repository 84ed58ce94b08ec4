"""The config's slot for the workloads the package ships (config/shipped.py): config/ names no model, and a third
built-in adds its settings, name and rules in its own module, touching nothing in config/."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from launch import REPO

from shardtrain.builtin_workloads.settings import BUILTINS, BuiltinModelConfig, Builtins
from shardtrain.config.settings import (
    FIELDS,
    ConfigError,
    build_arg_parser,
    from_dict,
    parse_cli,
    reads_images,
    replace_fields,
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
    longformer = parse_cli(["--name", "longformer", "--attention-window", "64", "--output-dir", str(tmp_path)])
    assert longformer.model.attention_window == 64


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


# ---- the built-ins' own rules, found by a new-user trial: each was a late or a misleading error -------------------
TINY = {name: str(REPO / "configs" / f"{name}_tiny.yaml") for name in ("multimodal", "longformer")}


@pytest.mark.parametrize(
    "argv, message",
    [
        # torch's own ValueError, after both processes had started, named no flag
        (
            ["--config", TINY["multimodal"], "--dropout", "1.5"],
            "--dropout (model.dropout) is a probability, between 0 and 1: got 1.5",
        ),
        # a fusion head of no units trained at chance, warning about zero-element tensors
        (
            ["--config", TINY["multimodal"], "--fusion-hidden", "0"],
            "--fusion-hidden (model.fusion_hidden) must be positive, got 0",
        ),
        # refused only after both processes had started
        (
            ["--config", TINY["longformer"], "--attention-window", "15"],
            "--attention-window (model.attention_window): 15 must be an even number of tokens",
        ),
        (
            ["--config", TINY["longformer"], "--max-length", "20000"],
            "--max-length (data.max_length)=20000 is beyond the 16384 positions Longformer supports",
        ),
        # the file's model.name was replaced without a word, and the error after launch named it
        (
            ["--config", TINY["multimodal"], "--workload", "longformer"],
            f"{TINY['multimodal']}:4: --workload (workload.target) is longformer but model.name is multimodal: two "
            "built-ins; drop model.name",
        ),
        # an explicit max_position_embeddings below what --max-length needs was raised in silence
        (
            ["--config", TINY["multimodal"], "--text-config", '{"max_position_embeddings": 40}'],
            f"{TINY['multimodal']}:15: --text-config (model.text_config): max_position_embeddings 40 holds 38 tokens "
            "(positions start after pad_token_id 1), fewer than data.max_length 64: set it to 66 or more",
        ),
    ],
    ids=["dropout", "fusion_hidden", "odd_window", "max_length", "name", "positions"],
)
def test_the_builtins_own_rules_are_one_line_before_launch(argv, message, tmp_path):
    with pytest.raises(ConfigError) as e:
        parse_cli([*argv, "--output-dir", str(tmp_path)])
    assert str(e.value).startswith(message), str(e.value)


def test_the_workload_that_a_config_file_names_is_its_model_name(tmp_path):
    cfg = parse_cli(["--config", TINY["longformer"], "--workload", "longformer", "--output-dir", str(tmp_path)])
    assert cfg.model.name == "longformer"


def test_check_data_takes_the_workloads_name_for_its_records(tmp_path, capsys):
    from shardtrain import cli

    assert cli.main(["make-data", "longdoc", str(tmp_path / "d"), "--n-train", "8", "--n-val", "4"]) == 0
    assert cli.main(["check-data", str(tmp_path / "d"), "--kind", "longformer"]) == 0
    assert "no problems found" in capsys.readouterr().out


def test_a_misspelt_builtin_workload_is_suggested(tmp_path):
    from shardtrain.workloads.base import workload_class

    for typed in ("Longformer", "longfromer"):
        cfg = replace_fields(parse_cli(["--output-dir", str(tmp_path)]), workload=typed)
        with pytest.raises(ConfigError, match=r"; did you mean 'longformer'\?$"):
            workload_class(cfg)


def test_the_longformer_on_the_default_text_model_is_refused_before_launch(tmp_path):
    """`--workload longformer` alone failed after both processes had started and tokenised, blaming --name, which
    the user never gave. check-data reads no model, so the check is the built-in's own before launch."""
    from shardtrain.workloads.base import workload_class

    cfg = parse_cli(["--workload", "longformer", "--pretrained", "false", "--output-dir", str(tmp_path)])
    with pytest.raises(ConfigError) as e:
        workload_class(cfg).check_before_launch(cfg)
    assert str(e.value).startswith(
        "--text-model (model.text_model) is roberta-base (the multimodal model's text encoder, and the default): "
        "longformer needs a Longformer checkpoint: --text-model allenai/longformer-base-4096"
    ), str(e.value)


@pytest.mark.parametrize(
    "workload, flag",
    [
        ("longformer", ["--fusion", "gated"]),
        ("longformer", ["--image-size", "64"]),
        ("multimodal", ["--attention-window", "64"]),
    ],
)
def test_a_setting_of_the_other_builtin_is_refused_not_ignored(workload, flag, tmp_path):
    """The new-user trial's Longformer run took --fusion gated, trained, and recorded it: a setting with no effect."""
    with pytest.raises(
        ConfigError, match=rf"^{flag[0]} \(\w+\.\w+\) is a setting of the \w+ model, and this run trains {workload}"
    ):
        parse_cli(["--config", TINY[workload], *flag, "--output-dir", str(tmp_path)])


def test_a_users_workload_may_read_any_setting(tmp_path):
    cfg = parse_cli(["--workload", "my_pkg.tasks:MyTask", "--attention-window", "64", "--output-dir", str(tmp_path)])
    assert cfg.model.attention_window == 64


def test_a_setting_written_as_a_yaml_section_is_pointed_to_its_section(tmp_path):
    path = tmp_path / "top.yaml"
    path.write_text("attention_window: 64\n")
    with pytest.raises(
        ConfigError, match=r"top.yaml:1: unknown section 'attention_window'; it belongs in section 'model'"
    ):
        parse_cli(["--config", str(path)])
