"""`shardtrain train --nproc N` starts as one parent process that runs the pre-launch checks and then torchrun.
That parent never trains: importing torch there (~2 s, ~1 s more at exit) only delays the workers."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from launch import REPO, test_env

# The parent's whole path (cli -> commands.train), with the launch itself replaced by a note of what it would run.
PARENT = """
import json, sys
import shardtrain.runtime.launch as launch
launch.launch_local = lambda nproc, program, shown, extra_env=None: print("LAUNCH", json.dumps(program)) or 0
from shardtrain.cli import run_command
code = run_command("train", sys.argv[1:])
heavy = [m for m in ("torch", "transformers", "datasets", "deepspeed") if m in sys.modules]
print("RESULT", json.dumps({"code": code, "heavy": heavy}))
"""


def parent(mm_data, tmp_path, *extra: str) -> subprocess.CompletedProcess:
    """The parent of `train --nproc N` on the tiny multimodal config, with `extra` flags."""
    args = ["--config", str(REPO / "configs" / "multimodal_tiny.yaml"), "--data-dir", str(mm_data)]
    return subprocess.run(
        [sys.executable, "-c", PARENT, *args, "--output-dir", str(tmp_path / "out"), *extra],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=test_env(),
        timeout=120,
    )


@pytest.mark.parametrize(
    "strategy",
    [["--strategy", "ddp"], ["--strategy", "fsdp"], ["--ds", str(REPO / "ds_configs" / "zero2.json")]],
    ids=["ddp", "fsdp", "zero2"],
)
def test_parent_checks_and_launches_without_torch(mm_data, tmp_path, strategy):
    run = parent(mm_data, tmp_path, "--nproc", "2", *strategy)
    lines = {
        line.split(" ", 1)[0]: line.split(" ", 1)[1]
        for line in run.stdout.splitlines()
        if line.startswith(("LAUNCH ", "RESULT "))
    }
    assert "RESULT" in lines, run.stdout + run.stderr
    result = json.loads(lines["RESULT"])
    assert result["code"] == 0 and "LAUNCH" in lines, run.stdout + run.stderr
    assert result["heavy"] == [], f"the parent imported {result['heavy']}"


def test_parent_still_refuses_bad_input_before_launch(mm_data, tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    run = parent(mm_data, tmp_path, "--nproc", "2", "--ds", str(tmp_path / "bad.json"))
    assert "LAUNCH" not in run.stdout and "bad.json" in run.stderr, run.stdout + run.stderr


def test_check_only_makes_the_checks_and_starts_nothing(mm_data, tmp_path):
    """`train --check-only` (a login node's check before a queued job; slurm/srun_train.sh's before srun): the
    parent's checks, at the world size it would launch, then exit 0 with no launch, no torch and no output folder."""
    run = parent(mm_data, tmp_path, "--nproc", "3", "--check-only")
    result = json.loads(run.stdout.split("RESULT ", 1)[1]) if "RESULT " in run.stdout else None
    assert result == {"code": 0, "heavy": []} and "LAUNCH" not in run.stdout, run.stdout + run.stderr
    assert "--check-only: every check made before a launch passed" in run.stdout
    assert not (tmp_path / "out").exists()
    # 256 examples: 100 a rank fits 2 ranks, not these 3
    run = parent(mm_data, tmp_path, "--nproc", "3", "--check-only", "--per-device-batch-size", "100")
    assert "LAUNCH" not in run.stdout and 'RESULT {"code": 2,' in run.stdout, run.stdout + run.stderr
    assert "256 examples // world size 3 = 85" in run.stderr.strip().splitlines()[-1], run.stderr


