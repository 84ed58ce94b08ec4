"""A launch that hangs fails with every process's stacks (tests/launch.py, tests/stack_dumps/), not just a timeout:
an intermittent hang in a long multi-run launch is otherwise not diagnosable from CI's log."""

from __future__ import annotations

import sys

import pytest
from launch import run

# A parent waiting on a child, as torchrun's agent waits on a rank, each blocked where a hang would block.
HANGS = """
import subprocess, sys, time

def rank_waits_in_a_collective():
    time.sleep(600)

if sys.argv[1:] == ["child"]:
    rank_waits_in_a_collective()
else:
    child = subprocess.Popen([sys.executable, __file__, "child"])
    def agent_waits_for_its_worker():
        child.wait()
    agent_waits_for_its_worker()
"""


def test_a_hung_launch_fails_with_every_process_stacks(tmp_path):
    script = tmp_path / "hangs.py"
    script.write_text(HANGS)
    with pytest.raises(AssertionError) as failed:
        run([sys.executable, str(script)], timeout=3)
    message = str(failed.value)
    assert "timed out after 3s" in message
    assert "agent_waits_for_its_worker" in message
    assert "rank_waits_in_a_collective" in message
