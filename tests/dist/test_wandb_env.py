"""W&B as HF Trainer and Lightning users know it, read back from the offline run files: the WANDB_* variables,
a sweep agent's `--key=value` arguments and run id, the final model as an artifact, and system metrics."""

from __future__ import annotations

import json

import launch
from launch import cli, tiny_args
from wandb_records import read_run

WANDB_ENV = {
    "WANDB_MODE": "offline",
    "WANDB_PROJECT": "proj-x",
    "WANDB_ENTITY": "team-y",
    "WANDB_RUN_GROUP": "grp-1",
    "WANDB_TAGS": "fsdp,tiny",
    "WANDB_NAME": "run-name",
    "WANDB_NOTES": "notes here",
    "WANDB_LOG_MODEL": "end",
    # W&B samples system metrics every 15 s by default: a tiny run would end before the first sample.
    "WANDB__STATS_SAMPLING_INTERVAL": "0.2",
}


def _only_run(folder):
    runs = sorted(folder.glob("offline-run-*"))
    assert len(runs) == 1, runs
    return read_run(next(runs[0].glob("run-*.wandb")))


def test_wandb_variables_sweep_arguments_model_artifact_and_system_metrics(ld_data, tmp_path):
    # What `wandb agent` runs: every hyperparameter as --key=value in the sweep config's spelling, its run id
    # in WANDB_RUN_ID; the user's WANDB_* variables around it.
    out, wandb_dir = tmp_path / "sweep", tmp_path / "wandb-dir"
    env = launch.test_env(**WANDB_ENV, WANDB_DIR=wandb_dir, WANDB_RUN_ID="sweeprun01")
    cli(
        [
            "train",
            "--nproc",
            "1",
            *tiny_args(
                "longformer",
                ld_data,
                out,
                "--report_to=wandb",
                "--max_steps=2",
                "--lr=0.0005",
                "--per_device_batch_size=4",
            ),
        ],
        env=env,
    )
    assert not (out / "wandb").exists(), "WANDB_DIR is set: the run files belong there"
    rec = _only_run(wandb_dir / "wandb")
    assert rec["run_id"] == "sweeprun01"
    assert rec["run"] == {
        "project": "proj-x",
        "entity": "team-y",
        "run_group": "grp-1",
        "display_name": "run-name",
        "notes": "notes here",
        "tags": ["fsdp", "tiny"],
    }
    train = rec["config"]["config"]["train"]
    assert (train["lr"], train["per_device_batch_size"], train["max_steps"]) == (0.0005, 4, 2)
    state = json.loads(next((out / "checkpoints").glob("step-*/trainer_state.json")).read_text())
    assert state["wandb_run_id"] == "sweeprun01"  # a requeue continues the sweep's run
    # WANDB_LOG_MODEL=end: the exported final model, as one artifact of type "model".
    [artifact] = rec["artifacts"]
    assert (artifact["name"], artifact["type"]) == ("model-sweeprun01", "model")
    assert {"model.safetensors", "shardtrain_export.json"} <= set(artifact["files"])
    assert (out / "final_model" / "model.safetensors").is_file()
    assert "stats" not in rec["kinds"], "system metrics are off by default on a CPU run"

    # Flags win over the variables: system metrics on, no model artifact; without WANDB_DIR, files go to OUT.
    out2 = tmp_path / "flags"
    env2 = launch.test_env(**WANDB_ENV)
    cli(
        [
            "train",
            "--nproc",
            "1",
            *tiny_args(
                "longformer",
                ld_data,
                out2,
                "--report-to",
                "wandb",
                "--max-steps",
                "2",
                "--wandb-system-metrics",
                "--wandb-log-model",
                "false",
                "--wandb-project",
                "flag-project",
            ),
        ],
        env=env2,
    )
    rec2 = _only_run(out2 / "wandb")
    assert rec2["run"]["project"] == "flag-project"
    assert rec2["kinds"].get("stats", 0) > 0
    assert not rec2["artifacts"] and not (out2 / "final_model").exists()
