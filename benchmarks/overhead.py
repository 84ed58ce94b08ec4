"""Loop overhead: shardtrain against a hand-written loop and Hugging Face Accelerate, same everything else.

    ~/.cache/shardtrain/venv/bin/python benchmarks/overhead.py            # full run -> benchmarks/results/overhead.json
    ~/.cache/shardtrain/venv/bin/python benchmarks/overhead.py --dry-run  # seconds: one short rep, tiny, DDP

Per (config, strategy) cell the contenders run as real 2-process torchrun jobs on CPU (gloo), interleaved
A B C A B C ... so that drift on a shared machine hits every contender alike. Same config file, data folder,
seed, micro-batch, AdamW, schedule and clipping; only the training loop differs.

How time is measured, identically for all: each loop stamps the wall clock on rank 0 once per optimizer step
after that step's host sync (shardtrain: metrics.jsonl `wall_time`; the others: bench_common.StepLog). The
rate is global_batch x (steps after warm-up) / (time between the first and the last kept stamp): the whole
loop period counts, data loading, logging and per-step bookkeeping included; start-up, compile/JIT, the first
`--warmup` steps and shardtrain's final evaluation do not.
"""
from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

import launch  # noqa: E402  tests/launch.py: the one way this repo starts torchrun jobs

CONFIGS = {"tiny": REPO / "configs" / "multimodal_tiny.yaml",
           "mid": REPO / "benchmarks" / "configs" / "multimodal_mid.yaml"}
# Steps per run and warm-up steps excluded, per config: ~10-20 s of steady state per run, so that a second
# of machine noise moves a ratio by a few percent at most.
STEPS = {"tiny": (100, 10), "mid": (30, 6)}
BENCH = REPO / "benchmarks"

# strategy -> {contender: (script, extra args)}; None: not measured, with the reason.
CONTENDERS = {
    "ddp": {"shardtrain": (launch.MAIN, ["--strategy", "ddp"]),
            "handwritten": (BENCH / "handwritten_ddp.py", []),
            "accelerate": (BENCH / "accelerate_loop.py", [])},
    "fsdp": {"shardtrain": (launch.MAIN, ["--strategy", "fsdp"]),
             "handwritten": (BENCH / "handwritten_fsdp.py", [])},
    "zero2": {"shardtrain": (launch.MAIN, ["--ds", str(REPO / "ds_configs" / "zero2.json")]),
              "handwritten": (BENCH / "handwritten_zero.py", ["--ds", str(REPO / "ds_configs" / "zero2.json")])},
}
# --contenders ...,handwritten_again: the hand-written loop a second time, so that the JSON also holds the
# ratio of two identical loops (noise_floor): how far apart this machine puts contenders that cost the same.
for _loops in CONTENDERS.values():
    _loops["handwritten_again"] = _loops["handwritten"]
NOT_MEASURED = {"fsdp": {"accelerate": "not run: Accelerate's FSDP/DeepSpeed plugins target GPUs; the DDP cell "
                                       "is the like-for-like Accelerate comparison on CPU"},
                "zero2": {"accelerate": "not run: see fsdp"}}


def steady_rate(metrics_path: Path, global_batch: int, warmup: int) -> dict:
    stamps = [json.loads(line)["wall_time"] for line in metrics_path.read_text().splitlines() if line.strip()]
    kept = stamps[warmup:]
    if len(kept) < 2:
        raise RuntimeError(f"{metrics_path}: {len(stamps)} steps, too few after {warmup} warm-up steps")
    periods = [b - a for a, b in zip(kept, kept[1:])]
    return {"samples_per_sec": global_batch * len(periods) / (kept[-1] - kept[0]),
            "median_step_ms": 1000 * statistics.median(periods), "steps_timed": len(periods)}


def run_one(script: Path, extra: list[str], config: Path, data: Path, out: Path, steps: int, nproc: int) -> None:
    if out.exists():
        shutil.rmtree(out)
    args = ["--config", str(config), "--data-dir", str(data), "--output-dir", str(out), "--resume", "none",
            "--max-steps", str(steps), "--eval-every", "0", "--save-every", "0", *extra]
    cmd = [str(launch.BIN / "torchrun"), f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
           f"--master_port={launch.free_port()}", str(script), *args]
    launch.run(cmd, timeout=900)


def global_batch_of(config: Path, nproc: int) -> int:
    from shardtrain.config.settings import parse_cli
    t = parse_cli(["--config", str(config)]).train
    return t.per_device_batch_size * t.grad_accum * nproc


def write(result: dict, out: str, t_start: float) -> None:
    from shardtrain.observability.tracking import library_versions
    result["wall_seconds"] = time.time() - t_start
    result["versions"] = library_versions()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=2) + "\n")


