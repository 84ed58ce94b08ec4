"""The public Workload API: lookup, defaults, and the one-line errors for users' own models."""

from __future__ import annotations

import ast
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from test_layering import code_words
from torch import nn
from torch.utils.data import Dataset

from shardtrain.config.settings import Config, ConfigError, from_dict, parse_cli, replace_fields
from shardtrain.workloads.base import (
    CheckedCollate,
    Workload,
    check_loss,
    load_workload,
    model_inputs,
    resolve_block_classes,
    workload_class,
)

REPO = Path(__file__).resolve().parents[2]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(4, 3)

    def forward(self, x, mask=None):
        return self.head(self.blocks(x))


class Pairs(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return {"x": torch.full((4,), float(i)), "labels": torch.tensor(i % 3)}


class Task(Workload):
    def build_model(self):
        return Net()

    def datasets(self):
        return Pairs(), Pairs()

    def block_classes(self):
        return (Block,)


# ---- the loop and the strategies know no built-in --------------------------------------------------------
def _names_in_code(path: Path) -> tuple[set[str], list[str]]:
    """(imported modules, the identifiers and strings of the code), docstrings left out."""
    imports = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            imports.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imports.add(node.module)
            imports.update(f"{node.module}.{a.name}" for a in node.names)
    return imports, code_words(path)


@pytest.mark.parametrize(
    "path",
    [REPO / "shardtrain" / "loop" / "train.py", *sorted((REPO / "shardtrain" / "strategies").glob("*.py"))],
    ids=lambda p: p.name,
)
def test_loop_and_strategies_use_only_the_public_api(path):
    imports, words = _names_in_code(path)
    # The Workload API: base.py, and adapters.py (what --peft lora does to any workload's model).
    public = ("shardtrain.workloads.base", "shardtrain.workloads.adapters")
    private = sorted(
        m
        for m in imports
        if m.startswith(("shardtrain.workloads", "shardtrain.builtin_workloads")) and not m.startswith(public)
    )
    assert not private, f"{path.name} imports {private}: the built-ins must come through shardtrain.workloads.base"
    named = sorted({w for w in words if "multimodal" in w.lower() or "longformer" in w.lower()})
    assert not named, f"{path.name} names a built-in model: {named}"


# ---- finding the workload ----------------------------------------------------------------------------------
def test_yaml_string_mapping_and_flag_spellings(tmp_path):
    assert from_dict({"workload": "pkg.mod:Task"}).workload.workload == "pkg.mod:Task"
    cfg = from_dict({"workload": {"target": "pkg.mod:Task", "args": {"width": 8}}})
    assert (cfg.workload.workload, cfg.workload.workload_args) == ("pkg.mod:Task", {"width": 8})
    with pytest.raises(ConfigError, match=r"unknown key 'workload.arg'; did you mean 'args'"):
        from_dict({"workload": {"target": "pkg.mod:Task", "arg": {}}})
    cfg = parse_cli(["--workload", "longformer", "--output-dir", str(tmp_path / "o")])
    assert cfg.model.name == "longformer"  # the built-in reads the model section under its own name


def test_a_tasks_py_beside_the_config_is_importable(tmp_path, monkeypatch):
    (tmp_path / "beside_tasks.py").write_text(
        textwrap.dedent("""
        from shardtrain import Workload
        class MyTask(Workload):
            def __init__(self, cfg, width=2):
                super().__init__(cfg, width=width)
                self.width = width
    """)
    )
    (tmp_path / "run.yaml").write_text("workload: {target: beside_tasks:MyTask, args: {width: 5}}\n")
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "path", list(sys.path))
    cfg = parse_cli(["--config", str(tmp_path / "run.yaml"), "--output-dir", str(tmp_path / "o")])
    task = load_workload(cfg)
    assert (type(task).__name__, task.width, task.cfg) == ("MyTask", 5, cfg)


