"""slurm/train_multinode.sbatch on a Slurm cluster across two hosts, submitted unmodified.

The hosts are network namespaces (tests/hosts.py): node1 and node2 each run their own `slurmd -N nodeK` with
NodeAddr its own address, and slurmctld runs on node3 (slurm/local-cluster/start.sh --hosts). Each host has its
own hostname and /etc/hosts; the filesystem (repository, data, output dir, munged's socket) is shared, as a
cluster's home is. Clients (sbatch, squeue, scancel) run on a host too: the machine's own namespace has no route
to the cluster. What one host cannot show: the first host's name as MASTER_ADDR, the store and gloo on the
address that name resolves to, srun's tasks on two hosts, and a requeue that brings both back.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from launch import tiny_args, torchrun
from local_slurm import PACKAGES_UNAVAILABLE, START, STOP, alive
from test_slurm import JOB_TIMEOUT, check_banner, job_env, losses, requeued_and_resumed, submit, summary

pytestmark = pytest.mark.slurm

COMPUTE = ("node1", "node2")
CONTROLLER = "node3"
# The script's own request (--nodes=2) with one fake GPU, so one task, per host.
PER_HOST = ("--nodes=2", "--ntasks-per-node=1", "--gres=gpu:a100:1")


@dataclass
class HostsCluster:
    hosts: object  # tests/hosts.py's Hosts
    state: Path  # start.sh's STATE_DIR
    client: tuple  # runs a Slurm client on the controller's host
    env: dict  # what sbatch exports to the jobs

    def daemons(self) -> dict[str, int]:
        """munged, slurmctld, slurmd-node1, ... -> pid, from the pid files start.sh and the daemons write."""
        return {f.stem: int(f.read_text().strip()) for f in (self.state / "run").glob("*.pid")}


@pytest.fixture
def slurm_hosts(namespace_hosts):
    """A cluster on namespace hosts; stopped (stop.sh), then the hosts torn down, pass or fail."""
    hosts = namespace_hosts(3)
    run_on = hosts.run_on_script()
    state = tempfile.mkdtemp(prefix="st-slurmh-", dir="/tmp")  # short: munged's socket path has a length limit
    nodes = ",".join(f"{n}={hosts[n].address}" for n in COMPUTE)
    try:
        # The default ports: inside the namespaces they cannot collide with anyone's.
        start = subprocess.run(
            [
                "bash",
                str(START),
                state,
                "--hosts",
                nodes,
                "--controller",
                f"{CONTROLLER}={hosts[CONTROLLER].address}",
                "--run-on",
                str(run_on),
            ],
            capture_output=True,
            text=True,
            timeout=300,
            env={
                **job_env(f"{state}/slurm.conf"),
                "SHARDTRAIN_SLURMCTLD_PORT": "6817",
                "SHARDTRAIN_SLURMD_PORT": "6818",
            },
        )
        if start.returncode == PACKAGES_UNAVAILABLE:
            pytest.skip(f"Slurm unavailable (start.sh exit 3): {start.stderr.strip()[-300:]}")
        assert start.returncode == 0, f"start.sh --hosts failed ({start.returncode}):\n{start.stdout}\n{start.stderr}"
        cluster = HostsCluster(hosts, Path(state), (str(run_on), CONTROLLER), job_env(f"{state}/slurm.conf"))
        started = cluster.daemons()
        yield cluster
    finally:
        stop = subprocess.run(["bash", str(STOP), state], capture_output=True, text=True, timeout=120)
        shutil.rmtree(state, ignore_errors=True)
    # munged runs outside the namespaces: their teardown would not end it.
    left = {name: pid for name, pid in started.items() if alive(pid)}
    assert not left, f"stop.sh left {left} running:\n{stop.stdout}{stop.stderr}"


def hosts_in_banner(log: str) -> list[list[str]]:
    """Each banner's rank table in `log` (one per start of the job): [host of rank 0, host of rank 1, ...]."""
    tables = []
    for block in log.split("  rank  host ")[1:]:
        rows = re.findall(r"^\s+(\d+)\s+(\S+)\s+(\d+)\s+cpu\b", block.split("  strategy ")[0], re.M)
        tables.append([host for _, host, _ in sorted(rows, key=lambda r: int(r[0]))])
    return tables


