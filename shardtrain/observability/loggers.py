"""The loggers a run reports to besides metrics.jsonl (--report-to): W&B, TensorBoard and MLflow, one module each
(wandb_run.py, tensorboard_run.py, mlflow_run.py), behind one small interface that the Tracker (tracking.py)
opens and fans out to.

Only rank 0 opens them, one run per job: a logger that names its run (W&B, MLflow) gives the Tracker its id for the
checkpoint's trainer_state, and a resumed or requeued job continues that run. Each is an observer: a missing
package or a failure inside it is one warning, and training goes on without it. A logger's library is imported
only when --report-to asks for it, so the workers of every other run never pay for the import.
"""

from __future__ import annotations

from typing import Protocol

# The trainer_state key that holds each logger's run id (W&B's name is older than this module).
RUN_ID_KEYS = {"wandb": "wandb_run_id", "mlflow": "mlflow_run_id"}


class Logger(Protocol):
    name: str  # its --report-to name
    run_id: str | None  # the run it logs into, kept in every checkpoint; None: a logger without run ids

    @property
    def active(self) -> bool: ...  # False once it failed: log and finish do nothing

    def where(self) -> str: ...  # the banner's words for where its run is

    def log(self, step: int, values: dict) -> None: ...  # metric name -> number, at this optimizer step

    def finish(self, summary: dict) -> None: ...  # the run's totals; closes the run


def logged_values(record: dict, peak_mem_gib: float | None = None) -> dict:
    """A metrics.jsonl record -> the names every logger plots, grouped for dashboards: train/, perf/, mem/, sys/."""
    names = {
        "loss": "train/loss",
        "lr": "train/lr",
        "grad_norm": "train/grad_norm",
        "skipped_steps": "train/skipped_steps",
        "samples_per_sec": "perf/samples_per_sec",
        "tokens_per_sec": "perf/tokens_per_sec",
        "mfu": "perf/mfu",
        "step_seconds": "perf/step_seconds",
    }
    values = {names[k]: v for k, v in record.items() if k in names and v is not None}
    # The memory monitor's {rank: {key: bytes}} on measured steps -> mem/rank{r}/{key} in MiB.
    for rank, rec in (record.get("mem") or {}).items():
        values.update({f"mem/rank{rank}/{k}": v / 2**20 for k, v in rec.items() if isinstance(v, (int, float))})
    if peak_mem_gib is not None:  # rank 0's: the allocator's peak on a GPU, peak RSS on the CPU
        values["sys/peak_mem_gib"] = peak_mem_gib
    return values


def eval_values(result: dict) -> dict:
    """A workload's metrics() -> eval/{name}, numbers only (n_examples is a count, not a curve)."""
    return {
        f"eval/{k}": v
        for k, v in result.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "n_examples"
    }


def described(loggers: list[Logger]) -> list[dict]:
    """What the banner and summary.json's `run` say of them: each one asked for, on or off, and where its run is."""
    return [{"name": lg.name, "on": lg.active, "where": lg.where() if lg.active else None} for lg in loggers]


def failure_line(what: str, e: Exception) -> str:
    """`<what> failed (Error: its first line)`, cut to 300 characters: one warning line."""
    first = (str(e).splitlines() or [""])[0][:300]
    return f"{what} failed ({type(e).__name__}: {first})"
