"""`shardtrain plan` keeps the large blocks its measurement frees (runtime/host_malloc.py): a block above glibc's
mmap threshold, freed and allocated again, is not faulted in again page by page."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from shardtrain.runtime import host_malloc

# A fresh interpreter, so that the default arm really has glibc's defaults: 20 blocks of 40 MiB (above the
# threshold's 32 MiB cap), each written once per page and freed, before and after keep_freed_blocks().
PROBE = """
import json, resource
from shardtrain.runtime.host_malloc import keep_freed_blocks

def faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        block = bytearray(40 << 20)
        block[::4096] = bytes(len(range(0, 40 << 20, 4096)))
        del block
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

default = faults()
kept = keep_freed_blocks()
print(json.dumps({"default": default, "kept": kept, "after": faults()}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_freed_large_blocks_are_reused_instead_of_faulted_in_again():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    faults = json.loads(done.stdout)
    pages = 20 * (40 << 20) // 4096
    assert faults["kept"] is True
    assert faults["default"] > 0.9 * pages, faults  # every block mapped afresh: every page faulted
    assert faults["after"] < 0.1 * faults["default"], faults  # one block's pages, then reused


def test_plan_keeps_freed_blocks_before_it_measures(monkeypatch):
    from shardtrain.commands import plan

    calls = []

    class Measuring(Exception):
        pass

    def measure(*args, **kwargs):
        calls.append("measure")
        raise Measuring  # the order is the point, not the plan

    monkeypatch.setattr(plan, "keep_freed_blocks", lambda: calls.append("keep"))
    monkeypatch.setattr(plan, "plan", measure)
    with pytest.raises(Measuring):
        plan.main(["--config", "configs/longformer_tiny.yaml", "--gpus", "2", "--gpu", "a100"])
    assert calls == ["keep", "measure"]


def test_no_glibc_changes_nothing(monkeypatch):
    monkeypatch.setattr(host_malloc.sys, "platform", "darwin")
    assert host_malloc.keep_freed_blocks() is False
