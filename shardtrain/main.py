"""Script entry for launchers that run a file:

torchrun --nproc_per_node=3 shardtrain/main.py --config configs/multimodal_sentiment.yaml --strategy fsdp
deepspeed --num_gpus 4 shardtrain/main.py --config configs/longformer_4096.yaml --ds ds_configs/zero2.json
srun python shardtrain/main.py --config ...          (one task per GPU)
"""

import os
import sys

# Running a file puts its folder (shardtrain/) first on sys.path, where our modules would shadow
# libraries of the same name. Import the package from the repository root instead.
_here = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0] or ".") == _here:
    sys.path[0] = os.path.dirname(_here)

from shardtrain.runtime.process_exit import end_without_teardown_at_exit, exit_with  # noqa: E402

if __name__ == "__main__":
    end_without_teardown_at_exit()  # first: it runs after every exit handler registered later
    from shardtrain.cli import run_command

    exit_with(run_command("train", sys.argv[1:]))
