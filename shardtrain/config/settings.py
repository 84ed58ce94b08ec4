"""One typed config: YAML file + command-line overrides, validated before any heavy work.

Sections exist only to keep YAML files readable; every field name is unique across sections,
so each one is also a flat command-line flag (`train.per_device_batch_size` <-> `--per-device-batch-size`).
Errors name the flag or the YAML key, and show the arithmetic where there is some.
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import copy
import dataclasses
import difflib
import json
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar, Iterator, Literal, Mapping, Optional, Union, get_args, get_origin, get_type_hints

from shardtrain.config.errors import ConfigError  # everyone imports it from here; sagemaker_env, below us, from errors
from shardtrain.config.recompute import every_n
from shardtrain.config.shipped import ShippedWorkloads


class RecomputeSetting:
    """The type of activation_checkpointing: true, false, auto or every-N (config/recompute.py)."""


def setting(default: Any, help: str, compared_as: str | None = None, read_by: str | None = None) -> Any:
    """A config field and its one-line description: the one text `train --help` shows for it (with the YAML key
    and the default, added there). `compared_as`: the field is a workload setting that `compare` and `parity`
    check runs for, under this name (observability/comparable.py); `read_by`: only runs of this model.name read
    it, so only theirs are compared."""
    metadata = {"help": help, "compared_as": compared_as, "read_by": read_by}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def compared_fields(section: type) -> list[tuple[str, str, str | None]]:
    """(field, the name compare shows, the model.name that alone reads it) of a section's compared settings."""
    return [
        (f.name, f.metadata["compared_as"], f.metadata["read_by"])
        for f in dataclasses.fields(section)
        if f.metadata.get("compared_as")
    ]


@dataclass(frozen=True)
class ModelConfig:
    """The framework's model settings; the shipped workloads add their own (config/shipped.py)."""

    name: Optional[str] = setting(
        None, "a workload the package ships, by name (as --workload takes it)", compared_as="model"
    )
    # The jsonl --data-dir layout's integer labels do not say how many classes there are, hence its 3.
    num_labels: Optional[int] = setting(
        None,
        "number of classes; unset: the classes a ClassLabel, string or bool "
        "label column names, or 3 for the jsonl --data-dir layout",
        compared_as="labels",
    )
    freeze_layers: int = setting(
        0,
        "freeze the text embeddings and the first N encoder layers (and a matching "
        "share of the CNN); 0: train everything",
        compared_as="frozen layers",
    )
    unfreeze_at_step: Optional[int] = setting(
        None,
        "optimizer step at which the frozen layers start to train; unset: frozen for the whole run",
        compared_as="unfreeze step",
    )


@dataclass(frozen=True)
class DataConfig:
    data_dir: str = setting(
        "data",
        "folder of train.jsonl and validation.jsonl (or of a published layout, with --dataset-format)",
    )
    # None trains a byte-level BPE on the training text, which only a randomly initialised model can use.
    tokenizer: Optional[str] = setting(
        None,
        "tokenizer: a hub name or folder; unset: the text model's own, or one "
        "trained on the training text when pretrained is false",
        compared_as="tokenizer",
    )
    tokenizer_vocab_size: int = setting(2000, "vocabulary size of the tokenizer trained when none is given")
    max_length: int = setting(128, "texts are truncated to this many tokens", "sequence length")
    image_size: int = setting(224, "images are resized to this many pixels square", "image size")
    num_workers: Optional[int] = setting(
        None,
        "data-loading worker processes per rank (0: load in the training process); unset: up to 4, as many as "
        "leave each rank a CPU of its own",
    )
    pin_memory: bool = setting(True, "page-locked host memory for batches, for faster copies to the GPU (CUDA only)")
    skip_bad_samples: bool = setting(
        False,
        "skip records that do not read (empty text, undecodable image) and "
        "count them, instead of stopping with one line naming the first",
    )
    max_train_samples: Optional[int] = setting(None, "train on the first N records only; unset: all")
    max_eval_samples: Optional[int] = setting(None, "evaluate on the first N records only; unset: all")
    eval_data_dir: Optional[str] = setting(
        None, "folder holding validation.jsonl when it is not data_dir (SageMaker's separate validation channel)"
    )
    image_cache: Optional[str] = setting(
        None, "folder of decoded images written by `shardtrain cache-images`; unset: decode every image every epoch"
    )
    # No conversion script between the download and a run: the layout is read as unpacked (data/layouts.py).
    dataset_format: Optional[Literal["mvsa-single", "mvsa-multiple", "twitter2015", "twitter2017"]] = setting(
        None, "read data_dir as this research dataset's published layout; unset: the jsonl splits"
    )
    streaming: bool = setting(False, "read the training split as a stream, not into memory: data bigger than RAM")
    group_by_length: bool = setting(
        False,
        "train on batches of texts of similar length (HF's group_by_length): each random run of "
        "50 x per_device_batch_size x grad_accum samples is sorted by length, so batches pad less",
    )
    max_tokens_per_batch: Optional[int] = setting(
        None,
        "size each training micro-batch by a token budget instead of per_device_batch_size: as many texts of "
        "the length-grouped order as fit in N tokens once padded to their longest, the same N on every rank; "
        "unset: per_device_batch_size texts",
    )
    preprocessing_num_workers: Optional[int] = setting(
        None, "processes that tokenise through datasets.map (cached); unset: this process"
    )
    # Sources other than the jsonl --data-dir layout (shardtrain/data/sources.py), with the flag names of HF's
    # run_classification.py.
    dataset_name: Optional[str] = setting(
        None, "a dataset for datasets.load_dataset: a hub name, a local path, or a save_to_disk folder"
    )
    dataset_config_name: Optional[str] = setting(
        None, "the dataset's configuration (load_dataset's second argument), e.g. a GLUE task"
    )
    train_file: Optional[str] = setting(
        None, "the training split as one csv, json/jsonl or parquet file (by its extension)"
    )
    validation_file: Optional[str] = setting(None, "the validation split as one csv, json/jsonl or parquet file")
    train_dir: Optional[str] = setting(
        None,
        "an image folder with a metadata.jsonl or metadata.csv (file_name, "
        "text, label) for training, read by datasets' imagefolder",
    )
    validation_dir: Optional[str] = setting(None, "the same for the validation split")
    # IMDB's validation is its `test`.
    train_split_name: str = setting("train", "the split of a dataset with several to train on")
    validation_split_name: str = setting("validation", "the split to evaluate on")
    validation_split_percentage: Optional[int] = setting(
        None, "for a source without a validation split: this percentage of train, drawn with the seed"
    )
    text_column_names: list = setting(
        ["text"], "columns read as text, comma-separated; several are joined with text_column_delimiter"
    )
    text_column_delimiter: str = setting(" ", "what joins several text columns")
    label_column_name: str = setting("label", "the column read as the label")
    image_column_name: str = setting("image", "the column read as the image")
    # A run records them here, so its saved config, checkpoints and exports carry the mapping.
    label_names: list = setting(
        [],
        "class names in id order (id2label), comma-separated; empty: taken from the "
        "data. Set it to fix the order yourself",
    )


