"""`--peft lora`: LoRA adapters (the peft library) on the model a workload's build_model returns.

apply_lora wraps the workload's build_model, so that every place that builds the model (training on each
strategy, its meta-device copies, plan, check-data, export and predict) builds the same PeftModel, with the same
parameter names. What the strategies then see is a model whose base weights came frozen: they keep them frozen
(strategies/capabilities.py, Freezing.user_frozen) and train only the adapters and modules_to_save.
"""

from __future__ import annotations

import math
import sys

import torch
from torch import nn

from shardtrain.config.settings import ConfigError, PeftConfig, where

# What peft puts before every parameter name of the model it wraps (PeftModel.base_model, LoraModel.model).
PEFT_PREFIX = "base_model.model."
# The heads of transformers' *ForSequenceClassification models (peft's own SEQ_CLS task adds the same two).
CLASSIFIER_HEADS = ("classifier", "score")


def apply_lora(workload, peft: PeftConfig) -> None:
    """With --peft lora, workload.build_model() returns its model with adapters (a peft PeftModel)."""
    if peft.peft != "lora" or getattr(workload, "lora_applied", False):
        return
    build = workload.build_model
    workload_name = type(workload).__name__

    def build_with_adapters() -> nn.Module:
        return with_lora(build(), peft, workload_name)

    workload.build_model = build_with_adapters
    workload.lora_applied = True


def forwarded_model(workload, model: nn.Module) -> nn.Module:
    """The model Workload.forward receives: the module its build_model returned. Under --peft lora that is the
    base inside the PeftModel apply_lora made, where peft has put the adapters in place of the targeted Linear
    modules, so a forward written for the plain model (`model["text"](...)` on an nn.ModuleDict) runs them; a
    PeftModel's own forward calls that same module. A PeftModel that build_model returned itself stays one."""
    if getattr(workload, "lora_applied", False) and is_peft_model(model):
        return model.get_base_model()
    return model


def is_peft_model(model: nn.Module) -> bool:
    """Without importing peft (seconds) for the runs that do not use it."""
    peft_module = sys.modules.get("peft")
    return peft_module is not None and isinstance(model, peft_module.PeftModel)


def frozen_base(model: nn.Module) -> frozenset[str]:
    """The names a checkpoint leaves out: a PeftModel's frozen base, which build_model rebuilds (the pretrained
    weights it loads, or a seeded initialisation) at every resume, export and predict. Empty for any other model:
    what a user froze by hand may not be rebuilt alike, so it is saved."""
    if not is_peft_model(model):
        return frozenset()
    return frozenset(n for n, p in model.named_parameters() if not p.requires_grad)


def base_fingerprint(model: nn.Module) -> dict | None:
    """What a LoRA checkpoint records of the base its adapters belong to, from a full build of it: its name
    (peft's base_model_name_or_path), its size, and the float64 sum and sum of squares of its weights. A rebuild
    on another device or from other pretrained weights gives other sums; a reduction in another order, the same
    ones to ~1e-15 (same_base's tolerance is 1e-9). None for a model that is not a PeftModel."""
    if not is_peft_model(model):
        return None
    names = frozen_base(model)
    total = sum_sq = 0.0
    count = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in names:
                values = p.detach().double()
                total += values.sum().item()
                sum_sq += values.square().sum().item()
                count += p.numel()
    config = next(iter(model.peft_config.values()), None)
    return {
        "name_or_path": getattr(config, "base_model_name_or_path", None),
        "params": count,
        "sum": total,
        "sum_sq": sum_sq,
    }


def untrained_head_warning(model: nn.Module) -> str | None:
    """Under LoRA with no modules_to_save, a model with no classifier/score head trains its adapters alone: a head
    of the user's own (`fusion`), newly initialised, stays at its random weights. A trial's run ended below chance
    with no word about it. None when something trains whole, or for a transformers classifier (peft's SEQ_CLS
    model trains its head by itself)."""
    if not is_peft_model(model):
        return None
    config = next(iter(model.peft_config.values()))
    if config.modules_to_save or str(getattr(config, "task_type", None) or "").endswith("SEQ_CLS"):
        return None
    parts = [name for name, _ in model.get_base_model().named_children()]
    example = f" {parts[-1]}" if parts else " NAME"
    return (
        f"--peft lora: only the adapters train; the model has no module named {' or '.join(CLASSIFIER_HEADS)}, and "
        f"--modules-to-save (peft.modules_to_save) names none, so a head of your own stays at the weights "
        f"build_model gave it: --modules-to-save{example} trains it whole"
    )


