"""What a run tells people: rank-0 console lines and progress, metrics.jsonl, eval.jsonl, summary.json,
the loggers --report-to names (W&B, TensorBoard, MLflow: observability/loggers.py) and the end-of-run report.

Only rank 0 writes; other ranks print warnings and errors, prefixed with their rank. The loop talks to
one `Tracker`: `step()` once per optimizer step, `evaluated()` after an eval, `finish()` at the end.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from shardtrain.config.settings import logs_model_artifact
from shardtrain.observability.loggers import RUN_ID_KEYS, described, eval_values, logged_values
from shardtrain.observability.metric_text import metrics_line


class Console:
    def __init__(self, rank: int, verbose: bool = False):
        self.rank = rank
        self.verbose = verbose
        self.progress = None  # while a progress bar is up, lines go above it instead of through it
        from shardtrain.runtime.chatter import quiet_libraries

        quiet_libraries(verbose)

    def info(self, msg: str) -> None:
        if self.rank != 0:
            return
        if self.progress is not None:
            self.progress.write(msg)
        else:
            print(msg, flush=True)

    def warn(self, msg: str) -> None:
        prefix = "[shardtrain] warning: " if self.rank == 0 else f"[rank {self.rank}] warning: "
        print(prefix + msg, file=sys.stderr, flush=True)


class MetricsLog:
    """One JSON line per optimizer step, appended so a resumed run continues the same file."""

    def __init__(self, output_dir: Path, rank: int, resume_step: int, name: str = "metrics.jsonl"):
        self.enabled = rank == 0
        self.path = output_dir / name
        self.resume_step, self.file = resume_step, None
        if self.enabled:
            output_dir.mkdir(parents=True, exist_ok=True)

    def _truncate_after(self, step: int) -> None:
        # Steps after the checkpoint we resume from were never committed: they will be redone.
        if not self.path.exists():
            return
        kept = [
            line
            for line in self.path.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= step
        ]
        self.path.write_text("".join(line + "\n" for line in kept))

    def write(self, record: dict) -> None:
        if self.enabled:
            if self.file is None:
                # Truncated at the first record, not at start-up: a run that fails before its first step
                # leaves the previous run's lines as they were.
                self._truncate_after(self.resume_step)
                self.file = open(self.path, "a")
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def losses(self) -> list[float]:
        if not self.path.exists():
            return []
        return [json.loads(line)["loss"] for line in self.path.read_text().splitlines() if line.strip()]

    def close(self) -> None:
        if self.enabled and self.file is not None:
            self.file.close()


class Throughput:
    """Samples/s over the steps of this process's life, excluding the first (warm-up) step."""

    def __init__(self):
        self.samples = 0
        self.seconds = 0.0
        self.steps = 0

    def add(self, samples: int, seconds: float) -> None:
        self.steps += 1
        if self.steps > 1:
            self.samples += samples
            self.seconds += seconds

    @property
    def samples_per_sec(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0


def write_summary(output_dir: Path, summary: dict) -> None:
    path = output_dir / "summary.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(summary, indent=2, default=str))
    tmp.replace(path)


def wandb_summary(summary: dict) -> dict:
    """The W&B run's summary at the end, from summary.json's content (TensorBoard and MLflow get its numbers as
    summary/{key}): the last loss, the eval, throughput, and the best checkpoint (--metric-for-best-model: its
    step, value and metric, which mark it in W&B)."""
    best = summary.get("best") or {}
    return {
        "final_loss": (summary.get("train_loss") or [None])[-1],
        **{f"eval/{k}": v for k, v in (summary.get("eval") or {}).items()},
        "samples_per_sec": summary.get("samples_per_sec"),
        **({f"best/{k}": best[k] for k in ("step", "value", "metric")} if best.get("step") is not None else {}),
        **({"stopped_by": summary["stopped_by"]} if summary.get("stopped_by") else {}),
    }


def library_versions() -> dict:
    import platform

    import torch

    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "shardtrain": _own_version(),
    }
    for name in ("deepspeed", "transformers", "datasets", "tokenizers", "torchvision", "wandb", "tensorboard",
                 "mlflow", "mlflow-skinny"):  # fmt: skip
        try:
            from importlib.metadata import version

            versions[name] = version(name)
        except Exception:  # noqa: BLE001 - an absent optional library is simply not listed
            pass
    return versions


