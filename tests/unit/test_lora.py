"""--peft lora on a workload's model (shardtrain/workloads/adapters.py): the settings as flags and as a YAML `peft:`
section, target_modules that match nothing as one line listing the model's Linear modules, and what the wrapped
model trains: the adapters and the head, never the base."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from shardtrain.config.settings import ConfigError, from_dict, parse_cli, validate
from shardtrain.workloads.adapters import apply_lora, is_peft_model, linear_module_names, merged
from shardtrain.workloads.base import Workload


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.query, self.value, self.dense = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.dense(self.query(x) + self.value(x))


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder, self.classifier = Encoder(), nn.Linear(8, 3)

    def forward(self, x):
        return self.classifier(self.encoder(x))


class Task(Workload):
    def build_model(self):
        return Classifier()


def lora_cfg(*flags: str):
    return parse_cli(["--peft", "lora", *flags])


def test_the_yaml_section_and_the_flags_say_the_same():
    yaml = from_dict(
        {"peft": {"method": "lora", "lora_r": 4, "lora_alpha": 16, "lora_dropout": 0.1, "target_modules": ["query"]}}
    )
    flags = lora_cfg("--lora-r", "4", "--lora-alpha", "16", "--lora-dropout", "0.1", "--target-modules", "query")
    assert yaml.peft == flags.peft and flags.peft.peft == "lora"
    assert from_dict({"peft": "lora"}).peft == parse_cli(["--peft", "lora"]).peft


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--lora-r", "0"], "--lora-r (peft.lora_r) must be"),
        (["--lora-dropout", "1"], "--lora-dropout (peft.lora_dropout) must be in [0, 1)"),
        (["--freeze-layers", "2"], "--freeze-layers (model.freeze_layers): --peft (peft.method) already freezes"),
    ],
)
def test_bad_lora_settings_are_one_line_naming_the_flag(flags, message):
    with pytest.raises(ConfigError, match=None) as e:
        validate(lora_cfg(*flags))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_target_modules_that_match_nothing_list_the_models_linear_modules():
    workload = Task(lora_cfg("--target-modules", "query,q_proj"))
    apply_lora(workload, workload.cfg.peft)
    with pytest.raises(ConfigError) as e:
        workload.build_model()
    msg = str(e.value)
    assert msg.startswith("--target-modules (peft.target_modules): q_proj matches no Linear module of Classifier")
    assert "(from Task.build_model())" in msg and "\n" not in msg
    assert msg.endswith(
        "its Linear modules: query (encoder.query), value (encoder.value), dense (encoder.dense), classifier"
    )


def test_a_model_peft_has_no_default_for_must_name_its_targets():
    workload = Task(lora_cfg())
    apply_lora(workload, workload.cfg.peft)
    with pytest.raises(ConfigError, match=r"peft has no default for Classifier .*name its Linear modules: query"):
        workload.build_model()


def test_only_the_adapters_and_the_head_train_and_merging_gives_the_plain_model_back():
    workload = Task(lora_cfg("--target-modules", "query,value", "--lora-r", "2"))
    apply_lora(workload, workload.cfg.peft)
    apply_lora(workload, workload.cfg.peft)  # the loop applies it again to a workload it was given: once is kept
    torch.manual_seed(0)
    model = workload.build_model()
    assert is_peft_model(model) and not is_peft_model(Classifier())
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert all(".lora_" in n or ".modules_to_save." in n for n in trainable), trainable
    assert sum(".lora_A." in n for n in trainable) == 2 and any("classifier.modules_to_save" in n for n in trainable)
    x = torch.randn(4, 8)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.normal_()  # peft starts B at zero: a trained adapter is not
        before = model(x)
        plain = merged(model, "export RUN")
    assert type(plain) is Classifier and torch.allclose(plain(x), before, atol=1e-6)
    assert linear_module_names(plain).startswith("query (encoder.query)")


def test_merge_of_a_run_without_adapters_says_so():
    with pytest.raises(ConfigError, match=r"export RUN --merge: this run trained no adapters"):
        merged(Classifier(), "export RUN")


def test_plan_counts_the_frozen_base_and_the_trainable_adapters(capsys):
    from shardtrain.commands import plan

    argv = ["--workload", "test_lora:Task", "--gpus", "2", "--gpu", "a100", "--json"]
    assert plan.main([*argv, "--peft", "lora", "--target-modules", "query,value", "--lora-r", "2"]) == 0
    result = json.loads(capsys.readouterr().out)
    full = sum(p.numel() for p in Classifier().parameters())
    trainable = 2 * (2 * 8 + 8 * 2) + 8 * 3 + 3  # A (r x in), B (out x r) on query and value; the head's copy
    assert (result["model_params"], result["frozen_params"]) == (full + trainable, full)
    ddp = next(v for v in result["rows"] if v["variant"] == "ddp")["gpu_bytes"]
    # fp32 AdamW: every weight, but gradients and two moments for the trainable ones alone
    assert (ddp["params"], ddp["grads"], ddp["optimizer"]) == (4 * (full + trainable), 4 * trainable, 8 * trainable)


def test_peft_s_own_r_is_pointed_at_lora_r():
    with pytest.raises(ConfigError, match=r"unknown key 'peft.r'; did you mean 'peft.lora_r'\? \(peft's LoraConfig"):
        from_dict({"peft": {"method": "lora", "r": 4}})
    with pytest.raises(ConfigError, match=r"unknown argument '--r'; did you mean '--lora-r'\?"):
        parse_cli(["--r", "4"])


def test_lora_on_a_model_that_has_adapters_already_is_refused():
    from peft import LoraConfig, get_peft_model

    class HasAdapters(Task):
        def build_model(self):
            return get_peft_model(Classifier(), LoraConfig(target_modules=["query"]))

    workload = HasAdapters(lora_cfg("--target-modules", "query"))
    apply_lora(workload, workload.cfg.peft)
    with pytest.raises(ConfigError, match=r"^--peft \(peft.method\): HasAdapters.build_model\(\) returns a PeftModel"):
        workload.build_model()


def test_lr_multipliers_name_the_same_parts_inside_a_lora_model():
    from shardtrain.strategies.optim import part_prefixes

    workload = Task(lora_cfg("--target-modules", "query,value"))
    apply_lora(workload, workload.cfg.peft)
    names = [n for n, _ in workload.build_model().named_parameters()]
    prefixes = part_prefixes({"text": 0.1, "classifier": 1.0}, {"text": "encoder"}, names)
    assert prefixes == {"base_model.model.encoder": ("text", 0.1), "base_model.model.classifier": ("classifier", 1.0)}


def test_lora_settings_without_peft_lora_are_refused_not_ignored():
    with pytest.raises(
        ConfigError, match=r"^--target-modules \(peft.target_modules\) configures the adapters of --peft"
    ):
        validate(parse_cli(["--target-modules", "query"]))
    assert parse_cli([]).peft.peft is None  # the defaults alone: no adapters, nothing refused


def test_the_banner_names_the_adapters():
    from shardtrain.workloads.adapters import describe_adapters

    workload = Task(lora_cfg("--target-modules", "query,value", "--lora-r", "2", "--lora-alpha", "4"))
    apply_lora(workload, workload.cfg.peft)
    line = describe_adapters(workload.build_model())
    assert line == "lora r=2, alpha 4, dropout 0.0 on query, value; trained whole: classifier", line
    assert describe_adapters(Classifier()) is None


class FusionTask(Workload):
    """The first report's shape: an nn.ModuleDict, which has no forward of its own, called part by part."""

    def build_model(self):
        return nn.ModuleDict({"text": Encoder(), "fusion": nn.Linear(8, 3)})

    def forward(self, model, batch):
        return model["fusion"](model["text"](batch["x"]))


