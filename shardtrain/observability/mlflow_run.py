"""The MLflow run of a job: opened by rank 0 only, continued after a resume, configured by MLflow's own variables
and by those HF Trainer's MLflowCallback reads.

- MLFLOW_TRACKING_URI: the tracking server or store; unset, a file store in the run folder, OUT/mlruns.
- MLFLOW_EXPERIMENT_NAME (created when missing), else MLFLOW_EXPERIMENT_ID, else MLflow's Default experiment.
- MLFLOW_RUN_ID: the run to continue (a checkpoint's run id comes first); MLFLOW_TAGS: a JSON object of tags;
  MLFLOW_MAX_LOG_PARAMS: at most that many parameters.
- MLflow's own MLFLOW_ENABLE_ASYNC_LOGGING and MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING (with its sampling variables).

The run id is made by the store, so it travels in the checkpoint's trainer_state (`mlflow_run_id`): a resumed
or requeued job logs into the same run. MLflow is an observer: its absence or any failure inside it is one
warning, and training goes on.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from pathlib import Path

from shardtrain.observability.loggers import failure_line

# The characters MLflow takes in a metric or parameter name; any other becomes "_" (as HF's callback does).
_NAME_CHARS = re.compile(r"[^0-9A-Za-z_\-. :/]")
_TRUE = ("1", "true", "yes", "on")


def flat_params(config: dict) -> dict[str, str]:
    """The run's config sections (train.lr, ...), `run.*` and `versions.*`, one string per leaf, as MLflow
    parameters: names with other characters sanitised, values too long for MLflow left out."""
    from mlflow.utils.validation import MAX_ENTITY_KEY_LENGTH, MAX_PARAM_VAL_LENGTH

    tree = {**(config.get("config") or {}), "run": config.get("run") or {}, "versions": config.get("versions") or {}}
    out: dict[str, str] = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict) and value:
            for key, sub in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), sub)
            return
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        name = _NAME_CHARS.sub("_", prefix)
        if len(text) <= MAX_PARAM_VAL_LENGTH and len(name) <= MAX_ENTITY_KEY_LENGTH:
            out[name] = text

    walk("", tree)
    return out


def _chunks(items: list, size: int):
    for i in range(0, len(items), size):
        yield items[i : i + size]


class MlflowRun:
    name = "mlflow"

    def __init__(self, warn, output_dir, run_id: str | None, config: dict, run_name: str | None = None):
        self.warn = warn
        self.client = None
        self.monitor = None
        self.pending: list = []  # MLflow's handles of asynchronous log calls (MLFLOW_ENABLE_ASYNC_LOGGING)
        self.last_step = 0
        self.experiment = None
        # A checkpoint's run id continues that run; else MLFLOW_RUN_ID's (HF's way to reattach); else a new one.
        self.run_id = run_id or os.environ.get("MLFLOW_RUN_ID") or None
        self.uri = os.environ.get("MLFLOW_TRACKING_URI") or None
        if self.uri is None:
            self.uri = (Path(output_dir) / "mlruns").resolve().as_uri()
            # MLflow 3 keeps its file store in maintenance mode and refuses it unless this is set; this store is
            # shardtrain's own choice (offline nodes need none), a MLFLOW_TRACKING_URI names any other.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        try:
            from mlflow.tracking import MlflowClient
        except ImportError:
            warn(
                "--report-to mlflow: the mlflow package is not installed (pip install mlflow-skinny); "
                "continuing without MLflow"
            )
            return
        try:
            self._open(MlflowClient(tracking_uri=self.uri), config, run_name)
        except Exception as e:  # noqa: BLE001 - MLflow must never take training down
            self._fail("init", e)

    def _open(self, client, config: dict, run_name: str | None) -> None:
        tags = self._tags()
        run = self._continued(client) if self.run_id else None
        if run is None:
            experiment_id = self._experiment_id(client)
            run = client.create_run(experiment_id, tags=tags, run_name=run_name)
            self.run_id = run.info.run_id
        else:
            client.update_run(self.run_id, status="RUNNING")
            self._log_batch(client, tags=tags)
        self.experiment = client.get_experiment(run.info.experiment_id).name
        # Parameters cannot change in MLflow: a continued run keeps those of its first start.
        params = {k: v for k, v in flat_params(config).items() if k not in run.data.params}
        limit = os.environ.get("MLFLOW_MAX_LOG_PARAMS", "")
        items = list(params.items())[: int(limit)] if limit.isdigit() else list(params.items())
        self._log_batch(client, params=items)
        if os.environ.get("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "").lower() in _TRUE:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            continued = bool(run.data.metrics)  # its system/ metrics go on from their last step
            self.monitor = SystemMetricsMonitor(self.run_id, resume_logging=continued, tracking_uri=self.uri)
            self.monitor.start()
        self.client = client

    def _continued(self, client):
        """The run to continue, or None (with a warning) when this store has no such run."""
        try:
            return client.get_run(self.run_id)
        except Exception as e:  # noqa: BLE001 - e.g. another MLFLOW_TRACKING_URI than the first start's
            self.warn(failure_line(f"MLflow run {self.run_id} lookup at {self.uri}", e) + "; starting a new run")
            return None

    @staticmethod
    def _experiment_id(client) -> str:
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME")
        if not name and os.environ.get("MLFLOW_EXPERIMENT_ID"):
            return os.environ["MLFLOW_EXPERIMENT_ID"]
        # Unnamed: MLflow's Default experiment, by name. A file store makes it (as id 0) only in a folder it
        # creates itself, so an empty folder made beforehand (`mkdir mlruns`) has none: made here, as a name is.
        name = name or "Default"
        found = client.get_experiment_by_name(name)
        return found.experiment_id if found is not None else client.create_experiment(name)

    def _tags(self) -> dict:
        text = os.environ.get("MLFLOW_TAGS")
        if not text:
            return {}
        try:
            tags = json.loads(text)
            if not isinstance(tags, dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            self.warn(f"MLFLOW_TAGS is not a JSON object of tags ({e}); the run gets none")
            return {}
        return {str(k): str(v) for k, v in tags.items()}

    def _log_batch(self, client, metrics=(), params=(), tags=None) -> None:
        from mlflow.entities import Metric, Param, RunTag
        from mlflow.utils.validation import MAX_METRICS_PER_BATCH, MAX_PARAMS_TAGS_PER_BATCH

        for chunk in _chunks(list(metrics), MAX_METRICS_PER_BATCH):
            self._sent(client.log_batch(self.run_id, metrics=[Metric(*m) for m in chunk], synchronous=None))
        for chunk in _chunks(list(params), MAX_PARAMS_TAGS_PER_BATCH):
            self._sent(client.log_batch(self.run_id, params=[Param(k, v) for k, v in chunk], synchronous=None))
        for chunk in _chunks(list((tags or {}).items()), MAX_PARAMS_TAGS_PER_BATCH):
            self._sent(client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in chunk], synchronous=None))

    def _sent(self, operation) -> None:
        if operation is not None:  # asynchronous: waited for at finish
            self.pending.append(operation)

    @property
    def active(self) -> bool:
        return self.client is not None

    def where(self) -> str:
        return f"{self.uri}, experiment {self.experiment}, run {self.run_id}"

    def log(self, step: int, values: dict) -> None:
        if self.client is None:
            return
        self.last_step = max(self.last_step, step)
        now_ms = int(time.time() * 1000)
        metrics = [(_NAME_CHARS.sub("_", k), float(v), now_ms, step) for k, v in values.items()]
        try:
            self._log_batch(self.client, metrics=metrics)
        except Exception as e:  # noqa: BLE001
            self._fail("log", e)

    def finish(self, summary: dict) -> None:
        """The totals as summary/{name} metrics at the last step logged; the run ends FINISHED, or KILLED when
        the job was preempted (a requeue sets it RUNNING again)."""
        if self.client is None:
            return
        numbers = {
            f"summary/{k}": v
            for k, v in summary.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        }
        self.log(self.last_step, numbers)
        if self.client is None:  # that log failed
            return
        try:
            for operation in self.pending:
                operation.wait()
            if self.monitor is not None:
                self.monitor.finish()
            self.client.set_terminated(self.run_id, status="KILLED" if summary.get("preempted") else "FINISHED")
        except Exception as e:  # noqa: BLE001
            self._fail("finish", e)
        self.client = None

    def _fail(self, what: str, e: Exception) -> None:
        line = failure_line(f"MLflow {what}", e)
        if "MLFLOW_ALLOW_FILE_STORE" in str(e):
            line += " (MLFLOW_ALLOW_FILE_STORE=true lets MLflow use a file store)"
        self.warn(line + "; continuing without MLflow")
        if self.monitor is not None:
            try:
                self.monitor.finish()
            except Exception:  # noqa: BLE001
                pass
            self.monitor = None
        if self.client is not None and self.run_id:
            try:
                self.client.set_terminated(self.run_id, status="FAILED")
            except Exception:  # noqa: BLE001
                pass
        self.client = None
