"""The SageMaker environment -> settings mapping, hyperparameter spellings, and the SDK launcher's arguments."""

from __future__ import annotations

import importlib.util

import pytest
from launch import REPO

from shardtrain.config.sagemaker_env import sagemaker_settings
from shardtrain.config.settings import Config, ConfigError, parse_cli, with_sagemaker_env

SM_KEYS = (
    "SM_CHANNEL_TRAIN",
    "SM_CHANNEL_TRAINING",
    "SM_CHANNEL_VALIDATION",
    "SM_MODEL_DIR",
    "SM_HOSTS",
    "SM_CURRENT_HOST",
    "SM_TRAINING_ENV",
    "SHARDTRAIN_SM_CHECKPOINT_DIR",
)


@pytest.fixture
def clean_env(monkeypatch):
    import os

    for k in list(os.environ):
        if k.startswith("SM_") or k in SM_KEYS or k == "RANK":
            monkeypatch.delenv(k)
    return monkeypatch


def test_outside_sagemaker_nothing_changes():
    cfg, applied = with_sagemaker_env(Config(), set(), env={"HOME": "/root"})
    assert applied == {}
    assert cfg == Config()


def test_channels_model_and_checkpoint_folders():
    env = {
        "SM_CHANNEL_TRAIN": "/opt/ml/input/data/train",
        "SM_CHANNEL_VALIDATION": "/opt/ml/input/data/validation",
        "SM_MODEL_DIR": "/opt/ml/model",
        "SM_HOSTS": '["algo-1"]',
    }
    assert sagemaker_settings(env) == {
        "data_dir": "/opt/ml/input/data/train",
        "eval_data_dir": "/opt/ml/input/data/validation",
        "final_model_dir": "/opt/ml/model",
        "output_dir": "/opt/ml/checkpoints",
    }
    # `fit("s3://...")` names its single channel "training"
    assert sagemaker_settings({"SM_CHANNEL_TRAINING": "/x"})["data_dir"] == "/x"


def test_flags_win_over_the_environment():
    cfg, applied = with_sagemaker_env(Config(), {"output_dir"}, env={"SM_MODEL_DIR": "/m", "SM_CHANNEL_TRAIN": "/t"})
    assert cfg.checkpoint.output_dir == Config().checkpoint.output_dir
    assert cfg.data.data_dir == "/t" and cfg.checkpoint.final_model_dir == "/m"
    assert "output_dir" not in applied


def test_several_hosts_without_a_launcher_is_refused():
    with pytest.raises(
        ConfigError, match=r"ModelTrainer\(distributed=Torchrun\(\)\) \(SDK v2: distribution=\{.torch_distributed"
    ):
        with_sagemaker_env(Config(), set(), env={"SM_HOSTS": '["algo-1","algo-2"]'})
    with_sagemaker_env(Config(), set(), env={"SM_HOSTS": '["algo-1","algo-2"]', "RANK": "0"})


def test_parse_cli_takes_sagemaker_spellings_and_env(clean_env, tmp_path):
    (tmp_path / "val").mkdir()
    clean_env.setenv("SM_CHANNEL_TRAIN", str(tmp_path))
    clean_env.setenv("SM_CHANNEL_VALIDATION", str(tmp_path / "val"))
    clean_env.setenv("SHARDTRAIN_SM_CHECKPOINT_DIR", str(tmp_path / "ckpt"))
    cfg = parse_cli(
        [
            "--config",
            str(REPO / "configs/multimodal_tiny.yaml"),
            "--per_device_batch_size",
            "8",
            "--max_steps=7",
            "--activation_checkpointing",
            "True",
            "--gradient_accumulation_steps",
            "2",
        ]
    )
    assert (cfg.train.per_device_batch_size, cfg.train.max_steps, cfg.train.grad_accum) == (8, 7, 2)
    assert cfg.train.activation_checkpointing is True
    assert cfg.data.data_dir == str(tmp_path) and cfg.data.eval_data_dir == str(tmp_path / "val")
    assert cfg.checkpoint.output_dir == str(tmp_path / "ckpt")
    # Quoted as typed, suggested in our spelling.
    with pytest.raises(
        ConfigError, match=r"unknown hyperparameter 'max_stepz'; did you mean 'max_steps' \(--max-steps\)"
    ):
        parse_cli(["--max_stepz", "3"])