@dataclass(frozen=True)
class TrainConfig:
    max_steps: int = setting(1000, "optimizer steps to train; the learning-rate schedule follows it")
    per_device_batch_size: int = setting(
        32, "samples per process and micro-batch; the global batch is this x processes x grad_accum"
    )
    eval_batch_size: Optional[int] = setting(
        None, "samples per process and evaluation batch; unset: per_device_batch_size"
    )
    grad_accum: int = setting(1, "micro-batches accumulated into one optimizer step")
    lr: float = setting(3e-5, "peak learning rate (after warmup)")
    weight_decay: float = setting(0.01, "weight decay of weight matrices (AdamW's is decoupled)")
    optim: Literal["adamw", "adamw_8bit", "adafactor", "sgd"] = setting(
        "adamw",
        "the optimizer: adamw (torch), adamw_8bit (torchao's AdamW8bit: ~2 bytes of state per parameter; CUDA, DDP "
        "and FSDP), adafactor (transformers', factored second moments; DDP), sgd (torch, no momentum)",
    )
    lr_multipliers: dict = setting(
        {},
        'learning-rate factors by part of the model, as JSON, e.g. {"text": 0.1, "image": 0.1}: '
        "a part the workload names (Workload.parts) or a parameter-name prefix; every other parameter x1",
    )
    warmup_steps: int = setting(0, "optimizer steps of linear warmup from 0 to lr")
    lr_scheduler: Literal["linear", "cosine", "constant"] = setting(
        "linear", "learning rate after warmup: linear or cosine decay to 0 at max_steps, or constant"
    )
    max_grad_norm: float = setting(1.0, "gradients are clipped to this global L2 norm")
    seed: int = setting(42, "random seed of weights, data order and dropout")
    precision: Literal["fp32", "bf16", "fp16"] = setting(
        "fp32", "compute precision: fp32, or bf16 / fp16 under autocast (fp16 with a loss scaler)"
    )
    activation_checkpointing: RecomputeSetting = setting(
        False,
        "recompute blocks' activations in backward: less memory, up to one more forward per step. true: every "
        "block; every-N: every N-th; auto: the fewest that make the planner's predicted peak fit the device "
        "(its memory, or memory_budget_gb)",
    )
    eval_every: int = setting(0, "evaluate every N optimizer steps; 0: only at the end")
    # The best checkpoint and early stopping (loop/best.py), in HF TrainingArguments' and EarlyStoppingCallback's
    # spellings and meaning; decided at each --eval-every evaluation.
    metric_for_best_model: Optional[str] = setting(
        None,
        "keep checkpoints/best: the checkpoint of the evaluation with the best value of this key of the "
        "workload's metrics() (e.g. accuracy, macro_f1); unset: no best checkpoint, unless "
        "early_stopping_patience is set, which then takes the first key (accuracy for the built-ins)",
    )
    greater_is_better: Optional[bool] = setting(
        None, "a larger metric_for_best_model is better; unset: true unless the metric's name ends in 'loss' (as HF)"
    )
    early_stopping_patience: Optional[int] = setting(
        None,
        "stop (saved, exit 0) after this many evaluations in a row that do not improve metric_for_best_model "
        "by more than early_stopping_threshold; unset: no early stopping",
    )
    early_stopping_threshold: float = setting(
        0.0, "how much an evaluation must improve on the best value so far to reset the patience count"
    )
    log_every: int = setting(10, "log the loss and throughput every N optimizer steps")
    nan_policy: Literal["skip", "abort"] = setting(
        "skip", "a step with a non-finite loss or gradient: skip its update (every rank alike), or abort the run"
    )
    max_bad_steps: int = setting(5, "abort after this many skipped steps in a row")
    oom_recovery: bool = setting(
        True,
        "on CUDA out-of-memory, retry the step with a smaller micro-batch and more accumulation: the same global batch",
    )
    # Test-only fault injection: exercises --oom-recovery without a GPU.
    inject_oom_above: Optional[int] = setting(
        None,
        "test only: raise a real torch.OutOfMemoryError on rank 0 while the micro-batch is above this size; unset: off",
    )
    inject_oom: list = setting(
        [],
        "test only: out-of-memory errors where real ones happen, POINT@STEP:RANK, "
        "comma-separated; POINT is forward, alloc (a real allocation that fails), "
        "backward, recompute or step (see shardtrain/loop/oom.py); fires while the "
        "micro-batch is above --inject-oom-above, if set",
    )
    # Every tensor of every rank is walked, so not every step.
    memory_every: int = setting(100, "account each rank's memory on steps 1, 2 and every N steps; 0: only 1 and 2")
    # "inductor" generates fused kernels (the GPU choice); "aot_eager" / "eager" only trace, which tests use to
    # exercise the path cheaply on CPU.
    compile: Literal["none", "inductor", "aot_eager", "eager"] = setting(
        "none", "torch.compile backend for the model; none: eager mode"
    )
    # TF32 and cuDNN autotuning are CUDA's fast defaults (runtime/device_defaults.py); this is the one switch off.
    deterministic: bool = setting(
        False,
        "CUDA: TF32 off, cuDNN autotuning off and deterministic cuDNN kernels "
        "(slower; for bit-for-bit reruns); false: TF32 matmuls and "
        "cudnn.benchmark on. No effect on CPU",
    )
    fused_adamw: bool = setting(
        True, "fused AdamW kernels on CUDA (one launch for all parameters); CPU always uses the foreach implementation"
    )
    # Exercises --nan-policy and the ranks' agreement to skip.
    inject_nan_at_steps: list = setting(
        [], "test only: the last rank's loss becomes NaN at these optimizer steps (1-based, comma-separated, e.g. 3,4)"
    )


@dataclass(frozen=True)
class ParallelConfig:
    strategy: Literal["ddp", "fsdp", "deepspeed", "auto", "zero2", "zero3", "zero2_offload", "zero3_offload"] = setting(
        "ddp",
        "how the model is distributed: ddp, fsdp, deepspeed (with --ds), zero2/zero3[_offload] (DeepSpeed "
        "with the shipped ds_configs/<name>.json), or auto (the cheapest that fits, as `plan` picks)",
    )
    ds: Optional[str] = setting(None, "a DeepSpeed JSON config; selects --strategy deepspeed")
    fsdp_policy: str = setting(
        "fsdp_policies/default.yaml",
        "FSDP's policy file (blocks to wrap, sharding, offload, activation checkpointing) for --strategy fsdp",
    )
    device: Literal["auto", "cpu", "cuda"] = setting(
        "auto", "where to train; auto: CUDA when a GPU is visible, else CPU"
    )
    nproc: str = setting(
        "auto",
        "processes to start when `shardtrain train` runs as one plain process; auto: one per visible GPU (1 without)",
    )
    # A peer or link that goes silent (no reset, no FIN) leaves the others inside a collective: only this ends it.
    dist_timeout: float = setting(
        1800.0,
        "seconds a collective waits for the other ranks before the run fails "
        "(the process group's timeout): bounds a hang on a silent node or link",
    )
    memory_budget_gb: Optional[float] = setting(
        None,
        "memory per device (GB) that --strategy auto and --activation-checkpointing auto must fit in; unset: "
        "the GPU's own (required on CPU)",
    )


@dataclass(frozen=True)
class CheckpointConfig:
    output_dir: str = setting("runs/default", "the run's folder: checkpoints, metrics.jsonl, summary.json, report")
    save_every: int = setting(0, "save a checkpoint every N optimizer steps; 0: only at the end (see save_final)")
    save_final: bool = setting(
        True,
        "commit the last step when the run ends, so export and --resume see the model "
        "it ended with; false keeps only the --save-every checkpoints",
    )
    keep_last: int = setting(2, "checkpoints kept; older ones are deleted")
    # torch DCP async_save for every strategy (docs/checkpoints.md).
    async_save: bool = setting(
        False,
        "write checkpoints in the background: training waits only while the state "
        "is copied to host memory; committed once every rank's write is on disk",
    )
    # The portable form is what every resume reads; DeepSpeed's own files are a second copy of the same state.
    engine_files: bool = setting(
        False,
        "DeepSpeed only: also write DeepSpeed's own engine files (engine/), for its "
        "tools such as zero_to_fp32.py; resume and export read the portable form",
    )
    resume: str = setting(
        "auto", "auto (the latest committed checkpoint in output_dir, if any), none, or a checkpoint folder"
    )
    overwrite_output_dir: bool = setting(
        False, "with --resume none, start over in an output_dir that already holds a run (otherwise refused)"
    )
    final_model_dir: Optional[str] = setting(
        None, "at the end, rank 0 writes the consolidated model here (SageMaker: SM_MODEL_DIR); unset: not written"
    )
    final_model_checkpoint: Literal["final", "best"] = setting(
        "final",
        "which checkpoint --final-model-dir (and W&B's model artifact) gets: final (the step the run "
        "ended at) or best (checkpoints/best, which metric_for_best_model chose)",
    )


@dataclass(frozen=True)
class LogConfig:
    # HF TrainingArguments' report_to: a comma list (or a YAML list); validate() resolves none and all. The default
    # is HF 5's, none: all would open a W&B run in every job, wandb being a requirement (docs/observability.md).
    report_to: list = setting(
        [],
        "where metrics go besides metrics.jsonl: a comma list of wandb, tensorboard, mlflow; "
        "none: nowhere else; all: each of those that is installed",
    )
    # An unset W&B name comes from W&B's own WANDB_* variable, as under HF Trainer and Lightning.
    wandb_project: Optional[str] = setting(None, "W&B project; unset: WANDB_PROJECT, else shardtrain")
    wandb_entity: Optional[str] = setting(None, "W&B entity (team or user); unset: WANDB_ENTITY, else yours")
    wandb_run_name: Optional[str] = setting(None, "W&B run name; unset: WANDB_NAME, else one W&B makes up")
    # Off on CPU by default, where W&B's sampler thread only competes with data loading.
    wandb_system_metrics: Optional[bool] = setting(
        None, "W&B's system panels (GPU utilisation and memory); unset: on for CUDA runs, off on CPU"
    )
    # As HF Trainer's WANDB_LOG_MODEL=end does.
    wandb_log_model: Optional[bool] = setting(
        None, "upload the final model as a W&B artifact (type model); unset: follows WANDB_LOG_MODEL"
    )
    verbose: bool = setting(
        False, "show the libraries' info lines and warnings (hidden by default) and W&B's own output"
    )
    debug: bool = setting(False, "show the full traceback of an error instead of its one line")
    report: bool = setting(True, "write OUT/report.html with plots at the end of the run")
    predict_memory: bool = setting(
        True,
        "the startup banner predicts memory per rank, measuring activations on CPU (seconds on rank 0); false skips it",
    )
    # torch.profiler over a few steps (observability/step_profile.py): a trace per rank, and where the time went.
    profile_steps: Optional[str] = setting(
        None,
        "profile optimizer steps A-B (or one step N): a torch.profiler trace per rank in OUT/profile/ and a "
        "summary per rank of compute, communication, data wait, optimizer, recompute and host syncs",
    )


