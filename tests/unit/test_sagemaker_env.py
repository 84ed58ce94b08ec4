"""The SageMaker environment -> settings mapping, hyperparameter spellings, and the SDK launcher's arguments."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path

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
    with_sagemaker_env(Config(), {"output_dir"}, env={"SM_HOSTS": '["algo-1","algo-2"]', "RANK": "0"})


def test_several_instances_on_their_own_checkpoint_folders_are_refused_naming_what_works():
    """Each instance's /opt/ml/checkpoints is its own disk, synced to S3: the ranks of two instances would
    never see each other's checkpoint files. An output_dir the user chose (FSx, EFS) is theirs to share."""
    two = {"SM_HOSTS": '["algo-1","algo-2"]', "RANK": "2", "SM_MODEL_DIR": "/opt/ml/model"}
    with pytest.raises(ConfigError) as e:
        with_sagemaker_env(Config(), set(), env=two)
    assert "\n" not in str(e.value) and "2 instances" in str(e.value) and "/opt/ml/checkpoints" in str(e.value)
    assert "output_dir (--output-dir)" in str(e.value) and "FSx for Lustre or EFS" in str(e.value)
    cfg, applied = with_sagemaker_env(Config(), {"output_dir"}, env=two)  # --output-dir /fsx/run
    assert "output_dir" not in applied and applied["final_model_dir"] == "/opt/ml/model"
    with_sagemaker_env(Config(), set(), env={**two, "SM_HOSTS": '["algo-1"]'})  # one instance: its own disk is fine


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


def test_files_named_by_hyperparameters_leave_the_channels_unmapped_and_the_line_says_so(clean_env, tmp_path, capsys):
    """With train_file set (Hugging Face's csv/jsonl, class names as labels), the start-up line still said
    data_dir=<the train channel>, a folder the run never read."""
    train, val = tmp_path / "train", tmp_path / "validation"
    for folder, name in ((train, "train.csv"), (val, "validation.csv")):
        folder.mkdir()
        (folder / name).write_text("text,label\nsome words,positive\nother words,negative\n")
    clean_env.setenv("SM_CHANNEL_TRAIN", str(train))
    clean_env.setenv("SM_CHANNEL_VALIDATION", str(val))
    clean_env.setenv("SHARDTRAIN_SM_CHECKPOINT_DIR", str(tmp_path / "ckpt"))
    tiny = str(REPO / "configs/longformer_tiny.yaml")
    cfg = parse_cli(
        ["--config", tiny, "--train_file", str(train / "train.csv"), "--validation_file", str(val / "validation.csv")]
    )
    out = capsys.readouterr().out
    assert cfg.data.data_dir != str(train) and cfg.data.eval_data_dir != str(val)
    line = next(x for x in out.splitlines() if x.startswith("shardtrain: SageMaker environment:"))
    assert "data_dir" not in line.split("(")[0] and f"output_dir={tmp_path / 'ckpt'}" in line, line
    assert "channels train, validation not mapped to --data-dir: --train-file names the data" in line, line


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
        "s3_uri": f"s3://bkt/shardtrain-longformer/{job['run_id']}/checkpoints",
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


def test_the_example_launcher_passes_hyperparameters_for_csv_data(monkeypatch, capsys):
    """A trial's data was csv with class names: the docs name it by hyperparameters (train_file=...,
    text_column_names=...), and the launcher had no way to pass one."""
    ex = _example()
    started = []
    monkeypatch.setattr(ex, "start", lambda job, wait: started.append(job))
    csv = "/opt/ml/input/data/train/train.csv"
    hps = ["--hp", f"train_file={csv}", "--hp", "text_column_names=document", "--hp", "label_column_name=sentiment"]
    ex.main(["--role", "r", "--image", "i", "--bucket", "b", "--train", "s3://b/t", *hps])
    hp = started[0]["trainer"]["hyperparameters"]
    assert (hp["train_file"], hp["text_column_names"], hp["label_column_name"]) == (csv, "document", "sentiment")
    assert hp["config"] == "configs/longformer_4096.yaml"  # the defaults stay
    with pytest.raises(SystemExit):
        ex.main(["--role", "r", "--image", "i", "--bucket", "b", "--train", "s3://b/t", "--hp", "train_file"])
    assert "--hp train_file: write KEY=VALUE" in capsys.readouterr().err


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


