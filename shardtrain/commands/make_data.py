"""`shardtrain make-data`: a small synthetic dataset in the jsonl layout, for demos and tests."""

from __future__ import annotations

import argparse
import json


def main(argv: list[str]) -> int:
    from shardtrain.data.records import KINDS

    parser = argparse.ArgumentParser(prog="shardtrain make-data")
    parser.add_argument("kind", choices=KINDS)
    parser.add_argument("dir")
    parser.add_argument("--n-train", type=int, default=512)
    parser.add_argument("--n-val", type=int, default=128)
    parser.add_argument("--num-labels", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--min-words", type=int, default=200, help="longdoc: the shortest document")
    parser.add_argument("--max-words", type=int, default=1000, help="longdoc: the longest document")
    parser.add_argument(
        "--lengths",
        choices=["uniform", "lognormal"],
        default="uniform",
        help="longdoc: document lengths uniform between the two, or log-normal (a real corpus's shape)",
    )
    parser.add_argument("--debug", action="store_true")
    args = parser.parse_args(argv)

    from shardtrain.data.synthetic import DATASET_INFO, make_data

    path = make_data(
        args.kind,
        args.dir,
        n_train=args.n_train,
        n_val=args.n_val,
        seed=args.seed,
        num_labels=args.num_labels,
        overwrite=args.overwrite,
        min_words=args.min_words,
        max_words=args.max_words,
        lengths=args.lengths,
    )
    (path / DATASET_INFO).write_text(json.dumps({"kind": args.kind, "num_labels": args.num_labels}) + "\n")
    print(f"wrote {args.n_train} train / {args.n_val} validation {args.kind} examples to {path}")
    return 0