@dataclass(frozen=True)
class WorkloadConfig:
    # A dotted module path (no file paths: they break in subprocesses); the config file's folder is on the
    # import path. None: the built-in that model.name names (the configs written before workloads existed).
    workload: Optional[str] = setting(
        None,
        "your Workload, my_pkg.tasks:MyTask, or a built-in ({builtins}); unset: the one model.name names",
    )
    workload_args: dict = setting({}, "keyword arguments for the workload's constructor, as JSON")


@dataclass(frozen=True)
class PeftConfig:
    # The peft library's LoraConfig spellings and defaults (r is lora_r: the flag --r would say nothing).
    peft: Optional[Literal["lora"]] = setting(
        None, "train LoRA adapters (the peft library) on the frozen model build_model returns; unset: the whole model"
    )
    lora_r: int = setting(8, "rank of each LoRA adapter")
    lora_alpha: int = setting(8, "LoRA's scaling numerator: an adapter's update is scaled by lora_alpha / lora_r")
    lora_dropout: float = setting(0.0, "dropout on each adapter's input (0..1)")
    target_modules: list = setting(
        [],
        "the Linear modules that get adapters, by name or name suffix (query, value); empty: peft's default for "
        "the Hugging Face model inside",
    )
    modules_to_save: list = setting(
        [],
        "modules trained in full beside the adapters (a new head); empty: a classifier or score head when the "
        "model has one",
    )


def _section(name: str) -> Any:
    """A Config section's field: its default is the section's class as the shipped workloads extend it."""
    return field(default_factory=lambda: section_class(name)())


@dataclass(frozen=True)
class Config:
    workload: WorkloadConfig = _section("workload")
    model: ModelConfig = _section("model")
    peft: PeftConfig = _section("peft")
    data: DataConfig = _section("data")
    train: TrainConfig = _section("train")
    parallel: ParallelConfig = _section("parallel")
    checkpoint: CheckpointConfig = _section("checkpoint")
    log: LogConfig = _section("log")
    # field name -> (`configs/x.yaml:12`, the value read there) for the settings from_dict read from a YAML file,
    # so that validate() names the file and line. Set per instance; not a field, so saved configs lack it.
    origins: ClassVar[Mapping[str, tuple[str, Any]]] = MappingProxyType({})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def eval_batch_size(self) -> int:
        return self.train.eval_batch_size or self.train.per_device_batch_size


SECTIONS = {f.name: f.type for f in fields(Config)}

REPO = Path(__file__).resolve().parents[2]
# `--strategy zero3` is short for `--ds ds_configs/zero3.json`, the names `plan`, `parity` and `compare` print.
# Found beside the package, so the name works from any working directory.
SHIPPED_DS_CONFIGS = {
    name: REPO / "ds_configs" / f"{name}.json" for name in ("zero2", "zero3", "zero2_offload", "zero3_offload")
}

# Values `plan` prints that are not this setting's: what to write instead. plan's table names FSDP with another
# policy file as a variant of its own; "did you mean 'zero3_offload'?" sent such a user to DeepSpeed.
NAMED_ELSEWHERE = {
    "strategy": {
        "fsdp_offload": "is plan's name for FSDP with its offload policy: --strategy fsdp --fsdp-policy "
        "fsdp_policies/offload.yaml",
        "fsdp_sgo": "is plan's name for FSDP sharding gradients and optimizer state only (SHARD_GRAD_OP): "
        "--strategy fsdp --fsdp-policy fsdp_policies/shard_grad_op.yaml",
    }
}

# Hugging Face TrainingArguments spellings accepted as aliases of ours.
FLAG_ALIASES = {
    "per_device_batch_size": ["--per-device-train-batch-size"],
    "grad_accum": ["--gradient-accumulation-steps"],
    "lr": ["--learning-rate"],
    "save_every": ["--save-steps"],
    "eval_every": ["--eval-steps"],
    "log_every": ["--logging-steps"],
    "lr_scheduler": ["--lr-scheduler-type"],
    "activation_checkpointing": ["--gradient-checkpointing"],
    "max_length": ["--max-seq-length"],
    # HF TrainingArguments and `accelerate launch` spellings (docs/migration.md lists every one).
    "eval_batch_size": ["--per-device-eval-batch-size"],
    "keep_last": ["--save-total-limit"],
    "wandb_run_name": ["--run-name"],
    "num_workers": ["--dataloader-num-workers"],
    "nproc": ["--num-processes"],
}


# Section name -> its class: the framework's own, or the subclass with the shipped workloads' fields (ship()).
_FRAMEWORK_SECTIONS = MappingProxyType({name: get_type_hints(Config)[name] for name in SECTIONS})
_SECTION_CLASSES: dict[str, type] = dict(_FRAMEWORK_SECTIONS)
_SHIPPED = [ShippedWorkloads()]


def _section_classes() -> dict[str, type]:
    return dict(_SECTION_CLASSES)


def section_class(name: str) -> type:
    """The class of a Config section, with the shipped workloads' fields."""
    return _SECTION_CLASSES[name]


def shipped_fields() -> set[str]:
    """The fields the shipped workloads add to the config's sections: theirs alone, read by no user's workload."""
    own = {f.name for cls in _FRAMEWORK_SECTIONS.values() for f in fields(cls)}
    return {f.name for cls in _SECTION_CLASSES.values() for f in fields(cls)} - own


def shipped() -> ShippedWorkloads:
    """The workloads the package ships by name: their names, settings and rules (config/shipped.py)."""
    return _SHIPPED[0]


def ship(workloads: ShippedWorkloads) -> None:
    """Put the shipped workloads in the config's slot: their sections' subclasses become the sections' classes,
    their fields flags and YAML keys, their names what --workload and model.name take. Called once, by the package
    root, before any config is read; the tables below are updated in place, for the modules that imported them."""
    for name, cls in workloads.sections.items():
        base = _FRAMEWORK_SECTIONS[name]
        if not issubclass(cls, base):
            raise TypeError(f"{cls.__name__} must extend the config's {base.__name__} to be its {name} section")
    _SHIPPED[0] = workloads
    _SECTION_CLASSES.clear()
    _SECTION_CLASSES.update({**_FRAMEWORK_SECTIONS, **workloads.sections})
    FIELDS.clear()
    FIELDS.update(_field_index())
    BUILTIN_WORKLOADS.clear()
    BUILTIN_WORKLOADS.update(workloads.targets)


# The same aliases as YAML keys (`learning_rate` -> `lr`): YAML takes only our names, but suggests them.
KEY_ALIASES = {alias[2:].replace("-", "_"): name for name, aliases in FLAG_ALIASES.items() for alias in aliases}

# Names from other trainers whose nearest spelling here is the wrong setting (`--batch-size` is closest to
# `--eval-batch-size` by letters): what they mean here, and the one thing to know about it.
MEANT = {
    "batch_size": (
        "per_device_batch_size",
        "the batch of one process: the global batch is per-device-batch-size x processes x grad-accum",
    ),
    "train_batch_size": (
        "per_device_batch_size",
        "the batch of one process: the global batch is per-device-batch-size x processes x grad-accum",
    ),
    "num_train_epochs": ("max_steps", "shardtrain counts optimizer steps; the banner prints the steps per epoch"),
    "bf16": ("precision", "--precision bf16"),
    "fp16": ("precision", "--precision fp16"),
    "mixed_precision": ("precision", "--precision fp32|bf16|fp16"),
    "resume_from_checkpoint": ("resume", "--resume auto, none or a checkpoint folder"),
    # Not aliases: DeepSpeed's own launcher convention uses --deepspeed as a switch, not a file.
    "deepspeed": ("ds", "--ds ds_configs/zero2.json, or --strategy zero2|zero3"),
    "zero_stage": ("strategy", "--strategy zero2|zero3 (with _offload for CPU offload)"),
    "use_deepspeed": ("strategy", "--strategy zero2|zero3, or --ds FILE"),
    "fsdp": ("strategy", "--strategy fsdp; the wrap policy is --fsdp-policy"),
    "use_fsdp": ("strategy", "--strategy fsdp; the wrap policy is --fsdp-policy"),
    "eval_strategy": ("eval_every", "--eval-every N evaluates every N steps, 0 only at the end"),
    "save_strategy": ("save_every", "--save-every N saves every N steps, and a finished run saves its last"),
    # peft's LoraConfig(r=...): one letter says nothing beside the other flags
    "r": ("lora_r", "peft's LoraConfig(r=8) is --lora-r 8 here"),
    "load_best_model_at_end": (
        "final_model_checkpoint",
        "--final-model-checkpoint best hands over checkpoints/best; export and predict take --checkpoint best",
    ),
}


