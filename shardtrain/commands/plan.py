"""`shardtrain plan`: per-GPU memory of every strategy for a config (or a workload) on N GPUs of a kind,
before renting them (memory/planner.py does the arithmetic)."""

from __future__ import annotations

import argparse
import json
import sys

from shardtrain.config.settings import ConfigError, add_workload_flags, command_config, validate
from shardtrain.memory.planner import (
    GIB,
    GPUS,
    format_plan,
    format_workload_plan,
    memory_model_of,
    plan,
    plan_workload,
    resolve_gpu,
)
from shardtrain.runtime.host_malloc import keep_freed_blocks


class _OneLineParser(argparse.ArgumentParser):
    """A bad flag is one line (a ConfigError) naming what plan takes, not argparse's usage block."""

    def error(self, message):
        raise ConfigError(
            f"plan: {message} (plan takes --config/--workload, --gpus, --gpu, the batch, length and "
            f"precision flags, and train's model, data and peft flags: shardtrain plan --help)"
        )


def main(argv: list[str]) -> int:
    parser = _OneLineParser(prog="shardtrain plan", allow_abbrev=False)
    parser.add_argument("--config", help="the training config (optional with --workload)")
    add_workload_flags(parser)
    parser.add_argument("--gpus", type=int, required=True, help="GPUs the run trains on, all nodes together")
    parser.add_argument(
        "--gpu",
        required=True,
        help=f"one of {', '.join(GPUS)} (or their short names: a100, v100, l4, ...); another card's name "
        "with --memory-budget-gb",
    )
    parser.add_argument("--per-device-batch-size", type=int)
    parser.add_argument(
        "--grad-accum",
        "--gradient-accumulation-steps",
        type=int,
        help="as in train: the global batch planned is per-device batch x this x --gpus",
    )
    parser.add_argument("--max-length", type=int)
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp16"])
    parser.add_argument(
        "--memory-budget-gb",
        type=float,
        help="plan for this much memory per GPU instead of the card's, as train's auto choices do "
        "(parallel.memory_budget_gb)",
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--debug", action="store_true")
    from shardtrain.config.settings import FIELDS, FLAG_ALIASES, flag_of, key_of

    # train's model flags: the model planned (a workload's own, such as the built-ins' window or image encoder);
    # its data flags (--train-file, --text-column-names, ...): the vocabulary and the classes come from the data;
    # its peft flags (--peft lora, --lora-r, --target-modules, ...): the adapters change what trains
    for name, (section, _, typ) in FIELDS.items():
        if section in ("model", "data", "peft") and name != "max_length":
            extra = (
                {"nargs": "?", "const": "true", "metavar": "{true,false}"} if typ is bool else {"metavar": name.upper()}
            )
            parser.add_argument(
                flag_of(name),
                *FLAG_ALIASES.get(name, []),
                dest=f"data__{name}",
                default=None,
                help=f"as in train ({key_of(name)})",
                **extra,
            )
    args = parser.parse_args(argv)
    cfg = _plan_config(args)
    if args.gpus < 1:
        raise ConfigError(f"--gpus must be positive, got {args.gpus}")
    # The memory the run's auto choices fit in: the card's, or --memory-budget-gb (from the flag or the config)
    budget = cfg.parallel.memory_budget_gb
    gpu = resolve_gpu(args.gpu, budget)
    capacity = budget * GIB if budget is not None else gpu.memory_gib * GIB
    memory_model = memory_model_of(cfg)
    if memory_model is None:
        p = plan_workload(cfg, args.gpus, capacity, bf16_ok=gpu.bf16)
        print(json.dumps(p, indent=2) if args.json else format_workload_plan(p, gpu.name))
        return 0
    note = memory_model.check_offline()
    if note:
        print(f"shardtrain: {note}", file=sys.stderr)
    if sys.stderr.isatty():  # a new user stared at a minute of silence (the 4096-token Longformer on a CPU)
        print("plan: measuring the model's activations on this machine's CPU first (up to a minute)", file=sys.stderr)
    keep_freed_blocks()  # the measurement's forwards allocate the same large blocks again and again
    p = plan(cfg, args.gpus, capacity, bf16_ok=gpu.bf16, at_token_budget=True)
    p["launch"] = launch_line(p, args, argv)
    print(
        json.dumps(p, indent=2)
        if args.json
        else format_plan(p, gpu.name) + (f"\nlaunch: {p['launch']}" if p["launch"] else "")
    )
    return 0


def launch_line(p: dict, args, argv: list[str]) -> str | None:
    """The recommendation as the command that runs it: the strategy's flags (parity's table of them), its
    micro-batch, accumulation and activation checkpointing, and the flags plan was given."""
    from shardtrain.commands.parity import REPO, STRATEGIES

    rec = p.get("recommendation")
    if not rec or rec["variant"] not in STRATEGIES:
        return None
    shown = [a.replace(str(REPO) + "/", "") for a in STRATEGIES[rec["variant"]]]
    asked, fits = p.get("asked_max_tokens_per_batch"), p.get("max_tokens_per_batch")
    if asked:
        # Under a token budget the micro-batch is the budget's: the user's --per-device-batch-size (length groups,
        # OOM recovery's unit) stays, and a budget that does not fit gives way to the largest that does.
        budget = min(asked, fits) if fits else asked
        given = _without(argv, ("--gpus", "--gpu", "--max-tokens-per-batch", *ACCUM_FLAGS), ("--json", "--debug"))
        batch = ["--max-tokens-per-batch", str(budget)]
    else:
        given = _without(argv, ("--gpus", "--gpu", "--per-device-batch-size", *ACCUM_FLAGS), ("--json", "--debug"))
        batch = ["--per-device-batch-size", str(rec["micro_batch_size"])]
    flags = ["--nproc", str(args.gpus), *given, *shown, *batch, "--grad-accum", str(rec["grad_accum"])]
    if rec["activation_checkpointing"] == "auto":  # the fewest blocks that fit: the run chooses them again
        flags += ["--activation-checkpointing", "auto"]
    elif rec["activation_checkpointing"]:
        flags.append("--activation-checkpointing")
    return "shardtrain train " + " ".join(flags)


# The launch line says the recommendation's accumulation (the global batch kept), not the one plan was given.
ACCUM_FLAGS = ("--grad-accum", "--gradient-accumulation-steps")


def _without(argv: list[str], with_value: tuple, alone: tuple) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=")[0]
        if name in with_value:
            skip = "=" not in a
            continue
        if name not in alone:
            out.append(a)
    return out


def _plan_config(args):
    if args.config is None and args.workload is None:
        raise ConfigError("plan: give --config FILE or --workload my_pkg.tasks:MyTask (or both)")
    cfg = command_config(args.config, args.workload, args.workload_args)
    from shardtrain.config.settings import FIELDS, _coerce, flag_of, replace_fields

    given = {
        "per_device_batch_size": args.per_device_batch_size,
        "grad_accum": args.grad_accum,
        "max_length": args.max_length,
        "precision": args.precision,
        "memory_budget_gb": args.memory_budget_gb,
    }
    changes = {name: value for name, value in given.items() if value is not None}
    for name in FIELDS:
        value = getattr(args, f"data__{name}", None)
        if value is not None:
            changes[name] = _coerce(name, value, FIELDS[name][2], flag_of(name))
    # plan writes nothing; validate() checks the output dir is writable
    changes.update(output_dir="/tmp", resume="none")
    return validate(replace_fields(cfg, **changes))
