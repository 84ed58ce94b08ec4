"""`shardtrain compare OUT1 OUT2 ...`: several runs in one table and plot, to choose a strategy."""

from __future__ import annotations

import argparse

from shardtrain.observability.report import write_compare


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="shardtrain compare", description="several runs in one table and plot: which strategy to use"
    )
    parser.add_argument("run_dirs", nargs="+", help="training runs' --output-dir")
    parser.add_argument("--out", default="compare", help="folder for compare.html and its PNGs")
    parser.add_argument("--debug", action="store_true")
    args = parser.parse_args(argv)

    path, text = write_compare(args.run_dirs, args.out)
    print(text)
    print(f"wrote {path}")
    return 0
