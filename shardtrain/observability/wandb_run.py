"""The Weights & Biases run of a job: opened by rank 0 only, continued after a resume.

The run id travels in the checkpoint's trainer_state, so a resumed or requeued job logs into the
same run (resume="allow"). W&B is an observer: its absence or any failure inside it is one warning
and training goes on.
"""

from __future__ import annotations

import contextlib
import io
import os
import uuid

# Logged against this axis (define_metric) rather than W&B's own step: after a resume the steps
# between the checkpoint and the crash are logged again, which W&B's monotonic step would drop.
STEP_METRIC = "train/step"
METRIC_GROUPS = ("train/*", "perf/*", "mem/*", "sys/*", "eval/*")


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


class WandbRun:
    name = "wandb"  # one of the Tracker's loggers (observability/loggers.py)

    def __init__(
        self,
        enabled: bool,
        warn,
        output_dir,
        run_id: str | None,
        config: dict,
        project: str | None = None,
        entity: str | None = None,
        name: str | None = None,
        quiet: bool = True,
        system_metrics: bool = False,
    ):
        self.warn = warn
        self.quiet = quiet
        self.run = None
        self.project = project or os.environ.get("WANDB_PROJECT") or "shardtrain"
        # A checkpoint's run id continues that run; else a `wandb agent`'s (WANDB_RUN_ID ties the run to its
        # sweep); else a new one. It goes into every checkpoint, so a requeued job logs into the same run.
        self.run_id = run_id or os.environ.get("WANDB_RUN_ID") or new_run_id()
        if not enabled:
            return
        try:
            import wandb
        except ImportError:
            warn("--report-to wandb: the wandb package is not installed (pip install wandb); continuing without W&B")
            return
        try:
            # Everything not passed here comes from W&B's own WANDB_* variables (entity, name, group, tags,
            # notes, mode), as under HF Trainer and Lightning; an explicit flag wins over its variable.
            run_dir = os.environ.get("WANDB_DIR") or str(output_dir)
            os.makedirs(run_dir, exist_ok=True)
            # console="off": W&B would otherwise wrap our stdout to upload it. The system-metrics sampler is a
            # thread in rank 0 that competes with data loading for CPU, so it runs where its GPU panels are
            # worth that (CUDA runs) unless --wandb-system-metrics says otherwise.
            settings = wandb.Settings(console="off", quiet=quiet, silent=quiet, x_disable_stats=not system_metrics)
            self.run = wandb.init(
                project=self.project,
                entity=entity,
                name=name,
                id=self.run_id,
                resume="allow",
                dir=run_dir,
                config=config,
                settings=settings,
            )
            self.run.define_metric(STEP_METRIC)
            for group in METRIC_GROUPS:
                self.run.define_metric(group, step_metric=STEP_METRIC)
        except Exception as e:  # noqa: BLE001 - W&B must never take training down
            self._fail("init", e)

    @property
    def active(self) -> bool:
        return self.run is not None

    def where(self) -> str:
        mode = getattr(getattr(self.run, "settings", None), "mode", None)
        return f"project {self.project}, run {self.run_id}" + (f", {mode}" if mode == "offline" else "")

    def log(self, step: int, values: dict) -> None:
        if self.run is None:
            return
        try:
            self.run.log({STEP_METRIC: step, **values})
        except Exception as e:  # noqa: BLE001
            self._fail("log", e)

    def log_model(self, folder) -> None:
        """The final model as a W&B artifact of type "model" (--wandb-log-model), named as HF Trainer names it."""
        if self.run is None:
            return
        try:
            import wandb

            artifact = wandb.Artifact(f"model-{self.run_id}", type="model")
            # add_dir prints "Adding directory to artifact ... Done." to stderr whatever the run's settings say.
            with contextlib.redirect_stderr(io.StringIO()) if self.quiet else contextlib.nullcontext():
                artifact.add_dir(str(folder))
            self.run.log_artifact(artifact, aliases=["latest", "final"])
        except Exception as e:  # noqa: BLE001
            self._fail("log_model", e)

    def finish(self, summary: dict) -> None:
        if self.run is None:
            return
        try:
            for key, value in summary.items():
                self.run.summary[key] = value
            self.run.finish()
        except Exception as e:  # noqa: BLE001
            self._fail("finish", e)
        self.run = None

    def _fail(self, what: str, e: Exception) -> None:
        first = (str(e).splitlines() or [""])[0][:200]
        self.warn(f"W&B {what} failed ({type(e).__name__}: {first}); continuing without W&B")
        if self.run is not None:
            try:
                self.run.finish(exit_code=1)
            except Exception:  # noqa: BLE001
                pass
        self.run = None
