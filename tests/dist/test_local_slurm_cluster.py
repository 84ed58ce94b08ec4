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
