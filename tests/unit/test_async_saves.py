"""--async-save's commit and ordering rules in one process (no process group): a background write is committed
only once it is on disk, with the trainer state of the step it snapshotted; one save in flight; a failed write
leaves the previous checkpoint as `latest`; pruning spares the checkpoint `latest` names. The real multi-process
runs (DCP async_save, kill -9 while writing) are in tests/dist/test_async_checkpoints.py."""

from __future__ import annotations

import errno
import json
import threading
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import torch

from shardtrain.checkpointing import store as checkpoint
from shardtrain.config.settings import Config, ConfigError, parse_cli
from shardtrain.loop.saves import Saves


class FakeStrategy:
    """Writes one file per save; with `background` the file appears only when the test releases the write."""

    def __init__(self):
        self.dist = SimpleNamespace(is_rank0=True, rank=0, world_size=1)
        self.device = torch.device("cpu")
        self.writes: list[tuple[Future, object]] = []

    def describe(self):
        return {"strategy": "fake"}

    def save(self, path):
        (path / "shard").write_text("data")

    def save_async(self, path):
        future = Future()
        self.writes.append((future, path))
        return checkpoint.AsyncWrite(future)

    def release(self, i: int, error: BaseException | None = None):
        future, path = self.writes[i]
        if error is None:
            (path / "shard").write_text("data")
            future.set_result(None)
        else:
            future.set_exception(error)


class Quiet:
    def info(self, msg):
        pass


def state(step: int) -> dict:
    return {"step": step, "data": {"position": step}, "config": {}}


def committed(root) -> list[str]:
    return [p.name for p in checkpoint.committed_steps(root)]


def latest(root) -> str:
    return (root / "latest").read_text().strip()


def test_a_background_save_commits_only_when_written_with_its_own_steps_state(tmp_path):
    s = FakeStrategy()
    saves = Saves(s, tmp_path, keep_last=3, background=True, console=Quiet())
    root = checkpoint.checkpoints_root(tmp_path)
    saves.save(2, state(2))
    assert saves.writing() and committed(root) == [] and not (root / "latest").exists()
    saves.agreed(writing_ranks=1, any_failed=False)  # another rank still writes: nothing happens
    assert committed(root) == []
    s.release(0)
    assert not saves.writing()
    saves.agreed(writing_ranks=0, any_failed=False)
    assert committed(root) == ["step-000002"] and latest(root) == "step-000002"
    saved = json.loads((root / "step-000002" / checkpoint.TRAINER_STATE).read_text())
    assert saved["step"] == 2 and saved["data"] == {"position": 2}  # the snapshotted step's, not a later one's
    assert (root / "step-000002" / "rng" / "rank-00000.safetensors").is_file()
    assert len(saves.blocking_seconds) == len(saves.write_seconds) == 1


def test_one_save_in_flight_the_next_waits_and_commits_it_first(tmp_path):
    s = FakeStrategy()
    saves = Saves(s, tmp_path, keep_last=3, background=True, console=Quiet())
    root = checkpoint.checkpoints_root(tmp_path)
    saves.save(2, state(2))
    timer = threading.Timer(0.3, s.release, args=(0,))
    timer.start()
    saves.save(4, state(4))  # blocks until step 2's write is done, commits it, then starts step 4's
    timer.join()
    assert committed(root) == ["step-000002"] and latest(root) == "step-000002"
    assert saves.blocking_seconds[0] >= 0.25  # the wait counts as time the loop was blocked for step 2's save
    s.release(1)
    saves.wait()  # the end of a run
    assert committed(root) == ["step-000002", "step-000004"] and latest(root) == "step-000004"


def test_a_failed_background_write_keeps_the_previous_checkpoint_as_latest(tmp_path):
    s = FakeStrategy()
    saves = Saves(s, tmp_path, keep_last=3, background=True, console=Quiet())
    root = checkpoint.checkpoints_root(tmp_path)
    saves.save(2, state(2))
    s.release(0)
    saves.save(4, state(4))
    s.release(1, OSError(errno.ENOSPC, "No space left on device"))
    assert saves.write_failed()
    with pytest.raises(
        ConfigError,
        match=r"step-000004 failed \(No space left on device\); the previous "
        r"checkpoint .*step-000002 is intact",
    ):
        saves.agreed(writing_ranks=0, any_failed=True)
    assert committed(root) == ["step-000002"] and latest(root) == "step-000002"
    assert not (root / "step-000004").exists()


def test_an_unfinished_write_is_never_committed_and_pruning_spares_latest(tmp_path):
    """A crash (here: the run simply stops) with a write in flight leaves that step folder without COMMITTED;
    `latest` still names the previous one, and the next commit's pruning removes the torn folder but never
    the checkpoint being committed."""
    s = FakeStrategy()
    saves = Saves(s, tmp_path, keep_last=1, background=True, console=Quiet())
    root = checkpoint.checkpoints_root(tmp_path)
    saves.save(2, state(2))
    s.release(0)
    saves.save(4, state(4))  # commits step 2; step 4 stays in flight
    assert (root / "step-000004").is_dir() and not checkpoint.is_committed(root / "step-000004")
    assert checkpoint.latest_committed(root).name == "step-000002"  # what --resume auto would load
    # A restarted run (new Saves) commits step 6 with keep_last 1: step 2 goes, the torn step 4 goes.
    again = Saves(s, tmp_path, keep_last=1, background=True, console=Quiet())
    again.save(6, state(6))
    s.release(2)
    again.wait()
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == ["step-000006"]
    assert latest(root) == "step-000006"


def test_synchronous_saves_record_the_same_seconds_twice(tmp_path):
    saves = Saves(FakeStrategy(), tmp_path, keep_last=2, background=False, console=Quiet())
    saves.save(2, state(2))
    assert committed(checkpoint.checkpoints_root(tmp_path)) == ["step-000002"]
    assert saves.blocking_seconds == saves.write_seconds and not saves.writing()


def test_flag_and_yaml_key(tmp_path):
    assert Config().checkpoint.async_save is False
    assert parse_cli(["--async-save"]).checkpoint.async_save is True
    assert parse_cli(["--async-save", "false"]).checkpoint.async_save is False
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("checkpoint:\n  async_save: true\n")
    assert parse_cli(["--config", str(yaml_file)]).checkpoint.async_save is True
    yaml_file.write_text("checkpoint:\n  async_save: sometimes\n")
    with pytest.raises(ConfigError, match=r"checkpoint\.async_save.*expected true or false"):
        parse_cli(["--config", str(yaml_file)])


def test_deepspeed_fp16_is_refused_in_one_line_before_any_model(tmp_path):
    """The background ZeRO save writes the portable form alone, which has no place for the dynamic loss scale."""
    from shardtrain.runtime.distributed import DistInfo
    from shardtrain.strategies.zero import ZeroStrategy

    dist_info = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend="gloo")
    fp16 = parse_cli(["--ds", "ds_configs/zero2.json", "--precision", "fp16", "--async-save", "--device", "cpu"])
    with pytest.raises(
        ConfigError,
        match=r"^--async-save \(checkpoint\.async_save\) with DeepSpeed fp16: .* use --precision bf16 or fp32",
    ):
        ZeroStrategy(fp16, dist_info, workload=object())
    bf16 = parse_cli(["--ds", "ds_configs/zero2.json", "--precision", "bf16", "--async-save", "--device", "cpu"])
    assert ZeroStrategy(bf16, dist_info, workload=object()).name == "zero2"
