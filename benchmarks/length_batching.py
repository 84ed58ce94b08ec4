"""Length-aware batching on a long-document corpus: pad-to-longest random batches, --group-by-length, and
--max-tokens-per-batch.

    ~/.cache/shardtrain/venv/bin/python benchmarks/length_batching.py  # -> benchmarks/results/length_batching.json
    ~/.cache/shardtrain/venv/bin/python benchmarks/length_batching.py --dry-run  # one short round

The corpus is what `shardtrain make-data longdoc --lengths lognormal` writes: document lengths log-normal between
--min-words and --max-words (median about a sixth of the top), as a Longformer-4096 corpus mixes short posts with
long reports. The tiny Longformer (configs/longformer_tiny.yaml) at max_length 4096 trains on it as 2-process
torchrun jobs on CPU (gloo), the contenders interleaved A B C A B C ... so that machine drift hits them alike.
Only their batching flags differ; the token budget is micro x the corpus's longest text (padded), what
pad-to-longest's largest micro-batch can hold, and each contender runs the same share of an epoch (a token
budget's steps are fewer).

samples/s: steady state from metrics.jsonl's per-step wall_time stamps and sample counts after warm-up
(overhead.py's rule). Peak memory: GNU time's maximum resident set over the job's processes (the largest rank).
Every run meets the same longest document, and no micro-batch holds more than the budget, so the peak should
not move; the padding does: `padding_share` is the padded tokens'
share of all tokens the ranks computed on, from the batches' attention masks as the loop saw them.
"""

from __future__ import annotations

import argparse
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


def contenders(budget: int) -> dict[str, list[str]]:
    """The flags that differ. `budget`: the most padded tokens a pad-to-longest micro-batch can hold on this
    corpus (micro x its longest text, padded): no micro-batch of any contender holds more."""
    return {
        "pad_to_longest": [],
        "group_by_length": ["--group-by-length"],
        "token_budget": ["--max-tokens-per-batch", str(budget)],
    }


CONFIG = REPO / "configs" / "longformer_tiny.yaml"


class _Ids(list):
    """The training set as sample ids with its token counts: what the loop's streams order and cut."""

    def __init__(self, lengths: list[int]):
        super().__init__(range(len(lengths)))
        self._lengths = lengths

    def lengths(self) -> list[int]:
        return self._lengths


def replay(run_args: list[str], nproc: int) -> tuple[list[int], list, int]:
    """(token counts, every rank's training stream over sample ids, steps per epoch): the loop's own streams
    (data/loaders.py build_loaders, with the run's flags, its saved tokenizer and the built-in's padding rule)."""
    from shardtrain.config.settings import parse_cli
    from shardtrain.data import build_datasets, build_loaders, build_tokenizer
    from shardtrain.workloads.base import load_workload

    cfg = parse_cli(run_args)
    tok = build_tokenizer(cfg, Path(cfg.checkpoint.output_dir), True, lambda: None)  # as the run will build it
    train, _ = build_datasets(cfg, tok)
    train.tokenize(tok, cfg.data.max_length, None, True, lambda: None)
    ids, workload = _Ids(train.lengths()), load_workload(cfg)
    loaders = [
        build_loaders(cfg, None, ids, None, r, nproc, "cpu", collate=list, workload=workload) for r in range(nproc)
    ]
    return ids.lengths(), [x.train for x in loaders], loaders[0].steps_per_epoch


