"""Smoke test for slurm/local-cluster/start.sh: one typed-GPU batch job.

Needs root (or Slurm already installed and running as root); skips only when
start.sh reports (exit code 3) that the munge/slurm packages are missing and
apt-get cannot install them.  Warm run: ~3 s.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest


@pytest.mark.slurm
def test_local_cluster_runs_typed_gpu_job(local_slurm, tmp_path: Path) -> None:
    slurm_conf = local_slurm.conf
    assert f"export SLURM_CONF={slurm_conf}" in local_slurm.start_output

    env = dict(os.environ, SLURM_CONF=slurm_conf)
    out = tmp_path / "job.out"
    job = subprocess.run(
        [
            "sbatch",
            "--wait",
            "--gres=gpu:a100:3",
            "--cpus-per-task=12",
            "--mem=64G",
            "--time=2",
            f"--output={out}",
            "--wrap",
            'echo "CVD=$CUDA_VISIBLE_DEVICES"; echo "NGPU=$SLURM_GPUS_ON_NODE"',
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=tmp_path,
    )
    assert job.returncode == 0, f"sbatch failed:\n{job.stdout}\n{job.stderr}"
    lines = dict(line.split("=", 1) for line in out.read_text().splitlines() if "=" in line)
    devices = [d for d in lines.get("CVD", "").split(",") if d]
    assert len(devices) == 3, f"expected 3 GPUs in CUDA_VISIBLE_DEVICES, job output:\n{out.read_text()}"
    assert lines.get("NGPU") == "3"


# Each task: its visible GPUs are CUDA_VISIBLE_DEVICES (the fake GPUs have no driver, so torch's device count and
# the NCCL group are mocked from it), then shardtrain's own start-up picks the device.
PICK_DEVICE = r"""
import json, os, torch
from shardtrain.runtime import distributed as d
visible = [x for x in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if x]
torch.cuda.is_available = lambda: bool(visible)
torch.cuda.device_count = lambda: len(visible)
chosen = []
torch.cuda.set_device = chosen.append
d.dist.is_initialized = lambda: False
d.dist.init_process_group = lambda **kw: None
try:
    info = d.init_distributed("cuda")
    out = {"rank": info.rank, "local_rank": info.local_rank, "device": str(info.device), "set_device": chosen}
except Exception as e:
    out = {"rank": int(os.environ["SLURM_PROCID"]), "error": str(e)}
print("TASK " + json.dumps({**out, "visible": visible}), flush=True)
"""


@pytest.mark.slurm
def test_srun_gpus_per_task_gives_each_rank_its_one_gpu(local_slurm, tmp_path: Path) -> None:
    """srun --gpus-per-task=1: each task sees one GPU, its own, and every rank uses it as cuda:0;
    with the node's GPUs visible to every task, the local rank picks one."""
    import json
    import sys

    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, SLURM_CONF=local_slurm.conf, PYTHONPATH=str(repo))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    rows = {}
    for name, gpus in (("per_task", ["--gpus-per-task=1"]), ("shared", ["--gres=gpu:a100:2"])):
        job = subprocess.run(
            ["srun", "--ntasks=2", "--time=2", *gpus, sys.executable, "-c", PICK_DEVICE],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
            cwd=tmp_path,
        )
        assert job.returncode == 0, f"srun failed:\n{job.stdout}\n{job.stderr}"
        rows[name] = sorted(
            (json.loads(line[5:]) for line in job.stdout.splitlines() if line.startswith("TASK ")),
            key=lambda r: r["rank"],
        )
    per_task, shared = rows["per_task"], rows["shared"]
    assert [len(r["visible"]) for r in per_task] == [1, 1] and per_task[0]["visible"] != per_task[1]["visible"]
    assert [(r["local_rank"], r["device"], r["set_device"]) for r in per_task] == [
        (0, "cuda:0", [0]),
        (1, "cuda:0", [0]),
    ]
    assert [(r["local_rank"], r["device"]) for r in shared] == [(0, "cuda:0"), (1, "cuda:1")]
