"""Checkpoint loading refuses code-carrying pickles and says clearly what is wrong with a checkpoint."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import pytest
import torch

from shardtrain.checkpointing import store as checkpoint
from shardtrain.checkpointing.dcp_state import check_model_fits
from shardtrain.checkpointing.unpickle_guard import UnsafeCheckpoint, check_dcp_metadata, check_torch_file
from shardtrain.config.settings import Config, ConfigError
from shardtrain.runtime.preemption import requeue_if_slurm, slurm_job_to_requeue


class Evil:
    """Unpickling this runs a shell command that creates the marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def fake_checkpoint(root, marker):
    step = root / "checkpoints" / "step-000002"
    (step / "model_optim").mkdir(parents=True)
    with open(step / "model_optim" / ".metadata", "wb") as f:
        pickle.dump({"state_dict_metadata": Evil(marker)}, f)
    (step / "trainer_state.json").write_text(json.dumps({"step": 2, "format_version": 1, "config": Config().to_dict()}))
    (step / "COMMITTED").write_text("ok\n")
    return step


def test_malicious_dcp_metadata_is_refused_before_it_runs(tmp_path):
    marker = tmp_path / "pwned"
    step = fake_checkpoint(tmp_path, marker)
    with pytest.raises(UnsafeCheckpoint, match=r"contains a pickled object '(posix|os)\.system'.*refusing"):
        check_dcp_metadata(step / "model_optim")
    assert not marker.exists()


def test_malicious_torch_file_is_refused_before_it_runs(tmp_path):
    marker = tmp_path / "pwned"
    evil = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": Evil(marker), "w": torch.ones(2)}, evil)
    with pytest.raises(UnsafeCheckpoint, match="refusing to load"):
        check_torch_file(evil)
    assert not marker.exists()
    plain = tmp_path / "plain.pt"
    torch.save({"w": torch.ones(2), "n": 3}, plain)
    check_torch_file(plain)  # tensors and plain data pass


def test_export_cli_refuses_malicious_checkpoint_with_one_line(tmp_path):
    marker = tmp_path / "pwned"
    step = fake_checkpoint(tmp_path, marker)
    env = {**os.environ, "PYTHONPATH": str(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))}
    proc = subprocess.run(
        [sys.executable, "-m", "shardtrain", "export", str(step), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("shardtrain: error:")]
    assert len(lines) == 1 and "refusing to load" in lines[0] and ".metadata" in lines[0]
    assert "Traceback" not in proc.stderr
    assert not marker.exists()


def test_checkpoint_error_messages(tmp_path):
    step = tmp_path / "checkpoints" / "step-000004"
    step.mkdir(parents=True)
    with pytest.raises(ConfigError, match="not a committed checkpoint"):
        checkpoint.find_resume_dir(str(step), tmp_path)
    (step / "COMMITTED").write_text("ok\n")
    (step / "trainer_state.json").write_text('{"step": 4,\n "data": ')
    with pytest.raises(ConfigError, match=r"trainer_state.json: corrupt JSON at line 2"):
        checkpoint.read_trainer_state(step)
    (step / "trainer_state.json").write_text(json.dumps({"step": 4, "format_version": 99}))
    with pytest.raises(ConfigError, match="format 99 is newer"):
        checkpoint.read_trainer_state(step)
    with pytest.raises(
        ConfigError,
        match=r"another model: missing \(1\): head.b; unexpected \(1\): head.c; "
        r"shape checkpoint vs model \(1\): head.w \[4, 2\] vs \[3, 2\]",
    ):
        check_model_fits(
            step,
            {"head.w": (3, 2), "head.b": (3,)},
            {"model.head.w": (4, 2), "model.head.c": (3,), "optim.state.head.w.exp_avg": (4, 2)},
        )


def test_slurm_requeue_id():
    assert slurm_job_to_requeue({"SLURM_JOB_ID": "812"}) == "812"
    assert (
        slurm_job_to_requeue({"SLURM_JOB_ID": "813", "SLURM_ARRAY_JOB_ID": "800", "SLURM_ARRAY_TASK_ID": "13"})
        == "800_13"
    )
    assert slurm_job_to_requeue({}) is None


def test_slurm_requeue_survives_the_sigterm_it_causes(tmp_path, monkeypatch):
    """An accepted `scontrol requeue` makes Slurm SIGTERM the whole job, scontrol included, often before it
    exits: the requeue worked and must be reported so, not as a failure with "resubmit the job"."""
    fake = tmp_path / "scontrol"
    fake.write_text('#!/bin/sh\nkill -TERM $$\necho "requeue $2" >> "$0.log"\n')  # as Slurm's kill arrives first
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "814")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    lines = []
    assert requeue_if_slurm(lines.append) is True, lines
    assert lines == ["requeued Slurm job 814; it resumes from the checkpoint (--resume auto)"]
    assert (tmp_path / "scontrol.log").read_text() == "requeue 814\n"


