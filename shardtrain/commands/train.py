"""`shardtrain train` (and `torchrun shardtrain/main.py`): every check a user's mistake can fail, before any
process starts or any model loads; then the launch (`--nproc`) or, inside a launched rank, the loop."""

from __future__ import annotations

import os


def main(argv: list[str]) -> int:
    from shardtrain.config.settings import parse_cli

    args = [a for a in argv if not a.startswith(("--local_rank", "--local-rank"))]  # the deepspeed launcher adds it
    cfg = parse_cli(args)
    # The files the strategy reads (DeepSpeed JSON, FSDP policy) are checked before any process starts.
    from shardtrain.strategies import check_strategy_config

    check_strategy_config(cfg)
    from shardtrain.config.settings import is_builtin_workload

    builtin = is_builtin_workload(cfg)
    if builtin:
        # So are the data records: a typo on line 7 should not wait for N processes and a model.
        from shardtrain.data.precheck import check_splits

        check_splits(cfg)
    else:
        from shardtrain.workloads.base import workload_class

        workload_class(cfg)  # --workload imports, and names a Workload, before any process starts
    from shardtrain.checkpointing.store import refuse_to_overwrite

    refuse_to_overwrite(cfg)
    if builtin:
        # Hub names last (the probe may wait seconds): reachable, cached (offline by itself), or one line now.
        from shardtrain.runtime.hub import check_hub_names

        note = check_hub_names(cfg)
        if note and os.environ.get("RANK", "0") == "0":
            print(f"shardtrain: {note}", flush=True)
    from shardtrain.runtime.launch import maybe_relaunch

    code = maybe_relaunch(cfg, args)
    if code is not None:
        return code
    from shardtrain.loop.train import Trainer

    summary = Trainer(cfg).train()
    return 130 if summary.get("stopped_by") == "Ctrl-C" else 0  # a shell's code for a job ended by Ctrl-C