def _field_index() -> dict[str, tuple[str, dataclasses.Field, Any]]:
    """field name -> (section, field, resolved type)."""
    index = {}
    for section, cls in _section_classes().items():
        hints = get_type_hints(cls)
        for f in fields(cls):
            assert f.name not in index, f"duplicate config field {f.name}"
            index[f.name] = (section, f, hints[f.name])
    return index


FIELDS = _field_index()


def flag_of(name: str) -> str:
    return "--" + name.replace("_", "-")


# Keys whose YAML spelling is not section.field: `workload: {target, args}` reads better than workload.workload.
YAML_KEYS = {"workload": "workload.target", "workload_args": "workload.args", "peft": "peft.method"}


def key_of(name: str) -> str:
    return YAML_KEYS.get(name) or f"{FIELDS[name][0]}.{name}"


# While validate() runs: the config it was given, and (file:line, YAML key) of each value from a file it has named.
_CHECKING: contextvars.ContextVar[tuple[Config, list[tuple[str, str]]] | None] = contextvars.ContextVar(
    "checking", default=None
)


def where(name: str) -> str:
    """How to name a setting in an error: both its flag and its YAML key. Inside validate(), a value still as a
    YAML file set it (in the config validate() was given) is named by its key, and the error starts with the
    file and line (see located_errors)."""
    checking = _CHECKING.get()
    line = checking and set_in_file(checking[0], name)
    if line:
        named = checking[1]
        named.append((line, key_of(name)))
        return key_of(name) if len(named) == 1 else f"{key_of(name)} ({line})"
    return f"{flag_of(name)} ({key_of(name)})"


def located(cfg: Config, name: str) -> str:
    """where() for a line outside validate(), such as a warning: a value still as a YAML file set it is named by
    its `file:line: key`, any other by its flag and key."""
    line = set_in_file(cfg, name)
    return f"{line}: {key_of(name)}" if line else f"{flag_of(name)} ({key_of(name)})"


def set_in_file(cfg: Config, name: str) -> str | None:
    """The `file:line` of a YAML file that set this value, while the config still holds the value it set."""
    origin = cfg.origins.get(name)
    if origin and getattr(getattr(cfg, FIELDS[name][0]), name) == origin[1]:
        return origin[0]
    return None


@contextlib.contextmanager
def located_errors(cfg: Config):
    """A ConfigError raised inside about a value from a YAML file starts with its `file:line:`, as a compiler's
    does: `configs/x.yaml:12: train.lr must be positive, got -1.0`. Values a flag, SageMaker or a default set
    keep the flag form."""
    named: list[tuple[str, str]] = []
    token = _CHECKING.set((cfg, named))
    try:
        yield
    except ConfigError as e:
        # The first value from the file that the message names (not one a where() named for something else).
        located = next((loc for loc, key in named if key in str(e)), None)
        if located:
            raise ConfigError(f"{located}: {e}") from None
        raise
    finally:
        _CHECKING.reset(token)


def _suggest(word: str, options) -> str:
    # str(): a YAML key such as `3:` loads as a number
    close = difflib.get_close_matches(str(word), list(options), n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


def _meant(name: str) -> tuple[str, str] | None:
    """(our field, why) for a name another trainer uses, or None."""
    if name in MEANT:
        return MEANT[name]
    if name in KEY_ALIASES:
        target = KEY_ALIASES[name]
        return target, f"{flag_of(name)} is accepted as a flag; YAML takes {key_of(target)}"
    return None


def _suggest_flag(flag: str) -> str:
    meant = _meant(flag.lstrip("-").replace("-", "_"))
    if meant:
        return f"; did you mean '{flag_of(meant[0])}'? ({meant[1]})"
    known = [flag_of(n) for n in FIELDS] + [a for v in FLAG_ALIASES.values() for a in v] + ["--config"]
    return _suggest(flag, known)


def _suggest_key(key: str, own) -> str:
    meant = _meant(key)
    if meant:
        return f"; did you mean '{key_of(meant[0])}'? ({meant[1]})"
    hint = _suggest(key, own)
    if not hint and key in FIELDS:
        hint = f"; it belongs in section '{FIELDS[key][0]}'"
    return hint


def _coerce(name: str, value: Any, typ: Any, origin_desc: str) -> Any:
    """Check/convert one value against its annotated type; error names the key or flag."""
    origin = get_origin(typ)
    if origin is Union:
        return _coerce_optional(name, value, typ, origin_desc)
    if origin is Literal:
        if value in NAMED_ELSEWHERE.get(name, {}):
            raise ConfigError(f"{origin_desc}: '{value}' {NAMED_ELSEWHERE[name][value]}")
        return _coerce_choice(value, get_args(typ), origin_desc)
    if typ not in _COERCERS:
        raise AssertionError(f"unhandled type {typ} for {name}")
    return _COERCERS[typ](value, origin_desc)


def _coerce_optional(name: str, value: Any, typ: Any, origin_desc: str) -> Any:
    """Optional[X]: None (or the word none / null, unless X is str) is unset; anything else is an X."""
    args = [a for a in get_args(typ) if a is not type(None)]
    if value is None or (isinstance(value, str) and value.lower() in ("none", "null") and str not in args):
        return None
    return _coerce(name, value, args[0], origin_desc)


def _coerce_choice(value: Any, choices: tuple, origin_desc: str) -> Any:
    if value not in choices:
        raise ConfigError(
            f"{origin_desc}: '{value}' is not one of {', '.join(map(str, choices))}"
            f"{_suggest(str(value), map(str, choices))}"
        )
    return value


_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def _to_bool(value: Any, origin_desc: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in _TRUE + _FALSE:
        return value.lower() in _TRUE
    raise ConfigError(f"{origin_desc}: expected true or false, got {value!r}")


def _to_number(kind: type, what: str, accepted: tuple[type, ...]):
    """int / float from a number or its text; never from a bool (True is 1 to Python, not to a user)."""

    def convert(value: Any, origin_desc: str):
        if isinstance(value, bool) or not isinstance(value, accepted):
            raise ConfigError(f"{origin_desc}: expected {what}, got {value!r}")
        try:
            return kind(value)
        except ValueError:
            raise ConfigError(f"{origin_desc}: expected {what}, got {value!r}") from None

    return convert


def _to_str(value: Any, origin_desc: str) -> str:
    if not isinstance(value, (str, int, float)) or isinstance(value, bool):
        raise ConfigError(f"{origin_desc}: expected a string, got {value!r}")
    return str(value)


def _to_recompute(value: Any, origin_desc: str) -> bool | str:
    if isinstance(value, str) and (value == "auto" or (every_n(value) or 0) >= 1):
        return value
    try:
        return _to_bool(value, origin_desc)
    except ConfigError:
        raise ConfigError(
            f"{origin_desc}: expected true, false, auto or every-N (every N-th block, N >= 1), got {value!r}"
        ) from None


def _to_dict(value: Any, origin_desc: str) -> dict:
    if isinstance(value, str):  # from a flag: JSON
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{origin_desc}: expected a JSON object, {e.msg} at column {e.colno}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{origin_desc}: expected a mapping, got {value!r}")
    return value


def _to_list(value: Any, origin_desc: str) -> list:
    if isinstance(value, str):  # from a flag: comma-separated
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, list):
        raise ConfigError(f"{origin_desc}: expected a list, got {value!r}")
    return value


# The field types a config may use, each with its converter (value, origin_desc) -> value.
_COERCERS = {
    bool: _to_bool,
    int: _to_number(int, "an integer", (int, str)),
    float: _to_number(float, "a number", (int, float, str)),
    str: _to_str,
    dict: _to_dict,
    list: _to_list,
    RecomputeSetting: _to_recompute,
}


class YamlFile(dict):
    """A config file's mapping, with the line each key was written on, so that an error about a value names the
    file and the line: `configs/x.yaml:12: train.lr: expected a number, got 'fast'`."""

    def __init__(self, data: dict, path: str, lines: Mapping[tuple[str, ...], int]):
        super().__init__(data)
        self.path = path
        self.lines = lines  # (section, key, ...) -> 1-based line of that key

    def at(self, *keys: str) -> str:
        """`path:line` of the innermost of these nested keys that the file spells."""
        keys = tuple(map(str, keys))  # a loaded key may be a number or a boolean (`3:`, `yes:`); lines has str()
        for n in range(len(keys), 0, -1):
            if keys[:n] in self.lines:
                return f"{self.path}:{self.lines[keys[:n]]}"
        return self.path


def _key_lines(loader, node, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], int]:
    """(key, nested key, ...) -> 1-based line, for every mapping key in a composed YAML node tree. Keys as
    loaded, then str(): `yes:` is the key True."""
    import yaml

    lines = {}
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            if isinstance(key_node, yaml.ScalarNode):
                keys = prefix + (str(loader.construct_object(key_node)),)
                lines[keys] = key_node.start_mark.line + 1
                lines.update(_key_lines(loader, value_node, keys))
    return lines


