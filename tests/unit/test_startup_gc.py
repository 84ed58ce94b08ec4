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


def test_the_model_build_starts_with_the_start_up_heap_frozen(thresholds):
    """A full collection during the model build (DeepSpeed's ZeRO-3 set-up calls gc.collect()) walked the
    whole import heap: 0.58 to 0.67 s per rank on the tiny config, 0.14 to 0.17 s with it frozen."""
    startup_gc.defer_collections()
    imported = [object()]  # stands for the heap the imports built
    startup_gc.freeze_start_up()
    try:
        assert not any(o is imported for o in gc.get_objects())  # frozen: no collection walks it again
    finally:
        gc.unfreeze()
    startup_gc.restore_collections(freeze=False)


def test_freeze_start_up_without_defer_leaves_a_users_heap_alone(thresholds):
    before = gc.get_freeze_count()
    built = [object()]  # shardtrain.fit from a user's script: their collector, their heap
    startup_gc.freeze_start_up()
    assert gc.get_freeze_count() == before and any(o is built for o in gc.get_objects())


def test_the_trainer_and_zero3_freeze_before_what_collects():
    """The wiring: the Trainer freezes before the strategy builds the model, ZeRO-3 again after importing
    DeepSpeed and torch._dynamo (their heaps too) and before zero.Init."""
    from pathlib import Path

    loop = (Path(startup_gc.__file__).parents[1] / "loop" / "train.py").read_text()
    assert loop.index("freeze_start_up()") < loop.index("self.strategy.setup(")
    zero = (Path(startup_gc.__file__).parents[1] / "strategies" / "zero.py").read_text()
    assert zero.index("import torch._dynamo") < zero.index("freeze_start_up()") < zero.index("deepspeed.zero.Init(")