def padding_share(lengths: list[int], streams: list, steps: int, window: int) -> float:
    """1 - real tokens / padded tokens over every rank's micro-batches of `steps` steps, each batch padded to its
    longest text and to Longformer's window multiple, as collate pads it."""
    real = padded = 0
    for stream in streams:
        for _ in range(steps):
            batch = [lengths[i] for i in stream.next_batch()]
            real += sum(batch)
            padded += len(batch) * -(-max(batch) // window) * window
    return 1 - real / padded


def plan_runs(a, data: Path, work: Path) -> dict[str, dict]:
    """Per contender: its flags, the steps it runs (the same share of an epoch for each: a token budget's epoch
    has fewer, fuller steps), and the padding its order gives over them."""
    plans, budget = {}, None
    for name in ("pad_to_longest", "group_by_length", "token_budget"):
        flags = contenders(budget or 1)[name]
        extra = [
            "--save-final", "false", "--max-length", str(a.max_length), "--per-device-batch-size", str(a.micro),
            "--log-every", "1", "--predict-memory", "false", "--report", "false", *flags,
        ]  # fmt: skip
        out = work / "runs" / name
        run_args = ["--config", str(CONFIG), "--data-dir", str(data), "--output-dir", str(out), *extra]
        out.mkdir(parents=True, exist_ok=True)
        lengths, streams, per_epoch = replay(run_args, a.nproc)
        plans[name] = {"extra": extra, "per_epoch": per_epoch, "lengths": lengths, "streams": streams}
        budget = a.micro * -(-max(lengths) // a.attention_window) * a.attention_window
    plain = plans["pad_to_longest"]["per_epoch"]
    for p in plans.values():
        p["steps"] = max(a.warmup + 3, round(a.steps * p["per_epoch"] / plain))
        p["padding_share"] = padding_share(p.pop("lengths"), p.pop("streams"), p["steps"], a.attention_window)
    return plans


def one_run(name: str, plan: dict, a, data: Path, work: Path) -> dict:
    """One torchrun job (overhead.run_one) under GNU time (%M: the largest process's peak RSS, in KiB)."""
    out = work / "runs" / name
    maxrss = work / f"{name}.maxrss"
    run = run_one(
        launch.MAIN, plan["extra"], CONFIG, data, out, plan["steps"], a.nproc,
        ("/usr/bin/time", "-f", "%M", "-o", str(maxrss)),
    )  # fmt: skip
    if run.returncode != 0:
        raise RuntimeError(f"{name} failed (rc {run.returncode}):\n{run.output[-3000:]}")
    rate = steady_rate(out / "metrics.jsonl", a.micro * a.nproc, a.warmup)
    peak = int(maxrss.read_text().split()[-1]) / 1024
    return {**rate, "steps": plan["steps"], "peak_rss_mib": peak, "padding_share": plan["padding_share"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    # Whole epochs are timed: 400 samples at 2 ranks x 4 are 50 steps, two runs of 200 sorted samples; three
    # epochs, so that the token budget's fewer, longer steps are timed over more than a few seconds. A window of
    # part of an epoch would flatter the grouped orders, whose runs start with their longest batches.
    ap.add_argument("--steps", type=int, default=151)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--micro", type=int, default=4, help="per-device batch size")
    ap.add_argument("--max-length", type=int, default=4096)
    ap.add_argument("--n-train", type=int, default=400)
    ap.add_argument("--min-words", type=int, default=48)
    ap.add_argument("--max-words", type=int, default=3000)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--work", default="/tmp/shardtrain-bench/length_batching", help="data and runs (not committed)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "length_batching.json"))
    ap.add_argument("--dry-run", action="store_true", help="one round of 6 steps (2 warm-up), a small corpus")
    a = ap.parse_args(argv)
    if a.dry_run:
        a.rounds, a.steps, a.warmup, a.n_train, a.max_length, a.max_words = 1, 6, 2, 128, 512, 400

    from shardtrain.data import make_data

    work = Path(a.work)
    data = work / f"data-{a.n_train}-{a.min_words}-{a.max_words}"
    if not (data / "train.jsonl").exists():
        make_data("longdoc", data, n_train=a.n_train, n_val=32, seed=0, overwrite=True,
                  min_words=a.min_words, max_words=a.max_words, lengths="lognormal")  # fmt: skip
    from shardtrain.config.settings import parse_cli

    a.attention_window = parse_cli(["--config", str(CONFIG)]).model.attention_window
    t0 = time.time()
    plans = plan_runs(a, data, work)
    runs, loads = interleaved(list(plans), a.rounds, lambda name: one_run(name, plans[name], a, data, work))
    base = runs["pad_to_longest"]
    paired_all = {
        name: [x["samples_per_sec"] / b["samples_per_sec"] for x, b in zip(runs[name], base)]
        for name in ("group_by_length", "token_budget")
    }
    paired = paired_all["group_by_length"]
    result = {
        "benchmark": "length_batching",
        "dry_run": a.dry_run,
        "command": " ".join(["benchmarks/length_batching.py", *(argv if argv is not None else sys.argv[1:])]),
        "device": "cpu (gloo)",
        "host": {"cpus": os.cpu_count(), "machine": platform.machine()},
        "nproc": a.nproc,
        "setup": {
            "config": "configs/longformer_tiny.yaml",
            "max_length": a.max_length,
            "micro_batch": a.micro,
            "corpus": {"n_train": a.n_train, "words": [a.min_words, a.max_words], "lengths": "lognormal"},
            "steps": a.steps,
            "warmup_steps_excluded": a.warmup,
            "rounds": a.rounds,
        },  # fmt: skip
        "samples_per_sec_median": {c: statistics.median(x["samples_per_sec"] for x in v) for c, v in runs.items()},
        "paired_speedup_median": statistics.median(paired),
        "paired_speedup_per_round": paired,
        # against pad_to_longest, paired per round, for each contender
        "paired_vs_pad_to_longest_median": {c: statistics.median(v) for c, v in paired_all.items()},
        "paired_vs_pad_to_longest_per_round": paired_all,
        "token_budget_vs_group_by_length_per_round": [
            t["samples_per_sec"] / g["samples_per_sec"] for t, g in zip(runs["token_budget"], runs["group_by_length"])
        ],
        "steps_per_epoch": {c: p["per_epoch"] for c, p in plans.items()},
        "max_tokens_per_batch": int(plans["token_budget"]["extra"][-1]),
        "peak_rss_mib_median": {c: statistics.median(x["peak_rss_mib"] for x in v) for c, v in runs.items()},
        "padding_share_median": {c: statistics.median(x["padding_share"] for x in v) for c, v in runs.items()},
        "runs": runs,
        "machine_load": {"loadavg_before_each_round": loads, "loadavg_after": os.getloadavg()},
    }
    write(result, a.out, t0)
    for name, ratios in paired_all.items():
        print(f"{name} / pad_to_longest samples/s: {statistics.median(ratios):.3f} (per round "
              f"{[round(p, 3) for p in ratios]})")  # fmt: skip
    print(f"peak RSS MiB {result['peak_rss_mib_median']}; padding {result['padding_share_median']}")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