def load_yaml(path: str | os.PathLike) -> YamlFile:
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--config: file not found: {p}")
    # Composed first, then constructed: the node tree keeps each key's line (PyYAML's start_mark).
    loader = yaml.SafeLoader(p.read_text())
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
        lines = _key_lines(loader, node)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        loc = f"{p}:{mark.line + 1}: " if mark else f"{p}: "
        column = f" (column {mark.column + 1})" if mark else ""
        raise ConfigError(f"{loc}invalid YAML: {getattr(e, 'problem', None) or e}{column}") from None
    finally:
        loader.dispose()
    if data is None:
        return YamlFile({}, str(p), {})
    if not isinstance(data, dict):
        raise ConfigError(
            f"{p}:{node.start_mark.line + 1}: the top level must be a mapping of sections ({', '.join(SECTIONS)})"
        )
    return YamlFile(data, str(p), lines)


def from_dict(data: dict, source: str = "config") -> Config:
    """A Config from a YAML file's mapping (a YamlFile: errors name its file and line) or any other dict (errors
    name `source`)."""
    at = data.at if isinstance(data, YamlFile) else lambda *keys: source
    given: dict[str, dict[str, Any]] = {}
    origins: dict[str, tuple[str, Any]] = {}
    for section, values in data.items():
        for key, line, value in _section_values(section, values, at):
            given.setdefault(section, {})[key] = value
            if isinstance(data, YamlFile):
                origins[key] = (line, copy.deepcopy(value))
    classes = _section_classes()
    return _with_origins(Config(**{name: classes[name](**given.get(name, {})) for name in SECTIONS}), origins)


def _section_values(section: str, values: Any, at) -> Iterator[tuple[str, str, Any]]:
    """(key, `file:line` or source, the value converted to the key's type) for one section of from_dict's
    mapping; a section or key this config has not is an error that suggests the nearest."""
    if section not in SECTIONS:
        belongs = f"; it belongs in section '{FIELDS[section][0]}'" if section in FIELDS else ""
        raise ConfigError(
            f"{at(section)}: unknown section '{section}'{_suggest(section, SECTIONS) or belongs} "
            f"(sections: {', '.join(SECTIONS)})"
        )
    if values is None:
        return
    if section == "workload":
        values = _workload_section(values, at)
    if section == "peft":
        values = _peft_section(values)
    if not isinstance(values, dict):
        raise ConfigError(f"{at(section)}: section '{section}' must be a mapping, got {values!r}")
    own = {f.name for f in fields(_section_classes()[section])}
    for key, value in values.items():
        if key not in own:
            raise ConfigError(f"{at(section, key)}: unknown key '{section}.{key}'{_suggest_key(key, own)}")
        line = at(*key_of(key).split("."))  # workload.target, as the file spells workload.workload
        yield key, line, _coerce(key, value, FIELDS[key][2], f"{line}: {key_of(key)}")


def _with_origins(cfg: Config, origins: Mapping[str, tuple[str, Any]]) -> Config:
    """cfg, carrying the YAML origins of its values (not a field: set on the instance, as a frozen dataclass's
    own __init__ sets its fields)."""
    object.__setattr__(cfg, "origins", origins)
    return cfg


def replace_sections(cfg: Config, **sections: Any) -> Config:
    """A new Config with these sections (by name) in place of cfg's; cfg is left as it was, and the YAML
    origins go along, so that an error about a value still as the file set it names the file's line."""
    return _with_origins(dataclasses.replace(cfg, **sections), cfg.origins)


def replace_fields(cfg: Config, **values: Any) -> Config:
    """A new Config with these fields replaced, by their names (unique across sections: `max_length=64`, not
    `data.max_length`); cfg is left as it was. The values are taken as given: not converted, not checked."""
    by_section: dict[str, dict[str, Any]] = {}
    for name, value in values.items():
        by_section.setdefault(FIELDS[name][0], {})[name] = value
    return replace_sections(
        cfg, **{section: dataclasses.replace(getattr(cfg, section), **v) for section, v in by_section.items()}
    )


def _peft_section(values) -> Any:
    """`peft: lora` or `{method: lora, lora_r: 16, ...}` -> the section's own field names."""
    if isinstance(values, str):
        return {"peft": values}
    if isinstance(values, dict) and "method" in values:
        return {("peft" if k == "method" else k): v for k, v in values.items()}
    return values


def _workload_section(values, at) -> dict:
    """`workload: my_pkg.tasks:MyTask` or `{target: ..., args: {...}}` -> the section's own field names.
    (A config saved by a run, to_dict(), already uses those names.)"""
    if isinstance(values, str):
        return {"workload": values}
    if not isinstance(values, dict):
        raise ConfigError(f"{at('workload')}: workload must be 'module:Class' or a mapping with target and args")
    renamed = {}
    for key, value in values.items():
        own = {"target": "workload", "args": "workload_args"}.get(key, key)
        if own not in ("workload", "workload_args"):
            raise ConfigError(
                f"{at('workload', key)}: unknown key 'workload.{key}'"
                f"{_suggest(key, ['target', 'args'])} (keys: target, args)"
            )
        renamed[own] = value
    return renamed


class _OneLineParser(argparse.ArgumentParser):
    """argparse would print the whole usage (70 lines) and exit; a ConfigError is one line, exit 2."""

    def error(self, message):
        hint = "; for a negative value write it as --flag=-1e-3" if "expected one argument" in message else ""
        raise ConfigError(f"{message}{hint} (shardtrain train --help lists every flag)")


# `shardtrain train` only: what to do with the settings, not one of them (no YAML key, not in the saved config).
CHECK_ONLY = "--check-only"


def build_arg_parser(prog: str = "shardtrain train", check_only: bool = False) -> argparse.ArgumentParser:
    parser = _OneLineParser(prog=prog, description="Train with DDP, FSDP or DeepSpeed ZeRO.", allow_abbrev=False)
    parser.add_argument("--config", help="YAML config file (sections: " + ", ".join(SECTIONS) + ")")
    if check_only:
        parser.add_argument(
            CHECK_ONLY,
            action="store_true",
            help="make every check that runs before any process starts (flags, config, the files and data they "
            "name, the output folder) and exit: 0 when all pass, else 2 with the first problem; nothing is "
            "launched, loaded or written (a login node's seconds instead of a queued job's failure)",
        )
    for name, (_section, _f, typ) in FIELDS.items():
        names = [flag_of(name)] + FLAG_ALIASES.get(name, [])
        if typ in (bool, Optional[bool], RecomputeSetting):
            # `--activation-checkpointing` alone means true; `--activation-checkpointing false` also works.
            choices = "{true,false,auto,every-N}" if typ is RecomputeSetting else "{true,false}"
            parser.add_argument(
                *names, dest=name, nargs="?", const="true", default=None, metavar=choices, help=help_of(name)
            )
        else:
            parser.add_argument(*names, dest=name, default=None, metavar=_choices(typ), help=help_of(name))
    return parser


def _choices(typ: Any) -> str | None:
    """`{fp32,bf16,fp16}` for a Literal (checked by _coerce, which names the flag); None: argparse's NAME."""
    args = [a for a in get_args(typ) if a is not type(None)] if get_origin(typ) is Union else [typ]
    if get_origin(args[0]) is Literal:
        return "{" + ",".join(get_args(args[0])) + "}"
    return None


def help_of(name: str) -> str:
    """A flag's `--help` line: its description (the field's `setting` help), default and YAML key."""
    _, f, _ = FIELDS[name]
    default = f.default_factory() if f.default is dataclasses.MISSING else f.default
    described = f.metadata.get("help", "").replace("{builtins}", ", ".join(BUILTIN_WORKLOADS))
    if default is None and "unset:" in described:
        shown = described  # it says what unset means
    else:
        shown = f"{described}; default: {_shown(default)}" if described else f"default: {_shown(default)}"
    return f"{shown} (YAML {key_of(name)})".replace("%", "%%")  # argparse %-formats help texts


