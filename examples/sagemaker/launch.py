"""Start configs/longformer_4096.yaml on one ml.p3.8xlarge (4x V100 16 GB), all four GPUs, on spot capacity.

    pip install "sagemaker>=3,<4"
    python examples/sagemaker/launch.py --role arn:aws:iam::123456789012:role/SageMakerRole \
        --image <a PyTorch 2.x GPU training image URI> --bucket my-bucket \
        --train s3://my-bucket/longdoc/train --validation s3://my-bucket/longdoc/validation

Written against the SageMaker Python SDK v3 (`sagemaker.train.ModelTrainer`): v3 replaced v2's
`sagemaker.pytorch.PyTorch(distribution={"torch_distributed": {"enabled": True}})` with
`ModelTrainer(distributed=Torchrun())`, which likewise starts the entry script under torchrun, one
process per GPU. Spot: `Compute(enable_managed_spot_training=True)`, a max wait in the StoppingCondition,
and a CheckpointConfig whose local path, /opt/ml/checkpoints, is where shardtrain writes its run folder
in SageMaker (shardtrain/config/sagemaker_env.py), so a restarted job resumes from the last checkpoint.

A spot interruption is SIGTERM to the container's PID 1 alone, which under Torchrun() is the SDK's bash
running sm_train.sh: it passes nothing on. So `command` has sm_train.sh exec shardtrain's container init
(shardtrain/runtime/container_init.py) in its place, which runs the SDK's own torchrun driver below it and
passes the stop to the training workers: they finish the step, save and exit 0. The SDK warns that
hyperparameters are not passed to a `command`; the driver it runs reads them itself (SM_HPS), as without one.

Each run gets its own checkpoint prefix, s3://BUCKET/JOB_NAME/RUN_ID/checkpoints: a new job starts a new run
instead of finding the last finished one in its checkpoints. A spot interruption is restarted by SageMaker
within the same job, with the same prefix; to go on with a run in a new job (more steps, after a failure),
pass its id: `--continue-run RUN_ID` (printed at the start).

The code uploaded is the checkout's files as git lists them (tracked, and new files that .gitignore does not
exclude), staged in a temporary folder: not the venv, runs/ or data/ beside them. The SDK's own ignore
patterns match a name at any depth, so "data" would drop the package folder shardtrain/data too.

`build_job()` returns plain data and needs neither the SDK nor AWS; `main()` turns it into SDK objects.
"""

from __future__ import annotations

import argparse
import secrets
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CHECKPOINT_LOCAL_PATH = "/opt/ml/checkpoints"
TORCHRUN_DRIVER = "/opt/ml/input/data/sm_drivers/distributed_drivers/torchrun_driver.py"
# sm_train.sh runs this with `eval` in PID 1's shell: `exec` makes the init PID 1.
INIT_COMMAND = f"exec python -m shardtrain.runtime.container_init python {TORCHRUN_DRIVER}"
# Without git (a downloaded archive): the checkout less these top-level folders, .gitignore's own.
UNTRACKED_TOP_LEVEL = {".git", ".venv", "venv", "runs", "data", "out", "wandb", "tmp", ".pytest_cache"}
_STAGED: list[tempfile.TemporaryDirectory] = []  # the staged code lives until the upload is done (process exit)


