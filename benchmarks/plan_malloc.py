"""What glibc's malloc settings cost `shardtrain plan`: its defaults against runtime/host_malloc.py's.

    ~/.cache/shardtrain/venv/bin/python benchmarks/plan_malloc.py              # -> benchmarks/results/plan_malloc.json
    ~/.cache/shardtrain/venv/bin/python benchmarks/plan_malloc.py --rounds 1 --out /tmp/x.json   # a quick look

Each sample is a fresh interpreter running `shardtrain plan` for the Longformer seed setup
(configs/longformer_4096.yaml on 4 x V100-16GB, the plan tests/dist/test_seed_setup.py runs), as a user types it,
through the CLI's own entry; the `glibc_default` arm makes runtime/host_malloc.keep_freed_blocks a no-op first.
Both arms alternate who goes first in each round. Reported per arm: wall, user and system CPU seconds and page
faults (the child's getrusage), and its peak RSS; the paired ratios are taken within each round, then their
median. The noise floor is the spread of the default arm's CPU across rounds.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmarks" / "results" / "plan_malloc.json"
PLAN = ["plan", "--config", str(REPO / "configs" / "longformer_4096.yaml"), "--gpus", "4", "--gpu", "v100-16gb"]

# The CLI as `python -m shardtrain` runs it, with or without the malloc settings.
PROBE = """
import sys
if sys.argv[1] == "glibc_default":
    from shardtrain.runtime import host_malloc
    host_malloc.keep_freed_blocks = lambda *args, **kwargs: False
from shardtrain.cli import main
sys.exit(main(sys.argv[2:]))
"""
ARMS = ("glibc_default", "keep_freed_blocks")


def sample(arm: str, probe: str = PROBE, plan_args: list[str] = PLAN) -> dict:
    """One fresh interpreter running `probe` with `arm` and the plan's arguments (benchmarks/plan_zero_products.py
    runs its own probe through this too)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    before, started = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", probe, arm, *plan_args, "--json"], env=env, capture_output=True, text=True
    )
    wall, after = time.monotonic() - started, resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{arm}: plan exited {done.returncode}:\n{done.stderr[-2000:]}")
    plan, _ = json.JSONDecoder().raw_decode(done.stdout)
    return {
        "wall_s": wall,
        "user_s": after.ru_utime - before.ru_utime,
        "sys_s": after.ru_stime - before.ru_stime,
        "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
        "minor_faults": after.ru_minflt - before.ru_minflt,
        # RUSAGE_CHILDREN's maxrss is the largest child so far: this arm's only where it is the larger one
        "max_rss_mib_children_so_far": after.ru_maxrss / 1024,
        "recommendation": plan["recommendation"],
        # the whole plan (every row's bytes): the malloc settings must change no measurement
        "plan_sha256": hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()

    samples: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    peak_rss: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for r in range(args.rounds):
        for arm in ARMS if r % 2 == 0 else reversed(ARMS):
            samples[arm].append(sample(arm))
        print(f"round {r + 1}: " + ", ".join(f"{a} {samples[a][-1]['cpu_s']:.1f} CPU-s" for a in ARMS), flush=True)
    for arm in ARMS:  # peak RSS per arm, each measured alone (getrusage's children maxrss only grows)
        probe = subprocess.run(
            ["/usr/bin/time", "-f", "%M", sys.executable, "-c", PROBE, arm, *PLAN, "--json"],
            env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1"),
            capture_output=True,
            text=True,
        )
        peak_rss[arm].append(int(probe.stderr.strip().splitlines()[-1]) / 1024)

    def of(arm: str, key: str) -> list[float]:
        return [s[key] for s in samples[arm]]

    same = len({s["plan_sha256"] for a in ARMS for s in samples[a]}) == 1
    base = of("glibc_default", "cpu_s")
    result = {
        "what": "shardtrain plan (longformer_4096, 4 x v100-16gb) in a fresh interpreter, glibc's malloc defaults "
        "against runtime/host_malloc.keep_freed_blocks",
        "command": "python -m shardtrain " + " ".join(PLAN[:2] + ["configs/longformer_4096.yaml"] + PLAN[3:]),
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "loadavg_before": os.getloadavg()},
        "rounds": args.rounds,
        "same_plan": same,
        **{
            f"{key}_median": {arm: statistics.median(of(arm, key)) for arm in ARMS}
            for key in ("wall_s", "cpu_s", "user_s", "sys_s", "minor_faults")
        },
        "peak_rss_mib": {arm: peak_rss[arm][0] for arm in ARMS},
        "paired_cpu_ratio_median": statistics.median(k / d for k, d in zip(of("keep_freed_blocks", "cpu_s"), base)),
        "paired_wall_ratio_median": statistics.median(
            k / d for k, d in zip(of("keep_freed_blocks", "wall_s"), of("glibc_default", "wall_s"))
        ),
        "noise_floor_cpu_s": (max(base) - min(base)) if len(base) > 1 else None,
        "samples": samples,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("cpu_s_median", "wall_s_median", "sys_s_median", "peak_rss_mib")}))
    if not same:
        raise SystemExit("the arms planned different bytes: the malloc settings changed a measurement")


if __name__ == "__main__":
    main()