@pytest.mark.parametrize(
    "target, message",
    [
        ("no_such_module_xyz:Task", r"--workload \(workload.target\): cannot import no_such_module_xyz"),
        ("tasks.py", r"is not a workload; write a dotted module path and a class"),
        # A file, as one runs a script: the target it means.
        (
            "./my_pkg/tasks.py:Sentiment",
            r"'./my_pkg/tasks.py:Sentiment' is not a workload; .* e\.g\. my_pkg\.tasks:Sentiment,",
        ),
        ("test_workload:Nope", r"test_workload has no Workload subclass named Nope \(it has Task\)"),
    ],
)
def test_bad_targets_are_one_line(target, message):
    cfg = Config()
    cfg = replace_fields(cfg, workload=target)
    with pytest.raises(ConfigError, match=message):
        workload_class(cfg)


def test_builtins_resolve_by_model_name():
    cfg = from_dict({"model": {"name": "longformer"}})
    assert workload_class(cfg).__name__ == "LongformerWorkload"
    assert workload_class(Config()).__name__ == "MultimodalWorkload"


# ---- pitfalls: one line each, naming the workload method ------------------------------------------------------
def test_a_block_class_the_model_lacks_lists_the_classes_it_has():
    with pytest.raises(
        ConfigError,
        match=r"Task.block_classes\(\) names GPT2Block, which does not occur in the "
        r"model; its module classes are: Block, Linear, Net, Sequential",
    ):
        resolve_block_classes(Net(), ("GPT2Block",), "Task.block_classes()")
    assert resolve_block_classes(Net(), ("Block",)) == (Block,)
    assert resolve_block_classes(Net(), (Block,)) == (Block,)


def test_default_blocks_come_from_hf_no_split_modules():
    from transformers import BertConfig, BertForSequenceClassification

    model = BertForSequenceClassification(
        BertConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, vocab_size=50)
    )
    assert [c.__name__ for c in resolve_block_classes(model, ())] == list(model._no_split_modules)


def test_collate_keys_the_model_does_not_take():
    batch = {"pixels": torch.zeros(2, 4), "labels": torch.zeros(2, dtype=torch.long)}
    with pytest.raises(
        ConfigError,
        match=r"Task.collate gives keys labels, pixels, but Net.forward needs x: make "
        r"collate return those keys, or override Task.forward",
    ):
        model_inputs(Net(), batch, "Task")
    ddp_like = nn.Module()  # a wrapper whose forward is (*args, **kwargs) is looked through
    ddp_like.module = Net()
    ddp_like.forward = lambda *a, **k: None
    assert set(model_inputs(ddp_like, {"x": torch.zeros(2, 4), "labels": torch.zeros(2)}, "Task")) == {"x"}


@pytest.mark.parametrize(
    "loss, message",
    [
        (
            torch.ones(3, requires_grad=True),
            r"Task.loss must return a scalar floating-point tensor, got a tensor of "
            r"shape \(3,\)",
        ),
        (0.5, r"Task.loss must return a scalar floating-point tensor, got float \(return the tensor itself, "),
        (torch.tensor(1.0), r"Task.loss returned a tensor that does not depend on the model's parameters"),
    ],
)
def test_a_loss_that_is_not_a_scalar_tensor(loss, message):
    with pytest.raises(ConfigError, match=message):
        check_loss(loss, "Task")


def test_the_default_loss_reads_a_dict_of_logits_and_names_itself_for_anything_else():
    """A trial's forward returned {"logits": ...} (the most natural thing for a model of one's own) or a tuple:
    the default loss ended the run with `AttributeError: 'dict' object has no attribute 'float'`, naming nothing."""
    task = Task(Config())
    logits = torch.tensor([[2.0, 0.0], [0.0, 2.0]], requires_grad=True)
    batch = {"labels": torch.tensor([0, 1])}
    assert torch.equal(task.loss({"logits": logits}, batch), task.loss(logits, batch))
    assert torch.equal(task.metric_sums({"logits": logits}, batch)["confusion"], torch.eye(2, dtype=torch.float64))
    with pytest.raises(ConfigError) as e:
        task.loss((logits, logits), batch)
    assert str(e.value) == (
        "Task.loss: the default reads the logits from what forward returned, here a tuple of 2: return the logits "
        "tensor (or a dict with 'logits') from forward, or override Task.loss"
    )
    with pytest.raises(ConfigError, match=r"^Task.metric_sums: .* here a dict with keys scores and no 'logits': "):
        task.metric_sums({"scores": logits}, batch)


