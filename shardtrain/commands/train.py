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
        if cfg.peft.peft and "RANK" not in os.environ:  # the parent of a --nproc launch: the ranks would all fail
            _check_lora(cfg)
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


def _check_lora(cfg) -> None:
    """--peft lora on the workload's model, built on the meta device (shapes only, seconds): a --target-modules
    name that matches nothing, or a model that has adapters already, is one line before any process starts.
    Anything else a meta build raises is left to the run's own build, which says it with the run's context."""
    import torch

    from shardtrain.config.settings import ConfigError
    from shardtrain.workloads.base import load_workload

    try:
        workload = load_workload(cfg)
        workload.loads_weights = False
        with torch.device("meta"):
            workload.build_model()
    except ConfigError as e:
        if str(e).startswith(("--target-modules", "--peft")):  # what adapters.with_lora refuses
            raise
    except Exception:  # noqa: BLE001 - a build that needs the real device or data: the run's build decides
        return