def test_multinode_sbatch_across_two_hosts(slurm_hosts, mm_data, tmp_path):
    """Two hosts, one rank each: the script's MASTER_ADDR (the first host's name) works from both, and the
    ranks know which host they are on (banner, summary, and the GPU guard's reading of that table)."""
    # Each daemon where it belongs: a slurmd in each compute host's namespace, slurmctld in node3's, munged here.
    hosts = slurm_hosts.hosts
    where = {
        name: subprocess.run(
            ["ip", "netns", "identify", str(pid)], capture_output=True, text=True, check=True
        ).stdout.strip()
        for name, pid in slurm_hosts.daemons().items()
    }
    assert where == {
        "munged": "",
        "slurmctld": hosts[CONTROLLER].netns,
        **{f"slurmd-{n}": hosts[n].netns for n in COMPUTE},
    }, where

    out = tmp_path / "out"
    job, rc = submit(
        "train_multinode.sbatch",
        tmp_path,
        slurm_hosts.env,
        {
            "CONFIG": "configs/multimodal_tiny.yaml",
            "DEVICE": "cpu",
            "PRECISION": "fp32",
            "DATA_DIR": mm_data,
            "OUTPUT_DIR": out,
            "EXTRA_ARGS": "--max-steps 3 --resume none --report false",
        },
        sbatch_args=PER_HOST,
        client=slurm_hosts.client,
    )
    assert rc == 0, f"job {job.id} exit {rc}\n{job.logs()}"
    check_banner(job, gpus=1, world=2)
    assert "shardtrain-slurm: hosts: node1 node2" in job.out, job.logs()
    assert f"MASTER_ADDR=node1 MASTER_PORT={15000 + int(job.id) % 20000} " in job.out, job.logs()
    assert hosts_in_banner(job.out) == [["node1", "node2"]], job.logs()
    s = summary(out)
    assert (s["world_size"], s["strategy"], s["final_step"]) == (2, "fsdp", 3), s
    assert [(r["rank"], r["host"], r["local_rank"]) for r in s["ranks"]] == [(0, "node1", 0), (1, "node2", 0)], s

    # The GPU guard reads the gathered table by host: local rank 0 on each of two hosts, as srun gives one GPU
    # job per host, is two GPUs, not one shared. (On this CPU machine the table says cpu; the guard's verdict
    # on the same hosts with cuda:0 is what a GPU cluster gets.)
    from shardtrain.runtime.gpu_guard import check_rank_table

    assert check_rank_table(s["ranks"]).error is None
    as_on_gpus = [{**r, "device": "cuda:0", "visible_gpus": 1, "device_uuid": ""} for r in s["ranks"]]
    verdict = check_rank_table(as_on_gpus)
    assert (verdict.error, verdict.warnings) == (None, []), verdict
    assert [r["node"] for r in s["ranks"]] == ["0", "1"], s  # SLURM_NODEID: two nodes, even under one hostname
    one_host = [{**r, "host": "node1", "node": "0"} for r in as_on_gpus]
    assert "ranks 0, 1 on node1 all use cuda:0" in (check_rank_table(one_host).error or "")


def test_preemption_requeue_across_two_hosts(slurm_hosts, mm_data, tmp_path):
    """SIGUSR1 mid-run on both hosts -> checkpoint -> `scontrol requeue` from rank 0 on node1 -> the requeued
    job comes back on both hosts, resumes, and ends at max_steps with the losses of an uninterrupted run."""
    steps = 12
    out = tmp_path / "out"
    job, _ = submit(
        "train_multinode.sbatch",
        tmp_path,
        slurm_hosts.env,
        {
            "CONFIG": "configs/multimodal_tiny.yaml",
            "DEVICE": "cpu",
            "PRECISION": "fp32",
            "DATA_DIR": mm_data,
            "OUTPUT_DIR": out,
            "EXTRA_ARGS": f"--max-steps {steps} --report false",
        },  # --resume auto: the default
        sbatch_args=PER_HOST,
        wait=False,
        client=slurm_hosts.client,
    )
    try:
        deadline = time.monotonic() + JOB_TIMEOUT
        while not ((out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").read_text().strip()):
            assert job.listed() and time.monotonic() < deadline, f"no training step seen\n{job.logs()}"
            time.sleep(0.2)
        # The tasks on both hosts and the batch shell on node1, as Slurm's --signal=USR1@N plus a B: signal.
        subprocess.run(
            [*slurm_hosts.client, "scancel", "-s", "USR1", "--full", job.id],
            env=slurm_hosts.env,
            check=True,
            timeout=30,
        )
        while job.listed():  # running -> requeued (pending) -> running again -> gone
            assert time.monotonic() < deadline, f"job {job.id} not finished after {JOB_TIMEOUT}s\n{job.logs()}"
            time.sleep(1)
    finally:
        if job.listed():
            job.cancel()

    requeued_and_resumed(job, steps)
    assert hosts_in_banner(job.out) == [["node1", "node2"]] * 2, job.logs()  # both starts span both hosts
    s = summary(out)
    assert (s["world_size"], s["final_step"], s["preempted"]) == (2, steps, False), s

    # The same run without the interruption, on one host.
    ref_out = tmp_path / "ref"
    torchrun(
        tiny_args(
            "multimodal",
            mm_data,
            ref_out,
            "--strategy",
            "fsdp",
            "--precision",
            "fp32",
            "--device",
            "cpu",
            "--max-steps",
            str(steps),
        ),
        nproc=2,
    )
    resumed, reference = losses(out), losses(ref_out)
    assert sorted(resumed) == list(range(1, steps + 1)), resumed
    assert [resumed[i] for i in range(1, steps + 1)] == pytest.approx(
        [reference[i] for i in range(1, steps + 1)], rel=1e-6, abs=1e-7
    )
