"""SageMaker as it really runs (docs/sagemaker-and-gpus.md): the SDK v3's own container scripts, on CPU.

tests/sm_job.py has the SDK (ModelTrainer + Torchrun(), training_mode=LOCAL_CONTAINER: no AWS call) generate and
start the job of examples/sagemaker/launch.py's build_job(): sm_train.sh, sourcecode.json, distributed.json, its
container drivers, the /opt/ml config files. tests/sm_compose.py stands in for docker compose: the SDK's
entrypoint runs as PID 1 of a PID namespace of its own, with the SDK's volumes bind-mounted over a private
/opt/ml (an overlay in a private mount namespace: the host's /opt is never written) and
/opt/ml/checkpoints kept across jobs, as SageMaker syncs it to checkpoint_s3_uri. Everything is under
tmp_path; the namespaces end with their processes, pass or fail.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launch import REPO, kill_tree, test_env, tiny_args, torchrun

pytest.importorskip("sagemaker.train", reason="the SageMaker SDK v3 (requirements-sagemaker.txt) is not installed")
pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("unshare"),
    reason="emulated containers need root and unshare (namespaces, mounts)",
)

JOB = REPO / "tests" / "sm_job.py"
STEPS = 12
HP = {
    "config": "configs/longformer_tiny.yaml",
    "device": "cpu",
    "max_steps": STEPS,
    "predict_memory": False,
    "report": False,
    "log_every": 1,
}


class Job:
    """One SageMaker training job (the SDK's local mode, docker replaced) started in the background."""

    def __init__(
        self,
        tmp: Path,
        name: str,
        emulator_dir: Path,
        channels: dict,
        env: dict | None = None,
        hyperparameters: dict | None = None,
        instance_count: int = 1,
        run_id: str | None = None,
    ):
        self.root, self.emulator_dir, self.log = tmp / name, emulator_dir, tmp / f"{name}.log"
        self.root.mkdir()
        emulator_dir.mkdir(exist_ok=True)
        spec = {
            "root": str(self.root),
            "emulator_dir": str(emulator_dir),
            "channels": channels,
            "hyperparameters": {**HP, **(hyperparameters or {})},
            "processes_per_node": 2,
            "instance_count": instance_count,
            "run_id": run_id,
        }
        self.run_id = run_id
        (tmp / f"{name}.json").write_text(json.dumps(spec))
        full_env = test_env(AWS_DEFAULT_REGION="us-east-1", **(env or {}))
        full_env.pop("PYTHONPATH")  # the code channel carries shardtrain into the container
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, str(JOB), str(tmp / f"{name}.json")],
                cwd=REPO,
                env=full_env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    @property
    def checkpoints(self) -> Path:
        """/opt/ml/checkpoints of algo-1 (the run folder), as tests/sm_job.py keeps it for the job's S3 prefix."""
        return self.emulator_dir / "s3" / "my-bucket" / "shardtrain-longformer" / self.run_id / "checkpoints" / "algo-1"

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def pid1(self) -> int:
        return int((self.emulator_dir / "algo-1.pid1").read_text())

    def wait(self, timeout: float = 400) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(self.proc.pid)
            raise AssertionError(f"job still running after {timeout}s:\n{self.output()[-4000:]}") from None

    def kill(self) -> None:
        kill_tree(self.proc.pid)
        self.proc.wait()


def _losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines() if (run_dir / "metrics.jsonl").exists() else []
    return {(r := json.loads(line))["step"]: r["loss"] for line in lines if line.strip()}


