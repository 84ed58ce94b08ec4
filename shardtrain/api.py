"""`shardtrain.fit(workload, **overrides) -> summary`: the same path as `shardtrain train`, from Python.

    import shardtrain
    from my_pkg.tasks import MyTask

    if __name__ == "__main__":   # the relaunched ranks import this file: keep fit() out of their way
        summary = shardtrain.fit(MyTask, strategy="fsdp", nproc=2, max_steps=100, output_dir="runs/mine")

Inside ranks that torchrun / srun / the deepspeed launcher started, each rank trains in this process. From a plain
`python my_script.py` it trains in this process too when one process is asked for, and otherwise relaunches
itself with `nproc` processes, as `train` does; the summary then comes from the run's summary.json.
Overrides are the flags' names with underscores (`max_steps=100`, `workload_args={...}`, `config="x.yaml"`).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from shardtrain.config.settings import ConfigError, flag_of


def fit(workload, **overrides) -> dict:
    from shardtrain.workloads.base import Workload

    instance = workload if isinstance(workload, Workload) else None
    if instance is not None:
        workload = type(instance)
    if isinstance(workload, type) and issubclass(workload, Workload):
        target = _importable_target(workload)
    elif isinstance(workload, str):
        target = workload
    else:
        raise ConfigError(
            f"shardtrain.fit: expected a Workload subclass, instance or 'module:Class', got {type(workload).__name__}"
        )
    if instance is not None and instance.args and "workload_args" not in overrides:
        overrides["workload_args"] = instance.args
    argv = ["--workload", target] + _as_flags(overrides)
    return _run(argv, instance)


def _importable_target(cls: type) -> str:
    """module:Class; a class defined in the script being run is importable by the script's file name."""
    from shardtrain.workloads.base import target_of

    if cls.__module__ != "__main__":
        return target_of(cls)
    main_file = getattr(sys.modules["__main__"], "__file__", None)
    if not main_file:
        raise ConfigError(
            f"shardtrain.fit: {cls.__name__} is defined in an interactive session; relaunched ranks "
            f"cannot import it: put it in a module (e.g. tasks.py)"
        )
    folder = str(Path(main_file).resolve().parent)
    # The relaunched ranks find the script's folder through PYTHONPATH; this process through sys.path.
    os.environ["PYTHONPATH"] = folder + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return f"{Path(main_file).stem}:{cls.__qualname__}"


def _as_flags(overrides: dict) -> list[str]:
    argv = []
    for name, value in overrides.items():
        if name == "config":
            argv += ["--config", str(value)]
            continue
        if isinstance(value, dict):
            value = json.dumps(value)
        elif isinstance(value, (list, tuple)):
            value = ",".join(map(str, value))
        argv += [flag_of(name), str(value).lower() if isinstance(value, bool) else str(value)]
    return argv


def _run(argv: list[str], instance) -> dict:
    from shardtrain.checkpointing.store import refuse_another_workloads_checkpoint, refuse_to_overwrite
    from shardtrain.config.settings import parse_cli
    from shardtrain.runtime.launch import maybe_relaunch
    from shardtrain.strategies import check_strategy_config
    from shardtrain.workloads.base import check_planned_settings, workload_class

    cfg = parse_cli(argv)
    check_strategy_config(cfg)
    check_planned_settings(cfg, type(instance) if instance is not None else workload_class(cfg))
    refuse_to_overwrite(cfg)
    refuse_another_workloads_checkpoint(cfg)
    code = maybe_relaunch(cfg, argv)
    if code is not None:
        if code != 0:
            raise RuntimeError(f"shardtrain.fit: training failed (exit code {code}); its output is above")
        return json.loads((Path(cfg.checkpoint.output_dir) / "summary.json").read_text())

    import gc

    import torch.distributed as dist

    from shardtrain.loop.train import Trainer
    from shardtrain.runtime.distributed import barrier

    if instance is not None:
        instance.cfg = cfg  # the run's config, as a workload built by name gets it
    ours = not dist.is_initialized()  # a group the caller's own code started is the caller's to end
    summary = Trainer(cfg, instance).train()
    if ours and dist.is_initialized():
        # The caller's script carries on and may start another group: drop what still holds this one (gc), let
        # every rank get here (barrier), then end it.
        gc.collect()
        barrier()
        dist.destroy_process_group()
    return summary
