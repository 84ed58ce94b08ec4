"""One SageMaker training job as the SDK v3 runs it, on this machine: `python tests/sm_job.py SPEC.json`.

examples/sagemaker/launch.py's build_job() and make_trainer() make the job, with the SDK's
training_mode=LOCAL_CONTAINER (no AWS call) and local folders as channels. The SDK itself then writes
everything a container gets (sm_train.sh, sourcecode.json, distributed.json, its container drivers,
resourceconfig.json, inputdataconfig.json, hyperparameters.json, the compose file) and starts it; the one
piece replaced is docker compose, by tests/sm_compose.py. After the container exits the SDK gathers
/opt/ml/model and /opt/ml/output into model.tar.gz / output.tar.gz under the container root, as it does.

SPEC: {"root": container root, "emulator_dir": state for sm_compose.py, "channels": {name: folder},
"hyperparameters": {...}, "processes_per_node": N, "instance_count": N, "run_id": the run to continue (none: a
new one)}. What SageMaker syncs between /opt/ml/checkpoints and the job's checkpoint S3 prefix is a folder per
prefix under the emulator's state, `s3/<bucket>/<key>/<host>`: a job restores what an earlier job of the same
prefix left there, and a new run starts empty. Prints the SDK's log and exits with
the container's exit code (1 when the SDK raised for another reason).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMPOSE = Path(__file__).resolve().parent / "sm_compose.py"


def load_example():
    spec = importlib.util.spec_from_file_location("sm_example", REPO / "examples" / "sagemaker" / "launch.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    os.environ["SM_EMULATOR_DIR"] = spec["emulator_dir"]
    from sagemaker.train.local import local_container
    from sagemaker.train.model_trainer import Mode

    # docker compose, and only it, is replaced.
    local_container._LocalContainer._get_compose_cmd_prefix = lambda self: [sys.executable, str(COMPOSE)]

    example = load_example()
    channels = spec["channels"]
    job = example.build_job(
        "arn:aws:iam::123456789012:role/SageMakerRole",
        "shardtrain-test:cpu",
        "my-bucket",
        channels["train"],
        channels.get("validation"),
        instance_count=spec.get("instance_count", 1),
        hyperparameters=spec["hyperparameters"],
        run_id=spec.get("run_id"),
    )
    prefix = job["checkpoint_config"]["s3_uri"].removeprefix("s3://")
    os.environ["SM_EMULATOR_CHECKPOINTS"] = str(Path(spec["emulator_dir"]) / "s3" / prefix)
    job["distributed"]["process_count_per_node"] = spec["processes_per_node"]
    trainer, inputs = example.make_trainer(job, training_mode=Mode.LOCAL_CONTAINER, local_container_root=spec["root"])
    try:
        trainer.train(input_data_config=inputs, wait=True)
    except RuntimeError as e:  # _stream_output: the container's exit code
        print(f"sm_job: {e}", flush=True)
        code = str(e).rsplit("code: ", 1)[-1].strip()
        return int(code) if code.isdigit() else 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