def test_a_wrong_return_from_datasets_or_build_model_is_one_line_naming_it():
    """A trial's `datasets()` returned the training list alone, and its `build_model()` a (model, None) pair:
    `train` said `ValueError: too many values to unpack (expected 2)` and `'tuple' object has no attribute 'to'`,
    naming no method, though check-data already worded the first."""
    from shardtrain.workloads.base import model_of, splits_of

    class TrainOnly(Task):
        def datasets(self):
            return [{"x": torch.zeros(2), "labels": 0}] * 3

    class Pair(Task):
        def build_model(self):
            return Net(), None

    with pytest.raises(
        ConfigError, match=r"^TrainOnly.datasets\(\) must return \(train, validation_or_None\), got a list of 3$"
    ):
        splits_of(TrainOnly(Config()))
    with pytest.raises(
        ConfigError, match=r"^Pair.build_model\(\) must return the nn.Module to train, got a tuple of 2$"
    ):
        model_of(Pair(Config()))
    train, validation = splits_of(Task(Config()))
    assert isinstance(train, Pairs) and isinstance(model_of(Task(Config())), Net)


def test_a_workload_without_a_required_method_is_a_usage_error_before_launch():
    """A trial's workload without datasets() exited 1 (NotImplementedError), the code of a failure in training."""
    from shardtrain.workloads.base import check_required_methods

    class NoData(Workload):
        def build_model(self):
            return Net()

    class NoModel(Workload):
        def datasets(self):
            return Pairs(), None

    with pytest.raises(ConfigError, match=r"^NoData defines no datasets\(\), which must return \(train, "):
        check_required_methods(NoData)
    with pytest.raises(ConfigError, match=r"^NoModel defines no build_model\(\), which must return the nn.Module"):
        check_required_methods(NoModel)
    check_required_methods(Task)


def test_a_moduledict_with_the_default_forward_is_told_to_override_forward():
    """The hint was "make collate return those keys, or override ...forward": no keys can reach a ModuleDict."""
    from shardtrain.workloads.base import model_inputs

    with pytest.raises(ConfigError) as e:
        model_inputs(nn.ModuleDict({"text": Net()}), {"x": torch.zeros(2, 4), "labels": torch.zeros(2)}, "Parts")
    assert str(e.value) == (
        "ModuleDict has no forward of its own, so the default Parts.forward cannot call it: override "
        'Parts.forward(model, batch) to call its parts (model["text"](...), ...)'
    )


def test_unbatchable_samples_name_collate_and_datasets():
    class Ragged(Task):
        def datasets(self):
            return [{"x": torch.zeros(3)}, {"x": torch.zeros(5)}], None

    task = Ragged(Config())
    with pytest.raises(
        ConfigError,
        match=r"Ragged.collate cannot batch the samples of Ragged.datasets\(\) "
        r"\(dict items\): RuntimeError: stack expects each tensor",
    ):
        CheckedCollate(task)(task.datasets()[0])


def test_default_metrics_count_every_example_from_summed_confusions():
    task = Task(Config())
    logits = torch.tensor([[2.0, 0, 0], [0, 2.0, 0], [0, 2.0, 0], [0, 0, 2.0]])
    halves = [
        task.metric_sums(logits[:2], {"labels": torch.tensor([0, 1])}),
        task.metric_sums(logits[2:], {"labels": torch.tensor([2, 2])}),
    ]
    sums = {"confusion": halves[0]["confusion"] + halves[1]["confusion"]}
    m = task.metrics(sums)
    assert (m["accuracy"], m["n_examples"]) == (0.75, 4)
    assert m["macro_f1"] == pytest.approx((1 + 2 / 3 + 2 / 3) / 3)


def test_macro_f1_leaves_out_a_class_no_example_has_nor_any_prediction():
    """scikit-learn's macro average (over the labels in y_true and y_pred): a trial's 8-row prediction file had
    no 'positive' row, every prediction right, and macro-F1 0.667 for it."""
    from shardtrain.workloads.base import classification_metrics

    right = torch.tensor([[5.0, 0, 0], [0, 3.0, 0], [0, 0, 0]])
    assert classification_metrics(right)["macro_f1"] == 1.0
    # A class predicted but never true still counts (its F1 is 0), as in scikit-learn.
    wrong = torch.tensor([[4.0, 0, 1], [0, 3.0, 0], [0, 0, 0]])
    assert classification_metrics(wrong)["macro_f1"] == pytest.approx((8 / 9 + 1 + 0) / 3)
    assert classification_metrics(torch.zeros(3, 3))["macro_f1"] == 0.0