def new_run_id() -> str:
    """A run's own checkpoint prefix: its UTC start time, and a few random digits for two starts in one second."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(2)


def source_files(repo: Path) -> list[str]:
    """The files of the checkout a job needs, relative to it: what git lists (tracked, and new files that
    .gitignore does not exclude), so never the venv, runs/ or data/ of the checkout."""
    try:
        listed = subprocess.run(
            ["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            check=True, capture_output=True,
        ).stdout.decode()  # fmt: skip
        return sorted(f for f in listed.split("\0") if f and (repo / f).is_file())
    except (OSError, subprocess.CalledProcessError):
        return sorted(
            str(p.relative_to(repo))
            for p in repo.rglob("*")
            if p.is_file() and p.relative_to(repo).parts[0] not in UNTRACKED_TOP_LEVEL and "__pycache__" not in p.parts
        )


def stage_source(repo: Path = REPO) -> Path:
    """A temporary copy of source_files(repo), to upload as source_dir."""
    tmp = tempfile.TemporaryDirectory(prefix="shardtrain-source-")
    _STAGED.append(tmp)
    root = Path(tmp.name)
    for name in source_files(repo):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(repo / name, root / name)
    return root


def build_job(
    role: str,
    image: str,
    bucket: str,
    train: str,
    validation: str | None = None,
    instance_type: str = "ml.p3.8xlarge",
    instance_count: int = 1,
    spot: bool = True,
    max_run_hours: float = 24,
    max_wait_hours: float = 48,
    job_name: str = "shardtrain-longformer",
    hyperparameters: dict | None = None,
    run_id: str | None = None,
) -> dict:
    """Everything the training job needs, as plain values (the SDK config classes take them as keywords).
    `run_id`: the run whose checkpoints the job continues; None starts a new one (new_run_id())."""
    if spot and max_wait_hours < max_run_hours:
        raise ValueError(
            f"max_wait_hours ({max_wait_hours}) must be >= max_run_hours ({max_run_hours}): "
            f"SageMaker counts time spent waiting for spot capacity against it"
        )
    hp = {
        "config": "configs/longformer_4096.yaml",
        # DDP, checkpointing the fewest blocks that fit (the config's `activation_checkpointing: auto`):
        # `shardtrain plan` recommends it for 4 x V100 16 GB (the config's comment says why); "ds":
        # "ds_configs/zero2.json" instead for DeepSpeed ZeRO-2.
        "strategy": "ddp",
        # A spot interruption loses at most this many steps; the save also runs on SIGTERM.
        "save_every": 200,
        "resume": "auto",
        **(hyperparameters or {}),
    }
    stopping = {"max_runtime_in_seconds": int(max_run_hours * 3600)}
    if spot:
        stopping["max_wait_time_in_seconds"] = int(max_wait_hours * 3600)
    channels = {"train": train, **({"validation": validation} if validation else {})}
    run_id = run_id or new_run_id()
    return {
        "run_id": run_id,
        "trainer": {
            "training_image": image,
            "role": role,
            "base_job_name": job_name,
            "hyperparameters": hp,
        },
        # The checkout's own files are uploaded (make_trainer stages them); main.py is the same entry torchrun
        # runs everywhere else.
        # entry_script is what the torchrun driver starts in each process; `command` runs that driver under
        # the init that passes a stop signal on.
        "source_code": {
            "source_dir": str(REPO),
            "entry_script": "shardtrain/main.py",
            "command": INIT_COMMAND,
            "requirements": "requirements.txt",
        },
        "compute": {
            "instance_type": instance_type,
            "instance_count": instance_count,
            "volume_size_in_gb": 100,
            **({"enable_managed_spot_training": True} if spot else {}),
        },
        "stopping_condition": stopping,
        # Torchrun() starts one process per GPU on each instance (4 on a p3.8xlarge).
        "distributed": {"kind": "torchrun", "process_count_per_node": None},
        "checkpoint_config": {
            "s3_uri": f"s3://{bucket}/{job_name}/{run_id}/checkpoints",
            "local_path": CHECKPOINT_LOCAL_PATH,
        },
        "output_data_config": {"s3_output_path": f"s3://{bucket}/{job_name}/output"},
        "input_data": channels,
    }


def make_trainer(job: dict, **trainer_options):
    """The SDK's ModelTrainer for `job`; `trainer_options` go to it as they are (tests: a local training_mode)."""
    from sagemaker.train import ModelTrainer
    from sagemaker.train.configs import (
        CheckpointConfig,
        Compute,
        InputData,
        OutputDataConfig,
        SourceCode,
        StoppingCondition,
    )
    from sagemaker.train.distributed import Torchrun

    dist = {k: v for k, v in job["distributed"].items() if k != "kind" and v is not None}
    source = {**job["source_code"], "source_dir": str(stage_source(Path(job["source_code"]["source_dir"])))}
    trainer = ModelTrainer(
        **job["trainer"],
        source_code=SourceCode(**source),
        compute=Compute(**job["compute"]),
        stopping_condition=StoppingCondition(**job["stopping_condition"]),
        distributed=Torchrun(**dist),
        checkpoint_config=CheckpointConfig(**job["checkpoint_config"]),
        output_data_config=OutputDataConfig(**job["output_data_config"]),
        **trainer_options,
    )
    inputs = [InputData(channel_name=name, data_source=uri) for name, uri in job["input_data"].items()]
    return trainer, inputs


def start(job: dict, wait: bool = False):
    trainer, inputs = make_trainer(job)
    trainer.train(input_data_config=inputs, wait=wait)
    return trainer


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--role", required=True)
    p.add_argument("--image", required=True, help="a PyTorch 2.x GPU training image (SageMaker DLC) URI")
    p.add_argument("--bucket", required=True)
    p.add_argument(
        "--train", required=True, help="S3 prefix with train.jsonl (and validation.jsonl), or files a --hp names"
    )
    p.add_argument("--validation", help="S3 prefix with validation.jsonl, or a file a --hp names")
    p.add_argument("--on-demand", action="store_true", help="no spot capacity")
    p.add_argument("--continue-run", metavar="RUN_ID", help="go on with this run's checkpoints (default: a new run)")
    p.add_argument(
        "--hp",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a shardtrain flag for the job, as a hyperparameter (repeatable), e.g. for csv data "
        "train_file=/opt/ml/input/data/train/train.csv text_column_names=document label_column_name=sentiment",
    )
    p.add_argument("--wait", action="store_true")
    args = p.parse_args(argv)
    bad = [h for h in args.hp if "=" not in h]
    if bad:
        p.error(f"--hp {bad[0]}: write KEY=VALUE, e.g. train_file=/opt/ml/input/data/train/train.csv")
    job = build_job(
        args.role, args.image, args.bucket, args.train, args.validation, spot=not args.on_demand,
        run_id=args.continue_run, hyperparameters=dict(h.split("=", 1) for h in args.hp),
    )  # fmt: skip
    print(f"run {job['run_id']}: checkpoints in {job['checkpoint_config']['s3_uri']} "
          f"(a later job continues it with --continue-run {job['run_id']})", flush=True)  # fmt: skip
    start(job, wait=args.wait)


if __name__ == "__main__":
    main()
