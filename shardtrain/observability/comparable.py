"""Whether runs measured the same thing: the settings in which runs may differ before `compare` ranks them or
`parity` compares them step by step.

Read from what each run wrote: summary.json (its resolved config and run block), else, for a run killed
before its summary, the config in its latest committed checkpoint. A setting a run did not record is not
compared for that run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from shardtrain.config.labels import run_config_dict
from shardtrain.config.settings import (
    BUILTIN_WORKLOADS,
    compared_fields,
    flag_of,
    recorded_workload_target,
    section_class,
    shipped_fields,
)
from shardtrain.observability.runlog import RunLog

# Groups, by what a difference breaks:
#   model, data   the runs do different work per sample: neither speed nor memory rank them
#   seed, batch   the same work in another order or grouping: step-by-step losses cannot agree
#   training      optimisation settings: losses differ, throughput and memory still compare
WORKLOAD = ("model", "data")
TRAJECTORY = ("seed", "batch")


@dataclass(frozen=True)
class Setting:
    label: str
    group: str
    path: str  # "config.<section>.<field>" or "run.<key>" (summary.json's run block)
    only_for: str | None = None  # compared only between runs of this model.name (the setting's `read_by`)
    builtin_only: bool = False  # a built-in's own setting: not compared between runs of users' workloads

    @property
    def name(self) -> str:
        field = self.path.rpartition(".")[2]
        return f"{self.label} ({flag_of(field)})" if self.path.startswith("config.") else self.label


def _compared(section: str) -> tuple[Setting, ...]:
    """The section's fields that the config marks as compared (config/settings.py `compared_as`)."""
    return tuple(
        Setting(label, section, f"config.{section}.{name}", read_by, name in shipped_fields())
        for name, label, read_by in compared_fields(section_class(section))
    )


SETTINGS = (
    *_compared("model"),
    # What each run read (data_source's content hash), not the data_dir default a --train-file run never used.
    Setting("data", "data", "run.data_read"),
    *_compared("data"),
    Setting("train examples", "data", "run.train_examples"),
    Setting("eval examples", "data", "run.eval_examples"),
    Setting("seed", "seed", "config.train.seed"),
    Setting("batch geometry (micro x accum x world)", "batch", "run.batch"),
    Setting("precision", "training", "run.precision"),
    Setting("max_steps", "training", "config.train.max_steps"),
    Setting("learning rate", "training", "config.train.lr"),
    Setting("lr multipliers", "training", "config.train.lr_multipliers"),
    Setting("lr schedule", "training", "config.train.lr_scheduler"),
    Setting("warmup", "training", "config.train.warmup_steps"),
    Setting("weight decay", "training", "config.train.weight_decay"),
    Setting("gradient clipping", "training", "config.train.max_grad_norm"),
)


@dataclass
class Difference:
    setting: Setting
    runs_by_value: dict[str, list[str]]  # displayed value -> labels of the runs with it

    def line(self) -> str:
        sides = " vs ".join(f"{value} ({', '.join(labels)})" for value, labels in self.runs_by_value.items())
        return f"runs differ in {self.setting.name}: {sides}"


def recorded_settings(run: RunLog) -> dict | None:
    """{"config": resolved config, "run": run block} as the run wrote them; None when it wrote neither."""
    cfg = run_config_dict(run.summary) if "config" in run.summary else None  # with the data's classes
    info = dict(run.summary.get("run") or {})
    if cfg is None:
        state = _latest_trainer_state(run)
        if state is None:
            return None if not info else {"config": {}, "run": _with_batch(info)}
        cfg = run_config_dict(state)
        train = cfg.get("train") or {}
        info.setdefault("world_size", state.get("world_size"))
        info.setdefault("micro_batch_size", train.get("per_device_batch_size"))
        info.setdefault("grad_accum", train.get("grad_accum"))
        info.setdefault("precision", train.get("precision"))
        info.setdefault("data_source", state.get("data_source"))  # checkpoints record it too
    read = data_read(cfg, info)
    if read is not None:
        info["data_read"] = read
    return {"config": cfg, "run": _with_batch(info)}


def data_read(cfg: dict, info: dict) -> str | None:
    """The data a run read, as one comparable value: the content hash of each split (summary.json's
    data_source.content_sha256, shardtrain/data/sources.py), so that the same rows from another path or source flag
    are the same data; for a run that recorded no hash, the source flag that named its data and its value."""
    source = info.get("data_source") or {}
    hashes = source.get("content_sha256") or {}
    if hashes:
        return "content sha256 " + ", ".join(f"{split} {h[:12]}" for split, h in sorted(hashes.items()))
    data = (cfg or {}).get("data") or {}
    for key in ("dataset_name", "train_file", "train_dir", "dataset_format"):
        if data.get(key):
            extra = [data.get(k) for k in ("dataset_config_name", "validation_file", "validation_dir") if data.get(k)]
            return f"{key} {data[key]}" + (f" ({', '.join(map(str, extra))})" if extra else "")
    if source.get("source") == "workload" or "data_dir" not in data:
        return None  # a workload's own data: its args say what it read (compared as the workload's settings)
    return f"data_dir {data['data_dir']}" + (
        f" (validation {data['eval_data_dir']})" if data.get("eval_data_dir") else ""
    )


def _with_batch(info: dict) -> dict:
    parts = [info.get(k) for k in ("micro_batch_size", "grad_accum", "world_size")]
    if all(p is not None for p in parts):
        info = {**info, "batch": " x ".join(map(str, parts))}
    return info


def _latest_trainer_state(run: RunLog) -> dict | None:
    from shardtrain.checkpointing import store as checkpoint

    try:
        latest = checkpoint.latest_committed(checkpoint.checkpoints_root(run.path))
        return checkpoint.read_trainer_state(latest) if latest is not None else None
    except Exception:  # noqa: BLE001 - an unreadable checkpoint only means these settings are unknown
        return None


_MISSING = object()


def _lookup(settings: dict, path: str):
    node = settings
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _shown(value) -> str:
    return json.dumps(value, sort_keys=True) if isinstance(value, (dict, list)) else str(value)


def differences(runs: list[RunLog]) -> tuple[list[Difference], list[str]]:
    """(one Difference per setting that differs, labels of runs whose settings were not recorded)."""
    recorded = {run.label: recorded_settings(run) for run in runs}
    unknown = [label for label, s in recorded.items() if s is None]
    known = {label: s for label, s in recorded.items() if s is not None}
    out = []
    for setting in SETTINGS:
        by_value: dict[str, list[str]] = {}
        for label, s in known.items():
            model = _lookup(s, "config.model.name")
            if _users_own_workload(s):  # model.name is a default it never read
                if setting.builtin_only:
                    continue
            elif setting.only_for and model is not _MISSING and model != setting.only_for:
                continue
            value = _lookup(s, setting.path)
            if value is not _MISSING:
                by_value.setdefault(_shown(value), []).append(label)
        if len(by_value) > 1:
            out.append(Difference(setting, by_value))
    return out, unknown


def _users_own_workload(settings: dict) -> bool:
    target = recorded_workload_target(settings.get("config") or {})
    return target is not None and target not in BUILTIN_WORKLOADS.values()


def in_groups(diffs: list[Difference], groups) -> list[Difference]:
    return [d for d in diffs if d.setting.group in groups]
