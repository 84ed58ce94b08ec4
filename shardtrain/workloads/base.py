"""The public Workload API: your model, your data, your loss, your metrics; shardtrain runs the rest.

    from shardtrain import Workload

    class MyTask(Workload):
        def build_model(self):  return MyModel(**self.args)        # same weights on every rank for one seed
        def datasets(self):     return train_ds, validation_ds     # map-style Datasets (or datasets.Dataset)

shardtrain constructs the workload on every rank, as `MyTask(cfg, **workload.args)`, and the loop calls only
the methods below. The strategy decides where `build_model` runs (rank 0 only, the meta device, zero.Init), so
it must not move the model to a device or read a rank. The built-ins (`multimodal`, `longformer`) live in
shardtrain/workloads/ and use nothing but this API.

The rule for parameters (docs/your-own-model.md): read parameters only inside the model's forward. Outside
it, FSDP and ZeRO-3 hold just this rank's shard (ZeRO-3's has shape [0]), so a loss or metric that reads
`model.weight` gets a fragment.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardtrain.config.errors import with_where_raised
from shardtrain.config.labels import CLASS_METRICS, ClassLabels, class_metric_key
from shardtrain.config.labels import check_class_metric as check_class_metric_names
from shardtrain.config.settings import (
    BUILTIN_WORKLOADS,
    Config,
    ConfigError,
    located,
    value_of,
    where,
    workload_target,
)

if TYPE_CHECKING:
    import torch
    from torch import nn

# torch is imported where a method needs it: `shardtrain train --nproc N`'s parent process imports the workload's
# class (Workload.check_before_launch) and never trains (tests/unit/test_launch_parent.py).


class Workload:
    """Subclass it; `build_model` and `datasets` are required, every other method has a default."""

    def __init__(self, cfg: Config, **args: Any):
        self.cfg = cfg
        self.args = args
        # False while the strategy builds a copy whose weights arrive from rank 0 afterwards (on the meta
        # device, or partitioned under ZeRO-3's zero.Init, where a from_pretrained load would meet empty
        # shards): build_model should then skip loading pretrained files.
        self.loads_weights = True

    # ---- required --------------------------------------------------------------------------------
    # Left undefined, each is a user's mistake like any setting's: one line and exit 2 (a ConfigError), where
    # NotImplementedError exited 1, the code of a failure during training.
    def build_model(self) -> nn.Module:
        raise ConfigError(f"{type(self).__name__} defines no build_model(), which must return the nn.Module to train")

    def datasets(self) -> tuple:
        """(train, validation or None): map-style torch Datasets or `datasets.Dataset`s."""
        raise ConfigError(f"{type(self).__name__} defines no datasets(), which must return (train, validation_or_None)")

    # ---- optional --------------------------------------------------------------------------------
    def collate(self, samples: list):
        """torch's default_collate (and dataclasses): dict samples -> a dict of batched values; tuple samples such as
        `(text_dict, image, label)` -> a list `[text_dict batched, images, labels]`. A batch may nest dicts, lists,
        tuples, namedtuples, dataclasses and BatchEncodings: the loop moves every tensor in it to the device."""
        from shardtrain.data.batches import collate_samples

        return collate_samples(samples)

    def forward(self, model: nn.Module, batch) -> Any:
        """The keys of `batch` that the model's forward accepts, as keyword arguments. `model` is the model
        build_model returned; shardtrain runs this method as the forward of the module the strategy wraps, so
        it may call the model's submodules itself (`model["text"](**batch["text"])`)."""
        return model(**model_inputs(model, batch, type(self).__name__))

    def loss(self, outputs, batch) -> torch.Tensor:
        import torch.nn.functional as F

        method = f"{type(self).__name__}.loss"
        logits = logits_of(outputs, method)
        if not getattr(self, "_head_checked", False):  # the first batch's: the head does not change
            check_head_fits_classes(self, logits.shape[-1])
            self._head_checked = True
        return F.cross_entropy(logits.float(), labels_of(batch, method))

    def metric_sums(self, outputs, batch: dict) -> dict[str, torch.Tensor]:
        """Quantities that add up over batches and ranks; here a confusion matrix (true x predicted)."""
        import torch

        logits = logits_of(outputs, f"{type(self).__name__}.metric_sums")
        n = logits.shape[-1]
        labels = labels_of(batch, f"{type(self).__name__}.metric_sums").reshape(-1)
        outside = labels[(labels < 0) | (labels >= n)]
        if outside.numel():
            # A training batch's cross_entropy refuses such a label; one in the validation data alone would end the
            # run at its last evaluation, after all its steps, as a confusion matrix of the wrong size.
            raise ConfigError(
                f"{type(self).__name__}.metric_sums: an evaluation batch has label {outside[0].item()}, outside "
                f"0..{n - 1} (the model gives {n} logits): fix the validation data's labels, or give the model "
                f"as many outputs as classes"
            )
        idx = labels * n + logits.argmax(dim=-1).reshape(-1)
        return {"confusion": torch.bincount(idx, minlength=n * n).double().view(n, n)}

    def metrics(self, sums: dict[str, torch.Tensor]) -> dict[str, float]:
        labels = self.labels()
        return classification_metrics(sums["confusion"], labels.names if labels is not None else ())

    def loss_items(self, lengths: list[int]) -> float:
        """Under --max-tokens-per-batch, micro-batches hold different numbers of texts: how many items the loss of
        one whose texts have these lengths (the train dataset's lengths()) averages over, so that every item
        weighs alike across micro-batches and ranks. One per text (the default) is exact for a mean over samples;
        a mean over tokens returns their count (examples/causal_lm: the shifted targets, n - 1 per text)."""
        return len(lengths)

    def padded_tokens(self, lengths: list[int]) -> int:
        """Under --max-tokens-per-batch: the tokens a micro-batch of texts of these lengths holds once collate()
        has padded it, which the budget bounds. The default pads to the longest text."""
        return len(lengths) * max(lengths)

    def block_classes(self) -> tuple:
        """The repeated blocks (FSDP units, activation-checkpointing targets): classes or class names.
        Empty: the `_no_split_modules` of the Hugging Face models inside the model."""
        return ()

    def parts(self) -> dict[str, str]:
        """Names for parts of the model that `train.lr_multipliers` may use: {name: parameter-name prefix},
        e.g. {"encoder": "bert", "head": "classifier"}. A parameter-name prefix works there without a name."""
        return {}

    def labels(self) -> ClassLabels | None:
        """The classes the data decided (count and names, config/labels.py), once datasets() has run: the run
        records them apart from the config, the banner names them, an export's HF config maps ids to them.
        None (the default): the model's head is the workload's own business."""
        return None

    def freezable_parameter_names(self, n: int) -> list[str]:
        """The parameters `freeze_layers: n` freezes (usually the embeddings and the lowest n blocks)."""
        raise ConfigError(
            f"{where('freeze_layers')}={n}: {type(self).__name__} does not define "
            f"freezable_parameter_names(n), so shardtrain does not know which layers are the lower ones"
        )

    @classmethod
    def check_before_launch(cls, cfg: Config) -> str | None:
        """`shardtrain train` calls it once, in the process that starts the ranks (and under --check-only), with the
        class: checks of what the run will read that fail fast in one line (a ConfigError), such as a data file's
        records or hub names. Returns a note to print, or None. The default:
        - constructs the workload, as every rank will: a file or hub name its __init__ reads (a tokenizer by name,
          offline) is one line before any process starts, not one from the ranks after the launch. Anything else
          __init__ raises here (a rank's environment it reads, a device) is left to the ranks;
        - checks `--peft lora` against the model, built on the meta device (shapes only, seconds): a
          --target-modules name that matches nothing, or a model that has adapters already, is one line. Anything
          else a meta build raises is left to the run's own build, which says it with the run's context."""
        if "RANK" in os.environ:  # only the parent of a --nproc launch (and --check-only): the ranks would all fail
            return None
        try:
            workload = load_workload(cfg)
        except ConfigError:
            raise
        except Exception:  # noqa: BLE001 - not a setting's fault that a parent process could judge
            return None
        if not cfg.peft.peft:
            return None
        import torch

        try:
            workload.loads_weights = False
            with torch.device("meta"):
                workload.build_model()
        except ConfigError as e:
            if str(e).startswith(("--target-modules", "--peft")):  # what adapters.with_lora refuses
                raise
        except Exception:  # noqa: BLE001 - a build that needs the real device or data: the run's build decides
            pass
        return None

    def memory_model(self):
        """What `shardtrain plan` and the banner's prediction measure of this model before anything is built on a
        device; None (the default): only its model states are planned, counted from build_model on the meta
        device, and its activations are not predicted. An object with these methods:
            vocab() -> (vocab size or None, where it comes from)
            count(persistence_threshold, vocab_size) -> shardtrain.memory.planner.ModelCount
            saved_bytes(layers, seq_len, recompute, precision, batch, gathered_16bit) -> bytes one forward + loss
                saves for backward on CPU, with `layers` repeated layers (None: as configured)
            sample_lengths(seq_len) -> the lengths to measure at (two fit a line, three a quadratic)
            pad_multiple() -> texts are padded to multiples of this many tokens, or None
            check_offline() -> a note on what reading the architecture needs from the hub, or None
        The built-ins' is shardtrain/builtin_workloads/memory_model.py."""
        return None

    def export_checkpoint(self, ckpt_dir: Path, out_dir: Path, int8: bool) -> dict | None:
        """`shardtrain export` in a layout of the workload's own, which needs more than the model (the run's files
        beside the checkpoint, such as its tokenizer): write it into out_dir and return what
        shardtrain_export.json records. None (the default): build_model, the checkpoint's weights, export()."""
        return None

    def load_exported(self, out_dir: Path, int8: bool) -> nn.Module | None:
        """The model of an export that export_checkpoint wrote (load_export / load_int8, `predict`); None (the
        default): predict rebuilds it with build_model and loads the export's weights."""
        return None

    def export(self, model: nn.Module, out_dir: Path) -> None:
        """model.safetensors (a PeftModel: peft's own adapter files, which PeftModel.from_pretrained loads), and
        workload.json: the workload's target and args, which rebuild the model. A transformers model's
        config.json and the workload's `self.tokenizer` go beside them, so that the Auto classes load the folder."""
        import json

        from safetensors.torch import save_file

        from shardtrain.workloads.adapters import is_peft_model

        out_dir = Path(out_dir)
        if is_peft_model(model):
            model.save_pretrained(str(out_dir))
        else:
            save_file(_separate_tensors(model.state_dict()), str(out_dir / "model.safetensors"))
            config = getattr(model, "config", None)
            if callable(getattr(config, "save_pretrained", None)):  # a merged LoRA model's, too
                config.architectures = [type(model).__name__]
                config.save_pretrained(str(out_dir))
        tokenizer = getattr(self, "tokenizer", None)
        if callable(getattr(tokenizer, "save_pretrained", None)):
            tokenizer.save_pretrained(str(out_dir))
        (out_dir / "workload.json").write_text(
            json.dumps({"target": target_of(type(self)), "args": self.args}, indent=1, default=str)
        )


