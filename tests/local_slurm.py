"""The local Slurm cluster (slurm/local-cluster/start.sh) as one session-scoped fixture, `local_slurm`.

Started by the first test that needs it; at the end of the session, the daemons this session started are stopped
(slurm/local-cluster/stop.sh), so `make test` leaves no munged, slurmctld or slurmd behind. A cluster that was
already running when the session began is someone else's and is left alone, and SHARDTRAIN_KEEP_SLURM=1 keeps
the one the session started warm for the next (start.sh then returns in ~0.1 s instead of ~1-2 s).
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
START = REPO / "slurm" / "local-cluster" / "start.sh"
STOP = REPO / "slurm" / "local-cluster" / "stop.sh"
PACKAGES_UNAVAILABLE = 3  # start.sh: munge/slurm missing and apt-get cannot install them
DAEMONS = ("munged", "slurmctld", "slurmd")


@dataclass
class LocalSlurm:
    dir: str
    conf: str  # SLURM_CONF for clients
    start_output: str  # what start.sh printed


def running_daemons(state_dir: str) -> dict[str, int]:
    """name -> pid of this cluster's live daemons, from the pid files start.sh writes (a zombie is not alive)."""
    up = {}
    for name in DAEMONS:
        try:
            pid = int((Path(state_dir) / "run" / f"{name}.pid").read_text().strip())
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, ValueError, IndexError):
            continue
        if comm == name and state not in ("Z", "X"):
            up[name] = pid
    return up


@pytest.fixture(scope="session")
def local_slurm():
    state_dir = os.environ.get("SHARDTRAIN_SLURM_DIR", "/tmp/shardtrain-slurm")
    before = running_daemons(state_dir)
    try:
        start = subprocess.run(["bash", str(START), state_dir], capture_output=True, text=True, timeout=900)
    finally:
        # By pid, not name: start.sh restarts daemons whose config changed, and those are this session's too.
        started = {name for name, pid in running_daemons(state_dir).items() if before.get(name) != pid}
    try:
        if start.returncode == PACKAGES_UNAVAILABLE:
            pytest.skip(
                f"local Slurm unavailable (start.sh exit 3: packages cannot be installed): "
                f"{start.stderr.strip()[-300:]}"
            )
        assert start.returncode == 0, f"start.sh failed ({start.returncode}):\n{start.stdout}\n{start.stderr}"
        yield LocalSlurm(dir=state_dir, conf=f"{state_dir}/slurm.conf", start_output=start.stdout)
    finally:
        if started and os.environ.get("SHARDTRAIN_KEEP_SLURM") != "1":
            # A munged that was already there serves whoever started it.
            keep_munge = ["--keep-munge"] if "munged" in before else []
            subprocess.run(["bash", str(STOP), state_dir, *keep_munge], capture_output=True, timeout=120)


def alive(pid: int) -> bool:
    """Not a zombie: a stopped daemon may wait a while for pid 1 to reap it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False