def _shown(value: Any) -> str:
    """A default as a user would write it on the command line."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return ",".join(map(str, value)) or "none"
    if isinstance(value, dict):
        return json.dumps(value)
    if isinstance(value, str) and (not value or value.isspace()):
        return repr(value)
    return str(value)


def _dashed_flag(arg: str) -> str:
    """`--per_device_batch_size[=8]` -> `--per-device-batch-size[=8]`; values are left alone."""
    if not arg.startswith("--") or "_" not in arg.split("=", 1)[0]:
        return arg
    name, sep, value = arg.partition("=")
    return "--" + name[2:].replace("_", "-") + sep + value


def wants_check_only(argv: list[str]) -> bool:
    return any(_dashed_flag(a) == CHECK_ONLY for a in argv)


def parse_cli(argv: list[str], check_only: bool = False) -> Config:
    """`shardtrain train`'s flags (and a --config file under them) as a validated Config: the YAML, then the
    flags, then SageMaker's environment for what neither set, then validate()'s resolution. `check_only`: the
    parser also takes train's --check-only (the caller acts on it: wants_check_only)."""
    parser = build_arg_parser(check_only=check_only)
    # SageMaker passes hyperparameter names verbatim: `--per_device_batch_size 8` must work too.
    dashed = [_dashed_flag(a) for a in argv]
    args, unknown = parser.parse_known_args(dashed)
    if unknown:
        _reject_unknown_argument(argv, dashed, unknown[0])
    data = load_yaml(args.config) if args.config else {}
    add_import_paths(args.config)  # a tasks.py beside the config imports on every rank
    cfg = from_dict(data, source=f"--config {args.config}" if args.config else "config")
    flags = _flag_values(args)
    cfg = replace_fields(cfg, **flags)
    # SageMaker's channels and folders fill in what neither a flag nor a hyperparameter set.
    cfg, _ = with_sagemaker_env(cfg, explicit=set(flags))
    cfg = replace_sections(cfg, parallel=resolve_shipped_ds_config(cfg.parallel))
    explicit_strategy = args.strategy is not None or "strategy" in (data.get("parallel") or {})
    cfg = replace_sections(cfg, parallel=_ds_selects_deepspeed(cfg.parallel, explicit_strategy))
    return validate(cfg)


def _reject_unknown_argument(argv: list[str], dashed: list[str], flag: str) -> None:
    """The first argument parse_cli does not know, quoted as typed, with the nearest flag (or, under
    SageMaker, hyperparameter) suggested."""
    as_typed = argv[dashed.index(flag)] if flag in dashed else flag
    hint = _suggest_flag(flag.split("=")[0])
    from shardtrain.config.sagemaker_env import hyperparameter_hint, in_sagemaker

    if in_sagemaker(os.environ):  # the user wrote a hyperparameter, not a flag: name theirs
        raise ConfigError(f"unknown hyperparameter '{as_typed.lstrip('-')}'{hyperparameter_hint(hint)}")
    raise ConfigError(f"unknown argument '{as_typed}'{hint}")


def _flag_values(args: argparse.Namespace) -> dict[str, Any]:
    """field name -> value, converted to the field's type, for each flag given (in the fields' order, which
    is the order their errors are found in)."""
    given = {name: getattr(args, name) for name in FIELDS if getattr(args, name) is not None}
    return {name: _coerce(name, value, FIELDS[name][2], flag_of(name)) for name, value in given.items()}


def _ds_selects_deepspeed(p: ParallelConfig, explicit_strategy: bool) -> ParallelConfig:
    """`--ds FILE` alone means DeepSpeed; combined with another explicit strategy it is a contradiction."""
    if not p.ds:
        return p
    if explicit_strategy and p.strategy not in ("deepspeed",):
        raise ConfigError(f"--ds {p.ds} selects DeepSpeed, but --strategy is '{p.strategy}': drop one of them")
    return dataclasses.replace(p, strategy="deepspeed")


def logs_model_artifact(log: LogConfig) -> bool:
    """--wandb-log-model, else HF's WANDB_LOG_MODEL: "end" (or the older "true"); "checkpoint" gets the final
    model too, since shardtrain's checkpoints are sharded per strategy and an artifact should load anywhere."""
    if "wandb" not in log.report_to:
        return False
    if log.wandb_log_model is not None:
        return log.wandb_log_model
    return os.environ.get("WANDB_LOG_MODEL", "false").strip().lower() in ("end", "true", "checkpoint")


# The workloads the package ships, by name -> `module:Class` (filled by ship()).
BUILTIN_WORKLOADS: dict[str, str] = {}


def record_kinds() -> tuple[str, str]:
    """The jsonl records' two kinds, as make-data and check-data --kind spell them: with an image each, and without."""
    return shipped().image_records, shipped().text_records


def record_kind_aliases() -> Mapping[str, str]:
    """Other names a user may mean by one of the records' kinds (a workload's name for its records)."""
    return shipped().record_kind_aliases


def workload_target(cfg: Config) -> str:
    """`module:Class`, from --workload (workload.target), else the built-in that model.name names."""
    name = cfg.workload.workload or cfg.model.name
    return BUILTIN_WORKLOADS.get(name, name)


def recorded_workload_target(config: Mapping) -> str | None:
    """workload_target of a config as a run recorded it (a dict: summary.json's, a checkpoint's); None if it names
    none."""
    name = (config.get("workload") or {}).get("workload") or (config.get("model") or {}).get("name")
    return BUILTIN_WORKLOADS.get(name, name) if name else None


def is_builtin_workload(cfg: Config) -> bool:
    """The built-ins read jsonl records from data.data_dir and a text model from the hub; a user's workload
    brings its own data and model, so those checks are not run for it."""
    return workload_target(cfg) in BUILTIN_WORKLOADS.values()


def reads_images(cfg: Config) -> bool:
    """Whether the configured model reads an image per sample."""
    return shipped().reads_images(cfg)


def pad_multiple(cfg: Config) -> int | None:
    """Texts are padded to a multiple of this many tokens; None: no such rule."""
    return shipped().pad_multiple(cfg)


def hub_fields(cfg: Config) -> dict[str, str | None]:
    """field -> the hub name (or folder) it gives, for what the run loads by name: the shipped workloads' (their
    pretrained model), and the tokenizer (runtime/hub.py checks them before launch)."""
    return {**shipped().hub_names(cfg), "tokenizer": cfg.data.tokenizer}


def without_download(cfg: Config, field: str) -> str:
    """The way to train with nothing downloaded, for a new user offline, when `field`'s hub name is not at hand."""
    return shipped().without_download(cfg, field)


def add_import_paths(config_path: str | None) -> None:
    """The config file's folder (a tasks.py beside the YAML) and the working directory, where --workload's
    module is imported from, on every rank."""
    import sys

    for folder in ([str(Path(config_path).resolve().parent)] if config_path else []) + [os.getcwd()]:
        if folder not in sys.path:
            sys.path.insert(0, folder)


def add_workload_flags(parser) -> None:
    """--workload and --workload-args, spelled as `train` spells them, for the commands that are not `train`
    (plan, check-data, export, report): read into a Config by command_config()."""
    parser.add_argument(
        flag_of("workload"),
        dest="workload",
        default=None,
        help="my_pkg.tasks:MyTask, or a built-in: " + ", ".join(BUILTIN_WORKLOADS),
    )
    parser.add_argument(
        flag_of("workload_args"),
        dest="workload_args",
        default=None,
        help="the workload's keyword arguments as JSON (YAML workload.args)",
    )


def command_config(config_path: str | None, workload: str | None = None, workload_args: str | None = None) -> Config:
    """A command's Config: the YAML (if any) with --workload / --workload-args over it, their modules importable
    from the config's folder and the working directory as in training. Not validated: each command checks
    what it uses."""
    if config_path is not None and not Path(config_path).is_file():
        raise ConfigError(f"--config: file not found: {config_path}")
    cfg = from_dict(
        load_yaml(config_path) if config_path else {}, source=f"--config {config_path}" if config_path else "config"
    )
    add_import_paths(config_path)
    given = {"workload": workload, "workload_args": workload_args}
    flags = {name: _coerce(name, v, FIELDS[name][2], flag_of(name)) for name, v in given.items() if v is not None}
    return shipped().named_by_workload(replace_fields(cfg, **flags))


def with_sagemaker_env(
    cfg: Config, explicit: set[str], env: Mapping[str, str] | None = None
) -> tuple[Config, dict[str, str]]:
    """cfg filled from the SageMaker environment (config/sagemaker_env.py), leaving fields in `explicit` (set
    by a flag) alone, as a new Config, and what was applied; outside SageMaker, cfg itself and nothing."""
    from shardtrain.config.sagemaker_env import check_checkpoints_shared, check_hosts, in_sagemaker, sagemaker_settings

    env = os.environ if env is None else env
    if not in_sagemaker(env):
        return cfg, {}
    check_hosts(env)
    applied = {name: value for name, value in sagemaker_settings(env).items() if name not in explicit}
    # Files, a hub dataset or an image folder named by a hyperparameter (or the YAML) are the data, which may
    # sit inside the channels: the channels are then not the jsonl layout that --data-dir reads.
    other_source = next((n for n in ("train_file", "dataset_name", "train_dir") if value_of(cfg, n)), None)
    unmapped = [n for n in ("data_dir", "eval_data_dir") if n in applied] if other_source else []
    for name in unmapped:
        del applied[name]
    if "output_dir" in applied:  # the instance's checkpoint folder, not a path the user chose
        check_checkpoints_shared(env, applied["output_dir"])
    # parse_cli runs on every rank; RANK is unset in a plain process, which is rank 0 too.
    if (applied or unmapped) and env.get("RANK", "0") == "0":
        line = ", ".join(f"{k}={v}" for k, v in applied.items())
        if unmapped:
            channels = ", ".join({"data_dir": "train", "eval_data_dir": "validation"}[n] for n in unmapped)
            line += f" (channels {channels} not mapped to --data-dir: {flag_of(other_source)} names the data)"
        print(f"shardtrain: SageMaker environment: {line}", flush=True)
    return replace_fields(cfg, **applied), applied