def _separate_tensors(state: dict) -> dict:
    """Each name its own contiguous tensor. Tied weights (a causal LM's lm_head and input embeddings) share one,
    which safetensors refuses ("Some tensors share memory"): `export` failed on examples/causal_lm. A copy per
    name keeps both a strict load_state_dict and transformers' from_pretrained reading the file as it is."""
    seen, out = set(), {}
    for name, tensor in state.items():
        storage = tensor.untyped_storage().data_ptr()
        out[name] = tensor.detach().clone() if storage in seen and tensor.numel() else tensor.detach().contiguous()
        seen.add(storage)
    return out


# ---- what the framework calls, checked: a wrong return is one line naming the method --------------------
def splits_of(workload: Workload) -> tuple:
    """(train, validation or None) from workload.datasets()."""
    splits = workload.datasets()
    if not (isinstance(splits, (tuple, list)) and len(splits) == 2):
        got = _kind(splits)
        raise ConfigError(f"{_method(workload, 'datasets')} must return (train, validation_or_None), got {got}")
    return tuple(splits)


def model_of(workload: Workload) -> nn.Module:
    """workload.build_model(), which must be the nn.Module to train."""
    from torch import nn

    model = workload.build_model()
    if not isinstance(model, nn.Module):
        got = _kind(model)
        raise ConfigError(f"{_method(workload, 'build_model')} must return the nn.Module to train, got {got}")
    return model


