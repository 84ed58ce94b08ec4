"""One consolidated model from any strategy's checkpoint (`shardtrain export CKPT OUT [--int8] [--eval]`).

Runs in one process with no process group: it reads the checkpoint's portable `model_optim/` form
(checkpointing/dcp_state.py), which DDP, FSDP and DeepSpeed checkpoints all hold.

    OUT/model.safetensors + OUT/config.json (with the run's class names as id2label / label2id)
        longformer: Hugging Face layout, AutoModelForSequenceClassification.from_pretrained(OUT)
        multimodal: config.json is model.export_config(); load with load_export(OUT) (RoBERTa + a torchvision
                    CNN + a fusion head is no Hugging Face architecture)
    OUT/tokenizer.json, tokenizer_config.json   the run's tokenizer (its own, or the one it named), beside the
                              model, so that AutoTokenizer.from_pretrained(OUT) is the tokenizer the run trained
                              with; its model_max_length is the run's truncation length (data.max_length)
    OUT/model_int8.pt         (--int8) torchao INT8 (Linear: int8 weights and activations; embeddings: int8
                              weights), torch.save of the state_dict; CPU inference only
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import shutil
from pathlib import Path

import torch
from torch import nn

from shardtrain.checkpointing import store as checkpoint
from shardtrain.config.labels import run_config_dict
from shardtrain.config.settings import ConfigError, from_dict

EXPORT_META = "shardtrain_export.json"
INT8_FILE = "model_int8.pt"  # export --int8: torchao's format, torch.save of the quantized state_dict


def _resolve(ckpt: str | Path, which: str = "final") -> Path:
    """`which`: final (a run folder's newest checkpoint, or the step directory given) or best (checkpoints/best)."""
    path = Path(ckpt)
    if not path.exists():
        raise ConfigError(f"export: checkpoint not found: {path}")
    found = checkpoint.find_checkpoint(path, which, label="export")
    root = checkpoint.checkpoints_root_given(path)
    if root is not None and which == "final":  # a run folder stands for the model it ended with
        _refuse_older_than_run(root.parent, found, path)
    return found


def _refuse_older_than_run(run: Path, found: Path, asked: Path) -> None:
    try:
        final = json.loads((run / "summary.json").read_text()).get("final_step")
    except (OSError, ValueError):
        return  # still running, or crashed: its newest checkpoint is all there is
    saved = checkpoint.read_trainer_state(found)["step"]
    if final is not None and saved < final:
        raise ConfigError(
            f"export {asked}: the newest checkpoint is step {saved}, but the run ended at step "
            f"{final} (summary.json), so steps {saved + 1}-{final} were never saved "
            f"(--save-final false); export step {saved} by naming it ({found}), or resume the "
            f"run to save its end"
        )


def export_checkpoint(
    ckpt: str | Path,
    out: str | Path,
    int8: bool = False,
    workload: str | None = None,
    workload_args: str | None = None,
    evaluate: bool = False,
    which: str = "final",
    merge: bool = False,
    keep_others: bool = False,
) -> dict:
    """`workload` / `workload_args` (--workload, --workload-args): rebuild the model with this workload instead
    of the one the run recorded (its module moved, or its args name paths of another machine). `which`
    (--checkpoint): a run folder's final or best checkpoint. `merge` (--merge): a LoRA run's adapters folded into
    its base weights, written as the plain model (without it, a user's PeftModel is written in peft's adapter
    format; a built-in's export is always merged, its format being the plain model's). `keep_others`: see
    export_folder."""
    ckpt_dir = _resolve(ckpt, which)
    with export_folder(Path(out), keep_others=keep_others) as staging:
        return _export(ckpt_dir, staging, int8, workload, workload_args, evaluate, merge)


STAGING = ".export-in-progress"


@contextlib.contextmanager
def export_folder(out: Path, keep_others: bool = False):
    """Where an export writes: a staging folder inside OUT, whose files replace OUT's once all are written.
    A previous export in OUT goes entirely: its files would otherwise mix with the new ones (a stale
    adapter_config.json beside merged weights makes transformers apply the old adapters, without an error).
    Other files in OUT are refused, before any work (`keep_others`: left where they are, for --final-model-dir,
    which may be a folder the platform made, SageMaker's /opt/ml/model). A failed export leaves OUT as it was,
    and no OUT at all if it made it."""
    made = not out.exists()
    if not made and not out.is_dir():
        raise ConfigError(f"export: {out} is a file; give a folder to export into")
    previous = (out / EXPORT_META).is_file()
    others = [] if made or previous else [p.name for p in out.iterdir() if p.name != STAGING]
    if others and not keep_others:
        raise ConfigError(
            f"export: {out} holds files that are no shardtrain export ({', '.join(sorted(others)[:3])}): give a new "
            f"or empty folder (a previous export there is replaced)"
        )
    staging = out / STAGING
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(out if made else staging, ignore_errors=True)
        raise
    for entry in out.iterdir() if previous else ():
        if entry.name == STAGING:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    for entry in staging.iterdir():
        os.replace(entry, out / entry.name)
    staging.rmdir()


def _export(ckpt_dir: Path, out: Path, int8, workload, workload_args, evaluate, merge) -> dict:
    state = checkpoint.read_trainer_state(ckpt_dir)
    run_cfg = from_dict(run_config_dict(state), source=f"{ckpt_dir}/{checkpoint.TRAINER_STATE}")
    if workload is not None or workload_args is not None:
        run_cfg = _with_workload(run_cfg, workload, workload_args)
    return export_workload(ckpt_dir, run_cfg, out, int8, evaluate, merge)


def run_tokenizer(cfg, run_dir: Path):
    """The tokenizer the run trained with: the one it trained into its folder, or the one it named."""
    from transformers import AutoTokenizer

    own = run_dir / "tokenizer"
    name = str(own) if (own / "tokenizer.json").is_file() else cfg.data.tokenizer
    if name is None:
        raise ConfigError(
            f"export: the run's tokenizer {own} is not there (the run trained it, data.tokenizer "
            f"is unset): keep the run's tokenizer/ folder beside its checkpoints/; an export without "
            f"it would tokenise text into other ids"
        )
    try:
        return AutoTokenizer.from_pretrained(name)
    except Exception as e:  # noqa: BLE001 - OSError, ValueError, HFValidationError: all mean "not usable"
        raise ConfigError(f"export: cannot load the run's tokenizer '{name}': {_first_line(e)}") from None


def save_tokenizer(tokenizer, max_length: int, out: Path) -> None:
    """Into the export's root, where AutoTokenizer.from_pretrained(OUT) looks (beside config.json, which would
    otherwise make it build an empty tokenizer of the model's type), truncating where training truncated: a
    trained tokenizer's model_max_length is "unlimited" (1e30), and `truncation=True` would then keep every token."""
    tokenizer = copy.copy(tokenizer)
    tokenizer.model_max_length = max_length
    tokenizer.save_pretrained(str(out))
    for f in out.iterdir():
        if f.is_file() and f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            normal_mode(f)
    old = out / "tokenizer"  # exports before the tokenizer moved to the root kept it here
    if (old / "tokenizer.json").is_file():
        shutil.rmtree(old)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def save_hf_quietly(hf_model, out: Path) -> None:
    """save_pretrained without its "Writing model shards" bar: a bar for one file, on stderr, the one line an
    export printed that was not its own."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        hf_model.save_pretrained(str(out), safe_serialization=True)
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def _with_workload(run_cfg, workload: str | None, workload_args: str | None):
    """The run's config with --workload / --workload-args over its own (new args only for a new target)."""
    from shardtrain.config.settings import command_config, is_builtin_workload, replace_fields, workload_target

    flags = command_config(None, workload, workload_args)
    changes = {}
    if workload is not None and workload_target(flags) != workload_target(run_cfg):
        if is_builtin_workload(run_cfg) or is_builtin_workload(flags):
            raise ConfigError(
                f"export --workload {workload}: the run trained {workload_target(run_cfg)}; a "
                f"built-in's weights fit only that built-in"
            )
        changes.update(workload=workload, workload_args={})
    if workload_args is not None:
        changes["workload_args"] = flags.workload.workload_args
    return replace_fields(run_cfg, **changes)


def load_fitting_weights(model: nn.Module, weights: dict, workload, what: str, base: dict | None = None) -> nn.Module:
    """Strict: weights of another workload or model size are refused in one line naming the keys, not half-loaded.
    `what` starts the message (`export CKPT`, `predict CKPT`). `base`: the trainer state's record of a LoRA
    checkpoint's base, which the checkpoint leaves out: `model` must be built with that base's weights."""
    from shardtrain.workloads.adapters import base_fingerprint, check_same_base, frozen_base

    own = model.state_dict()
    if base is not None:
        check_same_base(base, base_fingerprint(model), what, type(workload).__name__)
        own = {k: v for k, v in own.items() if k not in frozen_base(model)}
    missing, unexpected = sorted(set(own) - set(weights)), sorted(set(weights) - set(own))
    shapes = sorted(k for k in set(own) & set(weights) if tuple(own[k].shape) != tuple(weights[k].shape))
    if missing or unexpected or shapes:
        raise ConfigError(
            f"{what}: its weights do not fit {type(workload).__name__}.build_model() (a checkpoint "
            f"of another workload or size?): missing {missing[:3]}, unexpected {unexpected[:3]}, "
            f"shape mismatches {shapes[:3]}"
        )
    model.load_state_dict(weights, strict=base is None)
    return model


def export_workload(ckpt_dir: Path, cfg, out: Path, int8: bool, evaluate: bool = False, merge: bool = False) -> dict:
    """The workload's own export from the checkpoint's folder when it has one (Workload.export_checkpoint: the
    built-ins), else its model rebuilt as training built it (same seed), the checkpoint's weights loaded, then
    written by Workload.export (by default model.safetensors + workload.json)."""
    from shardtrain.checkpointing.portable import read_portable
    from shardtrain.config.settings import add_import_paths
    from shardtrain.runtime.training_rng import aside
    from shardtrain.workloads.adapters import is_peft_model, merged
    from shardtrain.workloads.base import load_workload, model_of, with_import_root

    add_import_paths(None)  # the `shardtrain` console script's sys.path lacks the working directory
    state = checkpoint.read_trainer_state(ckpt_dir)
    root = (state.get("resolved") or {}).get("workload_import_root")
    with_import_root(root)  # after the working directory and PYTHONPATH: where training imported it from
    workload = load_workload(cfg)
    own = workload.export_checkpoint(ckpt_dir, out, int8)
    if own is not None:
        (out / EXPORT_META).write_text(json.dumps(own, indent=1))
        return own
    with aside(seed=cfg.train.seed):  # the caller's random numbers (shardtrain.fit's, a notebook's) stay as they were
        model = model_of(workload)
    base = state.get("base")  # a LoRA run's checkpoint leaves it out: build_model loaded it (above)
    load_fitting_weights(model, read_portable(ckpt_dir)["model"], workload, f"export {ckpt_dir}", base)
    if merge:  # a PeftModel's export is its adapters (PeftModel.from_pretrained); merged, the plain model's
        model = merged(model, f"export {ckpt_dir}")
    name_the_classes(model, cfg.data.label_names)
    workload.export(model.eval(), out)
    for f in out.glob("*.safetensors"):
        normal_mode(f)
    info = {
        "checkpoint": str(ckpt_dir),
        "workload": cfg.workload.workload,
        "workload_args": cfg.workload.workload_args,
        "adapters": "merged" if merge else "peft" if is_peft_model(model) else None,
        "workload_import_root": root,
        **label_maps(cfg),
        "bytes_fp32": sum(f.stat().st_size for f in out.glob("*.safetensors")),
        "config": cfg.to_dict(),
    }  # the run's data settings: `predict` reads them
    if evaluate:
        info["eval_fp32"] = evaluate_workload(workload, model)
    if int8:  # build_model() (merged, for adapters) + load_int8_weights(model, OUT/model_int8.pt) reads it back
        if is_peft_model(model):
            # A deployable INT8 model is the merged one: quantized unmerged, the file held the base and its adapters
            # under peft's names, which no plain architecture loads, and was compared with the adapters' size.
            model = merged(model, f"export {ckpt_dir}")
            info["int8_of"] = "merged"
            info["bytes_fp32_merged"] = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        save_int8(model, out / INT8_FILE)
        normal_mode(out / INT8_FILE)
        info["bytes_int8"] = (out / INT8_FILE).stat().st_size
        info["size_reduction"] = 1 - info["bytes_int8"] / info.get("bytes_fp32_merged", info["bytes_fp32"])
        if evaluate:
            info["eval_int8"] = evaluate_workload(workload, model)
    (out / EXPORT_META).write_text(json.dumps(info, indent=1, default=str))
    return info


def name_the_classes(model: nn.Module, names: list[str]) -> None:
    """A transformers model's config gets the run's class names where it still has transformers' own (LABEL_0,
    ...), so that the config.json its save_pretrained writes in a workload's export() maps ids to them, as the
    built-ins' exports do: without them `pipeline("text-classification")` answered LABEL_2 for "positive". Names a
    user's build_model() gave its config are theirs; a model of another kind has no such config."""
    from shardtrain.workloads.adapters import is_peft_model

    config = getattr(model.get_base_model() if is_peft_model(model) else model, "config", None)
    id2label = getattr(config, "id2label", None)
    if not names or not isinstance(id2label, dict) or len(id2label) != len(names):
        return
    if {int(i): label for i, label in id2label.items()} != {i: f"LABEL_{i}" for i in range(len(names))}:
        return
    config.id2label = dict(enumerate(names))
    config.label2id = {name: i for i, name in enumerate(names)}


def label_maps(cfg) -> dict:
    """HF's id2label / label2id from the class names a run recorded (data.label_names); {} for integer labels."""
    names = cfg.data.label_names
    if not names:
        return {}
    return {
        "id2label": {str(i): name for i, name in enumerate(names)},
        "label2id": {name: i for i, name in enumerate(names)},
    }


@torch.no_grad()
def evaluate_workload(workload, model: nn.Module) -> dict:
    """The exported weights on the workload's own validation set, by its own metric_sums / metrics."""
    from torch.utils.data import DataLoader

    from shardtrain.workloads.adapters import forwarded_model
    from shardtrain.workloads.base import CheckedCollate, splits_of

    validation = splits_of(workload)[1]
    if validation is None:
        raise ConfigError(f"export --eval: {type(workload).__name__}.datasets() has no validation split")
    sums: dict = {}
    for batch in DataLoader(
        validation,
        batch_size=workload.cfg.train.eval_batch_size or workload.cfg.train.per_device_batch_size,
        collate_fn=CheckedCollate(workload),
    ):
        outputs = workload.forward(forwarded_model(workload, model), batch)
        for key, value in workload.metric_sums(outputs, batch).items():
            sums[key] = sums[key] + value.double() if key in sums else value.double()
    return workload.metrics(sums)


def normal_mode(path: Path) -> None:
    """The mode open() would have given the file (0644 under umask 022). safetensors writes its files 0600,
    unreadable to the other users and services that an exported model is meant for."""
    path.chmod(0o666 & ~_umask())


def _umask() -> int:
    # Read, not set-and-restore: os.umask(0) would briefly apply to files other threads create (W&B, loaders).
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# ---- loading exports ---------------------------------------------------------------------------------
def load_export(out: str | Path) -> nn.Module:
    """The fp32 model of an export whose workload reads its own layout back (Workload.load_exported: the
    built-ins), ready for eval."""
    return _load_exported(Path(out), int8=False)


def quantize(model: nn.Module) -> nn.Module:
    """torchao, in place: every nn.Linear gets int8 weights and int8 activations quantized per batch
    (Int8DynamicActivationInt8WeightConfig), every nn.Embedding int8 weights (weight-only: its "activation" is a
    row lookup). Convolutions stay fp32: see the README's INT8 section for why not PT2E."""
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, quantize_

    quantize_(model, Int8DynamicActivationInt8WeightConfig())  # its default filter: nn.Linear
    quantize_(model, Int8WeightOnlyConfig(), filter_fn=lambda module, _: isinstance(module, nn.Embedding))
    return model


def save_int8(model: nn.Module, path: Path) -> None:
    """torchao's documented format: torch.save of the quantized state_dict, read back with
    `model.load_state_dict(torch.load(path, weights_only=True), assign=True)` into the fp32 architecture.
    For Longformer, pass the Hugging Face model inside ours, so that transformers + torch alone load the file."""
    torch.save(quantize(model).state_dict(), path)


def load_int8(out: str | Path) -> nn.Module:
    """The INT8 model of an export with --int8 (Workload.load_exported): the architecture, the int8 weights assigned."""
    return _load_exported(Path(out), int8=True)


def _load_exported(out: Path, int8: bool) -> nn.Module:
    from shardtrain.workloads.base import load_workload

    workload = load_workload(exported_config(out))
    model = workload.load_exported(out, int8)
    if model is None:
        raise ConfigError(
            f"{out}: {type(workload).__name__}'s export is read back with its build_model() and "
            f"{INT8_FILE if int8 else 'model.safetensors'} (load_int8_weights, safetensors' load_file), or by "
            f"`shardtrain predict {out}`"
        )
    return model.eval()


def exported_config(out: Path):
    """The run's config an export recorded (exports older than that named only the model)."""
    meta = json.loads((out / EXPORT_META).read_text())
    if "config" in meta:
        return from_dict(meta["config"], source=str(out / EXPORT_META))
    return from_dict({"model": {"name": meta["model"]}}, source=str(out / EXPORT_META))


def load_int8_weights(model: nn.Module, path: Path) -> nn.Module:
    """The documented torchao load; a missing or cut-off file is one line naming it."""
    if not path.is_file():
        raise ConfigError(f"{path}: not found; `shardtrain export CKPT OUT --int8` writes it")
    # torchao's tensor types (Int8Tensor, ...) are allowed by weights_only once torchao is imported; a model
    # that is not a transformers one (whose import pulls torchao in) found them "Unsupported global".
    import torchao.quantization  # noqa: F401

    try:
        state = torch.load(path, weights_only=True, mmap=True)
        model.load_state_dict(state, strict=True, assign=True)
    except Exception as e:  # noqa: BLE001 - torch's unpickling / size errors about the file's bytes
        raise ConfigError(
            f"{path}: cannot load the INT8 weights (truncated, or not this model's?): {_gist(e)}"
        ) from None
    return model.eval()


def _gist(error: Exception) -> str:
    """torch.load's weights_only failure is a page of advice with terminal colours; its cause is one sentence."""
    text = " ".join(re.sub(r"\x1b\[[0-9;]*m", "", str(error)).split())
    cause = re.search(r"Unsupported global: GLOBAL [\w.]+", text)
    return cause.group(0) if cause else text[:200]
