"""The shipped configs parse and validate; DeepSpeed JSON contradictions and strategy contradictions are
one-line ConfigErrors that name both sides (checked before any process group or deepspeed.initialize)."""

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torchvision

from shardtrain.config.settings import ConfigError, parse_cli
from shardtrain.strategies.ds_config import resolve_ds_config

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
DS_CONFIGS = sorted((REPO / "ds_configs").glob("*.json"))


def test_every_shipped_config_is_tested():
    names = {p.name for p in CONFIGS}
    assert {
        "multimodal_sentiment.yaml",
        "multimodal_densenet.yaml",
        "longformer_4096.yaml",
        "multimodal_tiny.yaml",
        "longformer_tiny.yaml",
    } <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_parses_and_validates(path):
    cfg = parse_cli(["--config", str(path)])
    if cfg.model.image_weights and cfg.model.name == "multimodal":
        # The torchvision weights name must exist (resolving the enum downloads nothing).
        torchvision.models.get_model_weights(cfg.model.image_model)[cfg.model.image_weights]
    if cfg.model.unfreeze_at_step is not None:
        assert cfg.model.freeze_layers > 0


def test_production_configs_say_what_the_issue_asks():
    mm = parse_cli(["--config", str(REPO / "configs/multimodal_sentiment.yaml")])
    assert (mm.model.text_model, mm.model.image_model, mm.model.pretrained) == ("roberta-base", "resnet50", True)
    assert (mm.train.per_device_batch_size, mm.train.grad_accum, mm.train.precision) == (32, 2, "bf16")
    assert (mm.data.num_workers, mm.data.pin_memory, mm.data.max_length, mm.data.image_size) == (4, True, 128, 224)
    dn = parse_cli(["--config", str(REPO / "configs/multimodal_densenet.yaml")])
    assert dn.model.image_model == "densenet121"
    lf = parse_cli(
        ["--config", str(REPO / "configs/longformer_4096.yaml"), "--ds", str(REPO / "ds_configs/zero2.json")]
    )
    assert (lf.model.text_model, lf.data.max_length, lf.model.attention_window) == (
        "allenai/longformer-base-4096",
        4096,
        512,
    )
    assert lf.train.precision == "fp16" and lf.train.activation_checkpointing
    assert lf.parallel.strategy == "deepspeed"


@pytest.mark.parametrize("ds", DS_CONFIGS, ids=lambda p: p.name)
def test_shipped_ds_configs_resolve(ds):
    cfg = parse_cli(["--config", str(REPO / "configs/longformer_tiny.yaml"), "--ds", str(ds), "--grad-accum", "3"])
    out = resolve_ds_config(cfg, world_size=2)
    assert out["train_batch_size"] == 8 * 3 * 2
    assert out["train_micro_batch_size_per_gpu"] == 8 and out["gradient_accumulation_steps"] == 3
    assert out["zero_optimization"]["stage"] in (2, 3)


def test_ds_with_another_strategy_is_a_contradiction():
    with pytest.raises(ConfigError, match=r"--ds .*zero2.json selects DeepSpeed, but --strategy is 'fsdp'"):
        parse_cli(
            [
                "--config",
                str(REPO / "configs/multimodal_tiny.yaml"),
                "--strategy",
                "fsdp",
                "--ds",
                str(REPO / "ds_configs/zero2.json"),
            ]
        )
    # --strategy deepspeed without a JSON has nothing to run
    with pytest.raises(ConfigError, match="--strategy deepspeed needs --ds"):
        parse_cli(["--config", str(REPO / "configs/multimodal_tiny.yaml"), "--strategy", "deepspeed"])


def _resolve(tmp_path, ds: dict | str, *flags, world_size=2, precision="fp32", config="longformer_tiny"):
    path = tmp_path / "ds.json"
    path.write_text(ds if isinstance(ds, str) else json.dumps(ds))
    cfg = parse_cli(
        ["--config", str(REPO / f"configs/{config}.yaml"), "--ds", str(path), "--precision", precision, *flags]
    )
    return resolve_ds_config(cfg, world_size, has_batchnorm=config.startswith("multimodal"))