def _method(workload: Workload, name: str) -> str:
    return f"{type(workload).__name__}.{name}()"


def _kind(value) -> str:
    """`a tuple of 2`, `a list of 256`, `a dict`: what a method returned instead."""
    kind = type(value).__name__
    article = "an" if kind[:1].lower() in "aeiou" else "a"
    return f"{article} {kind} of {len(value)}" if isinstance(value, (tuple, list)) else f"{article} {kind}"


# ---- helpers the defaults (and user code) use ----------------------------------------------------------
def check_head_fits_classes(workload: Workload, outputs: int | None) -> None:
    """A model with another number of logits than the classes its workload's labels() names: cross_entropy's
    `IndexError: Target 2 is out of bounds` (a device-side assert on CUDA) for fewer, and for more a class that
    no data has, trained silently and printed by predict ("3": 0.24); one line instead. Checked once the model
    is built where its config declares its outputs (declared_outputs), else at the first step's loss."""
    classes = workload.labels() if outputs is not None else None
    if classes is None or classes.count == outputs:
        return
    name = type(workload).__name__
    named = f" ({', '.join(classes.names)})" if classes.names else ""
    raise ConfigError(
        f"{name}.build_model() gives {outputs} logits, but {name}.labels() names {classes.count} classes{named}: "
        f"build the head with as many outputs as classes (num_labels={classes.count} for a transformers model)"
    )


