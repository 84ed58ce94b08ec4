"""Observability on real 2-process gloo runs: banner, plain log lines, quiet libraries, the loggers (the offline W&B
run, TensorBoard and MLflow: one run each per job, continued after a resume, no API key anywhere), the automatic
report, and `shardtrain parity`."""

from __future__ import annotations

import json

import launch
from launch import cli, tiny_args, torchrun
from logger_records import mlflow_history, tensorboard_scalars
from wandb_records import read_run

from shardtrain.checkpointing.store import TRAINER_STATE, checkpoints_root, step_dir_name

# Two sequential 2-process runs; a DeepSpeed one took ~4 min on the shared 2-core box under load.
PARITY_TIMEOUT = 900
SECRET = "sk-test-0123456789abcdef-not-a-real-key"
CHATTER = (
    "FutureWarning",
    "built successfully",
    "No CUDA runtime is found",
    "Setting ds_accelerator",
    "Setting accelerator to CPU",
)


def _no_secret(out, text: str) -> None:
    assert SECRET not in text
    for f in out.rglob("*"):
        if f.is_file():
            assert SECRET.encode() not in f.read_bytes(), f"API key written to {f}"


def test_loggers_banner_report_and_resume(ld_data, tmp_path, monkeypatch):
    out = tmp_path / "run"
    store = (tmp_path / "mlruns").as_uri()  # an MLflow server's stand-in: a file store outside the run
    env = launch.test_env(WANDB_API_KEY=SECRET, MLFLOW_TRACKING_URI=store, MLFLOW_ALLOW_FILE_STORE="true",
                          MLFLOW_EXPERIMENT_NAME="obs")  # fmt: skip
    common = [
        "--strategy",
        "ddp",
        "--report-to",
        "wandb,tensorboard,mlflow",
        "--wandb-run-name",
        "obs-test",
        "--log-every",
        "1",
        "--eval-every",
        "1",
        "--save-every",
        "2",
        "--max-eval-samples",
        "8",
    ]
    first = torchrun(
        tiny_args(
            "longformer", ld_data, out, *common, "--max-steps", "2", "--predict-memory", "true", "--report", "true"
        ),
        env=env,
    )

    # Banner: every rank, the batch arithmetic, the memory prediction; plain lines, no chatter.
    text = first.output
    assert "micro 8 x accum 1 x world 2 = global 16" in text
    assert text.count("  cpu          cpu") == 2 and "strategy    ddp" in text
    assert "step 1/2 | loss" in text and "step 2/2 | loss" in text and "ETA" in text
    assert "predicted per rank (shardtrain plan): variant ddp" in text
    assert "\r" not in text and "\x1b" not in text
    assert not [c for c in CHATTER if c in text], text[-3000:]

    runs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    rec = read_run(next(runs[0].glob("run-*.wandb")))
    losses = {h["train/step"]: h["train/loss"] for h in rec["history"] if "train/loss" in h}
    assert sorted(losses) == [1, 2]
    assert [round(x, 6) for x in losses.values()] == [round(m["loss"], 6) for m in first.metrics]
    assert all("perf/samples_per_sec" in h and "perf/tokens_per_sec" in h for h in rec["history"] if "train/loss" in h)
    assert any("eval/accuracy" in h for h in rec["history"])
    assert any(k.startswith("mem/rank1/") for h in rec["history"] for k in h)
    assert rec["config"]["config"]["train"]["max_steps"] == 2
    assert rec["config"]["run"]["strategy"] == "ddp" and "torch" in rec["config"]["versions"]
    state = json.loads((checkpoints_root(out) / step_dir_name(2) / TRAINER_STATE).read_text())
    assert state["wandb_run_id"] == rec["run_id"]
    # TensorBoard and MLflow got the same figures, from rank 0 alone; the banner said where.
    mlflow_id = state["mlflow_run_id"]
    assert (f"loggers     wandb (project shardtrain, run {rec['run_id']}, offline) | tensorboard ({out}/tensorboard)"
            f" | mlflow ({store}, experiment obs, run {mlflow_id})") in text  # fmt: skip
    tb = tensorboard_scalars(out / "tensorboard")
    assert [round(v, 6) for v in tb["train/loss"].values()] == [round(m["loss"], 6) for m in first.metrics]
    assert "eval/accuracy" in tb and any(k.startswith("mem/rank1/") for k in tb) and "perf/tokens_per_sec" in tb
    assert len(list((out / "tensorboard").glob("events.out.tfevents.*"))) == 1
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # for this reader too
    client = MlflowClient(tracking_uri=store)
    assert mlflow_history(client, mlflow_id, "train/loss") == [(m["step"], round(m["loss"], 6)) for m in first.metrics]

    # The end-of-run report, written automatically, holds this run's numbers.
    html = (out / "report.html").read_text()
    assert f"{first.metrics[-1]['loss']:.4f}" in html and f"{first.summary['eval']['accuracy']:.4f}" in html
    assert (out / "memory.png").read_bytes()[:4] == b"\x89PNG" and (out / "curves.png").stat().st_size > 10_000
    assert first.summary["run"]["ranks"][1]["rank"] == 1 and first.summary["run"]["steps_per_epoch"] > 0

    # A resumed job continues the same W&B run.
    # tiny_args says --resume none; the later flag wins.
    second = torchrun(
        tiny_args(
            "longformer", ld_data, out, *common, "--max-steps", "3", "--resume", "auto", "--predict-memory", "false"
        ),
        env=env,
    )
    runs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 2
    resumed = read_run(next(runs[-1].glob("run-*.wandb")))
    assert resumed["run_id"] == rec["run_id"]
    assert sorted(h["train/step"] for h in resumed["history"] if "train/loss" in h) == [3]
    # ... and the same MLflow run, finished, and one TensorBoard run (a second event file in its folder).
    [run] = client.search_runs([client.get_experiment_by_name("obs").experiment_id])
    assert run.info.run_id == mlflow_id and run.info.status == "FINISHED" and run.info.run_name == "obs-test"
    assert [step for step, _ in mlflow_history(client, mlflow_id, "train/loss")] == [1, 2, 3]
    assert sorted(tensorboard_scalars(out / "tensorboard")["train/loss"]) == [1, 2, 3]
    _no_secret(out, first.output + second.output)


