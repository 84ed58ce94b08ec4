"""What a resume changes when its settings differ from the checkpoint's, said in one line, never silently.

Extending a run (a larger --max-steps) is a choice to make visible, not to forbid. The learning-rate
schedule is a function of max_steps, warmup and the peak rate, so a resume with other values follows another
schedule from its first step on. The batch geometry sets how many samples a step takes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from shardtrain.config.settings import Config, ConfigError, flag_of, where
from shardtrain.strategies.optim import lr_lambda

SCHEDULE = ("max_steps", "lr", "warmup_steps", "lr_scheduler")
GEOMETRY = ("per_device_batch_size", "grad_accum")
SAID_WITH_THEIR_EFFECT = {*SCHEDULE, *GEOMETRY, "max_tokens_per_batch", "optim"}
# Every other setting of these sections is named when it differs from the checkpoint's: a resume with another
# --weight-decay, --dropout or --max-length trained on without a word, and summary.json then recorded it.
COMPARED_SECTIONS = ("workload", "model", "peft", "data", "train")
NOT_COMPARED = {
    # where the data is read from: data_changes compares what it holds (a moved file is the same data)
    "data_dir", "eval_data_dir", "train_file", "validation_file", "train_dir", "validation_dir", "image_cache",
    # how batches are loaded and what is reported, not what is trained
    "num_workers", "pin_memory", "preprocessing_num_workers", "log_every", "memory_every",
    # the tests' fault hooks
    "inject_oom_above", "inject_oom", "inject_nan_at_steps",
}  # fmt: skip
# Settings a resume cannot apply, and why.
KEPT_FROM_THE_RUN = {
    "tokenizer_vocab_size": "not applied: the run's trained tokenizer is kept (a new one would renumber the "
    "vocabulary under the checkpoint)",
}


@dataclass
class ResumeChanges:
    changes: list[str]  # one phrase per changed setting, with its effect
    schedule_changed: bool  # the strategy must then take the learning rate from the new schedule

    def line(self, step: int) -> str:
        return f"resuming from step {step} with changed settings: {'; '.join(self.changes)}"


def resume_changes(saved_state: dict, cfg: Config, world_size: int) -> ResumeChanges:
    saved = (saved_state.get("config") or {}).get("train") or {}
    t, step = cfg.train, saved_state["step"]
    optim = saved.get("optim", "adamw")  # checkpoints from before --optim: AdamW
    if optim != t.optim:
        # another optimizer's state has other tensors (or none): nothing of it would carry over, silently
        raise ConfigError(
            f"{where('optim')} {t.optim}, but the checkpoint at step {step} was trained with {optim}, whose state "
            f"does not carry over: resume with --optim {optim}, or train into a new --output-dir"
        )
    changes = [
        f"{flag_of(k)} {saved[k]} -> {getattr(t, k)}" for k in SCHEDULE if k in saved and saved[k] != getattr(t, k)
    ]
    schedule_changed = bool(changes)
    if schedule_changed:
        old = dataclasses.replace(t, **{k: saved[k] for k in SCHEDULE if k in saved})
        changes.append(
            f"the learning rate follows the new schedule: {t.lr * lr_lambda(t)(step):.2e} at step "
            f"{step + 1}, where the saved run's would be {old.lr * lr_lambda(old)(step):.2e}"
        )

    saved_world = int(saved_state.get("world_size", world_size))
    # The flags the saved run was given: an elastic resume ran with another geometry to keep its global batch.
    elastic = saved_state.get("elastic") or {}
    flags = elastic.get("configured") or saved
    geometry = [
        f"{flag_of(k)} {flags[k]} -> {getattr(t, k)}" for k in GEOMETRY if k in flags and flags[k] != getattr(t, k)
    ]
    # A world size change alone keeps the global batch (shardtrain/loop/elastic.py says so); with changed flags
    # the flags set the new one.
    if geometry and saved_world != world_size:
        geometry.append(f"world size {saved_world} -> {world_size}")
    if geometry:
        before = elastic.get("global_batch_size") or (
            flags.get("per_device_batch_size", t.per_device_batch_size)
            * flags.get("grad_accum", t.grad_accum)
            * saved_world
        )
        after = t.per_device_batch_size * t.grad_accum * world_size
        effect = (
            f"global batch {before} -> {after} samples per step"
            if before != after
            else f"global batch unchanged at {after}"
        )
        if saved_world != world_size:
            effect += " (the data position carries over exactly: the epoch's samples seen by all ranks)"
        changes.append(f"{', '.join(geometry)}: {effect}")
    saved_data = (saved_state.get("config") or {}).get("data") or {}
    budget, saved_budget = cfg.data.max_tokens_per_batch, saved_data.get("max_tokens_per_batch")
    if saved_budget and budget and saved_budget != budget:
        changes.append(
            f"{flag_of('max_tokens_per_batch')} {saved_budget} -> {budget}: the rest of the epoch is cut into "
            f"micro-batches of the new budget from the exact next sample"
        )
    changes += setting_changes(saved_state.get("config") or {}, cfg, skip=SAID_WITH_THEIR_EFFECT)
    return ResumeChanges(changes, schedule_changed)


def setting_changes(saved_config: dict, cfg: Config, sections=COMPARED_SECTIONS, skip=frozenset()) -> list[str]:
    """`--flag old -> new` for each setting of `sections` that differs from the checkpoint's config (a dict
    setting: the keys that differ), in the config's order."""
    now = cfg.to_dict()
    changes = []
    for section in sections:
        before, after = saved_config.get(section) or {}, now.get(section) or {}
        for key, new in after.items():
            if key in skip or key in NOT_COMPARED or key not in before or before[key] == new:
                continue
            old = before[key]
            if isinstance(old, dict) and isinstance(new, dict):
                differ = [
                    f"{k} {_shown(old.get(k))} -> {_shown(new.get(k))}"
                    for k in {**old, **new}
                    if old.get(k) != new.get(k)
                ]
                changes.append(f"{flag_of(key)} {', '.join(differ)}")
            else:
                kept = KEPT_FROM_THE_RUN.get(key)
                changes.append(f"{flag_of(key)} {_shown(old)} -> {_shown(new)}" + (f": {kept}" if kept else ""))
    return changes


def _shown(value) -> str:
    return "unset" if value is None else str(value)


def data_changes(saved_state: dict, data_source: dict | None) -> list[str]:
    """The data a resume reads against the data its checkpoint was trained on, by content (data_source's
    content_sha256, shardtrain/data/sources.py): another file of the same rows is the same data; the same path
    with other rows is not. Checkpoints that recorded no hash are not compared."""
    before = ((saved_state.get("data_source") or {}).get("content_sha256")) or {}
    now = ((data_source or {}).get("content_sha256")) or {}
    changes = []
    for split in ("train", "validation"):
        if before.get(split) and now.get(split) and before[split] != now[split]:
            rows = ((saved_state.get("data_source") or {}).get("rows") or {}).get(split)
            rows_now = ((data_source or {}).get("rows") or {}).get(split)
            counts = f", {rows} -> {rows_now} rows" if rows is not None and rows_now is not None else ""
            where = (data_source or {}).get(split) or (data_source or {}).get("source")
            changes.append(
                f"the {split} data changed (content sha256 {before[split][:12]} -> {now[split][:12]}"
                f"{counts}; now {where})"
            )
    return changes