def declared_outputs(model) -> int | None:
    """The logits a transformers sequence classifier declares (its config's `num_labels`), a PeftModel's base's
    included: it computes its own loss when the batch has labels, so a head of the wrong size fails inside its
    forward, before Workload.loss sees the logits. None for any other model (other heads' configs carry a
    num_labels that means nothing)."""
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    if not type(base).__name__.endswith("ForSequenceClassification"):
        return None
    declared = getattr(getattr(base, "config", None), "num_labels", None)
    return declared if isinstance(declared, int) else None


def logits_of(outputs, method: str = "Workload.loss") -> torch.Tensor:
    """The logits in what forward returned: the tensor itself, a model output's `.logits` (transformers'), or a
    dict's "logits". Anything else is one line naming `method`, the default that reads them."""
    import torch

    logits = outputs.logits if hasattr(outputs, "logits") else outputs
    if isinstance(logits, Mapping) and "logits" in logits:
        logits = logits["logits"]
    if isinstance(logits, torch.Tensor):
        return logits
    what = type(outputs).__name__
    if isinstance(outputs, Mapping):
        what = f"a dict with keys {', '.join(map(str, outputs))} and no 'logits'"
    elif isinstance(outputs, (tuple, list)):
        what = f"a {what} of {len(outputs)}"
    raise ConfigError(
        f"{method}: the default reads the logits from what forward returned, here {what}: return the logits "
        f"tensor (or a dict with 'logits') from forward, or override {method}"
    )