def resolve_shipped_ds_config(p: ParallelConfig) -> ParallelConfig:
    """`--strategy zero3` -> strategy deepspeed with ds_configs/zero3.json, as a new section (p is left as it
    was); another --ds beside it contradicts it."""
    shipped = SHIPPED_DS_CONFIGS.get(p.strategy)
    if shipped is None:
        return p
    if p.ds and Path(p.ds).resolve() != shipped:
        raise ConfigError(
            f"--strategy {p.strategy} means {shipped}, but {where('ds')} is {p.ds}: drop one of them "
            f"(--ds FILE alone selects DeepSpeed with FILE)"
        )
    if not shipped.is_file():
        raise ConfigError(
            f"--strategy {p.strategy}: {shipped} is missing from this installation; "
            f"pass your own DeepSpeed JSON with --ds FILE"
        )
    return dataclasses.replace(p, strategy="deepspeed", ds=str(shipped))


def validate(cfg: Config) -> Config:
    """Checks that need no process group, model or data; each error names its flag and key, or the file and
    line of a value from a YAML file. Returns the resolved config, a new one (cfg is left as it was): the
    built-in that --workload names as model.name, a shipped --strategy as its DeepSpeed file, and the defaults
    that depend on other settings (num_labels, the tokenizer, MVSA's validation share, the NaN steps sorted)."""
    with located_errors(cfg):
        return _validate(cfg)


def _validate(cfg: Config) -> Config:
    """The checks in a fixed order (a config with several errors reports the first that fails), each resolution
    step before the checks that read its value."""
    cfg = shipped().named_by_workload(cfg)
    cfg = replace_sections(cfg, parallel=resolve_shipped_ds_config(cfg.parallel))  # plan comes here, not via parse_cli
    _check_streaming_source(cfg.data)
    cfg = _with_default_num_labels(cfg)
    check_positive(cfg, *POSITIVE)
    _check_lr(cfg.train)
    _check_lr_multipliers(cfg.train)
    profile_range(cfg.log.profile_steps, cfg.train.max_steps)
    check_not_negative(cfg, *NOT_NEGATIVE)
    _check_best_metric(cfg.train)
    _check_early_stopping(cfg.train, cfg.checkpoint, cfg.log)
    _check_unfreeze_at_step(cfg.model, cfg.train)
    _check_lora(cfg)
    cfg = replace_fields(cfg, inject_nan_at_steps=_nan_steps(cfg.train.inject_nan_at_steps))
    shipped().check(cfg)
    _check_deepspeed_file(cfg.parallel)
    _check_auto_recompute(cfg)
    _check_nproc(cfg.parallel.nproc)
    check_not_negative(cfg, "memory_every")
    _check_engine_features(cfg)
    _check_oom_injection(cfg.train)
    check_positive(cfg, "memory_budget_gb")
    _check_data_settings(cfg)
    if cfg.data.dataset_format is not None:
        cfg = _with_layout_defaults(cfg)
        check_dataset_format(cfg)
    _check_checkpoint_paths(cfg.checkpoint)
    cfg = replace_fields(cfg, report_to=resolve_report_to(cfg.log.report_to))
    cfg = shipped().with_dependent_defaults(cfg)
    check_output_dir(cfg.checkpoint.output_dir)
    return cfg


# Checked in this order (the first that fails is the error): numbers that must be > 0, and >= 0. An unset
# optional one (eval_batch_size, num_labels) is not checked.
POSITIVE = (
    "max_steps",
    "per_device_batch_size",
    "grad_accum",
    "max_length",
    "image_size",
    "max_bad_steps",
    "log_every",
    "keep_last",
    "dist_timeout",
    "eval_batch_size",
    "num_labels",
    "early_stopping_patience",
    "lora_r",
    "lora_alpha",
    "max_tokens_per_batch",
)
NOT_NEGATIVE = (
    "weight_decay",
    "warmup_steps",
    "max_grad_norm",
    "eval_every",
    "save_every",
    "freeze_layers",
    "num_workers",
)
# The sources read into memory, which a streamed train.jsonl cannot be combined with.
IN_MEMORY_SOURCES = ("dataset_name", "train_file", "train_dir", "dataset_format")


def value_of(cfg: Config, name: str) -> Any:
    """A setting's value by its field name, whichever section holds it."""
    return getattr(getattr(cfg, FIELDS[name][0]), name)


def check_positive(cfg: Config, *names: str) -> None:
    for name in names:
        value = value_of(cfg, name)
        if value is not None and value <= 0:
            raise ConfigError(f"{where(name)} must be positive, got {value}")


def check_not_negative(cfg: Config, *names: str) -> None:
    for name in names:
        value = value_of(cfg, name)
        if value is not None and value < 0:
            raise ConfigError(f"{where(name)} must be >= 0, got {value}")


def _check_lr(t: TrainConfig) -> None:
    if not t.lr > 0:  # not `<= 0`: NaN is refused too
        raise ConfigError(f"{where('lr')} must be positive, got {t.lr}")


def _check_lr_multipliers(t: TrainConfig) -> None:
    """The values here; whether each key names a part of the model is known once it is built (strategies/optim.py)."""
    for part, factor in t.lr_multipliers.items():
        if not part.strip():
            raise ConfigError(f"{where('lr_multipliers')}: an empty part name")
        # bool is an int: `text: true` is a typo, not a factor of 1
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 <= factor < float("inf"):
            raise ConfigError(f"{where('lr_multipliers')}: the factor of '{part}' must be a number >= 0: {factor!r}")


def profile_range(text: str | None, max_steps: int) -> tuple[int, int] | None:
    """--profile-steps A-B (or N) -> (A, B), the first and last optimizer step profiled; None: no profile."""
    if text is None:
        return None
    first, _, last = str(text).strip().partition("-")
    try:
        a, b = int(first), int(last or first)
    except ValueError:
        raise ConfigError(f"{where('profile_steps')}: '{text}' is not a step range A-B (e.g. 5-7) or a step") from None
    if not 1 <= a <= b:
        raise ConfigError(f"{where('profile_steps')}: '{text}' must be steps A-B with 1 <= A <= B")
    if b > max_steps:
        raise ConfigError(f"{where('profile_steps')}: '{text}' ends after the run's last step ({where('max_steps')} "
                          f"is {max_steps})")  # fmt: skip
    return a, b


def tracks_best(t: TrainConfig) -> bool:
    """A best checkpoint is kept (loop/best.py): a metric is named, or early stopping needs one."""
    return t.metric_for_best_model is not None or t.early_stopping_patience is not None


def _check_best_metric(t: TrainConfig) -> None:
    """Whether the name is one of the workload's metrics is known at the first evaluation (loop/best.py)."""
    if t.metric_for_best_model is not None and not t.metric_for_best_model.strip():
        raise ConfigError(f"{where('metric_for_best_model')} must name a metric, e.g. accuracy")
    if not t.early_stopping_threshold >= 0:  # not `< 0`: NaN is refused too
        raise ConfigError(f"{where('early_stopping_threshold')} must be >= 0, got {t.early_stopping_threshold}")


def _check_early_stopping(t: TrainConfig, c: CheckpointConfig, log: LogConfig) -> None:
    """The best checkpoint is chosen at the evaluations during training: --eval-every 0 has none."""
    asked = "early_stopping_patience" if t.early_stopping_patience is not None else "metric_for_best_model"
    if tracks_best(t) and t.eval_every == 0:
        raise ConfigError(
            f"{where(asked)} decides at the evaluations during training, and {where('eval_every')} is 0 "
            f"(only at the end): set --eval-every N"
        )
    if c.final_model_checkpoint == "best" and not tracks_best(t):
        raise ConfigError(
            f"{where('final_model_checkpoint')} best: no best checkpoint is kept; set "
            f"--metric-for-best-model NAME (or --early-stopping-patience N)"
        )
    if c.final_model_checkpoint == "best" and not c.final_model_dir and not logs_model_artifact(log):
        # It was a silent no-op: HF's load_best_model_at_end users expect the best model somewhere.
        raise ConfigError(
            f"{where('final_model_checkpoint')} best chooses what --final-model-dir gets, and none is set (SageMaker "
            f"sets it): set --final-model-dir DIR, or after the run `shardtrain export RUN DIR --checkpoint best`"
        )


def _check_lora(cfg: Config) -> None:
    p = cfg.peft
    defaults = PeftConfig()
    unused = next(
        (f.name for f in fields(p) if f.name != "peft" and getattr(p, f.name) != getattr(defaults, f.name)), None
    )
    if p.peft is None and unused:
        raise ConfigError(
            f"{where(unused)} configures the adapters of {flag_of('peft')} lora, which is unset: add --peft lora "
            f"(a build_model that returns its own PeftModel brings its own LoraConfig)"
        )
    if not 0 <= p.lora_dropout < 1:
        raise ConfigError(f"{where('lora_dropout')} must be in [0, 1), got {p.lora_dropout}")
    if p.peft and cfg.model.freeze_layers:
        raise ConfigError(
            f"{where('freeze_layers')}: {where('peft')} already freezes every weight of the model but its "
            f"adapters (and modules_to_save): drop one of them"
        )


