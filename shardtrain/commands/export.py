"""`shardtrain export CKPT OUT [--int8] [--eval]`: one consolidated model from any strategy's checkpoint, in one
process (checkpointing/export.py writes it)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from shardtrain.checkpointing import export
from shardtrain.checkpointing.export import EXPORT_META, export_checkpoint
from shardtrain.config.settings import add_workload_flags


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="shardtrain export", description=export.__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a step directory, OUT/checkpoints or a run's OUT (its latest)")
    parser.add_argument("out")
    parser.add_argument(
        "--checkpoint",
        dest="which",
        choices=["final", "best"],
        default="final",
        help="of a run's folder: final (its latest, the model it ended with; the default) or best "
        "(checkpoints/best, which --metric-for-best-model chose)",
    )
    parser.add_argument(
        "--int8",
        action="store_true",
        help="also write a torchao INT8 copy (model_int8.pt) for CPU inference (not for training)",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="a LoRA run: fold the adapters into the base weights and write the plain model, which "
        "AutoModel*.from_pretrained loads (default: peft's adapter format, which PeftModel.from_pretrained loads)",
    )
    parser.add_argument("--eval", action="store_true", help="report accuracy/macro-F1 on the validation set")
    parser.add_argument(
        "--data-dir",
        default=None,
        help="validation data in the jsonl layout (default: the run's own data source, whichever flag named it)",
    )
    parser.add_argument("--verbose", action="store_true", help="show the libraries' warnings and info lines")
    add_workload_flags(parser)  # a user's run: rebuild with this workload (default: the one the run recorded)
    parser.add_argument("--debug", action="store_true")
    args = parser.parse_args(argv)

    from shardtrain.runtime.chatter import quiet_libraries

    quiet_libraries(args.verbose)
    info = export_checkpoint(
        args.checkpoint,
        args.out,
        int8=args.int8,
        workload=args.workload,
        workload_args=args.workload_args,
        evaluate=args.eval,
        which=args.which,
        merge=args.merge,
    )
    print(f"exported {info['checkpoint']} -> {args.out} ({info['bytes_fp32'] / 1e6:.2f} MB fp32)")
    if args.int8:
        print(
            f"int8 (torchao: Linear and embedding weights; CPU inference only): {info['bytes_int8'] / 1e6:.2f} MB, "
            f"{size_change(info['size_reduction'])}"
            + (
                f" than the merged fp32 model ({info['bytes_fp32_merged'] / 1e6:.2f} MB): the INT8 copy has the "
                "adapters merged in"
                if info.get("int8_of") == "merged"
                else ""
            )
        )
    if "workload" in info:  # a user's workload: evaluated by its own metrics, if asked
        _print_evals(info)
        return 0
    if args.eval:
        # The run's own data source (a --data-dir layout, --train-file, --dataset-name, ...), or --data-dir's.
        from shardtrain.commands.predict import split_metrics

        given = {"data_dir": args.data_dir} if args.data_dir else {}
        info["eval_fp32"] = split_metrics(Path(args.out), given)
        if args.int8:
            info["eval_int8"] = split_metrics(Path(args.out), given, int8=True)
        _print_evals(info)
        (Path(args.out) / EXPORT_META).write_text(json.dumps(info, indent=1))
    return 0


def size_change(reduction: float) -> str:
    """`46.2% smaller`; a model of few or small Linear and embedding layers quantizes little, and the scales add
    bytes: `4.6% larger`, not `-4.6% smaller`."""
    return f"{100 * reduction:.1f}% smaller" if reduction >= 0 else f"{-100 * reduction:.1f}% larger"


def _print_evals(info: dict) -> None:
    """fp32, then INT8 with each number's change from fp32: one format for the built-ins and users' workloads."""
    from shardtrain.observability.metric_text import metrics_line

    if "eval_fp32" in info:
        print(f"fp32 validation: {metrics_line(info['eval_fp32'])}")
    if "eval_int8" in info:
        print(f"int8 validation: {metrics_line(info['eval_int8'], before=info.get('eval_fp32'))}")