def labels_of(batch, method: str) -> torch.Tensor:
    """batch["labels"], which the default loss and metric_sums read; a batch without it is one line naming them."""
    import torch

    if isinstance(batch, Mapping) and isinstance(batch.get("labels"), torch.Tensor):
        return batch["labels"]
    if isinstance(batch, Mapping) and "labels" in batch:
        raise ConfigError(
            f"{method}: the default needs batch['labels'] as a tensor of class ids, and it is a "
            f"{type(batch['labels']).__name__}: return torch.tensor(...) from collate, or override "
            f"{method}"
        )
    what = f"a {type(batch).__name__}" + ("" if isinstance(batch, Mapping) else ", not a dict,")
    raise ConfigError(
        f"{method}: the default reads batch['labels'], and the batch is {what} without 'labels': "
        f"override {method}(outputs, batch)"
    )


def classification_metrics(confusion: torch.Tensor, names: tuple | list = ()) -> dict:
    """Accuracy, and macro-F1 as scikit-learn's f1_score(average="macro") gives it: over the classes that occur
    as a label or a prediction. A class absent from both is left out, not counted as F1 0: a small prediction
    file without one class scored a model right on every row 0.67. Then each class's own F1, precision and
    recall (`f1_<name>`, `precision_<name>`, `recall_<name>`, by the class names in `names`, else the class ids;
    scikit-learn's zero_division=0), for those same classes, so that macro-F1 is the mean of the F1s shown. An
    evaluation set with examples of every class gives the same keys at every evaluation."""
    import torch

    confusion = confusion.double().cpu()
    total = confusion.sum().item()
    tp = confusion.diag()
    precision = tp / confusion.sum(0).clamp(min=1)
    recall = tp / confusion.sum(1).clamp(min=1)
    f1 = torch.where(precision + recall > 0, 2 * precision * recall / (precision + recall), torch.zeros_like(tp))
    seen = (confusion.sum(0) + confusion.sum(1)) > 0
    macro_f1 = f1[seen].mean().item() if bool(seen.any()) else 0.0
    result = {"accuracy": tp.sum().item() / max(total, 1), "macro_f1": macro_f1}
    for metric, values in zip(CLASS_METRICS, (f1, precision, recall)):
        for i in range(len(tp)):
            if seen[i]:
                result[class_metric_key(metric, names[i] if i < len(names) else str(i))] = values[i].item()
    result["n_examples"] = int(total)
    return result


def _named_inputs(module: nn.Module) -> tuple[list[inspect.Parameter], bool]:
    params = list(inspect.signature(module.forward).parameters.values())
    named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return named, any(p.kind == p.VAR_KEYWORD for p in params)


def innermost(model: nn.Module) -> nn.Module:
    """Through the wrappers whose forward is only (*args, **kwargs): DDP, the DeepSpeed engine, torch.compile,
    peft's PeftModel. FSDP2 keeps the model's own class, and so its forward's signature."""
    from torch import nn

    seen = 0
    while seen < 8:
        named, _ = _named_inputs(model)
        inner = getattr(model, "_orig_mod", None) or getattr(model, "module", None)
        if inner is None and callable(getattr(model, "get_base_model", None)):
            inner = model.get_base_model()
        if named or not isinstance(inner, nn.Module):
            return model
        model, seen = inner, seen + 1
    return model


_CHECKED: set = set()