def test_a_moduledict_workloads_forward_gets_its_own_model_with_the_adapters_in_it():
    """Its forward received the PeftModel, which is not subscriptable: `model["text"]` failed in the user's own
    correct code, under every strategy."""
    from shardtrain.strategies.root import workload_root

    workload = FusionTask(lora_cfg("--target-modules", "query,value", "--modules-to-save", "fusion"))
    apply_lora(workload, workload.cfg.peft)
    torch.manual_seed(0)
    model = workload.build_model()
    root = workload_root(model, workload)
    batch = {"x": torch.randn(4, 8)}
    out = root(batch)
    assert out.shape == (4, 3)
    out.sum().backward()
    trained = {n for n, p in model.named_parameters() if p.grad is not None}
    assert trained and all(".lora_" in n or ".modules_to_save." in n for n in trained), trained
    with torch.no_grad():  # the adapters are in the path: moving LoRA's B (zero at start) moves the output
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.add_(0.5)
        assert not torch.allclose(root(batch), out)


def test_lora_with_no_head_to_train_says_so_and_names_one():
    """A trial's ModuleDict (text, image, fusion) under --peft lora trained its adapters alone: the new fusion head
    stayed at its random weights and the run ended below chance, with nothing said."""
    from shardtrain.workloads.adapters import untrained_head_warning

    def built(task, *flags):
        workload = task(lora_cfg("--target-modules", "query,value", *flags))
        apply_lora(workload, workload.cfg.peft)
        return workload.build_model()

    warning = untrained_head_warning(built(FusionTask))
    assert warning is not None and warning.startswith("--peft lora: only the adapters train; ")
    assert warning.endswith("build_model gave it: --modules-to-save fusion trains it whole")
    assert untrained_head_warning(built(FusionTask, "--modules-to-save", "fusion")) is None
    assert untrained_head_warning(built(Task)) is None  # its `classifier` trains whole by default
    assert untrained_head_warning(Classifier()) is None