def test_spot_interruption_saves_and_the_next_job_resumes(ld_data, tmp_path):
    """SIGTERM to the container's PID 1 only, as SageMaker stops a job (then SIGKILL, as `docker stop` after its
    grace period). Before, PID 1 (the SDK's bash running sm_train.sh) dropped it: training ran on until the
    SIGKILL, and nothing was saved. Now the init the example execs in its place passes it to the workers: a
    checkpoint at a step >= the one reached is committed, the container exits 0, and the next job (the
    checkpoints restored) resumes from it and ends with the uninterrupted run's losses."""
    emulator = tmp_path / "sm"
    hold = tmp_path / "hold"  # SHARDTRAIN_FAULT_HOLD: steps wait while it exists, until a stop signal
    # One run: SageMaker restarts an interrupted job with its own checkpoint prefix (example: the run's id).
    run = "run-1"
    first = Job(tmp_path, "job1", emulator, {"train": str(ld_data)}, env={"SHARDTRAIN_FAULT_HOLD": hold}, run_id=run)
    try:
        deadline = time.monotonic() + 400
        while len(_losses(first.checkpoints)) < 2:
            assert first.proc.poll() is None and time.monotonic() < deadline, first.output()[-4000:]
            time.sleep(0.2)
        hold.touch()
        k = max(_losses(first.checkpoints))
        assert k < STEPS, first.output()[-3000:]
        os.kill(first.pid1(), signal.SIGTERM)
        try:
            code = first.proc.wait(timeout=90)  # SageMaker's own grace period is 120 s
        except subprocess.TimeoutExpired:
            os.kill(first.pid1(), signal.SIGKILL)
            first.proc.wait()
            raise AssertionError(
                f"the stop never reached training (SIGKILL after 90 s):\n{first.output()[-3000:]}"
            ) from None
    finally:
        if first.proc.poll() is None:
            first.kill()
    out1 = first.output()
    assert code == 0, out1[-3000:]
    stopped = max(_losses(first.checkpoints))
    assert k <= stopped < STEPS and f"step {stopped}: stopped on a preemption signal" in out1, out1[-3000:]
    assert (first.checkpoints / "checkpoints" / f"step-{stopped:06d}" / "COMMITTED").is_file(), out1[-3000:]
    assert not (first.root / "artifacts" / "output" / "failure").exists(), out1[-3000:]

    second = Job(tmp_path, "job2", emulator, {"train": str(ld_data)}, run_id=run)
    assert second.wait() == 0, second.output()[-3000:]
    out2 = second.output()
    assert f"resumed from /opt/ml/checkpoints/checkpoints/step-{stopped:06d} at step {stopped}" in out2, out2[-3000:]
    assert (second.root / "artifacts" / "model" / "model.safetensors").is_file(), out2[-3000:]

    reference = tmp_path / "reference"
    torchrun(
        tiny_args(
            "longformer",
            ld_data,
            reference,
            "--strategy",
            "ddp",
            "--device",
            "cpu",
            "--max-steps",
            str(STEPS),
            "--save-every",
            "200",
        )
    )
    resumed, expected = _losses(first.checkpoints), _losses(reference)
    assert sorted(resumed) == list(range(1, STEPS + 1)), resumed
    assert [resumed[s] for s in range(1, STEPS + 1)] == pytest.approx(
        [expected[s] for s in range(1, STEPS + 1)], rel=1e-6, abs=1e-7
    )

    # A restart after completion (the finished run's checkpoints restored: a spot interruption between the last
    # checkpoint and the export, or a job that continues the run, --continue-run): nothing to train, and before,
    # an empty /opt/ml/model, a "Completed" job's empty model.tar.gz. Now the model is exported from the
    # finished run's last checkpoint.
    third = Job(tmp_path, "job3", emulator, {"train": str(ld_data)}, run_id=run)
    assert third.wait() == 0, third.output()[-3000:]
    assert "nothing to train" in third.output(), third.output()[-3000:]
    model = third.root / "artifacts" / "model"
    assert (model / "model.safetensors").is_file() and (model / "shardtrain_export.json").is_file(), third.output()[
        -3000:
    ]


def test_a_bad_hyperparameter_is_the_jobs_failure_reason(ld_data, tmp_path):
    """SageMaker shows /opt/ml/output/failure as the job's FailureReason. Before, it held only the SDK's
    `CalledProcessError ... returned non-zero exit status 1`; now our one line, naming the hyperparameter's
    own spelling."""
    job = Job(tmp_path, "job", tmp_path / "sm", {"train": str(ld_data)}, hyperparameters={"save_evry": 200})
    assert job.wait() != 0, job.output()[-3000:]
    failure = job.root / "artifacts" / "output" / "failure"  # the SDK gathers /opt/ml/output there
    assert failure.read_text() == (
        "shardtrain: error: unknown hyperparameter 'save_evry'; did you mean 'save_every' (--save-every)?\n"
    ), job.output()[-3000:]


def test_two_instances_are_refused_in_one_line_that_names_what_works(ld_data, tmp_path):
    """Each instance has its own /opt/ml/checkpoints (SageMaker syncs each to the one S3 prefix): ranks on two
    instances never see each other's checkpoint files. Before, every rank went on to build its process group
    and the job died there: on real instances in the shared-folder check ("not shared", naming NFS or Lustre,
    not what works on SageMaker), here (every algo-N is the one loopback) in the gloo address check. Now every
    worker of both instances refuses at start-up, before any process group, naming the
    hyperparameter and FSx/EFS, and that line is the job's FailureReason."""
    job = Job(tmp_path, "job", tmp_path / "sm", {"train": str(ld_data)}, instance_count=2)
    assert job.wait(timeout=300) != 0, job.output()[-3000:]
    failure = job.root / "artifacts" / "output" / "failure"
    assert failure.is_file(), job.output()[-3000:]
    line = failure.read_text()
    assert line.count("\n") == 1 and line.startswith("shardtrain: error: SageMaker job on 2 instances"), line
    assert "output_dir (--output-dir)" in line and "FSx for Lustre or EFS" in line, line
