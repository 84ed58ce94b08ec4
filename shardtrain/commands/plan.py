"""`shardtrain plan`: per-GPU memory of every strategy for a config (or a workload) on N GPUs of a kind,
before renting them (memory/planner.py does the arithmetic)."""
from __future__ import annotations

import argparse
import json
import sys

from shardtrain.config.settings import ConfigError, add_workload_flags, command_config, is_builtin_workload, validate
from shardtrain.memory.planner import (GIB, GPUS, arch_only, format_plan, format_workload_plan, plan, plan_workload,
                                       resolve_gpu)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="shardtrain plan", allow_abbrev=False)
    parser.add_argument("--config", help="the training config (optional with --workload)")
    add_workload_flags(parser)
    parser.add_argument("--gpus", type=int, required=True)
    parser.add_argument("--gpu", required=True, help=f"one of {', '.join(GPUS)}")
    parser.add_argument("--per-device-batch-size", type=int)
    parser.add_argument("--max-length", type=int)
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--debug", action="store_true")
    args = parser.parse_args(argv)
    cfg = _plan_config(args)
    if args.gpus < 1:
        raise ConfigError(f"--gpus must be positive, got {args.gpus}")
    gpu = resolve_gpu(args.gpu)
    if not is_builtin_workload(cfg):
        p = plan_workload(cfg, args.gpus, gpu.memory_gib * GIB, bf16_ok=gpu.bf16)
        print(json.dumps(p, indent=2) if args.json else format_workload_plan(p, gpu.name))
        return 0
    # Only a text model missing from the offline table is read from the hub (its config, no weights).
    from shardtrain.runtime.hub import check_hub_names
    note = check_hub_names(arch_only(cfg), fields=("text_model",))
    if note:
        print(f"shardtrain: {note}", file=sys.stderr)
    p = plan(cfg, args.gpus, gpu.memory_gib * GIB, bf16_ok=gpu.bf16)
    print(json.dumps(p, indent=2) if args.json else format_plan(p, gpu.name))
    return 0


def _plan_config(args):
    if args.config is None and args.workload is None:
        raise ConfigError("plan: give --config FILE or --workload my_pkg.tasks:MyTask (or both)")
    cfg = command_config(args.config, args.workload, args.workload_args)
    if args.per_device_batch_size:
        cfg.train.per_device_batch_size = args.per_device_batch_size
    if args.max_length:
        cfg.data.max_length = args.max_length
    if args.precision:
        cfg.train.precision = args.precision
    cfg.checkpoint.output_dir = "/tmp"  # plan writes nothing; validate() checks the output dir is writable
    cfg.checkpoint.resume = "none"
    validate(cfg)
    return cfg