def model_inputs(model: nn.Module, batch: dict, workload_name: str = "Workload") -> dict:
    """The batch keys the model's forward takes by name. The first batch of each model class is checked:
    a required argument the batch lacks, or a batch none of whose keys the model takes, is the error users
    otherwise meet as a TypeError deep inside the strategy's wrapper."""
    inner = innermost(model)
    if not isinstance(batch, Mapping):
        raise ConfigError(
            f"{workload_name}.collate gives a {type(batch).__name__}, and the default "
            f"{workload_name}.forward passes a dict's keys to {type(inner).__name__}.forward by name: "
            f"override {workload_name}.forward(model, batch)"
        )
    from torch import nn

    if type(inner).forward is nn.Module.forward:  # an nn.ModuleDict: a container with no forward to pass keys to
        raise ConfigError(
            f"{type(inner).__name__} has no forward of its own, so the default {workload_name}.forward cannot call "
            f'it: override {workload_name}.forward(model, batch) to call its parts (model["text"](...), ...)'
        )
    named, _ = _named_inputs(inner)
    names = [p.name for p in named]
    inputs = {k: v for k, v in batch.items() if k in names}
    key = (type(inner), tuple(sorted(batch)))
    if key not in _CHECKED:
        required = [p.name for p in named if p.default is p.empty and p.name not in batch]
        if required or not inputs:
            need = f"needs {', '.join(required)}" if required else f"takes {', '.join(names) or 'no named argument'}"
            raise ConfigError(
                f"{workload_name}.collate gives keys {', '.join(sorted(batch))}, but "
                f"{type(inner).__name__}.forward {need}: make collate return those keys, or override "
                f"{workload_name}.forward(model, batch) for positional inputs"
            )
        _CHECKED.add(key)
    return inputs


def check_loss(loss, workload_name: str) -> torch.Tensor:
    """The loop backpropagates this: a tensor with one element, of a floating type, attached to the graph."""
    import torch

    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        what = (
            f"a tensor of shape {tuple(loss.shape)} and dtype {loss.dtype}"
            if isinstance(loss, torch.Tensor)
            else type(loss).__name__
        )
        if isinstance(loss, torch.Tensor) and loss.is_floating_point():
            how = "reduce it, e.g. with .mean()"
        elif isinstance(loss, torch.Tensor):
            how = "compute it from the logits, in a floating type"
        else:  # a Python number: .item() or float() cut it from the graph
            how = "return the tensor itself, without .item() or float()"
        raise ConfigError(f"{workload_name}.loss must return a scalar floating-point tensor, got {what} ({how})")
    if loss.requires_grad is False and torch.is_grad_enabled():
        raise ConfigError(
            f"{workload_name}.loss returned a tensor that does not depend on the model's parameters "
            f"(no grad_fn): compute it from the outputs of Workload.forward"
        )
    return loss.reshape(())


class CheckedCollate:
    """Workload.collate as the DataLoader calls it; a failure names the method and the dataset it batched.
    A class, not a closure, so DataLoader workers can pickle it."""

    def __init__(self, workload: Workload):
        self.workload = workload

    def __call__(self, samples: list) -> dict:
        name = type(self.workload).__name__
        try:
            batch = self.workload.collate(samples)
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - the user's samples; one line says which method to look at
            first = type(samples[0]).__name__ if samples else "nothing"
            raise ConfigError(
                f"{name}.collate cannot batch the samples of {name}.datasets() ({first} items): "
                f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
            ) from None
        from shardtrain.data.batches import batch_problem

        problem = batch_problem(batch)
        if problem:
            raise ConfigError(f"{name}.collate {problem}")
        return batch


# ---- block classes -------------------------------------------------------------------------------------
def resolve_block_classes(model: nn.Module, spec, what: str = "Workload.block_classes()") -> tuple[type, ...]:
    """Classes or class names -> the classes as they occur in the model. A name or class that does not occur
    is an error that lists the module classes the model does have (a name matching
    nothing would wrap no block, silently)."""
    present: dict[str, type] = {}
    for m in model.modules():
        present.setdefault(type(m).__name__, type(m))
    if not spec:
        spec = hf_no_split_modules(model)
    found = []
    for item in spec:
        name = item if isinstance(item, str) else getattr(item, "__name__", str(item))
        cls = (
            present.get(name)
            if isinstance(item, str)
            else next((c for c in present.values() if issubclass(c, item)), None)
        )
        if cls is None:
            raise ConfigError(
                f"{what} names {name}, which does not occur in the model; "
                f"its module classes are: {', '.join(sorted(present))}"
            )
        if cls not in found:
            found.append(item if isinstance(item, type) else cls)
    return tuple(found)