STAGE2 = {"zero_optimization": {"stage": 2}}


def test_explicit_micro_batch_contradiction_names_both_values(tmp_path):
    with pytest.raises(ConfigError) as e:
        _resolve(tmp_path, {**STAGE2, "train_micro_batch_size_per_gpu": 16}, "--per-device-batch-size", "4")
    msg = str(e.value)
    assert "train_micro_batch_size_per_gpu" in msg and "16" in msg and "--per-device-batch-size=4" in msg
    assert "\n" not in msg


def test_agreeing_explicit_values_are_accepted(tmp_path):
    out = _resolve(
        tmp_path,
        {**STAGE2, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "train_batch_size": 16},
        "--per-device-batch-size",
        "4",
        "--grad-accum",
        "2",
    )
    assert out["train_batch_size"] == 16


def test_train_batch_size_mismatch_shows_the_arithmetic(tmp_path):
    with pytest.raises(ConfigError) as e:
        _resolve(
            tmp_path,
            {**STAGE2, "train_batch_size": 100},
            "--per-device-batch-size",
            "4",
            "--grad-accum",
            "2",
            world_size=3,
        )
    assert "100" in str(e.value) and "4 x grad accum 2 x world size 3 = 24" in str(e.value)


def test_grad_accum_contradiction(tmp_path):
    with pytest.raises(ConfigError, match=r'"gradient_accumulation_steps": 8 contradicts --grad-accum=2'):
        _resolve(tmp_path, {**STAGE2, "gradient_accumulation_steps": 8}, "--grad-accum", "2")


@pytest.mark.parametrize("stage", [0, 4, "two"])
def test_unknown_stage(tmp_path, stage):
    with pytest.raises(ConfigError, match=r"zero_optimization.stage=.* is not one of 1, 2, 3"):
        _resolve(tmp_path, {"zero_optimization": {"stage": stage}})


def test_offload_param_needs_stage3(tmp_path):
    ds = {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}
    with pytest.raises(ConfigError, match="offload_param needs stage 3 .*stage 2"):
        _resolve(tmp_path, ds)


def test_invalid_json_names_line_and_column(tmp_path):
    text = '{\n  "zero_optimization": {"stage": 2},\n  "train_batch_size": auto\n}\n'
    with pytest.raises(ConfigError, match=r"invalid JSON at line 3, column 23"):
        _resolve(tmp_path, text)


@pytest.mark.parametrize("section", ["optimizer", "scheduler"])
def test_optimizer_and_scheduler_sections_refused(tmp_path, section):
    ds = {**STAGE2, section: {"type": "AdamW", "params": {"lr": 1e-3}}}
    with pytest.raises(ConfigError, match=f'remove the "{section}" section'):
        _resolve(tmp_path, ds)


def test_precision_contradiction(tmp_path):
    with pytest.raises(ConfigError, match=r'"fp16" is enabled but --precision is bf16'):
        _resolve(tmp_path, {**STAGE2, "fp16": {"enabled": True}}, precision="bf16")


def test_ds_fp16_on_cpu_is_refused_before_any_process_starts():
    """A trial's CPU smoke test of the V100 launch line (--strategy zero2 with the 4096 config's fp16) failed after
    the processes, the data and the model, with DeepSpeed's "Type fp16 is not supported on your device"."""
    from shardtrain.strategies import check_strategy_config

    with pytest.raises(ConfigError, match=r"^--precision fp16 with DeepSpeed \(.*zero2.json\) on --device cpu: "):
        check_strategy_config(
            parse_cli(["--strategy", "zero2", "--precision", "fp16", "--device", "cpu", "--nproc", "2"])
        )
    check_strategy_config(parse_cli(["--strategy", "zero2", "--precision", "bf16", "--device", "cpu", "--nproc", "2"]))
    check_strategy_config(parse_cli(["--strategy", "zero2", "--precision", "fp16", "--device", "cuda", "--nproc", "2"]))


