"""What `docker compose -f FILE up` does for the SageMaker SDK's LOCAL_CONTAINER mode, without docker: each
service of the compose file the SDK wrote (one per instance, `algo-1`...) runs as an emulated container, and
this command's exit code is the first container to exit's, as with `--abort-on-container-exit`.

    python tests/sm_compose.py -f <container_root>/docker-compose.yaml up --build --abort-on-container-exit

A container here is this machine's own filesystem (the "image": the venv's python first on PATH) with:
- a PID namespace of its own, whose PID 1 is the service's entrypoint exactly as the SDK set it
  (bash -c running chmod and then the generated sm_train.sh), and a /proc that shows it;
- a mount namespace in which /opt is an overlay (the host's /opt is never written), and the compose file's
  volumes are bind-mounted where it says (/opt/ml/input, /opt/ml/model, /opt/ml/output, the channels);
- /opt/ml/checkpoints bound to `$SM_EMULATOR_CHECKPOINTS/<host>` (tests/sm_job.py: a folder per checkpoint
  S3 prefix): what SageMaker restores there from checkpoint_s3_uri before the job starts and syncs back while
  it runs (LOCAL_CONTAINER mode has no such mount of its own);
- a network namespace, loopback only, and the hostname `algo-N`, as on an instance. The instances of one job
  share it (started in the first one's, with nsenter), as the compose network joins them: every `algo-N`
  resolves to that loopback, so torchrun's rendezvous between instances works, and nothing leaves it.

The host pid of each container's PID 1 is written to `$SM_EMULATOR_DIR/<host>.pid1` for the test: a
spot interruption or StopTrainingJob is SIGTERM to that process alone (then SIGKILL, as `docker stop`).
The environment is the image's (this process's, less PYTHONPATH: the code channel carries shardtrain)
plus the compose file's `environment`.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml


def container_script(host: str, service: dict, all_hosts: list[str], state: Path, scratch: Path) -> str:
    upper, work = scratch / "upper", scratch / "work"
    upper.mkdir(parents=True)
    work.mkdir()
    checkpoints = Path(os.environ["SM_EMULATOR_CHECKPOINTS"]) / host
    checkpoints.mkdir(parents=True, exist_ok=True)
    # The compose network's aliases: every instance's name resolves (here, all on the one loopback).
    hosts_file = scratch / "hosts"
    hosts_file.write_text("127.0.0.1 localhost " + " ".join(all_hosts) + "\n")
    lines = [
        "set -e",
        "ip link set lo up",
        f"hostname {host}",
        f"mount --bind {hosts_file} /etc/hosts",
        f"mount -t overlay overlay -o lowerdir=/opt,upperdir={upper},workdir={work} /opt",
    ]
    volumes = [v[:-2] if v.endswith(":z") else v for v in service["volumes"]]
    volumes.append(f"{checkpoints}:/opt/ml/checkpoints")
    # Parents first: /opt/ml/input before /opt/ml/input/data/<channel>.
    for volume in sorted(volumes, key=lambda v: v.split(":")[1].count("/")):
        src, dst = volume.split(":")[:2]
        # docker makes a missing host folder of a volume, as it does here.
        lines += [
            f"mkdir -p {shlex.quote(src)} {shlex.quote(dst)}",
            f"mount --bind {shlex.quote(src)} {shlex.quote(dst)}",
        ]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",) and not k.startswith("SM_EMULATOR")}
    env.update(e.split("=", 1) for e in service.get("environment", []))
    env_args = " ".join(shlex.quote(f"{k}={v}") for k, v in env.items())
    lines.append("cd /")
    lines.append(f"exec env -i {env_args} {' '.join(shlex.quote(a) for a in service['entrypoint'])}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    compose = yaml.safe_load(Path(argv[argv.index("-f") + 1]).read_text())
    state = Path(os.environ["SM_EMULATOR_DIR"])
    procs, inits = {}, []
    with tempfile.TemporaryDirectory(prefix="sm-container-") as scratch:
        for host, service in compose["services"].items():
            script = container_script(host, service, list(compose["services"]), state, Path(scratch) / host)
            # The first instance makes the job's network namespace; the others join it.
            net = [f"--net=/proc/{inits[0]}/ns/net"] if inits else []
            unshare = ["unshare", "--pid", "--fork", "--mount-proc", "--mount", "--uts", *([] if net else ["--net"])]
            procs[host] = subprocess.Popen([*(["nsenter", *net] if net else []), *unshare, "bash", "-c", script])
            inits.append(_init_pid(procs[host]))
            (state / f"{host}.pid1").write_text(str(inits[-1]))
        try:
            while True:
                for proc in procs.values():
                    if proc.poll() is not None:
                        return proc.returncode
                time.sleep(0.2)
        finally:
            for pid in inits:  # SIGKILL to a PID 1 ends its whole namespace, as `docker compose` stopping it
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
            for proc in procs.values():
                proc.wait()


def _init_pid(unshare: subprocess.Popen) -> int:
    """The host pid of the container's PID 1: unshare --fork's one child."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            children = Path(f"/proc/{unshare.pid}/task/{unshare.pid}/children").read_text().split()
        except OSError:
            children = []
        if children:
            return int(children[0])
        time.sleep(0.05)
    raise RuntimeError("the emulated container did not start")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
