"""Read a finished (or interrupted) run directory back: the one place report and compare parse outputs."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from shardtrain.config.settings import ConfigError

MIB = 2**20
# What a rank must hold at once, in every strategy's figure alike. `comm` is the gradient buckets a backend
# allocates beside the gradients (ZeRO's reduce buckets: reduce_bucket_size elements); DDP's buckets are the
# gradients themselves (gradient_as_bucket_view), so they are already in `grads` and its comm is 0.
MEMORY_PARTS = ("params", "grads", "optimizer", "comm", "activations")


def _jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line cut short by a kill: the steps before it are still worth plotting
    return rows


@dataclass
class RunLog:
    path: Path
    summary: dict
    steps: list[dict]
    evals: list[dict]
    memory: dict = field(default_factory=dict)  # {rank: {params, grads, optimizer, activations, ...} bytes}
    memory_step: int | None = None
    alias: str | None = None

    @property
    def label(self) -> str:
        return self.alias or self.path.name

    @property
    def strategy(self) -> str:
        run = self.summary.get("run") or self.summary
        name = run.get("strategy", "?")
        return f"{name}+offload" if run.get("offload") else name

    @property
    def final_loss(self) -> float | None:
        return self.steps[-1]["loss"] if self.steps else None

    @property
    def samples_per_sec(self) -> float | None:
        value = self.summary.get("samples_per_sec")
        if value:
            return value
        rates = [r["samples_per_sec"] for r in self.steps[1:]]  # first step is warm-up
        return sum(rates) / len(rates) if rates else None

    @property
    def eval_result(self) -> dict:
        return self.summary.get("eval") or (self.evals[-1] if self.evals else {})

    def memory_per_rank_mib(self) -> float | None:
        """The largest rank's params + grads + optimizer + comm buffers + activations: what must fit on one
        device."""
        if not self.memory:
            return None
        return max(sum(rec.get(k, 0) for k in MEMORY_PARTS) for rec in self.memory.values()) / MIB


def load_run(path: str | Path) -> RunLog:
    p = Path(path)
    if not p.is_dir():
        raise ConfigError(f"{p}: no such run directory (give the --output-dir of a training run)")
    steps = _jsonl(p / "metrics.jsonl")
    summary_path = p / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    if not steps and not summary:
        raise ConfigError(f"{p}: neither metrics.jsonl nor summary.json found: not a shardtrain run directory")
    memory = (summary.get("memory") or {}).get("per_rank") or {}
    memory_step = (summary.get("memory") or {}).get("step")
    if not memory:
        for rec in reversed(steps):
            if rec.get("mem"):
                memory, memory_step = rec["mem"], rec["step"]
                break
    return RunLog(p, summary, steps, _jsonl(p / "eval.jsonl"), memory, memory_step)


def load_runs(paths) -> list[RunLog]:
    """Several runs, labelled by folder name; runs/a/out and runs/b/out are labelled a/out and b/out."""
    runs = [load_run(p) for p in paths]
    names = [r.path.name for r in runs]
    for run in runs:
        if names.count(run.path.name) > 1:
            run.alias = f"{run.path.parent.name}/{run.path.name}"
    return runs


# The default metrics' two headline numbers; a workload with its own metrics (a causal LM's perplexity) is shown by
# its first two, which `report` looked up as "accuracy" and failed on (KeyError) before.
DEFAULT_HEADLINE = ("accuracy", "macro_f1")
NOT_HEADLINE = ("step", "final", "n_examples")


def headline_metrics(runs) -> list[str]:
    """The eval keys a report plots and tabulates for these runs: accuracy and macro-F1 where the runs have them,
    else the first two numeric keys of their evaluations (a class's own F1, precision and recall left out)."""
    keys: list[str] = []
    for run in runs:
        for record in [*run.evals, run.eval_result]:
            for key, value in record.items():
                per_class = key.startswith(("f1_", "precision_", "recall_"))
                numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
                if key not in keys and key not in NOT_HEADLINE and numeric and not per_class:
                    keys.append(key)
    default = [k for k in DEFAULT_HEADLINE if k in keys]
    return default or keys[:2]
