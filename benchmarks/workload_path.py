"""The built-in multimodal tiny model through the Workload API vs the commit before it, paired and interleaved.

    ~/.cache/shardtrain/venv/bin/python benchmarks/workload_path.py [--base REV] [--pairs N] [--steps N]
        -> benchmarks/results/workload_path.json

REV (default: the parent of the commit that introduced the Workload API's module, found by the path it had
before the re-layout moved it to shardtrain/workloads/base.py) is unpacked with `git archive`
into a temporary folder (no worktree). Each pair runs both checkouts as real 2-process DDP torchrun jobs on CPU,
in alternating order, on the same data, seed and flags. The rate is global batch x (steps after warm-up) / (time
between the first and last kept metrics.jsonl `wall_time` stamps), as benchmarks/overhead.py measures it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

import launch  # noqa: E402  tests/launch.py: the one way this repo starts torchrun jobs


def base_revision() -> str:
    first = subprocess.run(
        ["git", "-C", str(REPO), "log", "--diff-filter=A", "--format=%H", "--", "shardtrain/workload.py"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return f"{first[-1]}^"


def unpack(rev: str, into: Path) -> Path:
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def rate(run_dir: Path, warmup: int) -> float:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    kept = [r for r in rows if r["step"] >= warmup]
    batch = rows[0]["samples_per_sec"] * rows[0]["step_seconds"]  # the global batch
    return round(batch) * (len(kept) - 1) / (kept[-1]["wall_time"] - kept[0]["wall_time"])


def one(checkout: Path, data: Path, out: Path, steps: int) -> None:
    env = launch.test_env(PYTHONPATH=str(checkout))
    args = launch.tiny_args(
        "multimodal",
        data,
        out,
        "--strategy",
        "ddp",
        "--max-steps",
        str(steps),
        "--save-final",
        "false",
        "--log-every",
        "1000",
        "--max-eval-samples",
        "16",
    )
    launch.torchrun(args, env=env, script=checkout / "shardtrain" / "main.py", timeout=900)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default=None)
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args()
    base = args.base or base_revision()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        sys.path.insert(0, str(REPO))
        from shardtrain.data import make_data

        data = make_data("multimodal", tmp / "data", n_train=512, n_val=32, seed=0)
        checkouts = {"workload": REPO, "previous": unpack(base, tmp / "previous")}
        rates: dict[str, list[float]] = {k: [] for k in checkouts}
        for i in range(args.pairs):
            order = list(checkouts) if i % 2 == 0 else list(reversed(checkouts))
            for name in order:
                out = tmp / f"{name}-{i}"
                one(checkouts[name], data, out, args.steps)
                rates[name].append(rate(out, args.warmup))
                print(f"pair {i} {name}: {rates[name][-1]:.2f} samples/s", flush=True)
    ratios = [w / p for w, p in zip(rates["workload"], rates["previous"])]
    result = {
        "base": base,
        "config": "configs/multimodal_tiny.yaml",
        "strategy": "ddp",
        "world_size": 2,
        "steps": args.steps,
        "warmup": args.warmup,
        "samples_per_sec": rates,
        "paired_ratios": [round(r, 4) for r in ratios],
        "median_ratio": round(statistics.median(ratios), 4),
    }
    (REPO / "benchmarks" / "results" / "workload_path.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
