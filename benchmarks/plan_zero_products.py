"""What not computing the zero weights' products saves `shardtrain plan` (builtin_workloads/memory_model.py
_ShapesOnly): the measurement's forward with its products and dropout masks computed, against allocated.

    python benchmarks/plan_zero_products.py   # -> benchmarks/results/plan_zero_products.json

Each sample is a fresh interpreter running `shardtrain plan --json` through the CLI's own entry, for two seed
setups: the 4096-token Longformer on 4 x V100-16GB (the plan tests/dist/test_seed_setup.py runs) and RoBERTa-base +
ResNet-50 on 3 x A100-40GB; the `computed` arm replaces _ShapesOnly with a context that does nothing. The arms
alternate who goes first in each round; the paired CPU ratios are taken within each round, then their median. The
noise floor is the spread of the computed arm's CPU across rounds. Both arms must give the same plan to the byte.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
from pathlib import Path

from plan_malloc import REPO, sample

OUT = REPO / "benchmarks" / "results" / "plan_zero_products.json"
SETUPS = {
    "longformer_4096 on 4 x v100-16gb": ["configs/longformer_4096.yaml", "--gpus", "4", "--gpu", "v100-16gb"],
    "multimodal_sentiment on 3 x a100-40gb": ["configs/multimodal_sentiment.yaml", "--gpus", "3", "--gpu", "a100-40gb"],
}
PROBE = """
import sys
if sys.argv[1] == "computed":
    import contextlib
    from shardtrain.builtin_workloads import memory_model
    memory_model._ShapesOnly = contextlib.nullcontext
from shardtrain.cli import main
sys.exit(main(sys.argv[2:]))
"""
ARMS = ("computed", "shortcut")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()

    result = {
        "what": "shardtrain plan in a fresh interpreter, the zero weights' products and dropout masks computed "
        "against allocated (builtin_workloads/memory_model.py _ShapesOnly)",
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "loadavg_before": os.getloadavg()},
        "rounds": args.rounds,
        "setups": {},
    }
    for label, setup in SETUPS.items():
        plan_args = ["plan", "--config", str(REPO / setup[0]), *setup[1:]]
        samples: dict[str, list[dict]] = {arm: [] for arm in ARMS}
        for r in range(args.rounds):
            for arm in ARMS if r % 2 == 0 else reversed(ARMS):
                samples[arm].append(sample(arm, PROBE, plan_args))
            print(f"{label} round {r + 1}: " + ", ".join(f"{a} {samples[a][-1]['cpu_s']:.1f} CPU-s" for a in ARMS))

        def of(arm: str, key: str, samples=samples) -> list[float]:
            return [s[key] for s in samples[arm]]

        computed = of("computed", "cpu_s")
        result["setups"][label] = {
            "command": "python -m shardtrain plan --config " + " ".join(setup),
            "same_plan": len({s["plan_sha256"] for a in ARMS for s in samples[a]}) == 1,
            **{f"{key}_median": {arm: statistics.median(of(arm, key)) for arm in ARMS} for key in ("wall_s", "cpu_s")},
            "paired_cpu_ratio_median": statistics.median(s / c for s, c in zip(of("shortcut", "cpu_s"), computed)),
            "noise_floor_cpu_s": (max(computed) - min(computed)) if len(computed) > 1 else None,
            "samples": samples,
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for label, r in result["setups"].items():
        print(label, json.dumps({k: r[k] for k in ("same_plan", "cpu_s_median", "paired_cpu_ratio_median")}))
    if not all(r["same_plan"] for r in result["setups"].values()):
        raise SystemExit("the arms planned different bytes: the shortcut changed a measurement")


if __name__ == "__main__":
    main()
