"""`shardtrain doctor`: its checks on crafted environments, and the command's lines, JSON and exit codes."""

from __future__ import annotations

import json
import subprocess
import sys

from launch import REPO, cli
from launch import test_env as launch_env

from shardtrain.commands import doctor


def levels(problems):
    return [(p.level, p.message) for p in problems]


def test_world_size_without_rank_blocks():
    p = doctor.check_launcher({"WORLD_SIZE": "4"}, n_gpus=4)[0]
    assert p.level == "error" and "WORLD_SIZE=4" in p.message and "torchrun --nproc_per_node=4" in p.fix


def test_launcher_env_checks():
    assert doctor.check_launcher({}, 0) == []
    assert (
        doctor.check_launcher(
            {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, 2
        )
        == []
    )
    msgs = levels(doctor.check_launcher({"RANK": "5", "WORLD_SIZE": "2"}, 0))
    assert ("error", "RANK=5 is outside 0..WORLD_SIZE-1 (1)") in msgs
    assert any(lv == "error" and "MASTER_ADDR and MASTER_PORT unset" in m for lv, m in msgs)
    assert any(lv == "warning" and "LOCAL_RANK is not" in m for lv, m in msgs)
    (p,) = doctor.check_launcher({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "2"}, 2)
    assert p.level == "error" and "only 2 GPU(s)" in p.message
    (p,) = doctor.check_launcher({}, 4)  # the SageMaker plain-python case
    assert p.level == "warning" and "GPU 0 only" in p.message and "--nproc auto" in p.fix


def test_sagemaker_checks(tmp_path):
    train = tmp_path / "train"
    train.mkdir()
    env = {
        "SM_CHANNEL_TRAIN": str(train),
        "SM_CHANNEL_VALIDATION": str(tmp_path / "missing"),
        "SM_NUM_GPUS": "4",
        "SM_HOSTS": '["algo-1","algo-2"]',
    }
    msgs = levels(doctor.check_sagemaker(env, n_gpus=4))
    assert ("error", f"SM_CHANNEL_VALIDATION={tmp_path / 'missing'} is not a folder") in msgs
    assert any("has no train.jsonl" in m for _, m in msgs)
    assert any(lv == "error" and "2 SageMaker hosts and no launcher" in m for lv, m in msgs)
    fix = next(p.fix for p in doctor.check_sagemaker(env, n_gpus=4) if "no launcher" in p.message)
    assert fix.startswith("start the job with ModelTrainer(distributed=Torchrun()) (SDK v2: distribution="), fix
    # csv in the channel: the error says what it holds and how to name it; named by a hyperparameter, no error.
    # (A trial's doctor failed csv data that trains, which the docs name by hyperparameters.)
    (train / "train.csv").write_text("document,sentiment\n")
    csv_env = {"SM_CHANNEL_TRAIN": str(train), "SM_NUM_GPUS": "4", "SM_HOSTS": '["algo-1"]'}
    (problem,) = [p for p in doctor.check_sagemaker(csv_env, 4) if "train.jsonl" in p.message]
    assert problem.message.endswith("has no train.jsonl; the folder holds train.csv: name it with --train-file "
                                    "(and --text-column-names / --label-column-name for other column names), as "
                                    "docs/data.md shows")  # fmt: skip
    assert "train_file=/opt/ml/input/data/train/train.csv" in problem.fix
    named = {**csv_env, "SM_HPS": json.dumps({"train_file": str(train / "train.csv"), "text_column_names": "document"})}
    assert doctor.check_sagemaker(named, 4) == []
    (train / "train.jsonl").write_text("")
    (train / "validation.jsonl").write_text("")
    ok = {"SM_CHANNEL_TRAIN": str(train), "SM_NUM_GPUS": "4", "SM_HOSTS": '["algo-1"]'}
    assert doctor.check_sagemaker(ok, 4) == []
    assert levels(doctor.check_sagemaker(ok, 1)) == [("warning", "SM_NUM_GPUS=4 but torch sees 1 GPU(s)")]


def test_threads_and_workers():
    (p,) = doctor.check_threads({}, cpus=16, procs_per_node=4, workers=None)
    assert "OMP_NUM_THREADS is unset" in p.message and "1.8x slower" in p.message and "=4" in p.fix
    (p,) = doctor.check_threads({"OMP_NUM_THREADS": "8"}, 16, 4, None)
    assert "8 x 4 processes > 16 CPUs" in p.message
    (p,) = doctor.check_threads({"OMP_NUM_THREADS": "1"}, 16, 4, workers=4)
    assert "20 > 16 CPUs" in p.message and p.fix == "--num-workers 3"
    assert doctor.check_threads({"OMP_NUM_THREADS": "4"}, 16, 4, workers=2) == []


def test_nccl_settings():
    ifaces = ["lo", "eth0", "ens5"]
    (p,) = doctor.check_nccl({"NCCL_SOCKET_IFNAME": "eth9"}, ifaces)
    assert p.level == "error" and "lo, eth0, ens5" in p.message
    for ok in ("eth", "en,eth", "=ens5", "^docker"):
        assert doctor.check_nccl({"NCCL_SOCKET_IFNAME": ok}, ifaces) == []
    assert doctor.check_nccl({"NCCL_IB_DISABLE": "1"}, ifaces)[0].level == "warning"


def test_ops_without_compiler():
    msgs = levels(doctor.check_ops({"ninja": False, "cxx": None, "ops": {"cpu_adam": False}}))
    assert [lv for lv, _ in msgs] == ["warning"] * 3


def test_import_is_light():
    code = "import sys, shardtrain.commands.doctor; print('deepspeed' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=launch_env(), check=True
    ).stdout.split()
    assert out == ["False", "False"]