def _own_version() -> str:
    try:
        from importlib.metadata import version

        return version("shardtrain")
    except Exception:  # noqa: BLE001
        return "dev"


def now() -> float:
    return time.perf_counter()


class Tracker:
    """Everything the loop reports, behind three calls. Rank 0 does the work; other ranks only count."""

    def __init__(
        self,
        cfg,
        dist_info,
        console: Console,
        output_dir: Path,
        resume_step: int,
        run_info: dict,
        resume_state: dict | None = None,
        model_factory=None,
        elastic: dict | None = None,
        membership_change: dict | None = None,
    ):
        """`elastic`: the batch and membership state the checkpoint carries (shardtrain/loop/elastic.py);
        `membership_change`: this start's change of world size, which the first metrics.jsonl record carries."""
        from shardtrain.observability.banner import format_banner
        from shardtrain.observability.progress import Progress

        self.cfg, self.dist, self.console, self.out = cfg, dist_info, console, output_dir
        self.rank0 = dist_info.is_rank0
        self.resume_state = resume_state or {}
        self.model_factory = model_factory
        self.elastic, self.membership_change = elastic, membership_change
        self.flops_per_sample: float | None = None
        self.peak_flops: float | None = None
        self.metrics = MetricsLog(output_dir, dist_info.rank, resume_step)
        self.evals = MetricsLog(output_dir, dist_info.rank, resume_step, name="eval.jsonl")
        # Opened before the banner, which says which loggers are on and where their runs are.
        self.loggers = self._open_loggers(run_info, resume_step) if self.rank0 else []
        self.run_info = {**run_info, "loggers": described(self.loggers)}
        console.info(format_banner(self.run_info))
        self.progress = None
        if self.rank0:
            self.progress = Progress(cfg.train.max_steps, resume_step, cfg.train.log_every)
            console.progress = self.progress

    def _open_loggers(self, run_info: dict, resume_step: int) -> list:
        """--report-to's loggers, continuing the checkpoint's runs. Rank 0 only."""
        log = self.cfg.log
        wandb_options = {
            "project": log.wandb_project,
            "entity": log.wandb_entity,
            "name": log.wandb_run_name,  # --run-name, HF's name for it: the MLflow run's name too
            "quiet": not log.verbose,
            "system_metrics": (
                log.wandb_system_metrics if log.wandb_system_metrics is not None else self.dist.device.type == "cuda"
            ),
        }
        config = {"config": self.cfg.to_dict(), "run": run_info, "versions": library_versions()}
        warn, loggers = self.console.warn, []
        for name in log.report_to:  # each module imported only when asked for: it imports its library
            run_id = self.resume_state.get(RUN_ID_KEYS.get(name, ""))
            if name == "wandb":
                from shardtrain.observability.wandb_run import WandbRun

                loggers.append(WandbRun(True, warn, self.out, run_id, config, **wandb_options))
            elif name == "tensorboard":
                from shardtrain.observability.tensorboard_run import TensorBoardRun

                loggers.append(TensorBoardRun(warn, self.out, resume_step, config))
            elif name == "mlflow":
                from shardtrain.observability.mlflow_run import MlflowRun

                loggers.append(MlflowRun(warn, self.out, run_id, config, run_name=log.wandb_run_name))
        return loggers

    def _logger(self, name: str):
        return next((lg for lg in self.loggers if lg.name == name), None)

    def _fan_out(self, step: int, values: dict) -> None:
        for logger in self.loggers:
            logger.log(step, values)

    def checkpoint_state(self) -> dict:
        """Merged into the checkpoint's trainer_state: a resumed job continues the same W&B and MLflow runs (a run
        id the checkpoint had stays, for a later resume that reports there again), and its final summary lists
        every membership change; a resume compares its data with the data_source this one read."""
        run_ids = {key: self.resume_state.get(key) for key in RUN_ID_KEYS.values()}
        run_ids.update({RUN_ID_KEYS[lg.name]: lg.run_id for lg in self.loggers if lg.name in RUN_ID_KEYS and lg.run_id})
        return {
            **run_ids,
            **({"elastic": self.elastic} if self.elastic else {}),
            "data_source": self.run_info.get("data_source"),
        }

    def step(self, record: dict, batch) -> None:
        """Once per optimizer step, after the step's one host sync: only host arithmetic and rank-0 I/O."""
        if not self.rank0:
            return
        from shardtrain.data.batches import top_tensor
        from shardtrain.observability.progress import peak_memory_gb

        input_ids = top_tensor(batch, "input_ids")  # a batch of any shape; tokens where it is a dict with input_ids
        if input_ids is not None and input_ids.dim() > 0 and input_ids.shape[0]:
            # Padded tokens per sample, from shapes alone (no sync); ranks see equally shaped micro-batches.
            record["tokens_per_sec"] = input_ids.numel() / input_ids.shape[0] * record["samples_per_sec"]
        mfu = self._mfu(record, batch)
        if mfu is not None:
            record["mfu"] = mfu
        if self.membership_change:  # the first step at a new world size
            record["membership"], self.membership_change = self.membership_change, None
        self.metrics.write(record)
        peak = peak_memory_gb(self.dist.device)
        self.progress.update(record, peak)
        if self.loggers:
            self._fan_out(record["step"], logged_values(record, peak))

    def evaluated(self, step: int, result: dict, final: bool = False) -> None:
        if not self.rank0:
            return
        if not result:
            return  # a workload with no validation set
        where = "eval" if final else f"step {step} eval"
        self.console.info(f"{where} | {metrics_line(result, sep=' | ')}")
        self.evals.write({"step": step, "final": final, **result})
        self._fan_out(step, eval_values(result))

    def finish(self, summary: dict, final_model: Path | None = None) -> None:
        """Close the bar, write summary.json (with `run`), close the loggers (W&B logging `final_model` as an
        artifact when it is given), write the report. Rank 0 only."""
        self.metrics.close()
        self.evals.close()
        if not self.rank0:
            return
        self.progress.close()
        self.console.progress = None
        summary["run"] = self.run_info
        write_summary(self.out, summary)
        wandb = self._logger("wandb")
        if final_model is not None and wandb is not None and logs_model_artifact(self.cfg.log):
            wandb.log_model(final_model)
        # A preempted attempt's figures are not the run's: the requeued attempt logs the real ones at its end, and
        # TensorBoard and MLflow would keep both as summary/* points.
        preempted = bool(summary.get("preempted"))
        totals = {"preempted": True} if preempted else {**wandb_summary(summary), "preempted": False}
        for logger in self.loggers:
            logger.finish(totals)
        if self.cfg.log.report:
            try:
                from shardtrain.observability.report import write_report

                path = write_report(self.out)
                self.console.info(f"report: {path}")
            except Exception as e:  # noqa: BLE001 - the run is done and saved; a plot must not fail it
                self.console.warn(
                    f"report not written ({type(e).__name__}: {e}); retry with: shardtrain report {self.out}"
                )

    def _mfu(self, record: dict, batch: dict) -> float | None:
        if self.dist.device.type != "cuda" or self.model_factory is None:
            return None
        from shardtrain.memory import flops

        if self.flops_per_sample is None:  # counted once, on the first step's batch shapes
            import torch

            precision = self.cfg.train.precision
            if precision == "fp32" and (self.run_info.get("cuda_math") or {}).get("tf32"):
                precision = "tf32"  # its matmuls run on the tensor cores: the plain fp32 peak would flatter MFU
            self.peak_flops = flops.peak_flops(
                torch.cuda.get_device_name(self.dist.device), precision
            ) or flops.peak_flops(torch.cuda.get_device_name(self.dist.device), "fp32")
            from shardtrain.runtime.training_rng import aside

            with aside(device=self.dist.device):  # a model built mid-run: off the training stream
                self.flops_per_sample = flops.train_flops_per_sample(
                    self.model_factory, batch, self.run_info["params_trainable"]
                )
        return flops.mfu(self.flops_per_sample, record["samples_per_sec"], self.dist.world_size, self.peak_flops)