def test_parity_agrees_across_strategies(ld_data, tmp_path):
    run = cli(
        [
            "parity",
            "--config",
            "configs/longformer_tiny.yaml",
            "--strategies",
            "ddp,fsdp",
            "--steps",
            "3",
            "--nproc",
            "2",
            "--out",
            str(tmp_path),
            "--data-dir",
            str(ld_data),
            "--max-eval-samples",
            "8",
        ],
        timeout=PARITY_TIMEOUT,
    )
    assert "parity: OK" in run.output
    report = json.loads((tmp_path / "parity.json").read_text())
    assert [r["step"] for r in report["steps"]] == [1, 2, 3] and report["first_divergence"] is None


def test_parity_exits_nonzero_on_divergence(ld_data, tmp_path):
    # A different learning rate changes nothing at step 1 (loss before any update) and everything after.
    run = cli(
        [
            "parity",
            "--config",
            "configs/longformer_tiny.yaml",
            "--strategies",
            "ddp,zero2",
            "--steps",
            "2",
            "--nproc",
            "2",
            "--out",
            str(tmp_path),
            "--data-dir",
            str(ld_data),
            "--max-eval-samples",
            "8",
            "--args-for",
            "zero2=--lr 5e-3",
        ],
        check=False,
        timeout=PARITY_TIMEOUT,
    )
    assert run.returncode == 1, run.tail()
    assert "DIVERGED at step 2: zero2 vs ddp" in run.output
    report = json.loads((tmp_path / "parity.json").read_text())
    assert report["steps"][0]["loss_rel_diff"]["zero2"] < 1e-6
    # The DeepSpeed run's own log: banner with the resolved config, and none of DeepSpeed's chatter.
    log = (tmp_path / "zero2" / "parity.log").read_text()
    assert '"stage": 2' in log and "micro 8 x accum 1 x world 2 = global 16" in log
    assert not [c for c in CHATTER if c in log], log[-3000:]