def test_a_class_metric_is_checked_against_the_datas_classes_before_launch(mm_data, tmp_path):
    """--metric-for-best-model f1_<class> names a class the data has: checked by --check-only and before any
    process starts (a user's --check-only passed `f1_negtive`, and the job failed after its ranks started)."""
    csv = tmp_path / "reviews.csv"
    csv.write_text("review,sentiment\n" + "".join(f"text {i},{('negative', 'positive')[i % 2]}\n" for i in range(16)))
    text_only = ["--config", str(REPO / "configs" / "longformer_tiny.yaml")]  # the later --config is the one read
    named = [*text_only, "--train-file", str(csv), "--text-column-names", "review", "--label-column-name", "sentiment"]
    for source, typo, fine in ((named, "f1_negtive", "f1_negative"), (["--data-dir", str(mm_data)], "f1_3", "f1_2")):
        args = ["--nproc", "2", "--eval-every", "10", *source, "--check-only", "--metric-for-best-model"]
        refused = parent(mm_data, tmp_path, *args, typo)
        assert 'RESULT {"code": 2,' in refused.stdout, refused.stdout + refused.stderr
        assert f"{typo}: no such class; the data's classes give" in refused.stderr, refused.stderr
        assert 'RESULT {"code": 0,' in parent(mm_data, tmp_path, *args, fine).stdout


def test_the_other_built_ins_checkpoint_is_refused_before_launch(mm_data, tmp_path):
    """A Longformer run's checkpoint under the multimodal config: in the run's own folder (--resume auto) and
    named by --resume (it was refused only by the weights' names, after the launch, the data and a tokenizer
    folder: 16.6 s in a user's trial). One line each, nothing launched, no folder made."""
    from shardtrain.checkpointing import store

    longformer_run = tmp_path / "longformer_run"
    step = store.checkpoints_root(longformer_run) / store.step_dir_name(6)
    step.mkdir(parents=True)
    (step / store.TRAINER_STATE).write_text(json.dumps({"step": 6, "config": {"model": {"name": "longformer"}}}))
    (step / store.COMMIT_MARKER).write_text("ok\n")

    named = parent(mm_data, tmp_path, "--nproc", "2", "--resume", str(longformer_run))
    assert "LAUNCH" not in named.stdout and 'RESULT {"code": 2,' in named.stdout, named.stdout + named.stderr
    assert named.stderr.strip().splitlines()[-1] == (
        f"shardtrain: error: --resume (checkpoint.resume) {longformer_run}: a checkpoint of longformer "
        "(step-000006), and this run trains multimodal: name a checkpoint of multimodal, or start afresh with "
        "--resume none"
    )
    assert not (tmp_path / "out").exists()
    shutil.move(longformer_run, tmp_path / "out")
    own = parent(mm_data, tmp_path, "--nproc", "2", "--resume", "auto")
    assert "LAUNCH" not in own.stdout and "holds a run of longformer (step-000006)" in own.stderr, own.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["checkpoints"]


def test_the_world_size_before_launch_is_the_launchers_or_nproc(monkeypatch):
    """What the pre-launch checks size the job by (the training set's share per rank, DeepSpeed's batch)."""
    from shardtrain.config.settings import parse_cli
    from shardtrain.runtime.launch import launch_world_size

    cfg = parse_cli(["--config", str(REPO / "configs" / "multimodal_tiny.yaml"), "--nproc", "3"])
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    assert launch_world_size(cfg) == 3  # the parent of `train --nproc 3`
    monkeypatch.setenv("SLURM_NTASKS", "4")  # srun, one task per GPU
    assert launch_world_size(cfg) == 4
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "6")  # a torchrun worker of two nodes
    assert launch_world_size(cfg) == 6


def test_the_launch_line_printed_can_be_pasted_from_where_it_was_typed(tmp_path, monkeypatch):
    """From an example's folder, with a JSON --workload-args: the line named `shardtrain/main.py`, a file that is
    not there, and joined the arguments with spaces, so the JSON split into several."""
    import shlex

    import shardtrain.runtime.launch as launch
    from shardtrain.config.settings import parse_cli

    for name in ("RANK", "LOCAL_RANK", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    lines = []
    monkeypatch.setattr(launch, "launch_local", lambda nproc, program, shown, **_: lines.append(shown) or 0)
    monkeypatch.chdir(tmp_path)
    argv = ["--config", str(REPO / "configs" / "multimodal_tiny.yaml"), "--workload-args", '{"n": 8}', "--nproc", "2"]
    assert launch.maybe_relaunch(parse_cli(argv, check_only=True), argv) == 0
    words = shlex.split(lines[0])
    assert Path(words[0]).is_file() and words[1:] == argv[:4], lines
