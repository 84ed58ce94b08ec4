"""Activation checkpointing only where memory needs it: --activation-checkpointing auto against true (every
block), within one memory budget.

    ~/.cache/shardtrain/venv/bin/python benchmarks/partial_recompute.py  # -> benchmarks/results/partial_recompute.json
    ~/.cache/shardtrain/venv/bin/python benchmarks/partial_recompute.py --dry-run  # one short round

The model is the Longformer built-in (configs/longformer_tiny.yaml) grown to 8 layers of width 256 at 1024
tokens, every document longer than that, so every batch has the planner's shape. The budget
(--memory-budget-gb) is set from shardtrain's own planner, halfway between its predicted peak with k-1 and
with k of the 8 blocks checkpointed, so that full checkpointing is needed for k blocks only: auto must choose
k, and `true` checkpoints all 8 within the same budget. `none` (nothing checkpointed, over the budget) is the
floor that neither can beat. 2-process torchrun jobs on CPU (gloo), the contenders interleaved and their order
reversed every round (A B C, C B A, ...), so that machine drift hits them alike.

Step time: the median period between metrics.jsonl's per-step wall_time stamps after warm-up (overhead.py's
rule). Paired: auto / true within each round, then the median over rounds; the noise floor is the largest
spread between one contender's rounds (max/min - 1).
Memory: the planner's prediction against what the run measured at step 2 for the same parts, model state
(params + grads + optimizer) plus saved activations (summary.json memory.per_rank vs memory.predicted), on
the largest rank; and GNU time's peak resident set of the largest process, an outside check that auto's peak
lies between none's and true's (it also holds the interpreter, torch and the data: not the planner's figure).
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
from overhead import interleaved, run_one, steady_rate, write  # noqa: E402

CONFIG = REPO / "configs" / "longformer_tiny.yaml"
GIB = 2**30


def model_args(a) -> list[str]:
    text = {"hidden_size": a.hidden, "num_hidden_layers": a.layers, "num_attention_heads": 4,
            "intermediate_size": 4 * a.hidden}  # fmt: skip
    return [
        "--text-config", json.dumps(text), "--attention-window", str(a.window), "--max-length", str(a.max_length),
        "--per-device-batch-size", str(a.micro), "--grad-accum", "1", "--precision", "fp32", "--strategy", "ddp",
    ]  # fmt: skip


def budget_gb(a, data: Path, work: Path) -> tuple[float, list[float]]:
    """The budget under which the planner's predicted peak fits with a.blocks checkpointed blocks and not with
    one fewer (halfway between, before the planner's headroom); and its predicted peak (GiB) for each count."""
    from shardtrain.config.settings import parse_cli
    from shardtrain.memory.planner import HEADROOM, count_model, gpu_bytes, variant_of

    cfg = parse_cli(["--config", str(CONFIG), "--data-dir", str(data), "--output-dir", str(work), *model_args(a)])
    m, variant = count_model(cfg), variant_of(cfg)
    assert m.blocks == a.layers, m

    def peak(k: int) -> float:
        g, _ = gpu_bytes(cfg, variant, m, a.nproc, a.micro, "fp32", k / m.blocks, False)
        return sum(g.values()) / GIB

    peaks = [peak(k) for k in range(m.blocks + 1)]
    return (peaks[a.blocks - 1] + peaks[a.blocks]) / 2 / (1 - HEADROOM), peaks


def one_run(name: str, a, data: Path, work: Path, budget: float) -> dict:
    out = work / "runs" / name
    setting = {"none": ["false"], "true": ["true"], "auto": ["auto", "--memory-budget-gb", repr(budget)]}[name]
    extra = [
        *model_args(a), "--activation-checkpointing", *setting, "--save-final", "false", "--log-every", "1",
        "--predict-memory", "true", "--report", "false",
    ]  # fmt: skip
    maxrss = work / f"{name}.maxrss"
    run = run_one(
        launch.MAIN, extra, CONFIG, data, out, a.steps, a.nproc, ("/usr/bin/time", "-f", "%M", "-o", str(maxrss))
    )
    if run.returncode != 0:
        raise RuntimeError(f"{name} failed (rc {run.returncode}):\n{run.output[-3000:]}")
    rate = steady_rate(out / "metrics.jsonl", a.micro * a.nproc, a.warmup)
    s = json.loads((out / "summary.json").read_text())
    mem = s["memory"]
    rank = max(mem["per_rank"], key=lambda r: mem["per_rank"][r]["model_state"] + mem["per_rank"][r]["activations"])
    measured, predicted = mem["per_rank"][rank], mem["predicted"][rank]
    measured_gib = (measured["model_state"] + measured["activations"]) / GIB
    predicted_gib = predicted["model_state_gib"] + predicted["activations_gib"]
    recompute = s["resolved"]["recompute"]
    return {
        **rate,
        "checkpointed_blocks": recompute["checkpointed_blocks"],
        "blocks": recompute["blocks"],
        "why": recompute.get("why"),
        "measured_state_and_activations_gib": measured_gib,
        "predicted_state_and_activations_gib": predicted_gib,
        "prediction_error": predicted_gib / measured_gib - 1,
        "peak_rss_mib": int(maxrss.read_text().split()[-1]) / 1024,
    }


def spread(values: list[float]) -> float:
    return max(values) / min(values) - 1 if len(values) > 1 else 0.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--micro", type=int, default=2, help="per-device batch size")
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--window", type=int, default=64, help="Longformer's attention window")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=2, help="how many blocks the budget needs checkpointed")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--work", default="/tmp/shardtrain-bench/partial_recompute", help="data and runs (not committed)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "partial_recompute.json"))
    ap.add_argument("--dry-run", action="store_true", help="one round of 6 steps (2 warm-up), 256 tokens")
    a = ap.parse_args(argv)
    if a.dry_run:
        a.rounds, a.steps, a.warmup, a.max_length, a.hidden, a.window = 1, 6, 2, 256, 64, 32

    from shardtrain.data import make_data

    work = Path(a.work)
    # Every document longer than max_length (a word is one token or more): every batch has the planner's shape.
    words = a.max_length + 64
    data = work / f"data-{words}"
    if not (data / "train.jsonl").exists():
        make_data("longdoc", data, n_train=96, n_val=16, seed=0, overwrite=True, min_words=words,
                  max_words=words + 64)  # fmt: skip
    budget, peaks = budget_gb(a, data, work)
    print(f"budget {budget:.4f} GiB per rank; predicted peak by checkpointed blocks: {[round(p, 4) for p in peaks]}")
    contenders = ["none", "true", "auto"]
    t0 = time.time()
    runs, loads = interleaved(contenders, a.rounds, lambda name: one_run(name, a, data, work, budget))
    step = {c: [x["median_step_ms"] for x in v] for c, v in runs.items()}
    paired = [x / t for x, t in zip(step["auto"], step["true"])]
    result = {
        "benchmark": "partial_recompute",
        "dry_run": a.dry_run,
        "command": " ".join(["benchmarks/partial_recompute.py", *(argv if argv is not None else sys.argv[1:])]),
        "device": "cpu (gloo)",
        "host": {"cpus": os.cpu_count(), "machine": platform.machine()},
        "nproc": a.nproc,
        "setup": {
            "config": "configs/longformer_tiny.yaml",
            "layers": a.layers,
            "hidden": a.hidden,
            "window": a.window,
            "max_length": a.max_length,
            "micro_batch": a.micro,
            "precision": "fp32",
            "strategy": "ddp",
            "steps": a.steps,
            "warmup_steps_excluded": a.warmup,
            "rounds": a.rounds,
        },  # fmt: skip
        "memory_budget_gb": budget,
        "planned_peak_gib_by_checkpointed_blocks": peaks,
        "median_step_ms": {c: statistics.median(v) for c, v in step.items()},
        "paired_step_time_auto_over_true_median": statistics.median(paired),
        "paired_step_time_auto_over_true_per_round": paired,
        "noise_floor_between_rounds": {c: spread(v) for c, v in step.items()},
        "prediction_error_median": {c: statistics.median(x["prediction_error"] for x in v) for c, v in runs.items()},
        "peak_rss_mib_median": {c: statistics.median(x["peak_rss_mib"] for x in v) for c, v in runs.items()},
        "checkpointed_blocks": {c: v[0]["checkpointed_blocks"] for c, v in runs.items()},
        "runs": runs,
        "machine_load": {"loadavg_before_each_round": loads, "loadavg_after": os.getloadavg()},
    }
    write(result, a.out, t0)
    print(
        f"auto ({result['checkpointed_blocks']['auto']} of {a.layers} blocks) / true step time: "
        f"{result['paired_step_time_auto_over_true_median']:.3f} (per round {[round(p, 3) for p in paired]}); "
        f"noise floor {result['noise_floor_between_rounds']}; prediction error {result['prediction_error_median']}; "
        f"peak RSS MiB {result['peak_rss_mib_median']}"
    )
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
