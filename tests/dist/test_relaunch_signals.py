"""A plain `python -m shardtrain train --nproc 2` relaunches itself under torchrun; a preemption signal sent
to that parent (what SageMaker and Slurm signal) must still reach the workers and end in a checkpoint."""
from __future__ import annotations

import signal
import subprocess
import sys
import time

from launch import REPO, test_env, tiny_args


def test_sigusr1_to_relaunching_parent_checkpoints_and_exits_0(ld_data, tmp_path):
    out = tmp_path / "run"
    args = tiny_args("longformer", ld_data, out, "--strategy", "ddp", "--max-steps", "500", "--nproc", "2",
                     "--device", "cpu", "--log-every", "1")
    proc = subprocess.Popen([sys.executable, "-m", "shardtrain", "train", *args], cwd=REPO, env=test_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 180
        while time.time() < deadline and not (out / "metrics.jsonl").exists():
            time.sleep(0.5)
        while time.time() < deadline and len((out / "metrics.jsonl").read_text().splitlines()) < 2:
            time.sleep(0.5)
        proc.send_signal(signal.SIGUSR1)
        output, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output[-3000:]
    summary = __import__("json").loads((out / "summary.json").read_text())
    assert summary["preempted"] is True and summary["final_step"] < 500
    step = summary["final_step"]
    assert (out / "checkpoints" / f"step-{step:06d}" / "COMMITTED").is_file(), output[-3000:]
    assert "stopping on a preemption signal" in output