def test_doctor_command_crafted_env(tmp_path):
    env = launch_env(
        WORLD_SIZE="4",
        SM_NUM_GPUS="4",
        SM_HOSTS='["algo-1"]',
        SM_CURRENT_HOST="algo-1",
        SM_MODEL_DIR=str(tmp_path),
        SM_CHANNEL_TRAIN=str(tmp_path),
        NCCL_DEBUG="INFO",
    )
    env.pop("OMP_NUM_THREADS")
    run = cli(["doctor", "--json"], env=env, check=False)
    assert run.returncode == 1, run.tail()
    report = json.loads(run.output[run.output.index("{") :])
    assert report["ok"] is False
    assert report["env"]["sagemaker"]["SM_CHANNEL_TRAIN"] == str(tmp_path)
    assert report["env"]["launcher"] == {"WORLD_SIZE": "4"}
    assert set(report["versions"]) >= {"torch", "cuda", "nccl", "deepspeed", "transformers"}
    assert set(report["deepspeed_ops"]["ops"]) == {"cpu_adam", "fused_adam"}
    messages = [p["message"] for p in report["problems"]]
    assert any("WORLD_SIZE=4 is set but RANK is not" in m for m in messages)
    assert any("OMP_NUM_THREADS is unset" in m for m in messages)
    assert any("NCCL_DEBUG=INFO" in m for m in messages)
    assert any("has no train.jsonl" in m for m in messages)

    clean = cli(["doctor", "--config", str(REPO / "configs/multimodal_tiny.yaml")], env=launch_env())
    lines = clean.output.splitlines()
    assert lines[0].startswith("versions: python") and "deepspeed 0." in lines[0]
    assert any(line.startswith("deepspeed ops: ninja") for line in lines)
    assert not any(line.startswith("error:") for line in lines)


def test_counts_read_as_english():
    (p,) = doctor.check_threads({}, cpus=2, procs_per_node=1, workers=None)
    assert p.fix == "export OMP_NUM_THREADS=2 (2 CPUs for 1 process)"
    omp, workers = doctor.check_threads({"OMP_NUM_THREADS": "2"}, cpus=1, procs_per_node=1, workers=1)
    assert omp.message == "OMP_NUM_THREADS=2 x 1 process > 1 CPU: threads fight for cores"
    assert workers.message == "1 loader worker x 1 process + the processes themselves = 2 > 1 CPU"
    report = {
        "versions": {},
        "gpus": [],
        "deepspeed_ops": {"ninja": True, "cxx": "g++", "ops": {}},
        "env": {"omp_num_threads": None},
        "cpus": 1,
        "processes_per_node": 1,
        "loader_workers": 1,
        "problems": [{"level": "warning", "message": "m", "fix": "f"}],
    }
    text = doctor.render(report)
    assert "| 1 CPU | 1 process per node | 1 loader worker" in text and text.endswith("0 errors, 1 warning")