def describe_adapters(model: nn.Module) -> str | None:
    """`lora r=8, alpha 8, dropout 0.0 on query, value; trained whole: classifier` for the banner; None for a
    model without adapters."""
    if not is_peft_model(model):
        return None
    config = next(iter(model.peft_config.values()))
    targets = ", ".join(sorted(config.target_modules)) if config.target_modules else "peft's defaults"
    saved = ", ".join(sorted({m for m in config.modules_to_save or [] if _has_module(model, m)}))  # SEQ_CLS names two
    return (
        f"{str(config.peft_type.value).lower()} r={config.r}, alpha {config.lora_alpha}, dropout {config.lora_dropout} "
        f"on {targets}" + (f"; trained whole: {saved}" if saved else "")
    )


def same_base(a: dict, b: dict) -> bool:
    return a["params"] == b["params"] and all(
        math.isclose(a[k], b[k], rel_tol=1e-9, abs_tol=1e-9) for k in ("sum", "sum_sq")
    )


def check_same_base(recorded: dict | None, built: dict | None, what: str, workload_name: str) -> None:
    """A LoRA checkpoint's adapters on the base they were trained on, or one line saying they are not."""
    if recorded is None:
        return
    if built is None or not same_base(recorded, built):
        name = recorded.get("name_or_path") or "the run's own build"
        got = "no PeftModel" if built is None else f"{built['params']:,} parameters, other weights"
        raise ConfigError(
            f"{what}: the checkpoint holds LoRA adapters only, trained on the base {name} "
            f"({recorded['params']:,} parameters); {workload_name}.build_model() now gives another base "
            f"({got}): give the run's base (--workload-args), or resume and export where the run was trained"
        )


def with_lora(model: nn.Module, peft: PeftConfig, workload_name: str) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    if is_peft_model(model):
        raise ConfigError(
            f"{where('peft')}: {workload_name}.build_model() returns a PeftModel already, with its own adapters: "
            f"drop --peft (or return the plain model)"
        )
    hf = _hf_model_inside(model)
    targets = list(peft.target_modules) or _default_targets(hf)
    if not targets:
        raise ConfigError(
            f"{where('target_modules')}: peft has no default for {type(model).__name__} (from "
            f"{workload_name}.build_model()); name its Linear modules: {linear_module_names(model)}"
        )
    missing = [t for t in targets if not _matches(model, t)]
    if missing:
        raise ConfigError(
            f"{where('target_modules')}: {', '.join(missing)} matches no Linear module of {type(model).__name__} "
            f"(from {workload_name}.build_model()); its Linear modules: {linear_module_names(model)}"
        )
    # peft's SEQ_CLS model trains a transformers classifier's head by itself; any other model's head is named.
    seq_cls = hf is model and type(model).__name__.endswith("ForSequenceClassification")
    to_save = list(peft.modules_to_save) or ([] if seq_cls else [h for h in CLASSIFIER_HEADS if _has_module(model, h)])
    config = LoraConfig(
        r=peft.lora_r,
        lora_alpha=peft.lora_alpha,
        lora_dropout=peft.lora_dropout,
        target_modules=targets,
        modules_to_save=to_save or None,
        # A transformers classifier gets peft's SEQ_CLS model: the one PeftModel.from_pretrained rebuilds for an
        # AutoModelForSequenceClassification.
        task_type="SEQ_CLS" if seq_cls else None,
    )
    return get_peft_model(model, config)


def merged(model: nn.Module, what: str) -> nn.Module:
    """The model with its adapters folded into the base weights (peft's merge_and_unload): a plain model again,
    which AutoModel*.from_pretrained loads without peft."""
    if not is_peft_model(model):
        raise ConfigError(
            f"{what} --merge: this run trained no adapters (no --peft lora, and build_model returned no PeftModel)"
        )
    return model.merge_and_unload()


def _hf_model_inside(model: nn.Module):
    """The model itself if it is a transformers PreTrainedModel, else the first one inside it (a built-in's
    encoder), else None."""
    from transformers import PreTrainedModel

    return next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)


def _default_targets(hf) -> list[str]:
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

    model_type = getattr(getattr(hf, "config", None), "model_type", None)
    return list(TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(model_type) or [])


def _matches(model: nn.Module, target: str) -> bool:
    # peft's own rule for a list of names: the full name, or its last components.
    return any(
        isinstance(m, nn.Linear) and (name == target or name.endswith("." + target))
        for name, m in model.named_modules()
    )


def _has_module(model: nn.Module, target: str) -> bool:
    return any(name == target or name.endswith("." + target) for name, _ in model.named_modules())


def linear_module_names(model: nn.Module) -> str:
    """The distinct last names of the model's Linear modules, each with one full name: `query
    (encoder.layer.0.attention.self.query)`; what target_modules takes."""
    first: dict[str, str] = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            first.setdefault(name.rsplit(".", 1)[-1], name)
    return ", ".join(f"{short} ({full})" if short != full else short for short, full in first.items()) or "none"
