"""The SageMaker training-toolkit environment, mapped onto shardtrain settings.

The toolkit describes the job in SM_* variables and passes hyperparameters as `--name value` flags.
Where neither a flag nor a hyperparameter set them, these fill in (YAML values are overridden: a
config written for a laptop names local folders that do not exist in the container):

    SM_CHANNEL_TRAIN (or SM_CHANNEL_TRAINING, the SDK's name for `fit("s3://...")`)  -> --data-dir
        a folder with train.jsonl (+ validation.jsonl and images, if no validation channel)
    SM_CHANNEL_VALIDATION                                                            -> --eval-data-dir
        a folder with validation.jsonl (+ its images)
    SM_MODEL_DIR                                                                     -> --final-model-dir
    /opt/ml/checkpoints                                                              -> --output-dir

The whole run folder goes to /opt/ml/checkpoints, not only the checkpoints: a resumed run also needs
the tokenizer and metrics.jsonl it wrote, and SageMaker syncs that folder to checkpoint_s3_uri and
restores it after a spot interruption, where `--resume auto` (the default) picks it up.
Not named sagemaker.py: it would shadow the SDK.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Mapping

from shardtrain.config.errors import ConfigError

CHECKPOINT_DIR = "/opt/ml/checkpoints"
# How a job asks SageMaker for one process per GPU, as messages name it (the SDK v3 spelling first).
TORCHRUN_HINT = "ModelTrainer(distributed=Torchrun()) (SDK v2: distribution={'torch_distributed': {'enabled': True}})"
# For a checkpoint_local_path other than the default, and for tests that cannot write /opt/ml.
CHECKPOINT_DIR_ENV = "SHARDTRAIN_SM_CHECKPOINT_DIR"
MARKERS = ("SM_MODEL_DIR", "SM_CURRENT_HOST", "SM_HOSTS", "SM_TRAINING_ENV")


# SageMaker shows this file's text as the job's FailureReason (the convention for training code).
FAILURE_FILE = "/opt/ml/output/failure"


OTHER_RANKS_LINE = "shardtrain: error (rank "  # cli.report_once's prefix for a rank that is not 0


def write_failure_reason(line: str, env: Mapping[str, str] | None = None, over_other_ranks: bool = False) -> None:
    """Under SageMaker, our one-line error becomes the job's FailureReason. The first writer wins (the SDK's
    driver writes its own CalledProcessError only where no file exists yet); elsewhere, nothing happens.
    `over_other_ranks`: rank 0's own error, the one meant to be said, also replaces a line that another rank
    said after its quiet wait (a rank on another instance, whose launcher did not stop it, may get there first
    when rank 0's start-up is slow)."""
    env = os.environ if env is None else env
    if not in_sagemaker(env):
        return
    path = env.get("SM_OUTPUT_FAILURE") or FAILURE_FILE
    try:
        with open(path, "x") as f:
            f.write(line + "\n")
    except FileExistsError:
        if over_other_ranks and Path(path).read_text().startswith(OTHER_RANKS_LINE):
            Path(path).write_text(line + "\n")
    except OSError:  # no /opt/ml/output here (SM_* set by hand)
        pass


def hyperparameter_hint(flag_hint: str) -> str:
    """ "; did you mean '--save-every'?" -> "; did you mean 'save_every' (--save-every)?": a hyperparameter's
    own spelling first."""
    return re.sub(
        r"'--([A-Za-z0-9-]+)'", lambda m: f"'{m.group(1).replace('-', '_')}' (--{m.group(1)})", flag_hint, count=1
    )


def in_sagemaker(env: Mapping[str, str]) -> bool:
    return any(k in env for k in MARKERS) or any(k.startswith("SM_CHANNEL_") for k in env)


def sagemaker_settings(env: Mapping[str, str]) -> dict[str, str]:
    """Config field -> value that the SageMaker environment implies."""
    out = {}
    train = env.get("SM_CHANNEL_TRAIN") or env.get("SM_CHANNEL_TRAINING")
    if train:
        out["data_dir"] = train
    if env.get("SM_CHANNEL_VALIDATION"):
        out["eval_data_dir"] = env["SM_CHANNEL_VALIDATION"]
    if env.get("SM_MODEL_DIR"):
        out["final_model_dir"] = env["SM_MODEL_DIR"]
    out["output_dir"] = env.get(CHECKPOINT_DIR_ENV) or CHECKPOINT_DIR
    return out


def sagemaker_hosts(env: Mapping[str, str]) -> list[str]:
    try:
        return json.loads(env.get("SM_HOSTS", "[]"))
    except json.JSONDecodeError:
        raise ConfigError(f"SM_HOSTS is not a JSON list: {env['SM_HOSTS']!r}") from None


def check_hosts(env: Mapping[str, str]) -> None:
    """Several hosts and no launcher: each host would relaunch a standalone job of its own and train
    a separate model on the same data, so refuse."""
    hosts = sagemaker_hosts(env)
    if len(hosts) > 1 and "RANK" not in env:
        raise ConfigError(
            f"SageMaker job on {len(hosts)} hosts started without a launcher: start it with {TORCHRUN_HINT}"
        )


def check_checkpoints_shared(env: Mapping[str, str], output_dir: str) -> None:
    """Several instances writing the run folder to the checkpoint local path: each instance has its own
    (SageMaker syncs every instance's to the one checkpoint S3 prefix, and restores it to each), so no rank sees
    what another host wrote, and rank 0's checkpoint would lack the other instances' shards. Refused on every
    rank before any process group or model work, naming what works."""
    hosts = sagemaker_hosts(env)
    if len(hosts) > 1:
        raise ConfigError(
            f"SageMaker job on {len(hosts)} instances: the run folder {output_dir} is the checkpoint local path, "
            f"which is each instance's own disk (SageMaker only syncs it to S3), so the instances cannot share "
            f"checkpoints: set the hyperparameter output_dir (--output-dir) to a file system every instance "
            f"mounts at the same path (FSx for Lustre or EFS), or run on one instance"
        )