def _check_streaming_source(d: DataConfig) -> None:
    for name in ("group_by_length", "max_tokens_per_batch"):
        if d.streaming and getattr(d, name):
            raise ConfigError(
                f"{where(name)} needs every training text's length before the epoch starts, which "
                f"{where('streaming')} does not read ahead: use one or the other"
            )
    other = next((f for f in IN_MEMORY_SOURCES if getattr(d, f)), None)
    if d.streaming and other:
        raise ConfigError(
            f"{where('streaming')}: streams the jsonl --data-dir layout's train.jsonl; "
            f"{where(other)} is read into memory (drop one of them)"
        )


def _with_default_num_labels(cfg: Config) -> Config:
    """The jsonl --data-dir layout's integer labels do not say how many classes there are: 3. Other sources'
    labels do (shardtrain/data/sources.py takes it from them)."""
    d = cfg.data
    if cfg.model.num_labels is not None or d.dataset_name or d.train_file or d.train_dir:
        return cfg
    return replace_fields(cfg, num_labels=3)


def _check_unfreeze_at_step(m: ModelConfig, t: TrainConfig) -> None:
    if m.unfreeze_at_step is None:
        return
    if m.freeze_layers == 0:
        raise ConfigError(f"{where('unfreeze_at_step')} is set but {where('freeze_layers')} is 0: nothing to unfreeze")
    if not 0 < m.unfreeze_at_step <= t.max_steps:
        raise ConfigError(
            f"{where('unfreeze_at_step')}={m.unfreeze_at_step} is outside 1..max_steps "
            f"({t.max_steps}): the frozen layers would never train"
        )


def _nan_steps(steps: list) -> list[int]:
    """--inject-nan-at-steps as sorted, distinct step numbers."""
    try:
        return sorted({int(v) for v in steps})
    except (TypeError, ValueError):
        raise ConfigError(f"{where('inject_nan_at_steps')} must be step numbers, e.g. 3,4; got {steps!r}") from None


def _check_deepspeed_file(p: ParallelConfig) -> None:
    if p.strategy == "deepspeed" and not p.ds:
        raise ConfigError(
            f"--strategy deepspeed needs {where('ds')}, e.g. --ds ds_configs/zero2.json "
            f"(or --strategy zero2 for that shipped file)"
        )
    if p.ds and not Path(p.ds).is_file():
        raise ConfigError(f"{where('ds')}: file not found: {p.ds}")


def _check_auto_recompute(cfg: Config) -> None:
    """--activation-checkpointing auto fits the blocks to a device's memory: on CPU there is none to fit. (Whether
    the workload can predict its activations is checked where the workload is known: workloads/base.py
    check_planned_settings.)"""
    if cfg.train.activation_checkpointing != "auto":
        return
    if cfg.parallel.device == "cpu" and cfg.parallel.memory_budget_gb is None:
        raise ConfigError(
            f"{where('activation_checkpointing')}=auto on cpu needs {where('memory_budget_gb')}: there is no "
            f"device memory to fit"
        )


def _check_nproc(nproc: str) -> None:
    if nproc == "auto":
        return
    try:
        if int(nproc) < 1:
            raise ValueError
    except ValueError:
        raise ConfigError(f"{where('nproc')} must be 'auto' or a positive integer, got {nproc!r}") from None


def _check_engine_features(cfg: Config) -> None:
    """What only some strategies have: DeepSpeed's own checkpoint files, and torch.compile (not DeepSpeed)."""
    p, t = cfg.parallel, cfg.train
    if cfg.checkpoint.engine_files and p.strategy in ("ddp", "fsdp"):
        raise ConfigError(
            f"{where('engine_files')} asks for DeepSpeed's own checkpoint files; --strategy "
            f"{p.strategy} writes only the portable form (model_optim/): drop it, or run a ZeRO strategy"
        )
    if t.compile != "none" and p.strategy == "deepspeed":
        raise ConfigError(
            f"{where('compile')}={t.compile} is wired up for --strategy ddp and fsdp only, "
            f"not DeepSpeed; drop --compile or use ddp/fsdp"
        )


def _check_oom_injection(t: TrainConfig) -> None:
    """The test-only out-of-memory faults: a size, and POINT@STEP:RANK specs."""
    if t.inject_oom_above is not None and t.inject_oom_above < 0:
        raise ConfigError(f"{where('inject_oom_above')} must be >= 0, got {t.inject_oom_above}")
    for spec in t.inject_oom:
        if not re.fullmatch(r"(forward|alloc|backward|recompute|step)@[1-9][0-9]*:[0-9]+", str(spec)):
            raise ConfigError(
                f"{where('inject_oom')}: {spec!r} is not POINT@STEP:RANK with POINT one of forward, "
                f"alloc, backward, recompute, step (e.g. forward@2:1)"
            )


def _check_data_settings(cfg: Config) -> None:
    """The data section's own settings: preprocessing processes, the validation folder."""
    d = cfg.data
    if d.preprocessing_num_workers is not None and d.preprocessing_num_workers < 1:
        raise ConfigError(
            f"{where('preprocessing_num_workers')} must be a positive number of processes, "
            f"got {d.preprocessing_num_workers}"
        )
    if d.eval_data_dir is not None and not Path(d.eval_data_dir).is_dir():
        raise ConfigError(f"{where('eval_data_dir')}: folder not found: {d.eval_data_dir}")


def _with_layout_defaults(cfg: Config) -> Config:
    """MVSA has no validation split, and the reports evaluate on it: 10% of train unless given."""
    d = cfg.data
    if d.dataset_format.startswith("mvsa") and d.validation_split_percentage is None:
        return replace_fields(cfg, validation_split_percentage=10)
    return cfg


def check_dataset_format(cfg: Config) -> None:
    """What a published layout cannot be combined with; its files are checked later, in data/precheck.py."""
    d = cfg.data
    fmt = f"{flag_of('dataset_format')} {d.dataset_format} ({key_of('dataset_format')})"
    if d.eval_data_dir is not None:
        raise ConfigError(f"{fmt}: the layout's own files give its validation split; drop {where('eval_data_dir')}")


# --report-to's loggers (observability/loggers.py opens them), each with the module whose presence `all` asks for.
REPORTERS = {"wandb": "wandb", "tensorboard": "tensorboard", "mlflow": "mlflow"}


def resolve_report_to(names: list, env: Mapping[str, str] | None = None) -> list[str]:
    """--report-to as HF's TrainingArguments reads it: none (or nothing) -> [], all -> each logger whose package
    is installed (MLflow unless DISABLE_MLFLOW_INTEGRATION=TRUE, as HF's all), else the names, in order, once."""
    import importlib.util

    env = os.environ if env is None else env
    wanted = [str(n).strip().lower() for n in names if str(n).strip()]
    for name in wanted:
        if name not in (*REPORTERS, "none", "all"):
            choices = [*REPORTERS, "none", "all"]
            raise ConfigError(
                f"{where('report_to')}: '{name}' is not one of {', '.join(choices)}{_suggest(name, choices)}"
            )
    if len(wanted) > 1 and {"none", "all"} & set(wanted):
        raise ConfigError(f"{where('report_to')}: none and all stand alone, got {','.join(wanted)}")
    if wanted == ["all"]:
        mlflow_off = env.get("DISABLE_MLFLOW_INTEGRATION", "false").upper() == "TRUE"
        return [
            name
            for name, module in REPORTERS.items()
            if importlib.util.find_spec(module) is not None and not (name == "mlflow" and mlflow_off)
        ]
    return [] if wanted == ["none"] else list(dict.fromkeys(wanted))


def _check_checkpoint_paths(c: CheckpointConfig) -> None:
    if c.final_model_dir is not None and Path(c.final_model_dir).is_file():
        raise ConfigError(f"{where('final_model_dir')}: {c.final_model_dir} is a file, not a folder")
    if c.resume not in ("auto", "none") and not Path(c.resume).exists():
        raise ConfigError(f"{where('resume')}: checkpoint not found: {c.resume} (use 'auto', 'none' or a path)")


def check_output_dir(output_dir: str) -> None:
    """Fail now, not after the model and data are built, if the run could not write its outputs.
    Creates nothing: an anonymous temporary file in the nearest existing folder is the probe."""
    import tempfile

    probe = Path(output_dir).absolute()
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(
            f"{where('output_dir')} {output_dir}: {probe} is a file, not a folder; choose another --output-dir"
        )
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as e:
        raise ConfigError(
            f"{where('output_dir')} {output_dir}: cannot write in {probe} ({e.strerror}); "
            f"choose a writable --output-dir"
        ) from None