def test_rank_0s_own_error_replaces_another_ranks_that_got_there_first(tmp_path):
    """Two instances: instance 2's first worker (rank 2) is not stopped by instance 1's launcher and says its line
    after the quiet wait; on a loaded machine that can precede rank 0's. Rank 0's line is the job's reason; a
    secondary one (a collective failing because another rank died) never replaces the cause."""
    from shardtrain.config.sagemaker_env import write_failure_reason

    failure = tmp_path / "failure"
    env = {"SM_OUTPUT_FAILURE": str(failure), "SM_CURRENT_HOST": "algo-2"}
    write_failure_reason("shardtrain: error (rank 2): same cause", env=env)
    write_failure_reason("shardtrain: error: a consequence", env=env)  # rank 0, secondary
    assert failure.read_text() == "shardtrain: error (rank 2): same cause\n"
    write_failure_reason("shardtrain: error: same cause", env=env, over_other_ranks=True)
    assert failure.read_text() == "shardtrain: error: same cause\n"
    write_failure_reason("shardtrain: error: later", env=env, over_other_ranks=True)  # rank 0's first line stays
    assert failure.read_text() == "shardtrain: error: same cause\n"


def test_each_job_gets_its_own_checkpoint_prefix_unless_it_continues_a_run():
    """Before, the prefix was fixed per base job name: the next job found the last one's finished run and
    trained nothing. A spot interruption keeps its prefix (SageMaker restarts the same job)."""
    ex = _example()
    one, two = (ex.build_job("r", "i", "b", "s3://b/t") for _ in range(2))
    assert one["run_id"] != two["run_id"]
    assert one["checkpoint_config"]["s3_uri"] != two["checkpoint_config"]["s3_uri"]
    again = ex.build_job("r", "i", "b", "s3://b/t", run_id=one["run_id"])  # --continue-run RUN_ID
    assert again["checkpoint_config"] == one["checkpoint_config"]


def _git(repo, *args):
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


def test_the_upload_is_the_checkouts_own_files_not_its_venv_runs_or_data(tmp_path):
    """Before, source_dir was the checkout root: 6.25 GB with a venv, runs/ and data/ beside 1.7 MB of code.
    Staged now: what git lists (tracked, and new files .gitignore does not exclude). The package folder
    shardtrain/data stays, which the SDK's name patterns ("data") would have dropped."""
    ex = _example()
    repo = tmp_path / "checkout"
    for name, text in {
        "shardtrain/main.py": "x",
        "shardtrain/data/loaders.py": "y",
        ".gitignore": "/.venv\n/runs/\n/data/\n",
    }.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    (repo / "my_task.py").write_text("new, not ignored: the user's own workload")
    for junk in (".venv/lib/torch.so", "runs/demo/checkpoints/step-1/model.bin", "data/train.jsonl"):
        (repo / junk).parent.mkdir(parents=True, exist_ok=True)
        (repo / junk).write_bytes(b"\0" * 1_000_000)
    assert ex.source_files(repo) == [".gitignore", "my_task.py", "shardtrain/data/loaders.py", "shardtrain/main.py"]
    staged = ex.stage_source(repo)
    assert sorted(str(p.relative_to(staged)) for p in staged.rglob("*") if p.is_file()) == ex.source_files(repo)
    assert (staged / "shardtrain/data/loaders.py").read_text() == "y"
    shutil.rmtree(repo / ".git")  # a downloaded archive: the same files, by .gitignore's top-level folders
    assert ex.source_files(repo) == [".gitignore", "my_task.py", "shardtrain/data/loaders.py", "shardtrain/main.py"]


def test_this_checkouts_upload_is_its_code_only(monkeypatch, tmp_path):
    ex = _example()
    pytest.importorskip("sagemaker.train", reason="the SageMaker SDK v3 (requirements-sagemaker.txt) is not installed")
    from sagemaker.train.model_trainer import Mode

    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")  # local mode: no AWS call (tests/sm_job.py)
    job = ex.build_job("arn:aws:iam::1:role/R", "img:latest", "bkt", str(tmp_path))
    trainer, _ = ex.make_trainer(job, training_mode=Mode.LOCAL_CONTAINER, local_container_root=str(tmp_path))
    staged = Path(trainer.source_code.source_dir)
    files = [p for p in staged.rglob("*") if p.is_file()]
    size = sum(p.stat().st_size for p in files)
    assert staged != REPO and (staged / "shardtrain/main.py").is_file() and (staged / "shardtrain/data").is_dir()
    assert len(files) == len(ex.source_files(REPO)) and size < 20_000_000, (len(files), size)
    assert not any(p.relative_to(staged).parts[0] in (".venv", "runs", ".git") for p in files)
