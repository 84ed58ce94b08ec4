"""Where a step's time goes, per rank (--profile-steps): the tiny Longformer under DDP (with activation
checkpointing, so that recompute shows), FSDP and ZeRO-2, profiled over the same steps.

    ~/.cache/shardtrain/venv/bin/python benchmarks/step_profile.py  # -> benchmarks/results/step_profile.json

Each strategy is one 2-process torchrun job on CPU (gloo) through shardtrain/main.py, the runs interleaved and
their order reversed every round so that machine drift hits them alike. The JSON holds, per run and rank, the
summary.json `profile` table the run printed (ms per step by part: data, compute, communication, recompute,
host_sync, optimizer, other), the step time, how far the parts' sum is from it, and the slowest rank; and per
strategy, the median share of each part over the rounds and its spread (the noise floor).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

import launch  # noqa: E402  tests/launch.py: the one way this repo starts torchrun jobs
from overhead import interleaved, run_one, write  # noqa: E402

CONFIG = REPO / "configs" / "longformer_tiny.yaml"
CONTENDERS = {
    "ddp_checkpointed": ["--strategy", "ddp", "--activation-checkpointing", "true"],
    "fsdp": ["--strategy", "fsdp"],
    "zero2": ["--strategy", "zero2"],
}


def one_run(name: str, a, data: Path, work: Path) -> dict:
    out = work / "runs" / name
    extra = [
        *CONTENDERS[name], "--profile-steps", a.profile, "--save-final", "false", "--predict-memory", "false",
        "--report", "false", "--precision", "fp32",
    ]  # fmt: skip
    run = run_one(launch.MAIN, extra, CONFIG, data, out, a.steps, a.nproc)
    if run.returncode != 0:
        raise RuntimeError(f"{name} failed (rc {run.returncode}):\n{run.output[-3000:]}")
    profile = json.loads((out / "summary.json").read_text())["profile"]
    ranks = []
    for r in profile["ranks"]:
        parts = r["parts_ms"]
        ranks.append(
            {
                "rank": r["rank"],
                "step_ms": r["step_ms"],
                "parts_ms": parts,
                "parts_sum_vs_step": sum(parts.values()) / r["step_ms"] - 1,
            }
        )
    return {"steps": profile["steps"], "ranks": ranks, "slowest_rank": profile["slowest_rank"]}


def shares(run: dict) -> dict[str, float]:
    """Each part's share of the step, over the ranks (their mean)."""
    parts = run["ranks"][0]["parts_ms"]
    return {p: statistics.mean(r["parts_ms"][p] / r["step_ms"] for r in run["ranks"]) for p in parts}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--profile", default="5-10", help="--profile-steps (after the memory table's steps 1-2)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--work", default="/tmp/shardtrain-bench/step_profile", help="data and runs (not committed)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "step_profile.json"))
    a = ap.parse_args(argv)

    from shardtrain.data import make_data

    work = Path(a.work)
    data = work / "data"
    if not (data / "train.jsonl").exists():
        make_data("longdoc", data, n_train=256, n_val=16, seed=0, overwrite=True)
    t0 = time.time()
    runs, loads = interleaved(list(CONTENDERS), a.rounds, lambda name: one_run(name, a, data, work))
    per_strategy = {}
    for name, rs in runs.items():
        by_round = [shares(r) for r in rs]
        per_strategy[name] = {
            "step_ms_median": statistics.median(r["step_ms"] for run in rs for r in run["ranks"]),
            "share_median": {p: statistics.median(s[p] for s in by_round) for p in by_round[0]},
            "share_spread": {p: [min(s[p] for s in by_round), max(s[p] for s in by_round)] for p in by_round[0]},
            "worst_parts_sum_vs_step": max(abs(r["parts_sum_vs_step"]) for run in rs for r in run["ranks"]),
        }
    result = {
        "benchmark": "step_profile",
        "command": " ".join(["benchmarks/step_profile.py", *(argv if argv is not None else sys.argv[1:])]),
        "device": "cpu (gloo)",
        "host": {"cpus": os.cpu_count(), "machine": platform.machine()},
        "nproc": a.nproc,
        "setup": {
            "config": "configs/longformer_tiny.yaml",
            "steps": a.steps,
            "profile_steps": a.profile,
            "rounds": a.rounds,
            "precision": "fp32",
        },  # fmt: skip
        "per_strategy": per_strategy,
        "runs": runs,
        "machine_load": {"loadavg_before_each_round": loads, "loadavg_after": os.getloadavg()},
    }
    write(result, a.out, t0)
    for name, s in per_strategy.items():
        top = ", ".join(f"{p} {100 * v:.0f}%" for p, v in s["share_median"].items() if v >= 0.01)
        print(f"{name}: {s['step_ms_median']:.1f} ms per step: {top}; parts sum within "
              f"{100 * s['worst_parts_sum_vs_step']:.1f}% of the step")  # fmt: skip
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
