"""`python -m shardtrain <command>` and the `shardtrain` console script.

Commands are looked up lazily so that `shardtrain doctor` never pays for importing DeepSpeed.
Every command turns a ConfigError into one line on stderr and exit code 2 (a traceback with --debug).
"""
from __future__ import annotations

import importlib
import os
import sys

from shardtrain.config import ConfigError

COMMANDS = {
    "train": ("shardtrain.cli", "train_main", "train a model (the same entry torchrun/deepspeed run)"),
    "make-data": ("shardtrain.cli", "make_data_main", "write a small synthetic dataset"),
    "check-data": ("shardtrain.cli", "check_data_main", "scan a dataset folder and list every problem"),
    "plan": ("shardtrain.planner", "main", "predict per-GPU memory for every strategy"),
    "doctor": ("shardtrain.doctor", "main", "check GPUs, libraries and the launcher environment"),
    "export": ("shardtrain.export", "main", "write a consolidated safetensors model from a checkpoint"),
    "report": ("shardtrain.report", "main", "write OUT/report.html with plots"),
    "compare": ("shardtrain.report", "compare_main", "compare several runs in one table and plot"),
    "parity": ("shardtrain.parity", "main", "run the same steps under several strategies and compare"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: shardtrain <command> [options]\n\ncommands:")
        for name, (module, _, help_text) in COMMANDS.items():
            if _available(module):
                print(f"  {name:<11} {help_text}")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS or not _available(COMMANDS[name][0]):
        print(f"shardtrain: unknown command '{name}' (see shardtrain --help)", file=sys.stderr)
        return 2
    module, func, _ = COMMANDS[name]
    return getattr(importlib.import_module(module), func)(rest)


def _available(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def run_guarded(fn, argv: list[str]) -> int:
    """One line for problems a user can fix; the traceback only with --debug."""
    debug = "--debug" in argv or os.environ.get("SHARDTRAIN_DEBUG") == "1"
    try:
        return fn(argv) or 0
    except ConfigError as e:
        if debug:
            raise
        # Every rank hits the same config/data error; rank 0 alone says it.
        if os.environ.get("RANK", "0") == "0":
            print(f"shardtrain: error: {e}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        return 130


def train_main(argv: list[str]) -> int:
    from shardtrain.config import parse_cli
    from shardtrain.distributed import teardown_and_exit

    argv = [a for a in argv if not a.startswith(("--local_rank", "--local-rank"))]  # the deepspeed launcher adds it

    def run(args):
        cfg = parse_cli(args)
        from shardtrain.launch import maybe_relaunch
        code = maybe_relaunch(cfg, args)
        if code is not None:
            return code
        from shardtrain.train import train
        train(cfg)
        return 0

    code = run_guarded(run, argv)
    # Inside a process group: leave through the abort-free path (see distributed.teardown_and_exit).
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        teardown_and_exit(code)
    return code


def make_data_main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="shardtrain make-data")
    parser.add_argument("kind", choices=["multimodal", "longdoc"])
    parser.add_argument("dir")
    parser.add_argument("--n-train", type=int, default=512)
    parser.add_argument("--n-val", type=int, default=128)
    parser.add_argument("--num-labels", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--debug", action="store_true")
    args = parser.parse_args(argv)

    def run(_):
        from shardtrain.data import make_data
        path = make_data(args.kind, args.dir, n_train=args.n_train, n_val=args.n_val, seed=args.seed,
                         num_labels=args.num_labels, overwrite=args.overwrite)
        print(f"wrote {args.n_train} train / {args.n_val} validation {args.kind} examples to {path}")
        return 0

    return run_guarded(run, argv)


def check_data_main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="shardtrain check-data")
    parser.add_argument("dir")
    parser.add_argument("--kind", choices=["multimodal", "longdoc"], default=None,
                        help="default: multimodal if records name images")
    parser.add_argument("--num-labels", type=int, default=3)
    parser.add_argument("--debug", action="store_true")
    args = parser.parse_args(argv)

    def run(_):
        from shardtrain.data import check_data
        kind = args.kind or _guess_kind(args.dir)
        problems = check_data(args.dir, kind, args.num_labels)
        for line in problems:
            print(line)
        print(f"{len(problems)} problem(s) in {args.dir}" if problems else f"{args.dir}: no problems found")
        return 1 if problems else 0

    return run_guarded(run, argv)


def _guess_kind(data_dir: str) -> str:
    import json
    from pathlib import Path

    first = Path(data_dir) / "train.jsonl"
    try:
        with open(first) as f:
            return "multimodal" if "image" in json.loads(f.readline() or "{}") else "longdoc"
    except (OSError, ValueError):
        return "multimodal"


if __name__ == "__main__":
    sys.exit(main())