def test_each_class_gets_its_own_f1_precision_and_recall_by_name():
    """Per-class numbers (sentiment users watch the negative class, often its recall): the keys name the classes,
    in characters every logger takes, for the classes macro-F1 averages (a label or a prediction), so that it is
    the mean of the F1s (a user read a macro of 0.6256 beside 0.909 and 0.968: the predicted-only class's 0 was
    left out). The eval line shows the F1s; eval.jsonl and the loggers all three."""
    from shardtrain.observability.metric_text import metrics_line
    from shardtrain.workloads.base import classification_metrics

    # true x predicted: 4 negatives (3 right), 4 neutrals (2 right), no positives but 1 predicted
    confusion = torch.tensor([[3.0, 1.0, 0.0], [1.0, 2.0, 1.0], [0.0, 0.0, 0.0]])
    named = classification_metrics(confusion, ("negative", "neutral", "very positive :)"))
    classes = ("negative", "neutral", "very positive __")
    assert list(named) == [
        "accuracy",
        "macro_f1",
        *(f"{metric}_{c}" for metric in ("f1", "precision", "recall") for c in classes),
        "n_examples",
    ]
    assert named["f1_negative"] == pytest.approx(0.75) and named["f1_neutral"] == pytest.approx(2 / 3.5)
    assert (named["precision_negative"], named["recall_negative"]) == (0.75, 0.75)
    assert (named["precision_neutral"], named["recall_neutral"]) == (pytest.approx(2 / 3), 0.5)
    assert (named["precision_very positive __"], named["recall_very positive __"]) == (0.0, 0.0)  # zero_division=0
    per_class = [v for k, v in named.items() if k.startswith("f1_")]
    assert named["macro_f1"] == pytest.approx(sum(per_class) / len(per_class))
    assert "f1_2" not in classification_metrics(torch.tensor([[1.0, 0, 0], [0, 1.0, 0], [0, 0, 0]]))  # neither
    assert [k for k in classification_metrics(torch.eye(3), ("a/b", "x:y", "z")) if k.startswith("f1_")] == [
        "f1_a/b",
        "f1_x_y",
        "f1_z",
    ]
    assert "recall_0" in classification_metrics(confusion)  # no names: the class ids
    assert metrics_line(named) == (
        "accuracy 0.6250, macro-F1 0.4405, F1 negative 0.7500, F1 neutral 0.5714, F1 very positive __ 0.0000, "
        "8 examples"
    )
    own = {"accuracy": 0.5, "precision_macro": 0.25}  # a workload's own: no F1 of that name beside it, shown
    assert metrics_line(own) == "accuracy 0.5000, precision_macro 0.2500"


def test_a_built_in_names_a_runs_classes_where_its_data_is_not_read():
    """predict --file and export load the run's config, not its data: the per-class F1 keys are still the class
    names the run logged (predict's file metrics said f1_0, f1_1, f1_2 for a run that logged f1_negative)."""
    from shardtrain.config.labels import ClassLabels
    from shardtrain.workloads.base import workload_class

    sentiment = ClassLabels(3, ("negative", "neutral", "positive"))
    cfg = sentiment.applied_to(parse_cli(["--config", str(REPO / "configs" / "longformer_tiny.yaml")]))
    workload = workload_class(cfg)(cfg)
    assert workload.labels() == sentiment
    assert "f1_neutral" in workload.metrics({"confusion": torch.eye(3)})