def test_ds_fp16_refused_on_batchnorm_model(tmp_path):
    with pytest.raises(ConfigError, match="--precision fp16 .* BatchNorm"):
        _resolve(tmp_path, STAGE2, precision="fp16", config="multimodal_tiny")


def test_bf16_uses_torch_autocast_not_deepspeed_bf16(tmp_path):
    # DeepSpeed's own bf16 mode casts BatchNorm too (measured failure); autocast keeps it fp32.
    out = _resolve(tmp_path, {**STAGE2, "bf16": {"enabled": "auto"}}, precision="bf16", config="multimodal_tiny")
    assert out["torch_autocast"] == {"enabled": True, "dtype": "bfloat16"} and out["bf16"]["enabled"] is False


# ---- the suggestion engine: names from other trainers point to the setting they mean here -----------------


def test_batch_size_points_to_per_device_batch_size():
    # By letters, --batch-size is closest to --eval-batch-size; what users mean is the training batch.
    with pytest.raises(ConfigError) as e:
        parse_cli(["--batch-size", "8"])
    assert "did you mean '--per-device-batch-size'?" in str(e.value) and "eval" not in str(e.value)
    assert "global batch is per-device-batch-size x processes x grad-accum" in str(e.value)


def test_yaml_batch_size_points_to_per_device_batch_size(tmp_path):
    (tmp_path / "c.yaml").write_text("train:\n  batch_size: 8\n")
    with pytest.raises(
        ConfigError,
        match=r"unknown key 'train.batch_size'; did you mean "
        r"'train.per_device_batch_size'\? \(the batch of one process",
    ):
        parse_cli(["--config", str(tmp_path / "c.yaml")])


@pytest.mark.parametrize(
    "key,ours",
    [
        ("train.learning_rate", "train.lr"),
        ("train.gradient_accumulation_steps", "train.grad_accum"),
        ("data.max_seq_length", "data.max_length"),
        ("train.save_steps", "checkpoint.save_every"),
    ],
)
def test_hf_spellings_in_yaml_suggest_our_key(tmp_path, key, ours):
    """The CLI accepts HF's --learning-rate; in YAML the same spelling gets our key as the suggestion
    (in its own section, even when the user wrote another)."""
    section, name = key.split(".")
    (tmp_path / "c.yaml").write_text(f"{section}:\n  {name}: 1\n")
    flag = "--" + name.replace("_", "-")
    with pytest.raises(
        ConfigError,
        match=rf"unknown key '{key}'; did you mean '{ours}'\? \({flag} is accepted "
        rf"as a flag; YAML takes {ours}\)",
    ):
        parse_cli(["--config", str(tmp_path / "c.yaml")])


# ---- --strategy zero2|zero3|zero2_offload|zero3_offload: the shipped DeepSpeed configs by name ---------------