def ratio(a, b):
    return a / b if a and b else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cells", default="tiny:ddp,mid:ddp,tiny:fsdp,tiny:zero2,mid:fsdp,mid:zero2",
                    help="config:strategy pairs, run in this order (the JSON is rewritten after each)")
    ap.add_argument("--contenders", default="shardtrain,handwritten,accelerate")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--work", default="/tmp/shardtrain-bench/overhead", help="data and run folders (not committed)")
    ap.add_argument("--out", default=str(BENCH / "results" / "overhead.json"))
    ap.add_argument("--dry-run", action="store_true", help="tiny config, DDP, one rep of a few steps")
    a = ap.parse_args(argv)
    cells = [tuple(c.split(":")) for c in a.cells.split(",")]
    steps = dict(STEPS)
    if a.dry_run:
        cells, a.reps, steps = [("tiny", "ddp")], 1, {"tiny": (6, 2)}
    wanted = a.contenders.split(",")
    assert "shardtrain" in wanted, "the ratios need shardtrain"

    from shardtrain.data import make_data
    work = Path(a.work)
    data = work / "data"
    if not (data / "train.jsonl").exists():
        make_data("multimodal", data, n_train=512, n_val=64, seed=0, overwrite=True)

    result = {"benchmark": "overhead", "dry_run": a.dry_run, "nproc": a.nproc, "device": "cpu (gloo)",
              "host": {"cpus": __import__("os").cpu_count(), "machine": platform.machine()},
              "method": "interleaved A B C per repetition; steady-state samples/s from per-step wall-clock "
                        "stamps after warm-up (see benchmarks/overhead.py docstring); medians over repetitions",
              "reps": a.reps, "cells": []}
    t_start = time.time()
    for cname, strategy in cells:
        total, warmup = steps[cname]
        gb = global_batch_of(CONFIGS[cname], a.nproc)
        contenders = {c: v for c, v in CONTENDERS[strategy].items() if c in wanted}
        if "handwritten_again" in contenders:  # interleaved right after the loop it repeats
            order = [c for c in contenders if c != "handwritten_again"]
            order.insert(order.index("handwritten") + 1, "handwritten_again")
            contenders = {c: contenders[c] for c in order}
        runs = {c: [] for c in contenders}
        for rep in range(a.reps):
            for c, (script, extra) in contenders.items():
                out = work / "runs" / f"{cname}-{strategy}-{c}"
                run_one(script, extra, CONFIGS[cname], data, out, total, a.nproc)
                r = steady_rate(out / "metrics.jsonl", gb, warmup)
                if c == "shardtrain":  # its own figure (step_seconds: excludes logging) for reference
                    r["self_reported_samples_per_sec"] = json.loads((out / "summary.json").read_text())[
                        "samples_per_sec"]
                runs[c].append(r)
                print(f"{cname:5s} {strategy:6s} rep {rep + 1}/{a.reps} {c:12s} "
                      f"{r['samples_per_sec']:8.1f} samples/s  (median step {r['median_step_ms']:.1f} ms)",
                      flush=True)
        med = {c: statistics.median(r["samples_per_sec"] for r in rs) for c, rs in runs.items()}
        paired = {c: statistics.median(s["samples_per_sec"] / o["samples_per_sec"]
                                       for s, o in zip(runs["shardtrain"], runs[c]))
                  for c in runs if c != "shardtrain"}
        if "handwritten_again" in runs:
            twins = [a_["samples_per_sec"] / b["samples_per_sec"] for a_, b in zip(runs["handwritten"],
                                                                              runs["handwritten_again"])]
            noise_floor = {"paired_ratio_median": statistics.median(twins),
                           "paired_ratio_range": [min(twins), max(twins)],
                           "ratio_of_medians": med["handwritten"] / med["handwritten_again"]}
        else:
            noise_floor = None
        cell = {"config": cname, "strategy": strategy, "reps": a.reps, "global_batch": gb, "steps": total,
                "warmup_steps_excluded": warmup,
                "samples_per_sec_median": {**med, **{c: None for c in NOT_MEASURED.get(strategy, {})}},
                "ratio_vs_handwritten": ratio(med["shardtrain"], med.get("handwritten")),
                "ratio_vs_accelerate": ratio(med["shardtrain"], med.get("accelerate")),
                "paired_ratio_median": paired, "noise_floor": noise_floor,
                "not_measured": NOT_MEASURED.get(strategy, {}),
                "runs": runs}
        result["cells"].append(cell)
        write(result, a.out, t_start)  # after every cell: a long run interrupted keeps what it measured
    print(f"\n{'config':6s} {'strategy':8s} {'shardtrain':>11s} {'handwritten':>12s} {'accelerate':>11s} "
          f"{'vs hand':>8s} {'vs acc':>7s}")
    for c in result["cells"]:
        m = c["samples_per_sec_median"]
        f = lambda v, w: f"{v:{w}.1f}" if v else f"{'-':>{w}s}"  # noqa: E731
        g = lambda v: f"{v:7.3f}x" if v else f"{'-':>8s}"  # noqa: E731
        print(f"{c['config']:6s} {c['strategy']:8s} {f(m['shardtrain'], 11)} {f(m.get('handwritten'), 12)} "
              f"{f(m.get('accelerate'), 11)} {g(c['ratio_vs_handwritten'])} {g(c['ratio_vs_accelerate'])}")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