def test_a_run_folder_named_checkpoints_is_a_run_folder(tmp_path):
    """SageMaker's run folder is /opt/ml/checkpoints: export, predict and --resume took it for OUT/checkpoints
    and said it held no committed checkpoint. OUT/checkpoints itself still works, and so does best."""
    run = tmp_path / "opt" / "ml" / "checkpoints"
    for step in (2, 4):
        committed = checkpoint.checkpoints_root(run) / checkpoint.step_dir_name(step)
        committed.mkdir(parents=True)
        (committed / checkpoint.TRAINER_STATE).write_text(json.dumps({"step": step}))
        (committed / checkpoint.COMMIT_MARKER).write_text("ok\n")
    (checkpoint.checkpoints_root(run) / checkpoint.BEST).write_text("step-000002\n")
    latest = run / "checkpoints" / "step-000004"
    assert checkpoint.find_resume_dir(str(run), tmp_path) == latest
    assert checkpoint.find_resume_dir(str(run / "checkpoints"), tmp_path) == latest
    assert checkpoint.find_checkpoint(run, "final", "export") == latest
    assert checkpoint.find_checkpoint(run, "best", "export") == run / "checkpoints" / "step-000002"
    assert checkpoint.find_checkpoint(run / "checkpoints", "best", "export").name == "step-000002"


def _committed_step(root, step: int, weight: torch.Tensor):
    """A committed checkpoint of a one-tensor model, written by DCP as a run writes its `model_optim/`."""
    import torch.distributed.checkpoint as dcp

    path = root / checkpoint.step_dir_name(step)
    dcp.save({"model": {"w": weight}}, checkpoint_id=str(path / "model_optim"), no_dist=True)
    (path / checkpoint.TRAINER_STATE).write_text(json.dumps({"step": step}))
    (path / checkpoint.COMMIT_MARKER).write_text("ok\n")
    return path


def test_a_shard_cut_short_or_gone_is_named_with_the_checkpoint_before_it(tmp_path):
    """A shard file that a dying host or a partial S3 sync cut short: torch's error named no file, and DCP's
    CheckpointException (a BaseException) carried every rank's traceback past the one-line handler."""
    from shardtrain.checkpointing.portable import read_portable

    root = tmp_path / "checkpoints"
    earlier = _committed_step(root, 2, torch.ones(4096))
    damaged = _committed_step(root, 4, torch.arange(4096.0))
    (shard,) = (damaged / "model_optim").glob("*.distcp")
    size = shard.stat().st_size
    os.truncate(shard, size // 2)
    with pytest.raises(ConfigError) as cut:
        read_portable(damaged)
    assert str(cut.value) == (
        f"checkpoint file {shard} is truncated ({size // 2:,} of the {size:,} bytes its index names); "
        f"the run's previous checkpoint is whole: --resume {earlier}"
    )
    shard.unlink()
    with pytest.raises(ConfigError, match=rf"^checkpoint file {shard} is missing; .* --resume {earlier}$"):
        read_portable(damaged)
    assert torch.equal(read_portable(earlier)["model"]["w"], torch.ones(4096))


def test_a_shard_damaged_inside_is_one_line_naming_the_rank_error(tmp_path):
    from shardtrain.checkpointing.portable import read_portable

    damaged = _committed_step(tmp_path / "checkpoints", 2, torch.arange(4096.0))
    (shard,) = (damaged / "model_optim").glob("*.distcp")
    data = bytearray(shard.read_bytes())
    data[: len(data) // 2] = bytes(len(data) // 2)  # the size is whole, the bytes are not
    shard.write_bytes(bytes(data))
    with pytest.raises(ConfigError) as bad:
        read_portable(damaged)
    line = str(bad.value)
    assert line.startswith(f"checkpoint {damaged}: cannot read model_optim/ (corrupt?): ") and "\n" not in line
    assert "Traceback" not in line and "CheckpointException" not in line


def test_a_write_error_wrapped_by_dcp_keeps_its_errno(monkeypatch):
    """A real full disk reaches the save's commit wrapped in DCP's CheckpointException, which has no errno: the
    line said "a rank failed to write its shards" instead of the cause."""
    import errno
    import traceback

    from torch.distributed.checkpoint.api import CheckpointException

    full = OSError(errno.ENOSPC, "No space left on device")
    wrapped = CheckpointException("CheckpointException ranks:dict_keys([1])", {1: (full, traceback.StackSummary())})
    assert checkpoint.rank_error(wrapped) is full and checkpoint.rank_error(full) is full
    assert checkpoint._cause(checkpoint.rank_error(wrapped)) == "No space left on device"
    # torch's stream writer reports a full disk as a RuntimeError with no errno (seen once in four real full-disk
    # runs): a filesystem left without space says ENOSPC; one with space, nothing.
    written = RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")
    here = checkpoint.Path(".")
    assert checkpoint._errno_of(written, here) is None
    monkeypatch.setattr(checkpoint, "FULL_BELOW_BYTES", 1 << 62)  # any filesystem is "full" below that
    assert checkpoint._errno_of(written, here) == errno.ENOSPC
    assert checkpoint._errno_of(full, here) == errno.ENOSPC and checkpoint._errno_of(None, here) is None
    # The advice follows the cause: a trial's line said "free space" whatever it was.
    root = checkpoint.Path("/out/checkpoints")
    assert checkpoint._remedy(errno.ENOSPC, root) == "free space under /out/checkpoints and rerun with --resume auto"
    assert checkpoint._remedy(errno.EACCES, root) == "make /out/checkpoints writable and rerun with --resume auto"
    assert (
        checkpoint._remedy(errno.EIO, root)
        == checkpoint._remedy(-1, root)
        == "fix the cause and rerun with --resume auto"
    )