@pytest.mark.parametrize("name", ["zero2", "zero3", "zero2_offload", "zero3_offload"])
def test_strategy_names_the_shipped_ds_config_from_any_cwd(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # resolved beside the package, not in the working directory
    cfg = parse_cli(["--strategy", name, "--output-dir", str(tmp_path / "o")])
    assert (cfg.parallel.strategy, cfg.parallel.ds) == ("deepspeed", str(REPO / "ds_configs" / f"{name}.json"))
    (tmp_path / "c.yaml").write_text(f"parallel:\n  strategy: {name}\n")
    cfg = parse_cli(["--config", "c.yaml", "--output-dir", str(tmp_path / "o")])
    assert (cfg.parallel.strategy, cfg.parallel.ds) == ("deepspeed", str(REPO / "ds_configs" / f"{name}.json"))
    assert resolve_ds_config(cfg, world_size=2)["zero_optimization"]["stage"] == int(name[4])


@pytest.mark.parametrize("variant, policy", [("fsdp_offload", "offload"), ("fsdp_sgo", "shard_grad_op")])
def test_a_plan_variant_given_as_strategy_names_the_flags_that_run_it(variant, policy, tmp_path):
    """plan's table names FSDP with another policy file as a variant of its own. As --strategy it was "not one of
    ddp, fsdp, ...; did you mean 'zero3_offload'?": DeepSpeed, not the FSDP that plan had weighed."""
    for args in (["--strategy", variant], ["--config", str(tmp_path / "c.yaml")]):
        (tmp_path / "c.yaml").write_text(f"parallel:\n  strategy: {variant}\n")
        with pytest.raises(ConfigError) as refused:
            parse_cli([*args, "--output-dir", str(tmp_path / "o")])
        message = str(refused.value)
        assert f"'{variant}' is plan's name for FSDP" in message and "did you mean" not in message, message
        assert message.endswith(f"--strategy fsdp --fsdp-policy fsdp_policies/{policy}.yaml"), message
        assert (REPO / "fsdp_policies" / f"{policy}.yaml").is_file()


def test_strategy_name_and_another_ds_is_a_contradiction(tmp_path):
    other = tmp_path / "other.json"
    other.write_text(json.dumps(STAGE2))
    with pytest.raises(
        ConfigError,
        match=rf"--strategy zero3 means .*ds_configs/zero3.json, but --ds "
        rf"\(parallel.ds\) is {other}: drop one of them",
    ):
        parse_cli(["--strategy", "zero3", "--ds", str(other), "--output-dir", str(tmp_path / "o")])
    # The same file both ways says one thing, not two.
    cfg = parse_cli(
        ["--strategy", "zero3", "--ds", str(REPO / "ds_configs/zero3.json"), "--output-dir", str(tmp_path / "o")]
    )
    assert cfg.parallel.ds == str(REPO / "ds_configs/zero3.json")
    # A --strategy on the command line still overrides the YAML's name, as for any other strategy.
    (tmp_path / "c.yaml").write_text("parallel:\n  strategy: zero3\n")
    cfg = parse_cli(["--config", str(tmp_path / "c.yaml"), "--strategy", "ddp", "--output-dir", str(tmp_path / "o")])
    assert (cfg.parallel.strategy, cfg.parallel.ds) == ("ddp", None)


# ---- a bad value in a YAML file: the file and the line, then what is wrong ------------------------------------


def _error(tmp_path, text: str, *flags: str) -> str:
    path = tmp_path / "x.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        parse_cli(["--config", str(path), "--output-dir", str(tmp_path / "out"), *flags])
    return str(e.value).replace(str(path), "x.yaml")


@pytest.mark.parametrize(
    "text,message",
    [
        # wrong type, below a comment and a blank line
        ("# tiny\ntrain:\n  max_steps: 3\n\n  lr: fast\n", "x.yaml:5: train.lr: expected a number, got 'fast'"),
        ("train:\n  max_steps: [3]\n", "x.yaml:2: train.max_steps: expected an integer, got [3]"),
        # unknown key and section, with a did-you-mean
        ("train:\n  lr: 1.0e-3\n  max_step: 3\n", "x.yaml:3: unknown key 'train.max_step'; did you mean 'max_steps'?"),
        ("model:\n  pretrained: false\ntrian:\n  lr: 1\n", "x.yaml:3: unknown section 'trian'; did you mean 'train'?"),
        # a value not among the allowed ones, in a flow mapping
        (
            "model: {pretrained: false}\ntrain: {lr: 0.1, precision: fp8}\n",
            "x.yaml:2: train.precision: 'fp8' is not one of fp32, bf16, fp16",
        ),
        # nested: workload's own keys, a section that is not a mapping, a key nested one level too deep
        (
            "workload:\n  target: my.mod:Task\n  arg:\n    width: 3\n",
            "x.yaml:3: unknown key 'workload.arg'; did you mean 'args'?",
        ),
        ("workload:\n  target: my.mod:Task\n  args: [3]\n", "x.yaml:3: workload.args: expected a mapping, got [3]"),
        ("data:\n  max_length: 64\ntrain: 5\n", "x.yaml:3: section 'train' must be a mapping, got 5"),
        ("train:\n  optimizer:\n    lr: 1\n", "x.yaml:2: unknown key 'train.optimizer'"),  # optim (--optim) exists
        ("train:\n  lr: 1\n3: x\n", "x.yaml:3: unknown section '3'"),  # a key YAML reads as a number
        # YAML syntax
        ("train:\n  lr: 1\n max_steps: 3\n", "x.yaml:3: invalid YAML: expected <block end>, but found"),
        ("train:\n  lr: [1, 2\n", "x.yaml:3: invalid YAML:"),
        ("- train\n- model\n", "x.yaml:1: the top level must be a mapping of sections"),
    ],
    ids=[
        "type",
        "type-list",
        "key",
        "section",
        "enum",
        "workload-key",
        "workload-args",
        "section-type",
        "too-deep",
        "number-key",
        "syntax",
        "syntax-unclosed",
        "top-level",
    ],
)
def test_a_bad_value_in_a_yaml_file_names_the_file_and_line(tmp_path, text, message):
    assert _error(tmp_path, text).startswith(message)


def test_a_yaml_value_that_validate_refuses_names_the_file_and_line(tmp_path):
    text = "model:\n  pretrained: false\n  freeze_layers: 0\n  unfreeze_at_step: 2\ntrain:\n  max_steps: 4\n  lr: -1\n"
    assert _error(tmp_path, text) == "x.yaml:7: train.lr must be positive, got -1.0"
    # Two values of the file in one message: the first leads, the second carries its own line.
    assert _error(tmp_path, text, "--lr", "0.1") == (
        "x.yaml:4: model.unfreeze_at_step is set but model.freeze_layers (x.yaml:3) is 0: nothing to unfreeze"
    )
    # A flag over the file's value is named as the flag: the file's line did not set it.
    assert _error(tmp_path, text, "--lr=-2") == "--lr (train.lr) must be positive, got -2.0"
    assert _error(tmp_path, "model:\n  pretrained: false\nparallel:\n  nproc: lots\n") == (
        "x.yaml:4: parallel.nproc must be 'auto' or a positive integer, got 'lots'"
    )


# ---- train --help: every option described, from the config fields' own help ------------------------------------


def _help_entries(help_text: str) -> dict[str, str]:
    """`train --help`'s options: first flag -> its help text (argparse separates the flags from the text with two
    or more spaces on the first line, or puts the text on the lines below)."""
    entries: dict[str, str] = {}
    flag = None
    for line in help_text.split("options:", 1)[1].splitlines():
        head = re.match(r"^  (-\S.*?)(?: {2,}(.*))?$", line)
        if head:
            flag = head.group(1).split()[0].rstrip(",")
            entries[flag] = head.group(2) or ""
        elif flag and line.strip():
            entries[flag] = (entries[flag] + " " + line.strip()).strip()
    return entries


def _undescribed(help_text: str) -> list[str]:
    """Options whose help says no more than their default and YAML key (a description has 3 words or more)."""

    def description(text: str) -> str:
        return re.sub(r";? ?default: .*$", "", re.sub(r" ?\(YAML [\w.]+\)$", "", text))

    return [
        flag
        for flag, text in _help_entries(help_text).items()
        if flag not in ("-h", "--config") and len(description(text).split()) < 3
    ]


def test_train_help_describes_every_option(monkeypatch):
    from shardtrain.config.settings import FIELDS, build_arg_parser, flag_of

    monkeypatch.setenv("COLUMNS", "120")
    text = build_arg_parser().format_help()
    entries = _help_entries(text)
    assert set(entries) >= {flag_of(name) for name in FIELDS}
    assert _undescribed(text) == []
    lr = entries["--lr"]
    assert lr.startswith("peak learning rate") and "default: 3e-05" in lr and lr.endswith("(YAML train.lr)"), lr
    assert entries["--precision"] and "--precision {fp32,bf16,fp16}" in text
    # A field without a description is caught: only its default and YAML key would be left.
    section, f, typ = FIELDS["lr"]
    monkeypatch.setitem(FIELDS, "lr", (section, dataclasses.field(default=f.default), typ))
    assert _undescribed(build_arg_parser().format_help()) == ["--lr"]