def test_missing_validation_channel_folder_is_one_line(clean_env, tmp_path):
    clean_env.setenv("SM_CHANNEL_VALIDATION", str(tmp_path / "nope"))
    clean_env.setenv("SHARDTRAIN_SM_CHECKPOINT_DIR", str(tmp_path / "ckpt"))
    with pytest.raises(ConfigError, match=r"--eval-data-dir \(data.eval_data_dir\): folder not found"):
        parse_cli(["--config", str(REPO / "configs/multimodal_tiny.yaml")])


def _example():
    spec = importlib.util.spec_from_file_location("sm_example", REPO / "examples/sagemaker/launch.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_example_launcher_builds_the_job_without_sdk_or_aws():
    ex = _example()
    job = ex.build_job("arn:aws:iam::1:role/R", "img:latest", "bkt", "s3://bkt/train", "s3://bkt/val")
    assert job["compute"] == {
        "instance_type": "ml.p3.8xlarge",
        "instance_count": 1,
        "volume_size_in_gb": 100,
        "enable_managed_spot_training": True,
    }
    assert job["distributed"]["kind"] == "torchrun"
    assert job["checkpoint_config"] == {
        "s3_uri": "s3://bkt/shardtrain-longformer/checkpoints",
        "local_path": "/opt/ml/checkpoints",
    }
    assert job["stopping_condition"]["max_wait_time_in_seconds"] >= job["stopping_condition"]["max_runtime_in_seconds"]
    assert job["source_code"]["entry_script"] == "shardtrain/main.py"
    assert (REPO / job["source_code"]["source_dir"] / job["source_code"]["entry_script"]).is_file()
    hp = job["trainer"]["hyperparameters"]
    assert hp["config"] == "configs/longformer_4096.yaml" and (REPO / hp["config"]).is_file()
    assert hp["strategy"] == "ddp"  # shardtrain plan's pick for 4 x V100 (tests/dist/test_seed_setup.py)
    assert job["input_data"] == {"train": "s3://bkt/train", "validation": "s3://bkt/val"}
    # every hyperparameter is a flag shardtrain accepts, spelled as SageMaker passes it
    from shardtrain.config.settings import FIELDS

    assert all(k in FIELDS or k == "config" for k in hp)

    on_demand = ex.build_job("r", "i", "b", "s3://b/t", spot=False)
    assert "enable_managed_spot_training" not in on_demand["compute"]
    assert "max_wait_time_in_seconds" not in on_demand["stopping_condition"]
    with pytest.raises(ValueError, match="max_wait_hours"):
        ex.build_job("r", "i", "b", "s3://b/t", max_run_hours=10, max_wait_hours=5)


def test_a_bad_hyperparameter_names_its_own_spelling(monkeypatch):
    from shardtrain.config.settings import parse_cli

    monkeypatch.setenv("SM_CURRENT_HOST", "algo-1")
    with pytest.raises(
        ConfigError,
        match=r"^unknown hyperparameter 'save_evry'; did you mean 'save_every' "
        r"\(--save-every\)\?$",
    ):
        parse_cli(["--save_evry", "200"])
    monkeypatch.delenv("SM_CURRENT_HOST")
    with pytest.raises(ConfigError, match=r"^unknown argument '--save_evry'; did you mean '--save-every'\?$"):
        parse_cli(["--save_evry", "200"])


def test_failure_reason_is_written_once_under_sagemaker_only(tmp_path):
    from shardtrain.config.sagemaker_env import write_failure_reason

    failure = tmp_path / "failure"
    write_failure_reason("shardtrain: error: x", env={"SM_OUTPUT_FAILURE": str(failure)})  # no SM marker
    assert not failure.exists()
    env = {"SM_OUTPUT_FAILURE": str(failure), "SM_CURRENT_HOST": "algo-1"}
    write_failure_reason("shardtrain: error: first", env=env)
    write_failure_reason("shardtrain: error: second", env=env)
    assert failure.read_text() == "shardtrain: error: first\n"
