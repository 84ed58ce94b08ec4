"""The `local_slurm` session fixture (tests/local_slurm.py) stops, at the end of the session, the daemons that session
started; it leaves alone a cluster that was already running, and keeps its own with SHARDTRAIN_KEEP_SLURM=1.

Each case is a small pytest session in a subprocess, on a cluster of its own (a fresh SHARDTRAIN_SLURM_DIR and
free ports), so the cluster of the session running this test is not touched. ~1-2 s per start on a warm machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from launch import REPO, free_port
from local_slurm import DAEMONS, STOP, alive

pytestmark = pytest.mark.slurm

INNER_TEST = """
import json, os
from pathlib import Path

def test_cluster_is_up(local_slurm):
    pids = {}
    for name in ("munged", "slurmctld", "slurmd"):
        pids[name] = int((Path(local_slurm.dir) / "run" / f"{name}.pid").read_text())
    Path(os.environ["PIDS_OUT"]).write_text(json.dumps(pids))
"""


@pytest.fixture
def own_cluster(tmp_path):
    """An environment naming a cluster no one else uses; whatever is left of it is stopped afterwards."""
    state_dir = tempfile.mkdtemp(prefix="st-slurm-", dir="/tmp")  # short: munged's socket path has a length limit
    env = {k: v for k, v in os.environ.items() if k != "SHARDTRAIN_KEEP_SLURM"}
    env.update(
        SHARDTRAIN_SLURM_DIR=state_dir,
        SHARDTRAIN_SLURMCTLD_PORT=str(free_port()),
        SHARDTRAIN_SLURMD_PORT=str(free_port()),
        PYTHONPATH=str(REPO / "tests"),
    )
    (tmp_path / "test_inner.py").write_text(INNER_TEST)
    yield env
    subprocess.run(["bash", str(STOP), state_dir], capture_output=True, timeout=120)
    subprocess.run(["rm", "-rf", state_dir])


def session(tmp_path: Path, env: dict, **extra) -> dict[str, int]:
    """One pytest session using the fixture -> the daemons' pids it saw."""
    out = tmp_path / "pids.json"
    out.unlink(missing_ok=True)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "local_slurm",
            "-p",
            "no:cacheprovider",
            str(tmp_path / "test_inner.py"),
        ],
        cwd=tmp_path,
        env={**env, "PIDS_OUT": str(out), **extra},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    if not out.exists() and "1 skipped" in run.stdout:  # the fixture's skip: start.sh exit 3, no packages
        pytest.skip(f"local Slurm unavailable: {run.stdout.strip()[-300:]}")
    return json.loads(out.read_text())


def test_session_stops_only_the_cluster_it_started(own_cluster, tmp_path):
    # Asked to keep it warm: started, and still running after the session.
    kept = session(tmp_path, own_cluster, SHARDTRAIN_KEEP_SLURM="1")
    assert set(kept) == set(DAEMONS) and all(alive(p) for p in kept.values()), kept

    # Already running when the session began: not this session's to stop.
    again = session(tmp_path, own_cluster)
    assert again == kept and all(alive(p) for p in kept.values())

    # Started by the session: gone at its end, munged included.
    subprocess.run(
        ["bash", str(STOP), own_cluster["SHARDTRAIN_SLURM_DIR"]], capture_output=True, timeout=120, check=True
    )
    assert not any(alive(p) for p in kept.values())
    started = session(tmp_path, own_cluster)
    assert set(started) == set(DAEMONS) and set(started.values()).isdisjoint(kept.values())
    assert [name for name, pid in started.items() if alive(pid)] == []