def hf_no_split_modules(model: nn.Module) -> list[str]:
    names: list[str] = []
    for m in model.modules():
        for n in getattr(m, "_no_split_modules", None) or []:
            if n not in names:
                names.append(n)
    present = {type(m).__name__ for m in model.modules()}
    return [n for n in names if n in present]


# ---- finding and constructing the workload -------------------------------------------------------------
def import_root(cls: type) -> str | None:
    """The folder that puts `cls`'s module on the import path (a tasks.py's folder; for my_pkg.tasks, the folder
    holding my_pkg): what a run records, so that export and predict find the workload from any folder."""
    module = sys.modules.get(cls.__module__)
    file = getattr(module, "__file__", None)
    if not file:
        return None
    root = Path(file).resolve().parent
    for _ in range(cls.__module__.count(".") + (Path(file).name == "__init__.py")):
        root = root.parent
    return str(root)


def with_import_root(folder: str | None) -> None:
    """A run's recorded import root, after the working directory and PYTHONPATH (which win: a workload moved
    since is found where the user says)."""
    if folder and Path(folder).is_dir() and folder not in sys.path:
        sys.path.append(folder)


def _nearest_builtin(name: str) -> str:
    """`; did you mean 'longformer'?` for a misspelt or differently cased built-in name; "" otherwise."""
    by_lower = {n.lower(): n for n in BUILTIN_WORKLOADS}
    close = difflib.get_close_matches(name.lower(), list(by_lower), n=1, cutoff=0.75)
    return f"; did you mean '{by_lower[close[0]]}'?" if close else ""


