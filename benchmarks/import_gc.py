"""What the garbage collector costs a rank's imports, per setting of its thresholds.

    ~/.cache/shardtrain/venv/bin/python benchmarks/import_gc.py              # -> benchmarks/results/import_gc.json
    ~/.cache/shardtrain/venv/bin/python benchmarks/import_gc.py --rounds 1 --out /tmp/x.json   # a quick look

Every rank, and every command run in its own process (export, predict, plan), starts by importing torch,
transformers (which brings torchvision, torchao and torch._dynamo), datasets and torch's DCP: ~3,800 modules and
close to a million long-lived objects, while the cyclic collector walks the young ones again every
`threshold0` allocations. runtime/startup_gc.py raises the thresholds for start-up; this measures what each
setting costs. Each sample is a fresh interpreter that imports what a multimodal DDP rank imports and reports
its own CPU seconds for them (time.process_time) and its peak RSS. The settings are interleaved in every round;
the noise floor is the spread of the interpreter's default setting across rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmarks" / "results" / "import_gc.json"

SETTINGS = {
    "python_default": None,  # gc.get_threshold() as the interpreter starts: (700, 10, 10)
    "100k": (100_000, 50, 1000),
    "1M": (1_000_000, 50, 1000),
    "disabled": "disabled",
}

# Run in a fresh interpreter: the setting, then a rank's imports, then one JSON line.
PROBE = """
import gc, json, resource, sys, time
setting = json.loads(sys.argv[1])
if setting == "disabled":
    gc.disable()
elif setting is not None:
    gc.set_threshold(*setting)
started = time.process_time()
import torch
import torch.distributed.checkpoint
import datasets
import torchvision
from transformers import RobertaModel
import shardtrain.loop.train
import shardtrain.strategies.native
print(json.dumps({
    "cpu_s": time.process_time() - started,
    "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    "modules": len(sys.modules),
    "collections": [s["collections"] for s in gc.get_stats()],
}))
"""


def sample(setting) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
    done = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(setting)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()

    samples: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    for r in range(args.rounds):
        order = list(SETTINGS) if r % 2 == 0 else list(reversed(SETTINGS))  # alternate who goes first
        for name in order:
            samples[name].append(sample(SETTINGS[name]))
        print(f"round {r + 1}: " + ", ".join(f"{n} {samples[n][-1]['cpu_s']:.2f}s" for n in SETTINGS), flush=True)

    def cpu(name: str) -> list[float]:
        return [s["cpu_s"] for s in samples[name]]

    base = cpu("python_default")
    result = {
        "what": "CPU seconds of one rank's imports (fresh interpreter each), per garbage-collector setting",
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "loadavg_before": os.getloadavg()},
        "rounds": args.rounds,
        "settings": {name: (list(t) if isinstance(t, tuple) else t) for name, t in SETTINGS.items()},
        "cpu_s_median": {name: statistics.median(cpu(name)) for name in SETTINGS},
        "max_rss_mib_median": {name: statistics.median(s["max_rss_mib"] for s in samples[name]) for name in SETTINGS},
        # Ratios within each round (the same machine load for all), then their median.
        "paired_ratio_median_vs_default": {
            name: statistics.median(c / b for c, b in zip(cpu(name), base)) for name in SETTINGS
        },
        "paired_saving_s_median_vs_100k": {
            name: statistics.median(o - c for c, o in zip(cpu(name), cpu("100k"))) for name in SETTINGS
        },
        "noise_floor_s": (max(base) - min(base)) if len(base) > 1 else None,
        "samples": samples,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("cpu_s_median", "paired_saving_s_median_vs_100k", "noise_floor_s")}))


if __name__ == "__main__":
    main()
