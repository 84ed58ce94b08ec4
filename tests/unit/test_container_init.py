"""The training container's PID 1 (shardtrain/runtime/container_init.py): what it signals, and its refusals."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardtrain.runtime import container_init

REPO = Path(__file__).resolve().parents[2]


def _wait_for(pred, seconds: float = 20.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        found = pred()
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError("timed out")


def test_a_stop_reaches_only_the_workers_below_it_not_another_job_on_the_host(tmp_path):
    """It used to signal every process on the machine whose command line ran shardtrain/main.py: run outside a
    container (or beside another job), a stop of one job stopped the others."""
    script = tmp_path / "shardtrain" / "main.py"
    script.parent.mkdir()
    script.write_text("import time\ntime.sleep(60)\n")
    other_job = subprocess.Popen([sys.executable, str(script)])
    # A driver below which the worker runs, as torchrun's workers run below the SDK's driver.
    driver = subprocess.Popen(
        [sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, {str(script)!r}])"]
    )
    import psutil

    try:
        worker = _wait_for(lambda: [c.pid for c in psutil.Process(driver.pid).children()])
        both = {other_job.pid, *worker}
        assert _wait_for(lambda: both <= set(container_init.training_workers(root=os.getpid())))
        assert container_init.training_workers(root=driver.pid) == worker
    finally:
        # The worker first: once the driver is killed it belongs to init and no longer shows among our children.
        for p in psutil.Process().children(recursive=True):
            p.kill()
        for p in (other_job, driver):
            p.kill()
            p.wait()


def test_help_and_a_command_that_does_not_exist_are_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        container_init.main(["--help"])
    assert e.value.code == 0 and "python -m shardtrain.runtime.container_init CMD" in capsys.readouterr().out
    assert container_init.main(["no-such-program-here"]) == 127
    err = capsys.readouterr().err.strip()
    assert err.startswith("container_init: cannot run no-such-program-here:") and "\n" not in err, err


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0, reason="needs unshare, as root")
def test_a_pid_namespace_without_its_own_proc_is_refused_before_the_command_runs(tmp_path):
    """`unshare --pid` without --mount-proc (a local imitation of a container) left /proc naming the host's
    processes: the stop found no worker, said nothing, and the job was killed mid-run."""
    marker = tmp_path / "ran"
    cmd = [sys.executable, "-m", "shardtrain.runtime.container_init", "touch", str(marker)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    refused = subprocess.run(["unshare", "--pid", "--fork", *cmd], capture_output=True, text=True, env=env)
    assert refused.returncode == 1 and not marker.exists()
    assert refused.stderr.strip().startswith("container_init: /proc belongs to another PID namespace"), refused.stderr
    own = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", *cmd], capture_output=True, env=env)
    assert own.returncode == 0 and marker.exists()
