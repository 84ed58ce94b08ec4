"""The best checkpoint and early stopping: --metric-for-best-model, --greater-is-better, --early-stopping-patience
and --early-stopping-threshold, with HF Trainer's meaning, decided at each --eval-every evaluation.

HF's rule (`Trainer._determine_best_metric` and `EarlyStoppingCallback.check_metric_value`), compared with the best
value before this evaluation:
    a new best       the value is strictly better than the best so far (any amount): its step is saved and
                     becomes checkpoints/best
    an improvement   a new best by more than the threshold: the patience count goes back to 0; any other
                     evaluation adds 1 to it, and the run stops once the count reaches the patience
A non-finite value (NaN, inf) is never a new best nor an improvement, the first evaluation's included. The first
finite value is a new best and an improvement.

Every rank decides alike, with no collective of its own: the metrics are computed from sums that
`loop/evaluate.py` all-reduces, so every rank holds the same float64 sums bit for bit (an all-reduce hands every
rank the same result) and runs the same `Workload.metrics` on them; `judge` below is a pure function of those
numbers and of the restored record. Every rank therefore saves, and stops, at the same step: nothing is decided
on rank 0 alone and broadcast.

The record (best step, best value, patience count) is part of every checkpoint's trainer_state.json (`best`), so
it survives kill -9, a Slurm requeue and an elastic resize like the data position does.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass

from shardtrain.checkpointing import store as checkpoint
from shardtrain.config.settings import ConfigError, TrainConfig, flag_of, tracks_best, where


@dataclass(frozen=True)
class Record:
    """What a checkpoint keeps of the choice so far (trainer_state.json `best`)."""

    metric: str
    greater_is_better: bool
    step: int | None = None  # None: no finite value yet
    value: float | None = None
    evals_without_improvement: int = 0  # HF's early_stopping_patience_counter

    @classmethod
    def from_state(cls, saved: dict | None) -> Record | None:
        if not saved:
            return None
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in saved.items() if k in names})


def judge(record: Record, step: int, value: float, threshold: float) -> Record:
    """The record after an evaluation at `step` gave `value` (HF's rule, module docstring). Pure."""
    if not math.isfinite(value):
        return dataclasses.replace(record, evals_without_improvement=record.evals_without_improvement + 1)
    if record.value is None:
        return dataclasses.replace(record, step=step, value=value, evals_without_improvement=0)
    better = value > record.value if record.greater_is_better else value < record.value
    improved = better and abs(value - record.value) > threshold
    return dataclasses.replace(
        record,
        step=step if better else record.step,
        value=value if better else record.value,
        evals_without_improvement=0 if improved else record.evals_without_improvement + 1,
    )


def default_greater_is_better(metric: str) -> bool:
    """HF TrainingArguments' default: greater is better unless the name ends in "loss"."""
    return not metric.endswith("loss")


def stopped_early(state: dict, t: TrainConfig) -> bool:
    """A checkpoint whose patience count has reached --early-stopping-patience: the run stopped there (a requeued
    or restarted job trains nothing more; a larger patience, or none, trains on)."""
    count = (state.get("best") or {}).get("evals_without_improvement", 0)
    return t.early_stopping_patience is not None and count >= t.early_stopping_patience


class BestCheckpoint:
    """The Trainer's part: `observe` after each evaluation (every rank), `saves_at` / `stop` for the loop,
    `checkpoint_state` for trainer_state.json and `summary` for summary.json."""

    def __init__(self, t: TrainConfig, saved: dict | None, task: str, console):
        self.on = tracks_best(t)
        self.asked, self.greater_asked = t.metric_for_best_model, t.greater_is_better
        self.patience, self.threshold = t.early_stopping_patience, t.early_stopping_threshold
        self.task, self.console = task, console
        # Restored from the checkpoint. Carried on even with the flags dropped: its checkpoint stays kept.
        self.record = Record.from_state(saved)
        self.checked = False  # the metric's name is checked against the first evaluation's keys
        self.new_best_at: int | None = None
        self.stop = False

    def repair_pointer(self, root, is_rank0: bool) -> None:
        """A resume in the run's own folder: `best` names the restored record's checkpoint (a kill between the
        commit's `latest` and `best` left the previous one)."""
        best = checkpoint.best_step_dir(root, {"best": dataclasses.asdict(self.record)} if self.record else {})
        if is_rank0 and best is not None and checkpoint.is_committed(best):
            checkpoint.point_best(root, best)

    def observe(self, step: int, metrics: dict) -> None:
        """After the evaluation at `step`: the new record, whether this step is to be saved as the best, and
        whether the run stops. Raises ConfigError (every rank alike) for a metric the workload does not return."""
        if not self.on:
            return
        metric = self._metric(metrics)
        value = _number(metrics[metric], metric, self.task)
        before = self.record
        self.record = judge(self.record, step, value, self.threshold)
        self.new_best_at = step if self.record.step == step else None
        self.stop = self.patience is not None and self.record.evals_without_improvement >= self.patience
        self.console.info(self._line(step, value, before))

    def saves_at(self, step: int) -> bool:
        """The evaluation at `step` was a new best: a checkpoint of this step is due (for `best` to name)."""
        return self.new_best_at == step

    def checkpoint_state(self) -> dict:
        return {"best": dataclasses.asdict(self.record)} if self.record else {}

    def summary(self) -> dict | None:
        if self.record is None:
            return None
        r = self.record
        at = checkpoint.step_dir_name(r.step) if r.step is not None else None
        return {**dataclasses.asdict(r), "checkpoint": at, "patience": self.patience, "threshold": self.threshold}

    def stop_line(self, step: int) -> str:
        r = self.record
        return (
            f"step {step}: early stopping: {r.metric} did not improve by more than {self.threshold:g} for "
            f"{r.evals_without_improvement} evaluations (--early-stopping-patience {self.patience}); best "
            f"{r.metric} {_shown(r.value)} at step {r.step}"
        )

    def _metric(self, metrics: dict) -> str:
        """The metric's name (the first key unless named; HF's `eval_` prefix is accepted), checked at the first
        evaluation; a record of another metric or direction starts over."""
        asked = "metric_for_best_model" if self.asked is not None else "early_stopping_patience"
        if not metrics:
            raise ConfigError(
                f"{where(asked)}: {self.task} has no validation set (datasets() returned None for it), so no "
                f"evaluation can choose a best checkpoint"
            )
        name = self.asked if self.asked is not None else next(iter(metrics))
        if name not in metrics and name.startswith("eval_") and name[5:] in metrics:
            name = name[5:]
        if name not in metrics:
            raise ConfigError(
                f"{where('metric_for_best_model')} {self.asked}: not among {self.task}.metrics()' keys "
                f"({', '.join(map(str, metrics))})"
            )
        if not self.checked:
            self._start(name)
        return name

    def _start(self, name: str) -> None:
        self.checked = True
        greater = self.greater_asked if self.greater_asked is not None else default_greater_is_better(name)
        r = self.record
        if r is not None and (r.metric, r.greater_is_better) != (name, greater):
            if self.console.rank == 0:
                self.console.warn(
                    f"the checkpoint chose its best by {r.metric} ({_direction(r.greater_is_better)}); this run "
                    f"chooses by {name} ({_direction(greater)}): the best checkpoint and the patience count "
                    f"start over"
                )
            r = None
        self.record = r or Record(name, greater)

    def _line(self, step: int, value: float, before: Record) -> str:
        r = self.record
        if self.saves_at(step):
            was = f" (was {_shown(before.value)} at step {before.step})" if before and before.step is not None else ""
            line = f"step {step}: new best {r.metric} {_shown(value)}{was}: checkpoints/best"
            if r.evals_without_improvement and self.patience is not None:
                # Better, but not by more than the threshold: HF counts it against the patience, and the early-
                # stopping line right after a "new best" read as a contradiction without this.
                line += (
                    f"; not better by more than {self.threshold:g} (--early-stopping-threshold): "
                    f"{r.evals_without_improvement} of {self.patience} evaluations without an improvement"
                )
            return line
        patience = f" of {self.patience}" if self.patience is not None else ""
        best = f"best {_shown(r.value)} at step {r.step}" if r.step is not None else "no finite value yet"
        return (
            f"step {step}: {r.metric} {_shown(value)}, {best}; "
            f"{r.evals_without_improvement}{patience} evaluations without an improvement above {self.threshold:g}"
        )


def _number(value, metric: str, task: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(
            f"{flag_of('metric_for_best_model')} {metric}: {task}.metrics() returned {value!r} for it, not a number"
        )
    return float(value)


def _direction(greater: bool) -> str:
    return "greater is better" if greater else "lower is better"


def _shown(value) -> str:
    return "-" if value is None else f"{value:.6g}"
