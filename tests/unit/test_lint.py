"""ruff keeps the code tidy: its lint rules (pyproject.toml [tool.ruff.lint]) and its formatter, on every folder of
Python the project ships. A finding fails here with ruff's own lines, so `make test` is where it shows."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FOLDERS = ["shardtrain", "tests", "benchmarks", "examples"]


def ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", *args, *FOLDERS], cwd=REPO, capture_output=True, text=True)


def test_ruff_lint_rules_hold():
    proc = ruff("check", "--output-format", "concise")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_ruff_format_is_applied():
    proc = ruff("format", "--check")
    assert proc.returncode == 0, f"run `ruff format {' '.join(FOLDERS)}`:\n" + proc.stdout[-4000:] + proc.stderr[-2000:]
