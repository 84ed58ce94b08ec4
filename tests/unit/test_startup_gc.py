"""Start-up runs with rare garbage collections, and the training loop gets the collector back as it was."""

from __future__ import annotations

import gc
import sys
import types

import pytest

from shardtrain import cli
from shardtrain.runtime import startup_gc


@pytest.fixture
def thresholds():
    saved = gc.get_threshold()
    assert startup_gc._saved is None, "a command run earlier in this process left collections deferred"
    yield saved
    startup_gc._saved = None
    gc.set_threshold(*saved)


def test_a_command_starts_with_rare_collections_and_restore_gives_back_the_users_thresholds(thresholds, monkeypatch):
    seen = {}
    command = types.ModuleType("shardtrain_fake_command")
    command.main = lambda argv: seen.setdefault("threshold", gc.get_threshold()) and 0
    monkeypatch.setitem(sys.modules, "shardtrain_fake_command", command)
    monkeypatch.setitem(cli.COMMANDS, "fake", ("shardtrain_fake_command", "a test command"))
    assert cli.run_command("fake", []) == 0
    assert seen["threshold"] == startup_gc.STARTUP_THRESHOLDS
    assert gc.get_threshold() == thresholds  # the command's end gives them back too


def test_the_loop_restores_them_before_its_first_step(thresholds):
    startup_gc.defer_collections()
    assert gc.get_threshold() == startup_gc.STARTUP_THRESHOLDS
    startup_gc.restore_collections()
    assert gc.get_threshold() == thresholds


def test_restore_without_defer_leaves_a_users_collector_alone(thresholds):
    gc.set_threshold(1234, 5, 6)  # shardtrain.fit from a script that tuned its own collector
    startup_gc.restore_collections()
    assert gc.get_threshold() == (1234, 5, 6)
