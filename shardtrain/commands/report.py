"""`shardtrain report OUT`: OUT/report.html with plots, from what the run wrote (observability/report.py)."""

from __future__ import annotations

import argparse

from shardtrain.config.settings import add_workload_flags, command_config
from shardtrain.observability.report import write_report


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="shardtrain report", description="OUT/report.html with plots")
    parser.add_argument("run_dir", help="a training run's --output-dir")
    parser.add_argument("--out", help="where to write (default: the run directory)")
    add_workload_flags(parser)  # checked against what the run recorded: the report reads the run
    parser.add_argument("--debug", action="store_true")
    args = parser.parse_args(argv)

    workload_args = None
    if args.workload_args is not None:
        workload_args = command_config(None, workload_args=args.workload_args).workload.workload_args
    path = write_report(args.run_dir, args.out, args.workload, workload_args)
    print(f"wrote {path}")
    return 0
