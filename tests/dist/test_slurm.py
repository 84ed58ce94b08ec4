"""The shipped sbatch scripts on a real (local, single-node) Slurm: submitted unmodified, configured only
through their override variables, with the tiny configs on CPU.

The cluster comes from slurm/local-cluster/start.sh (node `localhost`, fake typed GPUs gpu:a100:4 and
gpu:v100:4, so jobs get CUDA_VISIBLE_DEVICES / SLURM_GPUS_ON_NODE but no CUDA). The tests skip only when
start.sh exits 3: the munge/slurm Debian packages are missing and cannot be installed. Jobs inherit this
process's environment (sbatch --export=ALL), which is how SLURM_CONF and SHARDTRAIN_VENV reach them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import launch
import pytest
from launch import BIN, REPO, tiny_args, torchrun

pytestmark = pytest.mark.slurm

JOB_TIMEOUT = 360  # 3-4 CPU processes of a tiny model on a 2-core machine, imports included
# No HTML report: matplotlib would cost every job seconds of CPU and is tested elsewhere.
COMMON = "--resume none --report false"


@pytest.fixture(scope="module")
def slurm_env(local_slurm) -> dict:
    return job_env(local_slurm.conf)


def job_env(slurm_conf: str) -> dict:
    """The environment sbatch exports to the jobs of the cluster configured by `slurm_conf`."""
    env = launch.test_env(SLURM_CONF=slurm_conf)
    # The jobs' `python` is this interpreter: through the scripts' site block (SHARDTRAIN_VENV) when it
    # lives in a venv, and through PATH in any case.
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    if (Path(sys.prefix) / "bin" / "activate").is_file():
        env["SHARDTRAIN_VENV"] = sys.prefix
    for var in (
        "CONFIG",
        "STRATEGY",
        "DS_CONFIG",
        "PRECISION",
        "DEVICE",
        "EXTRA_ARGS",
        "NPROC_PER_NODE",
        "OUTPUT_DIR",
        "DATA_DIR",
        "SRUN_ARGS",
        "SHARDTRAIN_ROOT",
        "MASTER_ADDR",
        "MASTER_PORT",
    ):
        env.pop(var, None)  # only what a test sets
    return env


class Job:
    def __init__(self, job_id: str, cwd: Path, env: dict, client: tuple = ()):
        # client: the prefix that runs a Slurm command where slurmctld can be reached (a host of the cluster
        # across hosts, tests/dist/test_slurm_multi_host.py); none for the local single-node cluster.
        self.id, self.cwd, self.env, self.client = job_id, cwd, env, tuple(client)

    @property
    def out(self) -> str:
        return _read(self.cwd / f"train_{self.id}.out")

    @property
    def err(self) -> str:
        return _read(self.cwd / f"train_{self.id}.err")

    def logs(self) -> str:
        return f"--- train_{self.id}.out ---\n{self.out[-4000:]}\n--- train_{self.id}.err ---\n{self.err[-4000:]}"

    def listed(self) -> bool:
        """Still known to Slurm (pending, running, requeued, completing)."""
        q = subprocess.run(
            [*self.client, "squeue", "-h", "-j", self.id, "-o", "%T"],
            capture_output=True,
            text=True,
            env=self.env,
            timeout=30,
        )
        return q.returncode == 0 and bool(q.stdout.strip())

    def cancel(self) -> None:
        subprocess.run([*self.client, "scancel", self.id], env=self.env, capture_output=True, timeout=30)


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.is_file() else f"<{path.name} missing>"


def submit(
    script: str, cwd: Path, env: dict, overrides: dict, sbatch_args: tuple = (), wait: bool = True, client: tuple = ()
) -> tuple[Job, int]:
    """`sbatch [--wait] slurm/<script>` from `cwd` (where the %j logs go), the script itself untouched."""
    job_env = {**env, **{k: str(v) for k, v in overrides.items()}}
    cmd = [*client, "sbatch", "--parsable", *(["--wait"] if wait else []), *sbatch_args, str(REPO / "slurm" / script)]
    proc = subprocess.Popen(cmd, cwd=cwd, env=job_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = proc.stdout.readline().strip()  # --parsable: "<id>" or "<id>;<cluster>", printed at submission
    assert re.match(r"^\d+", first), f"sbatch did not submit: {first}\n{proc.stderr.read()}"
    job = Job(first.split(";")[0], cwd, env, client)
    try:
        rc = proc.wait(timeout=JOB_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        job.cancel()
        raise AssertionError(f"job {job.id} ({script}) still running after {JOB_TIMEOUT}s\n{job.logs()}") from None
    return job, rc


def summary(out_dir: Path) -> dict:
    return json.loads((out_dir / "summary.json").read_text())


def losses(out_dir: Path) -> dict[int, float]:
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    return {(r := json.loads(line))["step"]: r["loss"] for line in lines if line.strip()}


def check_banner(job: Job, gpus: int, world: int) -> None:
    """The script printed the GPUs Slurm gave it and launched one task per GPU."""
    out = job.out
    visible = re.search(r"CUDA_VISIBLE_DEVICES=(\S+)", out)
    # Node-wide indices here (the v100s are 4-7): count them, do not expect 0..n-1.
    assert visible and len(visible.group(1).split(",")) == gpus, job.logs()
    assert f"SLURM_GPUS_ON_NODE={gpus} " in out and f"world size {world}" in out, job.logs()
    assert re.search(rf"launch: srun --ntasks={world} .* python -u shardtrain/main.py --config ", out), job.logs()


def test_3xa100_fsdp(slurm_env, mm_data, tmp_path):
    out = tmp_path / "out"
    job, rc = submit(
        "train_3xa100.sbatch",
        tmp_path,
        slurm_env,
        {
            "CONFIG": "configs/multimodal_tiny.yaml",
            "DEVICE": "cpu",
            "PRECISION": "fp32",
            "DATA_DIR": mm_data,
            "OUTPUT_DIR": out,
            "EXTRA_ARGS": f"--max-steps 3 {COMMON}",
        },
    )
    assert rc == 0, f"job {job.id} exit {rc}\n{job.logs()}"
    check_banner(job, gpus=3, world=3)
    s = summary(out)
    assert (s["world_size"], s["strategy"], s["final_step"], s["preempted"]) == (3, "fsdp", 3, False), s
    assert len(s["train_loss"]) == 3 and s["eval"]["n_examples"] == 64, s


def test_a_mistake_ends_the_job_with_one_line_and_exit_2_before_any_task(slurm_env, mm_data, tmp_path):
    """A batch too large for each rank's share of the data at the job's world size. Each task used to refuse it
    itself: three copies of the line, and srun's 143 when one task was through its checks first and
    --kill-on-bad-exit terminated the others (`sacct` then reads like a preemption)."""
    job, rc = submit(
        "train_3xa100.sbatch",
        tmp_path,
        slurm_env,
        {
            "CONFIG": "configs/multimodal_tiny.yaml",
            "DEVICE": "cpu",
            "DATA_DIR": mm_data,
            "OUTPUT_DIR": tmp_path / "out",
            "EXTRA_ARGS": f"--per-device-batch-size 100 {COMMON}",
        },
    )
    assert rc == 2, f"job {job.id} exit {rc}\n{job.logs()}"
    errors = [line for line in job.err.splitlines() if line.startswith("shardtrain: error: ")]
    assert len(errors) == 1 and "256 examples // world size 3 = 85" in errors[0], job.logs()
    assert "srun: " not in job.err and "no task started" in job.err, job.logs()
    assert not (tmp_path / "out").exists()


def test_a_users_own_srun_line_says_a_mistake_once(slurm_env, mm_data, tmp_path):
    """A user's own job script: `srun python shardtrain/main.py` (main.py's docstring), without the shipped
    scripts' check in the batch shell. srun sets SLURM_PROCID, not RANK, and each task took itself for rank 0:
    the same error line once per task."""
    script = tmp_path / "own.sbatch"
    args = tiny_args("multimodal", mm_data, tmp_path / "out", "--per-device-batch-size", "200")
    script.write_text(
        "#!/bin/bash\n"
        "#SBATCH --ntasks=2 --output=train_%j.out --error=train_%j.err\n"
        f"cd {REPO}\n"
        f"srun --kill-on-bad-exit=1 python -u shardtrain/main.py {' '.join(map(str, args))}\n"
    )
    job, rc = submit(str(script), tmp_path, slurm_env, {})
    assert rc != 0, job.logs()
    errors = [line for line in job.err.splitlines() if line.startswith("shardtrain: error")]
    assert len(errors) == 1 and errors[0].startswith("shardtrain: error: "), job.logs()
    assert "256 examples // world size 2 = 128" in errors[0], job.logs()


def test_4xv100_ddp(slurm_env, ld_data, tmp_path):
    # The script's own strategy: DDP, shardtrain plan's pick (tests/dist/test_seed_setup.py); fp32 because fp16
    # needs a GPU. DS_CONFIG (DeepSpeed under srun) is exercised by the multinode test.
    out = tmp_path / "out"
    job, rc = submit(
        "train_4xv100.sbatch",
        tmp_path,
        slurm_env,
        {
            "CONFIG": "configs/longformer_tiny.yaml",
            "DEVICE": "cpu",
            "PRECISION": "fp32",
            "DATA_DIR": ld_data,
            "OUTPUT_DIR": out,
            "EXTRA_ARGS": f"--max-steps 2 --per-device-batch-size 4 {COMMON}",
        },
    )
    assert rc == 0, f"job {job.id} exit {rc}\n{job.logs()}"
    check_banner(job, gpus=4, world=4)
    assert "--strategy ddp" in job.out, job.logs()
    s = summary(out)
    assert (s["world_size"], s["strategy"], s["final_step"]) == (4, "ddp", 2), s


def test_multinode_two_tasks_deepspeed(slurm_env, mm_data, tmp_path):
    # Two tasks on the one node stand in for two nodes: ranks from SLURM_PROCID, MASTER_ADDR from the
    # first host, the port from the job id, and DeepSpeed joining that group without its ssh launcher.
    out = tmp_path / "out"
    job, rc = submit(
        "train_multinode.sbatch",
        tmp_path,
        slurm_env,
        {
            "CONFIG": "configs/multimodal_tiny.yaml",
            "DS_CONFIG": "ds_configs/zero3.json",
            "DEVICE": "cpu",
            "PRECISION": "fp32",
            "DATA_DIR": mm_data,
            "OUTPUT_DIR": out,
            "EXTRA_ARGS": f"--max-steps 2 {COMMON}",
        },
        sbatch_args=("--nodes=1", "--ntasks-per-node=2", "--gres=gpu:a100:2"),
    )
    assert rc == 0, f"job {job.id} exit {rc}\n{job.logs()}"
    check_banner(job, gpus=2, world=2)
    assert f"MASTER_ADDR=localhost MASTER_PORT={15000 + int(job.id) % 20000} " in job.out, job.logs()
    s = summary(out)
    assert (s["world_size"], s["strategy"], s["final_step"]) == (2, "zero3", 2), s


def test_preemption_requeue_resume(slurm_env, mm_data, tmp_path):
    """SIGUSR1 mid-run -> checkpoint at the next step -> `scontrol requeue` from rank 0 -> the requeued job
    (same id, SLURM_RESTART_COUNT=1) resumes and finishes with the losses of an uninterrupted run."""
    steps = 12
    out = tmp_path / "out"
    train_args = f"--strategy fsdp --precision fp32 --device cpu --max-steps {steps}"
    job, _ = submit(
        "train_3xa100.sbatch",
        tmp_path,
        slurm_env,
        {
            "CONFIG": "configs/multimodal_tiny.yaml",
            "DEVICE": "cpu",
            "PRECISION": "fp32",
            "DATA_DIR": mm_data,
            "OUTPUT_DIR": out,
            "EXTRA_ARGS": f"--max-steps {steps} --report false",
        },  # --resume auto: the default
        sbatch_args=("--gres=gpu:a100:2", "--ntasks-per-node=2"),
        wait=False,
    )
    try:
        deadline = time.monotonic() + JOB_TIMEOUT
        while not ((out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").read_text().strip()):
            assert job.listed() and time.monotonic() < deadline, f"no training step seen\n{job.logs()}"
            time.sleep(0.2)
        # What Slurm does at --signal=USR1@N, plus the batch shell (whose trap passes it on to srun).
        subprocess.run(["scancel", "-s", "USR1", "--full", job.id], env=slurm_env, check=True, timeout=30)
        while job.listed():  # running -> requeued (pending) -> running again -> gone
            assert time.monotonic() < deadline, f"job {job.id} not finished after {JOB_TIMEOUT}s\n{job.logs()}"
            time.sleep(1)
    finally:
        if job.listed():
            job.cancel()

    k = requeued_and_resumed(job, steps)
    assert (out / "checkpoints" / f"step-{k:06d}" / "COMMITTED").is_file()
    s = summary(out)
    assert (s["world_size"], s["final_step"], s["preempted"]) == (2, steps, False), s

    # The same run without the interruption, started directly with torchrun.
    ref_out = tmp_path / "ref"
    torchrun(tiny_args("multimodal", mm_data, ref_out, *train_args.split(), "--report", "false"), nproc=2)
    resumed, reference = losses(out), losses(ref_out)
    assert sorted(resumed) == list(range(1, steps + 1)), resumed
    assert resumed[steps] == pytest.approx(reference[steps], rel=1e-6, abs=1e-7), (resumed, reference)
    assert [resumed[i] for i in range(k + 1, steps + 1)] == pytest.approx(
        [reference[i] for i in range(k + 1, steps + 1)], rel=1e-6, abs=1e-7
    )


def test_scancel_saves_and_exits_0(slurm_env, ld_data, tmp_path):
    """A plain `scancel` (no --signal): Slurm sends SIGTERM to every process of the job at once (the batch
    shell, srun, the tasks and their DataLoader workers), then SIGKILL after KillWait (5 s on the local
    cluster, 30 s by default). Before, the DataLoader workers died of it and both tasks exited 1 with no
    checkpoint. Now every task finishes its step, saves and exits 0; a cancelled job is not requeued."""
    out = tmp_path / "out"
    job, _ = submit(
        "train_4xv100.sbatch",
        tmp_path,
        slurm_env,
        {
            "CONFIG": "configs/longformer_tiny.yaml",
            "DEVICE": "cpu",
            "PRECISION": "fp32",
            "DATA_DIR": ld_data,
            "OUTPUT_DIR": out,
            "EXTRA_ARGS": f"--max-steps 500 --num-workers 2 --log-every 1 {COMMON}",
        },
        sbatch_args=("--gres=gpu:v100:2", "--ntasks-per-node=2"),
        wait=False,
    )
    try:
        deadline = time.monotonic() + JOB_TIMEOUT
        while len(_read(out / "metrics.jsonl").splitlines()) < 2:
            assert job.listed() and time.monotonic() < deadline, f"no training step seen\n{job.logs()}"
            time.sleep(0.2)
        subprocess.run(["scancel", job.id], env=slurm_env, check=True, timeout=30)
        while job.listed():
            assert time.monotonic() < deadline, f"job {job.id} not gone after {JOB_TIMEOUT}s\n{job.logs()}"
            time.sleep(0.5)
    finally:
        if job.listed():
            job.cancel()
    stopped = re.search(r"step (\d+): stopped on a preemption signal", job.out)
    assert stopped, job.logs()
    k = int(stopped.group(1))
    assert (out / "checkpoints" / f"step-{k:06d}" / "COMMITTED").is_file(), job.logs()
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step-{k:06d}"
    assert summary(out)["final_step"] == k and summary(out)["preempted"] is True
    assert "shardtrain-slurm: srun exited with 0" in job.out, job.logs()
    assert "shardtrain: error" not in job.err and "Exited with exit code" not in job.err, job.logs()
    assert "requeued Slurm job" not in job.out, job.logs()


def requeued_and_resumed(job, steps: int) -> int:
    """The step a preempted job stopped at, after checking it requeued itself and its second start resumed there."""
    log = job.out
    stopped = re.search(r"step (\d+): stopped on a preemption signal", log)
    assert stopped, f"the job never stopped on SIGUSR1 (finished first?)\n{job.logs()}"
    k = int(stopped.group(1))
    assert 0 < k < steps, job.logs()
    assert "SLURM_RESTART_COUNT=0 " in log and "SLURM_RESTART_COUNT=1 " in log, job.logs()
    assert f"requeued Slurm job {job.id}" in log, job.logs()
    assert re.search(rf"resumed from \S*step-{k:06d} at step {k}\b", log), job.logs()
    return k
