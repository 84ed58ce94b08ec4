"""--report-to's loggers, driven through the Tracker with made-up step records in this process and read back with
each tool's own reader: TensorBoard's EventAccumulator and MLflow's MlflowClient. A resume continues the same
MLflow run and hides the redone steps in TensorBoard; a missing package or a failure is one warning; the variables
HF Trainer's TensorBoardCallback and MLflowCallback read are honoured. The real 2-process run with both on is in
tests/dist/test_observability_runs.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from logger_records import mlflow_history, tensorboard_scalars

from shardtrain.config.settings import Config, ConfigError, help_of, parse_cli, resolve_report_to
from shardtrain.observability.tracking import Console, Tracker
from shardtrain.runtime.distributed import DistInfo

REPO = Path(__file__).resolve().parents[2]
MIB = 2**20
DIST = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend="gloo")
BATCH = {"input_ids": torch.ones(2, 5, dtype=torch.long), "labels": torch.zeros(2, dtype=torch.long)}
RUN_INFO = {
    "strategy": "ddp",
    "offload": False,
    "world_size": 1,
    "precision": "fp32",
    "micro_batch_size": 2,
    "grad_accum": 1,
    "global_batch_size": 2,
    "train_examples": 8,
    "eval_examples": 8,
    "steps_per_epoch": 4,
    "activation_checkpointing": False,
    "params_total": 10,
    "params_trainable": 10,
    "params_frozen": 0,
    "max_steps": 4,
    "ranks": [{"rank": 0, "host": "here", "local_rank": 0, "device": "cpu"}],
    "strategy_settings": {"strategy": "ddp"},
    "memory_prediction": {"note": "test"},
}


@pytest.fixture(autouse=True)
def mlflow_env(monkeypatch):
    """No MLflow or TensorBoard variable from the caller's environment; no telemetry; the file-store switch that
    MlflowRun sets for its own default store is put back afterwards."""
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID", "MLFLOW_RUN_ID",
                 "MLFLOW_TAGS", "MLFLOW_MAX_LOG_PARAMS", "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING",
                 "MLFLOW_ENABLE_ASYNC_LOGGING", "TENSORBOARD_LOGGING_DIR", "DISABLE_MLFLOW_INTEGRATION"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "unset-below")  # recorded, so restored at teardown
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")


def config(out: Path, *flags: str) -> Config:
    return parse_cli(["--config", str(REPO / "configs/longformer_tiny.yaml"), "--output-dir", str(out),
                      "--max-steps", "4", "--report", "false", *flags])  # fmt: skip


def record(step: int, loss: float, mem: bool = False) -> dict:
    rec = {"step": step, "loss": loss, "lr": 1e-3, "grad_norm": 0.5, "samples_per_sec": 4.0, "step_seconds": 0.5}
    if mem:
        rec["mem"] = {"0": {"params": 2 * MIB, "optimizer": 4 * MIB}, "1": {"params": 2 * MIB}}
    return rec


def test_report_to_is_hf_report_to():
    assert Config().log.report_to == [] and "default: none" in help_of("report_to")  # HF 5's default
    tiny = ["--config", str(REPO / "configs/longformer_tiny.yaml")]
    assert parse_cli([*tiny, "--report-to", "wandb,TensorBoard, mlflow"]).log.report_to == [
        "wandb", "tensorboard", "mlflow"]  # fmt: skip
    assert parse_cli([*tiny, "--report_to=none"]).log.report_to == []
    assert parse_cli([*tiny, "--report-to", "wandb"]).log.report_to == ["wandb"]
    assert resolve_report_to(["mlflow", "tensorboard", "mlflow"]) == ["mlflow", "tensorboard"]  # a YAML list
    installed = resolve_report_to(["all"], env={})
    assert installed == ["wandb", "tensorboard", "mlflow"]  # all three are in requirements.txt
    assert resolve_report_to(["all"], env={"DISABLE_MLFLOW_INTEGRATION": "TRUE"}) == ["wandb", "tensorboard"]
    with pytest.raises(ConfigError, match=r"--report-to \(log.report_to\): 'tensorbord' is not one of .*"
                                          r"did you mean 'tensorboard'\?"):  # fmt: skip
        parse_cli([*tiny, "--report-to", "wandb,tensorbord"])
    with pytest.raises(ConfigError, match="none and all stand alone"):
        parse_cli([*tiny, "--report-to", "none,mlflow"])


def test_tensorboard_and_mlflow_get_every_figure_and_a_resume_continues_both(tmp_path, monkeypatch, capsys):
    from mlflow.tracking import MlflowClient

    out = tmp_path / "run"
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "exp-a")
    monkeypatch.setenv("MLFLOW_TAGS", '{"team": "nlp", "release": 2}')
    cfg = config(out, "--report-to", "tensorboard,mlflow", "--run-name", "run-a")
    tracker = Tracker(cfg, DIST, Console(0), out, 0, RUN_INFO)
    banner = capsys.readouterr().out
    run_id = tracker.checkpoint_state()["mlflow_run_id"]
    store = (out / "mlruns").resolve().as_uri()  # MLFLOW_TRACKING_URI unset: the run folder's own store
    mlflow_at = f"mlflow ({store}, experiment exp-a, run {run_id})"
    assert f"loggers     tensorboard ({out / 'tensorboard'}) | {mlflow_at}" in banner
    for step, loss in ((1, 1.0), (2, 0.9)):
        tracker.step(record(step, loss, mem=step == 2), BATCH)
    tracker.evaluated(2, {"accuracy": 0.5, "macro_f1": 0.4, "n_examples": 8})
    state = tracker.checkpoint_state()  # the step-2 checkpoint
    assert state["mlflow_run_id"] == run_id and state["wandb_run_id"] is None
    tracker.step(record(3, 0.8), BATCH)  # then the job dies: step 3 is done again by the resumed one
    tracker.loggers[0].writer.flush()  # as the writer's thread does every 30 s

    resumed = Tracker(cfg, DIST, Console(0), out, 2, RUN_INFO, resume_state=state)
    assert resumed.checkpoint_state()["mlflow_run_id"] == run_id
    for step, loss in ((3, 0.7), (4, 0.6)):
        resumed.step(record(step, loss), BATCH)
    resumed.evaluated(4, {"accuracy": 0.75, "macro_f1": 0.7, "n_examples": 8}, final=True)
    resumed.finish({"train_loss": [0.6], "eval": {"accuracy": 0.75}, "samples_per_sec": 4.0})

    tb = tensorboard_scalars(out / "tensorboard")
    assert tb["train/loss"] == pytest.approx({1: 1.0, 2: 0.9, 3: 0.7, 4: 0.6})  # the first try's step 3 hidden
    assert tb["eval/accuracy"] == pytest.approx({2: 0.5, 4: 0.75}) and "eval/n_examples" not in tb
    assert tb["mem/rank1/params"] == {2: 2.0} and tb["mem/rank0/optimizer"] == {2: 4.0}
    assert set(tb["sys/peak_mem_gib"]) == {1, 2, 3, 4} and tb["perf/tokens_per_sec"][1] == pytest.approx(20.0)
    assert tb["summary/final_loss"] == pytest.approx({4: 0.6})

    client = MlflowClient(tracking_uri=store)
    experiment = client.get_experiment_by_name("exp-a")
    [run] = client.search_runs([experiment.experiment_id])  # one run for the job
    assert run.info.run_id == run_id and run.info.status == "FINISHED" and run.info.run_name == "run-a"
    assert run.data.tags["team"] == "nlp" and run.data.tags["release"] == "2"
    assert run.data.params["train.max_steps"] == "4" and run.data.params["run.strategy"] == "ddp"
    assert "versions.torch" in run.data.params
    # MLflow cannot drop a value: the redone step 3 has both tries' values.
    assert mlflow_history(client, run_id, "train/loss") == [(1, 1.0), (2, 0.9), (3, 0.7), (3, 0.8), (4, 0.6)]
    assert mlflow_history(client, run_id, "eval/macro_f1") == [(2, 0.4), (4, 0.7)]
    assert run.data.metrics["mem/rank0/params"] == 2.0 and run.data.metrics["summary/samples_per_sec"] == 4.0


def test_mlflow_variables_as_hf_reads_them(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    from shardtrain.observability.mlflow_run import MlflowRun
    from shardtrain.observability.tensorboard_run import TensorBoardRun

    store = (tmp_path / "server-store").resolve().as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=store)
    earlier = client.create_run("0").info.run_id
    warnings = []
    # MLFLOW_RUN_ID reattaches to a run made elsewhere; MLFLOW_MAX_LOG_PARAMS caps the parameters.
    monkeypatch.setenv("MLFLOW_RUN_ID", earlier)
    monkeypatch.setenv("MLFLOW_MAX_LOG_PARAMS", "3")
    params = {"config": {"train": {"lr": 1, "seed": 2, "a": 3, "b": 4}}}
    run = MlflowRun(warnings.append, tmp_path / "out", None, params)
    assert run.run_id == earlier and run.active and not (tmp_path / "out" / "mlruns").exists()
    run.log(1, {"eval/f1(macro)": 0.5})  # MLflow refuses parentheses in a name: sanitised as HF does
    run.finish({"preempted": True})
    got = client.get_run(earlier)
    assert len(got.data.params) == 3 and got.info.status == "KILLED" and "eval/f1_macro_" in got.data.metrics
    # A checkpoint's run id this store has not (another MLFLOW_TRACKING_URI): one warning, and a new run.
    monkeypatch.delenv("MLFLOW_RUN_ID")
    fresh = MlflowRun(warnings.append, tmp_path / "out", "0123456789abcdef", {})
    assert fresh.active and fresh.run_id != "0123456789abcdef"
    assert len(warnings) == 1 and "MLflow run 0123456789abcdef lookup" in warnings[0]
    # HF's TENSORBOARD_LOGGING_DIR is the run's folder.
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb-here"))
    tb = TensorBoardRun(warnings.append, tmp_path / "out", 0, {})
    tb.log(1, {"train/loss": 1.0})
    tb.finish({})
    assert tensorboard_scalars(tmp_path / "tb-here")["train/loss"] == {1: 1.0} and len(warnings) == 1


def test_a_missing_package_or_a_failure_is_one_warning_and_nothing_else_is_imported(tmp_path, monkeypatch, capsys):
    # Blocked: any import of them raises ImportError. The default run (no --report-to) must not try.
    for name in ("mlflow", "mlflow.tracking", "tensorboard", "torch.utils.tensorboard"):
        monkeypatch.setitem(sys.modules, name, None)
    warnings = []
    console = Console(0)
    console.warn = warnings.append
    quiet = Tracker(config(tmp_path / "a"), DIST, console, tmp_path / "a", 0, RUN_INFO)
    assert "loggers     none besides metrics.jsonl" in capsys.readouterr().out
    quiet.step(record(1, 1.0), BATCH)
    quiet.finish({})
    assert warnings == [] and quiet.checkpoint_state()["mlflow_run_id"] is None

    tracker = Tracker(config(tmp_path / "b", "--report-to", "tensorboard,mlflow"), DIST, console, tmp_path / "b", 0,
                      RUN_INFO, resume_state={"mlflow_run_id": "kept"})  # fmt: skip
    off = "off (see its warning, on stderr)"  # under Slurm stdout and stderr are two files: not "above"
    assert f"tensorboard {off} | mlflow {off}" in capsys.readouterr().out
    tracker.step(record(1, 1.0), BATCH)
    tracker.finish({})
    assert [w.split(":")[0] for w in warnings] == ["--report-to tensorboard", "--report-to mlflow"]
    assert tracker.checkpoint_state()["mlflow_run_id"] == "kept"  # a later resume with MLflow back continues it


def test_a_failing_mlflow_call_stops_mlflow_only(tmp_path, monkeypatch):
    from shardtrain.observability.mlflow_run import MlflowRun

    warnings = []
    run = MlflowRun(warnings.append, tmp_path, None, {})

    def unreachable(*args, **kwargs):
        raise ConnectionError("tracking server unreachable\nretries exhausted")

    monkeypatch.setattr(run.client, "log_batch", unreachable)
    run.log(1, {"train/loss": 1.0})
    run.log(2, {"train/loss": 1.0})
    run.finish({})
    assert (
        warnings == ["MLflow log failed (ConnectionError: tracking server unreachable); continuing without MLflow"]
        and not run.active
    )


def test_an_empty_store_folder_made_beforehand_gets_the_default_experiment(tmp_path, monkeypatch):
    """`mkdir mlruns` and MLFLOW_TRACKING_URI=file://.../mlruns: MLflow makes its Default experiment (id 0) only
    in a store folder it creates itself, and the run was `MLflow init failed (... Could not find experiment with
    ID 0)`: MLflow off for the whole run. Without a name, the experiment named Default is used, made if missing."""
    from mlflow.tracking import MlflowClient

    from shardtrain.observability.mlflow_run import MlflowRun

    (tmp_path / "mlruns").mkdir()
    store = (tmp_path / "mlruns").resolve().as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    warnings = []
    run = MlflowRun(warnings.append, tmp_path / "out", None, {})
    assert warnings == [] and run.active and run.experiment == "Default"
    run.finish({})
    assert MlflowClient(tracking_uri=store).get_run(run.run_id).info.status == "FINISHED"


def test_a_preempted_attempt_leaves_no_summary_figures_beside_the_real_ones(tmp_path, capsys):
    """An attempt stopped by a preemption logged summary/final_loss and summary/eval/* at its stop step, and the
    requeued attempt its own at the end: two "final" losses in TensorBoard and MLflow for one run."""
    from mlflow.tracking import MlflowClient

    out = tmp_path / "run"
    cfg = config(out, "--report-to", "tensorboard,mlflow")
    first = Tracker(cfg, DIST, Console(0), out, 0, RUN_INFO)
    for step, loss in ((1, 1.0), (2, 0.9)):
        first.step(record(step, loss), BATCH)
    state = first.checkpoint_state()
    first.finish({"train_loss": [0.9], "eval": {"accuracy": 0.5}, "samples_per_sec": 4.0, "preempted": True})
    resumed = Tracker(cfg, DIST, Console(0), out, 2, RUN_INFO, resume_state=state)
    for step, loss in ((3, 0.7), (4, 0.6)):
        resumed.step(record(step, loss), BATCH)
    resumed.finish({"train_loss": [0.6], "eval": {"accuracy": 0.75}, "samples_per_sec": 4.0})
    tb = tensorboard_scalars(out / "tensorboard")
    assert tb["summary/final_loss"] == pytest.approx({4: 0.6}) and tb["summary/eval/accuracy"] == {4: 0.75}
    client = MlflowClient(tracking_uri=(out / "mlruns").resolve().as_uri())
    run_id = state["mlflow_run_id"]
    assert mlflow_history(client, run_id, "summary/final_loss") == [(4, 0.6)]
    assert client.get_run(run_id).info.status == "FINISHED"


def test_eval_lines_and_export_show_any_workloads_metrics_alike(tmp_path, capsys):
    """One format for every workload's metrics: a workload that returned the default three plus its own had its
    own dropped from the eval line, and `export --eval` printed a user's workload's as `n_examples 8`, a built-in's
    as `(8 examples)`."""
    from shardtrain.commands.export import _print_evals

    tracker = Tracker(config(tmp_path / "run"), DIST, Console(0), tmp_path / "run", 0, RUN_INFO)
    capsys.readouterr()
    fp32 = {"accuracy": 0.5, "macro_f1": 0.4, "n_examples": 8, "top2_accuracy": 0.875}
    tracker.evaluated(2, fp32)
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line == "step 2 eval | accuracy 0.5000 | macro-F1 0.4000 | 8 examples | top2_accuracy 0.8750"
    _print_evals({"eval_fp32": fp32, "eval_int8": {**fp32, "accuracy": 0.375}})
    assert capsys.readouterr().out.splitlines() == [
        "fp32 validation: accuracy 0.5000, macro-F1 0.4000, 8 examples, top2_accuracy 0.8750",
        "int8 validation: accuracy 0.3750 (-0.1250), macro-F1 0.4000 (+0.0000), 8 examples, "
        "top2_accuracy 0.8750 (+0.0000)",
    ]
