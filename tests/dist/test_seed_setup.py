"""The 4 x V100 Longformer seed setup: what `shardtrain plan` recommends is what every shipped place launches
(configs/longformer_4096.yaml's launch comment and settings, slurm/train_4xv100.sbatch, examples/sagemaker/
launch.py, the launch lines of the README, the docs pages and train.py).

The plan is computed for real, through the CLI users run (about 20 s of CPU: activations measured on
longformer-base's shape at 1024 and 1536 tokens). The sbatch script runs for real too, outside Slurm, with an
`srun` (and a `python` for its checks) that only exits: its own "launch:" line says what it would start.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess

import pytest
from launch import REPO, cli, test_env

CONFIG = "configs/longformer_4096.yaml"


@pytest.fixture(scope="module")
def recommendation() -> dict:
    run = cli(["plan", "--config", str(REPO / CONFIG), "--gpus", "4", "--gpu", "v100-16gb", "--json"], timeout=900)
    plan, _ = json.JSONDecoder().raw_decode(run.output)  # stdout (the JSON) comes before stderr in `output`
    assert plan["recommendation"] is not None, run.output[-2000:]
    # Only its own lines: no library warning or log line (torch's `W1201 ...`, Python's `...Warning: ...`).
    noise = [line for line in run.output.splitlines() if re.match(r"\[?\w*\]?[WE]\d{4} |.*Warning: ", line)]
    assert not noise, noise
    return plan["recommendation"]


def launch_args(line: str) -> list[str] | None:
    """shardtrain's arguments in a launch line (`... shardtrain/main.py ARGS` or `shardtrain train ARGS`)."""
    words = line.strip().lstrip("#").split(" #")[0].replace("`", " ").split()  # launch lines quote nothing
    for i, word in enumerate(words):
        if word == "shardtrain/main.py":
            return words[i + 1 :]
        if word == "shardtrain" and words[i + 1 : i + 2] == ["train"]:
            return words[i + 2 :]
    return None


def documented_launch_lines() -> dict[str, list[str]]:
    """Every line that launches the Longformer config, in the files a user reads."""
    found = {}
    docs = sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))
    for path in ("README.md", *docs, CONFIG, "shardtrain/loop/train.py"):
        # A command continued with a trailing backslash is one launch line.
        text = re.sub(r"\\\n\s*", " ", (REPO / path).read_text())
        for n, line in enumerate(text.splitlines(), 1):
            args = launch_args(line) if CONFIG in line else None
            if args:
                found[f"{path}:{n}"] = args
    return found


def sbatch_launch(tmp_path) -> list[str]:
    shims = tmp_path / "bin"
    shims.mkdir()
    # srun: start nothing; scontrol: no job to describe; python: the checks the script makes before srun, which
    # tests/dist/test_slurm.py runs for real (here the shipped config's data/longdoc is not there)
    for name in ("srun", "scontrol", "python"):
        (shims / name).write_text("#!/bin/sh\nexit 0\n")
        (shims / name).chmod(0o755)
    env = {k: v for k, v in test_env().items() if k not in ("CONFIG", "DS_CONFIG", "STRATEGY", "PRECISION")}
    env.update(
        PATH=f"{shims}{os.pathsep}{env['PATH']}",
        SHARDTRAIN_ROOT=str(REPO),
        SLURM_GPUS_ON_NODE="4",
        SLURM_JOB_ID="1",
        SLURM_JOB_NODELIST="localhost",
    )
    out = subprocess.run(
        ["bash", str(REPO / "slurm/train_4xv100.sbatch")],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    (line,) = [ln for ln in out.stdout.splitlines() if "shardtrain-slurm: launch:" in ln]
    return launch_args(line)


def sagemaker_launch() -> list[str]:
    spec = importlib.util.spec_from_file_location("sm_example", REPO / "examples/sagemaker/launch.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    hp = mod.build_job("arn:aws:iam::1:role/R", "img", "bkt", "s3://bkt/train")["trainer"]["hyperparameters"]
    # SageMaker passes `--name value`; shardtrain takes `save_every` as `--save-every`.
    return [w for k, v in hp.items() for w in (f"--{k.replace('_', '-')}", str(v))]


def test_shipped_longformer_launches_are_what_plan_recommends(recommendation, tmp_path, monkeypatch):
    from shardtrain.config.settings import parse_cli
    from shardtrain.memory.planner import variant_of

    monkeypatch.chdir(REPO)  # the launch lines name files relative to the repository root
    launches = {
        "slurm/train_4xv100.sbatch": sbatch_launch(tmp_path),
        "examples/sagemaker": sagemaker_launch(),
        **documented_launch_lines(),
    }
    assert len(launches) >= 5, launches  # the sbatch script, SageMaker, README and docs lines, the config comment
    want = (
        recommendation["variant"],
        recommendation["activation_checkpointing"],
        recommendation["micro_batch_size"],
        recommendation["grad_accum"],
    )
    for where, args in launches.items():
        assert re.search(r"longformer_4096\.yaml$", args[args.index("--config") + 1]), (where, args)
        cfg = parse_cli(args)
        got = (
            variant_of(cfg),
            cfg.train.activation_checkpointing,
            cfg.train.per_device_batch_size,
            cfg.train.grad_accum,
        )
        assert got == want, f"{where} launches {got}; shardtrain plan recommends {want}: {args}"
