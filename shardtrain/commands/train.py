"""`shardtrain train` (and `torchrun shardtrain/main.py`): every check a user's mistake can fail, before any
process starts or any model loads; then the launch (`--nproc`) or, inside a launched rank, the loop."""

from __future__ import annotations


def main(argv: list[str]) -> int:
    from shardtrain.config.settings import parse_cli, wants_check_only

    args = [a for a in argv if not a.startswith(("--local_rank", "--local-rank"))]  # the deepspeed launcher adds it
    cfg = parse_cli(args, check_only=True)
    from shardtrain.runtime.chatter import quiet_libraries

    # Before a user's workload module is imported below: one that imports transformers at its top (and so
    # torchao) would otherwise print library deprecations in every process.
    quiet_libraries(cfg.log.verbose)
    # The files the strategy reads (DeepSpeed JSON, FSDP policy) are checked before any process starts.
    from shardtrain.strategies import check_strategy_config

    check_strategy_config(cfg)
    from shardtrain.workloads.base import (
        check_metric_for_best_model,
        check_planned_settings,
        check_required_methods,
        check_workload_args,
        workload_class,
    )

    # --workload imports and names a Workload, and what it reads is checked, before any process starts.
    workload = workload_class(cfg)
    check_required_methods(workload)
    check_workload_args(cfg, workload)
    check_planned_settings(cfg, workload)
    check_metric_for_best_model(cfg, workload)
    note = workload.check_before_launch(cfg)
    from shardtrain.runtime.launch import launch_rank, maybe_relaunch

    if launch_rank() == 0:  # the process that will open the loggers' runs
        from shardtrain.observability.servers import check_tracking_servers

        check_tracking_servers(cfg.log.report_to)
    from shardtrain.checkpointing.output_lock import check_output_dir_free
    from shardtrain.checkpointing.store import refuse_another_workloads_checkpoint, refuse_to_overwrite

    if launch_rank() == 0:  # another rank that took the lock, even for an instant, could refuse its rank 0
        check_output_dir_free(cfg.checkpoint.output_dir)
    refuse_to_overwrite(cfg)
    refuse_another_workloads_checkpoint(cfg)
    if note and launch_rank() == 0:
        print(f"shardtrain: {note}", flush=True)
    if wants_check_only(args):
        print("shardtrain: --check-only: every check made before a launch passed; nothing started", flush=True)
        return 0
    code = maybe_relaunch(cfg, args)
    if code is not None:
        return code
    from shardtrain.loop.train import Trainer

    summary = Trainer(cfg).train()
    return 130 if summary.get("stopped_by") == "Ctrl-C" else 0  # a shell's code for a job ended by Ctrl-C