@pytest.mark.parametrize("label", [7, -1])
def test_a_validation_label_outside_the_models_classes_is_one_line_naming_it(label):
    """A trial's workload had label 7 in its validation data alone, with 2 classes: the run trained every step, then
    ended at its last evaluation with `RuntimeError: shape '[2, 2]' is invalid for input of size 15`."""
    task = Task(Config())
    message = rf"Task.metric_sums: an evaluation batch has label {label}, outside 0..1 \(the model gives 2 logits\)"
    with pytest.raises(ConfigError, match=message + ": fix the validation data's labels"):
        task.metric_sums(torch.zeros(3, 2), {"labels": torch.tensor([0, label, 1])})


def test_an_int8_export_that_grew_says_larger():
    """A model of few Linear layers (an EmbeddingBag and one small Linear) grows by the quantization scales: the
    size line said `-4.6% smaller`."""
    from shardtrain.commands.export import size_change

    assert (size_change(0.4616), size_change(-0.046), size_change(0.0)) == (
        "46.2% smaller",
        "4.6% larger",
        "0.0% smaller",
    )


def test_freezing_without_freezable_parameter_names_says_what_is_missing():
    with pytest.raises(
        ConfigError,
        match=r"--freeze-layers \(model.freeze_layers\)=2: Task does not define "
        r"freezable_parameter_names",
    ):
        Task(Config()).freezable_parameter_names(2)


# ---- the built-ins through the API ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, overrides",
    [
        ("multimodal", {"image_model": "resnet18", "image_config": {"layers": [1, 1, 1, 1]}}),
        ("multimodal", {"image_model": "resnet50", "image_config": {"layers": [1, 1, 1, 1], "block": "BasicBlock"}}),
        ("multimodal", {"image_model": "densenet121", "image_config": {"block_config": [1, 1, 1, 1]}}),
        ("longformer", {"text_model": "allenai/longformer-base-4096", "attention_window": 4}),
    ],
)
def test_builtin_blocks_are_the_models_own(name, overrides):
    from shardtrain.builtin_workloads.networks import build_model

    cfg = from_dict(
        {
            "model": {
                "name": name,
                "pretrained": False,
                "num_labels": 3,
                "text_config": {
                    "hidden_size": 16,
                    "num_hidden_layers": 1,
                    "num_attention_heads": 2,
                    "intermediate_size": 32,
                    **overrides.pop("text_config", {}),
                },
                **overrides,
            }
        }
    )
    with torch.device("meta"):
        model = build_model(cfg.model, cfg.data, 100, load_weights=False)
    assert resolve_block_classes(model, load_workload(cfg).block_classes()) == model.block_classes()


