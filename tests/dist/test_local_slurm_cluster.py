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

REPO = Path(__file__).resolve().parents[2]
START = REPO / "slurm" / "local-cluster" / "start.sh"
STATE_DIR = os.environ.get("SHARDTRAIN_SLURM_DIR", "/tmp/shardtrain-slurm")
PACKAGES_UNAVAILABLE = 3  # start.sh exit code: packages missing, cannot install


@pytest.mark.slurm
def test_local_cluster_runs_typed_gpu_job(tmp_path: Path) -> None:
    start = subprocess.run(
        ["bash", str(START), STATE_DIR],
        capture_output=True, text=True, timeout=900,
    )
    if start.returncode == PACKAGES_UNAVAILABLE:
        pytest.skip(f"Slurm packages cannot be installed: {start.stderr.strip()[-500:]}")
    assert start.returncode == 0, f"start.sh failed:\n{start.stdout}\n{start.stderr}"
    slurm_conf = f"{STATE_DIR}/slurm.conf"
    assert f"export SLURM_CONF={slurm_conf}" in start.stdout

    env = dict(os.environ, SLURM_CONF=slurm_conf)
    out = tmp_path / "job.out"
    job = subprocess.run(
        ["sbatch", "--wait", "--gres=gpu:a100:3", "--cpus-per-task=12", "--mem=64G",
         "--time=2", f"--output={out}",
         "--wrap", 'echo "CVD=$CUDA_VISIBLE_DEVICES"; echo "NGPU=$SLURM_GPUS_ON_NODE"'],
        capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path,
    )
    assert job.returncode == 0, f"sbatch failed:\n{job.stdout}\n{job.stderr}"
    lines = dict(line.split("=", 1) for line in out.read_text().splitlines() if "=" in line)
    devices = [d for d in lines.get("CVD", "").split(",") if d]
    assert len(devices) == 3, f"expected 3 GPUs in CUDA_VISIBLE_DEVICES, job output:\n{out.read_text()}"
    assert lines.get("NGPU") == "3"
