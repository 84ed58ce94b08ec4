"""SageMaker simulated on CPU, both ways SageMaker starts a script:

1. plain `python` (no distribution): `shardtrain train` relaunches itself with `--nproc 2` under torch's
   elastic launcher; world size 2; the idle-GPU guard runs on the real gathered table (CPU: no warning);
2. `torch_distributed` (torchrun): the same environment resumes the first run's checkpoint, as after a
   spot interruption.
Data comes from the two channel folders, checkpoints from the folder SageMaker syncs (a tmp dir through
SHARDTRAIN_SM_CHECKPOINT_DIR, the override of /opt/ml/checkpoints), the final model goes to SM_MODEL_DIR.
"""

from __future__ import annotations

import json
import shutil

from launch import REPO, cli, torchrun
from launch import test_env as launch_env

N_VAL = 20


def _channels(src, root):
    train, val = root / "train", root / "validation"
    (train / "images").mkdir(parents=True)
    (val / "images").mkdir(parents=True)
    shutil.copy(src / "train.jsonl", train / "train.jsonl")
    shutil.copytree(src / "images" / "train", train / "images" / "train")
    lines = (src / "validation.jsonl").read_text().splitlines()[:N_VAL]
    (val / "validation.jsonl").write_text("\n".join(lines) + "\n")
    shutil.copytree(src / "images" / "validation", val / "images" / "validation")
    return train, val


def test_sagemaker_plain_python_then_torchrun_resume(mm_data, tmp_path):
    train, val = _channels(mm_data, tmp_path / "input")
    ckpt, model = tmp_path / "checkpoints", tmp_path / "model"
    env = launch_env(
        SM_CHANNEL_TRAIN=train,
        SM_CHANNEL_VALIDATION=val,
        SM_MODEL_DIR=model,
        SM_HOSTS='["algo-1"]',
        SM_CURRENT_HOST="algo-1",
        SM_NUM_GPUS=0,
        SHARDTRAIN_SM_CHECKPOINT_DIR=ckpt,
    )
    # Hyperparameters spelled as SageMaker passes them: verbatim names, underscores.
    hp = [
        "--config",
        str(REPO / "configs/multimodal_tiny.yaml"),
        "--device",
        "cpu",
        "--per_device_batch_size",
        "4",
        "--save_every",
        "2",
        "--log_every",
        "1",
    ]

    first = cli(["train", *hp, "--max_steps", "2", "--nproc", "2"], env=env)
    assert "starting 2 processes" in first.output
    assert "idle" not in first.output
    summary = json.loads((ckpt / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["final_step"] == 2
    assert summary["config"]["data"]["data_dir"] == str(train)
    assert summary["eval"]["n_examples"] == N_VAL  # the validation channel, not a file beside train.jsonl
    assert (ckpt / "checkpoints" / "step-000002" / "COMMITTED").is_file()
    assert (ckpt / "tokenizer" / "tokenizer.json").is_file()  # resume needs it: it lives in the synced folder

    second = torchrun([*hp, "--max_steps", "3"], env=env)
    assert "resumed from" in second.output and "step-000002" in second.output
    summary = json.loads((ckpt / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["final_step"] == 3
    steps = [json.loads(line)["step"] for line in (ckpt / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    assert (ckpt / "checkpoints" / "step-000003" / "COMMITTED").is_file()
    # the consolidated model of the last step, on rank 0, where SageMaker packs model.tar.gz
    assert (model / "model.safetensors").is_file() and (model / "config.json").is_file(), second.tail()
    assert json.loads((model / "shardtrain_export.json").read_text())["checkpoint"].endswith("step-000003")