def test_the_default_export_of_tied_embeddings_loads_strictly_and_in_plain_transformers(tmp_path):
    """A GPT-2 ties lm_head to its input embeddings: one tensor under two names, which safetensors refused, so
    `shardtrain export` of examples/causal_lm failed ("Some tensors share memory"). The export now loads with the
    documented strict load_state_dict and with AutoModelForCausalLM alone, and predicts what the model does."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, GPT2Config

    class LM(Workload):
        def build_model(self):
            torch.manual_seed(0)
            config = GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2, n_positions=16)
            return AutoModelForCausalLM.from_config(config)

    model = LM(Config()).build_model().eval()
    assert model.lm_head.weight is model.get_input_embeddings().weight
    LM(Config()).export(model, tmp_path)
    again = LM(Config()).build_model()
    torch.nn.init.zeros_(again.get_input_embeddings().weight)
    again.load_state_dict(load_file(str(tmp_path / "model.safetensors")))  # strict
    plain = AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        assert torch.equal(again.eval()(input_ids=ids).logits, want)
        assert torch.allclose(plain(input_ids=ids).logits, want, atol=1e-6)


def test_shardtrain_exports_workload_and_fit():
    import shardtrain

    assert shardtrain.Workload is Workload
    assert callable(shardtrain.fit) and shardtrain.fit.__module__ == "shardtrain.api"


# ---- freezing: frozen BatchNorm keeps its running statistics ---------------------------------------------------
def test_frozen_batchnorm_uses_and_keeps_its_running_stats_until_unfrozen():
    from shardtrain.runtime.distributed import DistInfo
    from shardtrain.strategies.base import Strategy
    from shardtrain.strategies.capabilities import Freezing

    class Plain(Freezing, Strategy):  # Freezing with the core's train/eval, and no backend behind it
        def setup(self, build_model, frozen_names): ...
        def backward(self, loss): ...
        def step(self, skip=False, grad_norm=None): ...
        def save(self, ckpt_dir): ...
        def load(self, ckpt_dir, saved=None): ...

    torch.manual_seed(0)
    s = Plain(Config(), DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend="gloo"))
    s.model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4))
    frozen = {"0.weight", "0.bias", "1.weight", "1.bias"}  # the lower conv and its BatchNorm
    s.set_frozen(frozen, True)
    s.train()
    stats = s.model[1].running_mean.clone(), s.model[3].running_mean.clone()
    s.model(torch.randn(8, 3, 8, 8))
    assert torch.equal(s.model[1].running_mean, stats[0]) and not s.model[1].training  # frozen: held
    assert not torch.equal(s.model[3].running_mean, stats[1]) and s.model[3].training  # trainable: updates
    s.eval()
    s.train()  # an evaluation in between does not release it
    assert not s.model[1].training
    s.set_frozen(frozen, False)  # unfreeze_at_step: it trains with the rest
    s.model(torch.randn(8, 3, 8, 8))
    assert s.model[1].training and not torch.equal(s.model[1].running_mean, stats[0])


def test_fsdp_with_no_blocks_to_shard_names_block_classes():
    from shardtrain.strategies.fsdp import _units, load_policy

    with pytest.raises(
        ConfigError,
        match=r"FSDP found no blocks to shard: Bag.block_classes\(\) is empty and the model "
        r"has no Hugging Face _no_split_modules; return its repeated block classes "
        r"\(the model has Linear, ReLU, Sequential\)",
    ):
        _units(
            nn.Sequential(nn.Linear(4, 4), nn.ReLU()),
            load_policy("fsdp_policies/default.yaml"),
            (),
            "Bag.block_classes()",
        )
    assert len(_units(Net(), load_policy("fsdp_policies/default.yaml"), (Block,))) == 2


def test_a_head_of_another_size_than_the_classes_is_one_line_at_the_first_step():
    """A trial's `num_labels: 2` in --workload-args over 3 classes ended in `IndexError: Target 2 is out of bounds`,
    and `num_labels: 4` trained a class no data has, which predict then printed ("3": 0.24)."""
    import torch

    from shardtrain.config.labels import ClassLabels
    from shardtrain.config.settings import Config, ConfigError

    class Reviews(Workload):
        def labels(self):
            return ClassLabels(3, ("negative", "neutral", "positive"))

    batch = {"labels": torch.tensor([0, 2])}
    for outputs in (2, 4):
        with pytest.raises(ConfigError) as e:
            Reviews(Config()).loss(torch.zeros(2, outputs), batch)
        assert str(e.value) == (
            f"Reviews.build_model() gives {outputs} logits, but Reviews.labels() names 3 classes (negative, neutral, "
            "positive): build the head with as many outputs as classes (num_labels=3 for a transformers model)"
        )
    assert Reviews(Config()).loss(torch.zeros(2, 3), batch).item() == pytest.approx(torch.log(torch.tensor(3.0)))


def test_a_transformers_classifier_with_too_few_labels_is_refused_before_its_forward():
    """A trial's BERT with num_labels=2 over 3 classes: transformers' forward computes its own loss from the batch's
    labels, so its IndexError came before Workload.loss could look at the logits."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from shardtrain.config.labels import ClassLabels
    from shardtrain.config.settings import Config, ConfigError
    from shardtrain.workloads.base import check_head_fits_classes, declared_outputs

    class Reviews(Workload):
        def labels(self):
            return ClassLabels(3, ("negative", "neutral", "positive"))

    small = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, vocab_size=50)
    model = AutoModelForSequenceClassification.from_config(AutoConfig.for_model("bert", **small, num_labels=2))
    assert declared_outputs(model) == 2
    with pytest.raises(ConfigError, match=r"^Reviews.build_model\(\) gives 2 logits, but Reviews.labels\(\) names 3"):
        check_head_fits_classes(Reviews(Config()), declared_outputs(model))
    assert declared_outputs(nn.ModuleDict({"head": nn.Linear(4, 3)})) is None  # the first report's shape: at the loss
    check_head_fits_classes(Reviews(Config()), None)