def target_of(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def workload_class(cfg: Config) -> type[Workload]:
    target = workload_target(cfg)
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr or "/" in module_name or module_name.endswith(".py"):
        raise ConfigError(
            f"{located(cfg, 'workload')}: '{target}' is not a workload; write a dotted module path and a class, "
            f"e.g. {_as_target(module_name or target, attr)}, or a built-in: {', '.join(BUILTIN_WORKLOADS)}"
            f"{_nearest_builtin(target)}"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(
            f"{located(cfg, 'workload')}: cannot import {module_name} ({e}); the config file's folder and "
            f"the working directory are on the import path"
        ) from None
    from shardtrain.runtime.chatter import quiet_late_imports

    quiet_late_imports()
    cls = module
    for part in attr.split("."):
        cls = getattr(cls, part, None)
    if not (isinstance(cls, type) and issubclass(cls, Workload)):
        found = [
            n for n, v in vars(module).items() if isinstance(v, type) and issubclass(v, Workload) and v is not Workload
        ]
        raise ConfigError(
            f"{located(cfg, 'workload')}: {module_name} has no Workload subclass named {attr}"
            + (f" (it has {', '.join(found)})" if found else "")
        )
    return cls


# What each "auto" setting that plans from predicted activations says to use instead, without a memory model.
PLANNED_SETTINGS = {
    "strategy": "choose --strategy ddp, fsdp, zero2 or zero3 (shardtrain plan --workload shows each one's "
    "model-state memory)",
    "activation_checkpointing": "use true, or every-N to checkpoint every N-th block",
}


def check_planned_settings(cfg: Config, cls: type[Workload]) -> None:
    """`--strategy auto` and `--activation-checkpointing auto` choose from the activation memory the planner
    predicts, which it measures through the workload's memory_model(): refused in one line, before any process
    starts, for a workload class that gives none. (One whose memory_model() returns None at run time is refused
    by the planner, on rank 0, before any model is built.)"""
    if cls.memory_model is not Workload.memory_model:
        return
    for name, instead in PLANNED_SETTINGS.items():
        if value_of(cfg, name) == "auto":
            raise ConfigError(
                f"{where(name)}=auto chooses from predicted activation memory, which needs a memory_model() "
                f"that {workload_target(cfg)} does not give (docs/your-own-model.md); {instead}"
            )


def check_required_methods(cls: type[Workload]) -> None:
    """`train` runs it before any process starts: a workload class without build_model() or datasets()."""
    for name in ("build_model", "datasets"):
        if getattr(cls, name) is getattr(Workload, name):
            getattr(cls, name)(object.__new__(cls))  # the method's own one line


# What the default Workload.metrics returns (classification_metrics below), known before anything runs.
DEFAULT_METRICS = ("accuracy", "macro_f1", "n_examples")


def check_metric_for_best_model(cfg: Config, cls: type[Workload]) -> None:
    """With the default metrics their names are known now: a --metric-for-best-model that is none of them (HF's
    favourite, eval_loss, among others) is refused before any process starts, not at the first evaluation,
    hours into a real job. A workload's own metrics() is checked there (loop/best.py)."""
    name = cfg.train.metric_for_best_model
    if name is None or cls.metrics is not Workload.metrics:
        return
    bare = name.removeprefix("eval_")
    if bare in DEFAULT_METRICS or bare.startswith(tuple(f"{m}_" for m in CLASS_METRICS)):  # class: checked later
        return
    loss = " (they have no loss: return one from your metric_sums and metrics to choose by it)"
    raise ConfigError(
        f"{where('metric_for_best_model')} {name}: not among {cls.__name__}.metrics()' keys "
        f"({', '.join(DEFAULT_METRICS)}, f1_<class>, precision_<class>, recall_<class>)"
        + (loss if bare.endswith("loss") else "")
    )


def check_class_metric(cfg: Config, workload: Workload, labels: ClassLabels | None) -> None:
    """--metric-for-best-model f1_<class> against the classes the data decided, before the first step, for a
    workload with the default metrics (config/labels.py; a workload's own are checked at its first evaluation)."""
    if type(workload).metrics is Workload.metrics:
        check_class_metric_names(cfg, labels)


def check_workload_args(cfg: Config, cls: type[Workload]) -> None:
    """`--workload-args` against the constructor's signature, without constructing (which may load data or
    weights): `train` runs it before any process starts, where a wrong key failed in every rank."""
    try:
        inspect.signature(cls).bind(cfg, **cfg.workload.workload_args)
    except TypeError as e:
        raise _args_error(cls, cfg, e) from None


def _args_error(cls: type[Workload], cfg: Config, e: TypeError) -> ConfigError:
    """The constructor's own TypeError, and for an unknown keyword the argument meant (as a YAML key's typo is
    answered) and those the constructor takes."""
    import difflib

    line = f"{located(cfg, 'workload_args')}: {cls.__name__}({', '.join(cfg.workload.workload_args)}): {e}"
    unknown = re.search(r"unexpected keyword argument '(\w+)'", str(e))
    if unknown:
        params = inspect.signature(cls).parameters.values()
        takes = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)][1:]  # after cfg
        close = difflib.get_close_matches(unknown.group(1), takes, n=1)
        line += (
            f"; did you mean '{close[0]}'?" if close else ""
        ) + f" ({cls.__name__} takes {', '.join(takes) or 'no arguments'})"
    return ConfigError(line)


def _as_target(written: str, attr: str) -> str:
    """The target a `--workload` written as a file and a class (as one runs a script), or as a module alone,
    means: the module's dotted name and the class (the config's folder and the working directory are on the
    import path)."""
    parts = [part for part in Path(written.removesuffix(".py")).parts if part not in (".", "..", "/")]
    return f"{'.'.join(parts) or 'my_pkg.tasks'}:{attr or 'MyTask'}"


def load_workload(cfg: Config) -> Workload:
    from shardtrain.workloads.adapters import apply_lora

    cls = workload_class(cfg)
    try:
        workload = cls(cfg, **cfg.workload.workload_args)
    except TypeError as e:
        raise _args_error(cls, cfg, e) from None
    except OSError as e:  # a file or hub name its __init__ reads (a tokenizer by name, offline): the user's to fix
        raise ConfigError(f"{located(cfg, 'workload')}: constructing {cls.__name__}: {with_where_raised(e)}") from e
    apply_lora(workload, cfg.peft)  # --peft lora: its build_model returns the model with adapters
    return workload
