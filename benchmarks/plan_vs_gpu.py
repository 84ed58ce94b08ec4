"""The planner's prediction for every case a GPU run measured (benchmarks/results/gpu_suite.json), from this
checkout, on CPU: each case's config and flags as the suite ran them, planned as gpu_suite.planner_prediction
does, beside the step peak the GPU saw and the prediction recorded then.

    ~/.cache/shardtrain/venv/bin/python benchmarks/plan_vs_gpu.py [--out benchmarks/results/plan_vs_gpu.json]

No GPU is needed: the planner measures on CPU whatever the target. It answers whether a change to the planner
moved its predictions toward what a GPU measured, between two GPU runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", default=str(REPO / "benchmarks" / "results" / "gpu_suite.json"))
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "plan_vs_gpu.json"))
    a = ap.parse_args()

    import gpu_suite

    from shardtrain.config.settings import parse_cli

    measured = json.loads(Path(a.results).read_text())
    cases = {c[0]: c for c in gpu_suite.CASES}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        # The planner reads no record: empty folders stand in for the suite's data (its paths are only checked).
        data = {config: work / config.stem for config in (gpu_suite.FUSION, gpu_suite.LONGFORMER)}
        for folder in data.values():
            (folder / "cache").mkdir(parents=True)
        for seen in measured["cases"]:
            if seen.get("step_peak_allocated_gib") is None or seen["name"] not in cases:
                continue
            case = cases[seen["name"]]
            cfg = parse_cli(gpu_suite.case_args(case, work, data, dry=False))
            t0 = time.perf_counter()
            now = gpu_suite.planner_prediction(cfg)
            as_cpu = gpu_suite.planner_prediction(cfg, cuda=False)  # the same checkout, CPU's kernels measured
            peak, then = seen["step_peak_allocated_gib"], seen["planner"]["predicted_peak_gib"]
            rows.append(
                {
                    "name": seen["name"],
                    "precision": seen["precision"],
                    "max_length": seen["max_length"],
                    "per_device_batch_size": seen["per_device_batch_size"],
                    "variant": now.get("variant"),
                    "gpu_step_peak_gib": peak,
                    "predicted_then_gib": then,
                    "error_then": (then - peak) / peak,
                    "predicted_with_cpu_kernels_gib": as_cpu["predicted_peak_gib"],
                    "predicted_now_gib": now["predicted_peak_gib"],
                    "error_now": (now["predicted_peak_gib"] - peak) / peak if now["predicted_peak_gib"] else None,
                    "activations_then_gib": seen["planner"]["parts_gib"]["activations"],
                    "activations_with_cpu_kernels_gib": (as_cpu.get("parts_gib") or {}).get("activations"),
                    "activations_now_gib": (now.get("parts_gib") or {}).get("activations"),
                    "parts_now_gib": now.get("parts_gib"),
                    "plan_seconds": time.perf_counter() - t0,
                }
            )
            r = rows[-1]
            print(
                f"{r['name']:<22} GPU {peak:6.2f} GiB | then {then:6.2f} ({r['error_then']:+.1%}) | "
                f"CPU kernels {as_cpu['predicted_peak_gib']:6.2f} | now {r['predicted_now_gib']:6.2f} "
                f"({r['error_now']:+.1%})",
                flush=True,
            )
    result = {
        "benchmark": "plan_vs_gpu",
        "gpu_results": str(Path(a.results).relative_to(REPO)) if Path(a.results).is_relative_to(REPO) else a.results,
        "gpu": measured["environment"].get("gpu"),
        "gpu_versions": measured["environment"].get("versions"),
        "method": "each case's config and flags as gpu_suite.py ran them, planned by gpu_suite.planner_prediction "
        "(world size 1, no CUDA context) on this machine's CPU; error = (predicted - GPU step peak) / GPU step peak",
        "cases": rows,
    }
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
