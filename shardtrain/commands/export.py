"""`shardtrain export CKPT OUT [--int8] [--eval]`: one consolidated model from any strategy's checkpoint, in one
process (checkpointing/export.py writes it)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from shardtrain.checkpointing import export
from shardtrain.checkpointing import store as checkpoint
from shardtrain.checkpointing.export import EXPORT_META, evaluate_model, export_checkpoint, load_export, load_int8
from shardtrain.config.settings import add_workload_flags, from_dict


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="shardtrain export", description=export.__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a step directory, OUT/checkpoints or a run's OUT (its latest)")
    parser.add_argument("out")
    parser.add_argument("--int8", action="store_true",
                        help="also write a torchao INT8 copy (model_int8.pt) for CPU inference (not for training)")
    parser.add_argument("--eval", action="store_true", help="report accuracy/macro-F1 on the validation set")
    parser.add_argument("--data-dir", default=None, help="validation data (default: the run's data_dir)")
    parser.add_argument("--verbose", action="store_true", help="show the libraries' warnings and info lines")
    add_workload_flags(parser)  # a user's run: rebuild with this workload (default: the one the run recorded)
    parser.add_argument("--debug", action="store_true")
    args = parser.parse_args(argv)

    from shardtrain.runtime.chatter import quiet_libraries
    quiet_libraries(args.verbose)
    info = export_checkpoint(args.checkpoint, args.out, int8=args.int8, workload=args.workload,
                             workload_args=args.workload_args, evaluate=args.eval)
    print(f"exported {info['checkpoint']} -> {args.out} ({info['bytes_fp32'] / 1e6:.2f} MB fp32)")
    if "workload" in info:  # a user's workload: evaluated by its own metrics, if asked
        for key in ("eval_fp32", "eval_int8"):
            if key in info:
                print(f"{key[5:]} validation: " + ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                                                            for k, v in info[key].items()))
        return 0
    if args.int8:
        print(f"int8 (torchao: Linear and embedding weights; CPU inference only): {info['bytes_int8'] / 1e6:.2f} MB, "
              f"{100 * info['size_reduction']:.1f}% smaller")
    if args.eval or args.int8:
        ckpt_dir = Path(info["checkpoint"])
        cfg = from_dict(checkpoint.read_trainer_state(ckpt_dir)["config"])
        if args.data_dir:
            cfg.data.data_dir = args.data_dir
        # The run's tokenizer, when it was a hub name, is loaded again for the evaluation.
        from shardtrain.runtime.hub import check_hub_names
        note = check_hub_names(cfg, fields=("tokenizer",))
        if note:
            print(f"shardtrain: {note}")
        tok = Path(args.out) / "tokenizer"
        info["eval_fp32"] = evaluate_model(load_export(args.out), cfg, tok)
        print(f"fp32 validation: accuracy {info['eval_fp32']['accuracy']:.4f}, "
              f"macro-F1 {info['eval_fp32']['macro_f1']:.4f} ({info['eval_fp32']['n_examples']} examples)")
        if args.int8:
            info["eval_int8"] = evaluate_model(load_int8(args.out), cfg, tok)
            e8, e32 = info["eval_int8"], info["eval_fp32"]
            print(f"int8 validation: accuracy {e8['accuracy']:.4f} ({e8['accuracy'] - e32['accuracy']:+.4f}), "
                  f"macro-F1 {e8['macro_f1']:.4f} ({e8['macro_f1'] - e32['macro_f1']:+.4f})")
        (Path(args.out) / EXPORT_META).write_text(json.dumps(info, indent=1))
    return 0
