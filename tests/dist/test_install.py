"""`make venv` (which `make demo` and `make test` run first) leaves the `shardtrain` command every README example
uses, and a `python -m shardtrain` that works outside the repository with no PYTHONPATH: the checkout installed
in editable mode.

The shared venv is left alone: a throwaway venv that sees its packages through a .pth file stands in for VENV,
and PIP_NO_INDEX=1 keeps pip off the network (every requirement is already there)."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

from launch import REPO


def throwaway_venv(path: Path) -> Path:
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(path)], check=True)
    site = Path(sysconfig.get_paths(vars={"base": str(path), "platbase": str(path)})["purelib"])
    (site / "shared-venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return path


def make_venv(venv: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PIP_NO_INDEX"] = "1"
    return subprocess.run(
        ["make", "-s", "-C", str(REPO), "venv", f"VENV={venv}"], env=env, capture_output=True, text=True, timeout=180
    )


def test_make_venv_installs_the_shardtrain_command(tmp_path):
    venv = throwaway_venv(tmp_path / "venv")
    made = make_venv(venv)
    assert made.returncode == 0, made.stdout + made.stderr
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for cmd in (
        [str(venv / "bin" / "shardtrain"), "--help"],
        [str(venv / "bin" / "python"), "-m", "shardtrain", "--help"],
    ):
        run = subprocess.run(cmd, cwd=outside, env=env, capture_output=True, text=True, timeout=60)
        assert run.returncode == 0 and "usage: shardtrain <command>" in run.stdout, (cmd, run.stdout + run.stderr)
        assert "train " in run.stdout
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import shardtrain; print(shardtrain.__file__)"],
        cwd=outside,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert Path(where.stdout.strip()) == REPO / "shardtrain" / "__init__.py"  # this checkout, not a copy
    # Installed once per checkout: the next make (every `make demo`) does not run pip again.
    assert (venv / ".editable-checkout").read_text().startswith(f"{REPO} ")
    again = make_venv(venv)
    assert again.returncode == 0 and again.stdout == "" and again.stderr == "", again.stdout + again.stderr
