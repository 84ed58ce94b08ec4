"""Checkpoints written by older code load with today's code: exact resume and export.

The flat package's last commit (FLAT_PACKAGE) is unpacked from git and trains three steps under ZeRO-2
(DeepSpeed's engine files are pickles, the format most likely to name a module path) with its own
`shardtrain/main.py`, saving at step 2 on its way. Today's code then resumes that step-2 checkpoint for the third
step, which must log the loss the old run logged, and exports it. Both read the gathered portable form DeepSpeed
wrote beside its engine files then: today's ZeRO ranks each read their own partition out of it; the
second test does so under ZeRO-3, from the last commit before each rank wrote only its own partition (GATHERED_FORM).
"""

from __future__ import annotations

import io
import json
import subprocess
import tarfile

from launch import REPO, cli, test_env, tiny_args, torchrun

FLAT_PACKAGE = "aadbac5b260443caceffebf901d45755aed0e545"  # the last commit before shardtrain/*.py moved into folders
GATHERED_FORM = "a4e8e27456c5705db18d11a7f00b7089b7fb631a"  # the last commit whose ZeRO saves gathered the full state


def old_checkout(dest, commit=FLAT_PACKAGE):
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", commit, "shardtrain", "configs", "ds_configs", "fsdp_policies"],
        capture_output=True,
        check=False,
    )
    assert archive.returncode == 0, (
        f"git archive {commit[:7]} failed (a shallow clone? this test needs the "
        f"repository's history): {archive.stderr.decode()[-300:]}"
    )
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(dest, filter="data")
    return dest


def old_run(args, env, old):
    """The old code's uninterrupted 3-step run (the reference), which saves at step 2 on its way: the
    checkpoint under test, written exactly as a run stopped there would have written it."""
    reference = torchrun(args + ["--max-steps", "3"], env=env, script=old / "shardtrain" / "main.py")
    ckpt = reference.output_dir / "checkpoints" / "step-000002"
    assert (ckpt / "COMMITTED").exists(), reference.tail()
    return reference, ckpt


def resume_with_todays_code(args, ckpt, out):
    """Today's main.py resumes the old checkpoint (its config and ds config files as they were) for the third
    step, in a run folder of its own."""
    args = args[:]
    args[args.index("--output-dir") + 1] = str(out)
    return torchrun(args + ["--max-steps", "3", "--resume", str(ckpt)])


def assert_step3_matches(resumed, reference):
    reference_losses = [m["loss"] for m in reference.metrics]
    step3 = resumed.metrics[-1]
    assert step3["step"] == 3, resumed.tail()
    assert abs(step3["loss"] - reference_losses[2]) <= 1e-6 * abs(reference_losses[2]), (step3, reference_losses)


def test_a_checkpoint_of_the_flat_package_resumes_exactly_and_exports(mm_data, tmp_path):
    old = old_checkout(tmp_path / "old")
    env = test_env(PYTHONPATH=str(old))  # the old package first on the path, in every rank
    args = tiny_args(
        "multimodal",
        mm_data,
        tmp_path / "run",
        "--ds",
        str(old / "ds_configs" / "zero2.json"),
        "--per-device-batch-size",
        "8",
        "--save-every",
        "2",
    )
    args[args.index("--config") + 1] = str(old / "configs" / "multimodal_tiny.yaml")
    reference, ckpt = old_run(args, env, old)
    resumed = resume_with_todays_code(args, ckpt, tmp_path / "resumed")
    assert_step3_matches(resumed, reference)

    exported = cli(["export", str(resumed.output_dir), str(tmp_path / "export")])
    assert "step-000003" in exported.output
    assert json.loads((tmp_path / "export" / "config.json").read_text()), "export wrote an empty config.json"


def test_a_gathered_zero3_checkpoint_resumes_exactly_with_each_rank_reading_its_partition(mm_data, tmp_path):
    old = old_checkout(tmp_path / "old", GATHERED_FORM)
    env = test_env(PYTHONPATH=str(old))
    args = tiny_args(
        "multimodal",
        mm_data,
        tmp_path / "run",
        "--ds",
        str(old / "ds_configs" / "zero3.json"),
        "--per-device-batch-size",
        "8",
        "--save-every",
        "2",
        "--eval-every",
        "0",
    )
    args[args.index("--config") + 1] = str(old / "configs" / "multimodal_tiny.yaml")
    reference, ckpt = old_run(args, env, old)
    assert (ckpt / "engine").is_dir()  # the old form: engine files + gathered
    assert_step3_matches(resume_with_todays_code(args, ckpt, tmp_path / "resumed"), reference)
