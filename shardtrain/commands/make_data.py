"""`shardtrain make-data`: a small synthetic dataset in the jsonl layout, for demos and tests."""

from __future__ import annotations

import argparse


def main(argv: list[str]) -> int:
    from shardtrain.config.settings import record_kinds

    parser = argparse.ArgumentParser(prog="shardtrain make-data")
    with_images, text_only = record_kinds()
    parser.add_argument(
        "kind", choices=record_kinds(), help=f"{with_images}: text and an image per record; {text_only}: text"
    )
    parser.add_argument("dir", help="the folder to write train.jsonl, validation.jsonl (and images/) into")
    parser.add_argument("--n-train", type=int, default=512, help="training records (default: %(default)s)")
    parser.add_argument("--n-val", type=int, default=128, help="validation records (default: %(default)s)")
    parser.add_argument("--num-labels", type=int, default=3, help="classes (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="the same seed writes the same data")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace what an earlier make-data wrote in DIR; data it did not write is never touched",
    )
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

    from shardtrain.data.synthetic import make_data

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
    print(f"wrote {args.n_train} train / {args.n_val} validation {args.kind} examples to {path}")
    return 0
