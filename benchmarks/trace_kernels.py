"""Where a profiled step's GPU time went, from torch profiler traces (--profile-steps writes them):

    python benchmarks/trace_kernels.py OUT.json RUN/profile/rank-00000.json [more traces ...]

Per trace: the steps' wall time, the GPU's busy time (the union of kernel and memcpy intervals), the number of
kernels launched, and the kernels that took the most time. A step whose GPU is busy for a small share of its
wall time is bound by the host (Python, launches, waits), not by the GPU's arithmetic."""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def busy_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def summarise(path: Path, top: int = 15) -> dict:
    doc = json.loads(path.read_text())
    events = [e for e in (doc["traceEvents"] if isinstance(doc, dict) else doc) if e.get("ph") == "X"]
    steps = [e for e in events if e.get("name") == "shardtrain::step"]  # observability/step_profile.py's mark
    gpu = [e for e in events if e.get("cat") in GPU_CATEGORIES]
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in gpu:
        by_name[e["name"]][0] += e["dur"]
        by_name[e["name"]][1] += 1
    wall = sum(e["dur"] for e in steps)
    busy = busy_us([(e["ts"], e["ts"] + e["dur"]) for e in gpu])
    return {
        "trace": str(path),
        "steps": len(steps),
        "step_wall_ms": wall / 1000,
        "gpu_busy_ms": busy / 1000,
        "gpu_busy_share": busy / wall if wall else None,
        "kernels_launched": sum(1 for e in gpu if e.get("cat") == "kernel"),
        "top": [
            {"name": n[:160], "ms": us / 1000, "count": c}
            for n, (us, c) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
        ],
    }


def main(argv: list[str]) -> int:
    out, traces = Path(argv[0]), [Path(p) for p in argv[1:]]
    rows = [summarise(p) for p in traces if p.exists()]
    out.write_text(json.dumps(rows, indent=2) + "\n")
    for r in rows:
        print(
            f"{r['trace']}: {r['steps']} step(s), wall {r['step_wall_ms']:.1f} ms, "
            f"GPU busy {r['gpu_busy_ms']:.1f} ms, {r['kernels_launched']} kernels"
        )
        for k in r["top"][:8]:
            print(f"    {k['ms']:8.2f} ms  x{k['count']:<5d} {k['name'][:100]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
