"""Length-aware batching on a long-document corpus: pad-to-longest random batches against --group-by-length.

    ~/.cache/shardtrain/venv/bin/python benchmarks/length_batching.py  # -> benchmarks/results/length_batching.json
    ~/.cache/shardtrain/venv/bin/python benchmarks/length_batching.py --dry-run  # one short round

The corpus is what `shardtrain make-data longdoc --lengths lognormal` writes: document lengths log-normal between
--min-words and --max-words (median about a sixth of the top), as a Longformer-4096 corpus mixes short posts with
long reports. The tiny Longformer (configs/longformer_tiny.yaml) at max_length 4096 trains on it as 2-process
torchrun jobs on CPU (gloo), the two contenders interleaved A B A B ... so that machine drift hits both alike.
Only --group-by-length differs.

samples/s: steady state from metrics.jsonl's per-step wall_time stamps after warm-up (overhead.py's rule).
Peak memory: GNU time's maximum resident set over the job's processes (the largest rank). Both runs meet the
same longest document, so the peak should not move; the padding does: `padding_share` is the padded tokens'
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

CONTENDERS = {"pad_to_longest": [], "group_by_length": ["--group-by-length"]}
CONFIG = REPO / "configs" / "longformer_tiny.yaml"


def padding_share(run_args: list[str], steps: int, nproc: int) -> float:
    """1 - real tokens / padded tokens over every rank's micro-batches of a run: the loop's own order
    (data/loaders.py TrainStream, replayed over sample ids with the run's flags and its saved tokenizer), each
    batch padded to its longest text and to Longformer's window multiple, as collate pads it."""
    from shardtrain.config.settings import parse_cli
    from shardtrain.data import build_datasets, build_tokenizer
    from shardtrain.data.loaders import TrainStream, length_group_size

    cfg = parse_cli(run_args)
    tok = build_tokenizer(cfg, Path(cfg.checkpoint.output_dir), False, lambda: None)
    train, _ = build_datasets(cfg, tok)
    train.tokenize(tok, cfg.data.max_length, None, True, lambda: None)
    lengths, window = train.lengths(), cfg.model.attention_window
    grouped = lengths if cfg.data.group_by_length else None
    real = padded = 0
    for rank in range(nproc):
        ids = TrainStream(list(range(len(lengths))), list, cfg.train.per_device_batch_size, rank, nproc,
                          cfg.train.seed, {}, grouped, length_group_size(cfg))  # fmt: skip
        for _ in range(steps):
            batch = [lengths[i] for i in ids.next_batch()]
            real += sum(batch)
            padded += len(batch) * -(-max(batch) // window) * window
    return 1 - real / padded


def one_run(name: str, a, data: Path, work: Path) -> dict:
    """One torchrun job (overhead.run_one) under GNU time (%M: the largest process's peak RSS, in KiB)."""
    out = work / "runs" / name
    extra = [
        "--save-final", "false", "--max-length", str(a.max_length), "--per-device-batch-size", str(a.micro),
        "--log-every", "1", "--predict-memory", "false", "--report", "false", *CONTENDERS[name],
    ]  # fmt: skip
    maxrss = work / f"{name}.maxrss"
    run = run_one(
        launch.MAIN, extra, CONFIG, data, out, a.steps, a.nproc, ("/usr/bin/time", "-f", "%M", "-o", str(maxrss))
    )
    if run.returncode != 0:
        raise RuntimeError(f"{name} failed (rc {run.returncode}):\n{run.output[-3000:]}")
    rate = steady_rate(out / "metrics.jsonl", a.micro * a.nproc, a.warmup)
    if name not in PADDING:  # the same order every round
        run_args = ["--config", str(CONFIG), "--data-dir", str(data), "--output-dir", str(out), *extra]
        PADDING[name] = padding_share(run_args, a.steps, a.nproc)
    return {**rate, "peak_rss_mib": int(maxrss.read_text().split()[-1]) / 1024, "padding_share": PADDING[name]}


PADDING: dict[str, float] = {}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    # A whole epoch is timed: 400 samples at 2 ranks x 4 are 50 steps, two runs of 200 sorted samples. A window
    # of part of an epoch would flatter the grouped order, whose runs start with their longest batches.
    ap.add_argument("--steps", type=int, default=51)
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
    t0 = time.time()
    runs, loads = interleaved(list(CONTENDERS), a.rounds, lambda name: one_run(name, a, data, work))
    base, grouped = runs["pad_to_longest"], runs["group_by_length"]
    paired = [g["samples_per_sec"] / b["samples_per_sec"] for g, b in zip(grouped, base)]
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
        "peak_rss_mib_median": {c: statistics.median(x["peak_rss_mib"] for x in v) for c, v in runs.items()},
        "padding_share_median": {c: statistics.median(x["padding_share"] for x in v) for c, v in runs.items()},
        "runs": runs,
        "machine_load": {"loadavg_before_each_round": loads, "loadavg_after": os.getloadavg()},
    }
    write(result, a.out, t0)
    print(
        f"group_by_length / pad_to_longest samples/s: {result['paired_speedup_median']:.3f} "
        f"(per round {[round(p, 3) for p in paired]}); peak RSS MiB {result['peak_rss_mib_median']}; "
        f"padding {result['padding_share_median']}"
    )
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
