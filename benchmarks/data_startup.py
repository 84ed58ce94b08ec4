"""Tokenising once, and streaming from parquet or JSONL: what each costs.

    ~/.cache/shardtrain/venv/bin/python benchmarks/data_startup.py [--pairs N]
        # -> benchmarks/results/data_startup.json

1. Start-up with a cold and a warm `datasets` cache. Real 2-process DDP torchrun jobs of the tiny configs (the
   way tests/launch.py starts them), timed from just before the launch to the wall-clock stamp metrics.jsonl
   writes after step 1. Cold: an empty HF_DATASETS_CACHE, so datasets.map tokenises both splits and writes
   them; warm: the cache an untimed run filled, so the splits are loaded. Each pair runs both, in alternating
   order. Also the tokenise/load seconds the run prints itself. Two data sets: the test suite's tiny
   multimodal set (256 + 64 rows) and a larger long-document set (4,000 + 400 rows of 60-300 words), where
   the tokenisation is long enough to see. Noise floor: the same measurement between two warm runs.
2. Samples/s of the training loader reading the same rows from parquet and from JSONL: the --streaming loader
   (StreamingTrainStream, reading the file as it trains: the format matters there) and the in-memory one
   (TrainStream over a datasets.Dataset loaded from the file), each with the built-in collate (tokenise, pad,
   and images decoded for multimodal). The parquet file is written from the JSONL with `datasets`. One
   process, interleaved, medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

import launch  # noqa: E402  tests/launch.py: the one way this repo starts torchrun jobs


def startup(workload: str, data: Path, out: Path, cache: Path) -> dict:
    args = launch.tiny_args(
        workload, data, out, "--strategy", "ddp", "--max-steps", "1", "--save-final", "false", "--max-eval-samples", "8"
    )
    t0 = time.time()
    run = launch.torchrun(args, env=launch.test_env(HF_DATASETS_CACHE=cache), timeout=900)
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    prep = [line for line in run.output.splitlines() if "token sequences" in line]
    seconds = [float(line.rsplit(" in ", 1)[1].rstrip("s")) for line in prep]
    return {"to_first_step_s": first["wall_time"] - t0, "tokenise_or_load_s": sum(seconds), "lines": prep}


def measure_startup(name: str, workload: str, data: Path, tmp: Path, pairs: int) -> dict:
    warm = tmp / f"{name}-warm-cache"
    startup(workload, data, tmp / f"{name}-fill", warm)  # untimed: fills the warm cache
    runs: dict[str, list[dict]] = {"cold": [], "warm": [], "warm_twin": []}
    for i in range(pairs):
        order = ["cold", "warm", "warm_twin"] if i % 2 == 0 else ["warm_twin", "warm", "cold"]
        for kind in order:
            cache = tmp / f"{name}-cold-{i}" if kind == "cold" else warm
            runs[kind].append(startup(workload, data, tmp / f"{name}-{kind}-{i}", cache))
            print(
                f"{name} pair {i} {kind}: {runs[kind][-1]['to_first_step_s']:.2f}s to step 1, "
                f"{runs[kind][-1]['tokenise_or_load_s']:.2f}s tokenise/load",
                flush=True,
            )
    med = {k: statistics.median(r["to_first_step_s"] for r in v) for k, v in runs.items()}
    return {
        "to_first_step_s": {k: [round(r["to_first_step_s"], 3) for r in v] for k, v in runs.items()},
        "tokenise_or_load_s": {k: [round(r["tokenise_or_load_s"], 3) for r in v] for k, v in runs.items()},
        "median_to_first_step_s": {k: round(v, 3) for k, v in med.items()},
        "median_saved_s": round(med["cold"] - med["warm"], 3),
        "noise_floor_s": round(
            statistics.median(
                abs(a["to_first_step_s"] - b["to_first_step_s"]) for a, b in zip(runs["warm"], runs["warm_twin"])
            ),
            3,
        ),
        "example_lines": {"cold": runs["cold"][0]["lines"], "warm": runs["warm"][0]["lines"]},
    }


def loader_rates(workload: str, data: Path, tmp: Path, reps: int, batches: int) -> dict:
    import datasets

    from shardtrain.config.settings import parse_cli
    from shardtrain.data import build_loaders, build_tokenizer
    from shardtrain.data.splits import make_collator

    cfg = parse_cli(launch.tiny_args(workload, data, tmp / f"loader-{workload}"))
    tok = build_tokenizer(cfg, tmp / f"loader-{workload}", True, lambda: None)
    jsonl = data / "train.jsonl"
    parquet = tmp / f"{workload}-train.parquet"
    datasets.load_dataset("json", data_files=str(jsonl), split="train").to_parquet(str(parquet))
    files = {"jsonl": ("json", jsonl), "parquet": ("parquet", parquet)}

    def rate(fmt: str, streaming: bool) -> float:
        builder, path = files[fmt]
        ds = datasets.load_dataset(builder, data_files=str(path), split="train", streaming=streaming)
        stream = build_loaders(cfg, tok, ds, None, 0, 1, "cpu", collate=make_collator(cfg, tok)).train
        stream.next_batch()  # first read: the file opened, the buffer filled
        t0 = time.perf_counter()
        for _ in range(batches):
            stream.next_batch()
        return batches * cfg.train.per_device_batch_size / (time.perf_counter() - t0)

    ways = [(fmt, streaming) for streaming in (True, False) for fmt in files]
    runs: dict[str, list[float]] = {f"{'streaming' if s else 'in_memory'}_{f}": [] for f, s in ways}
    for i in range(reps):
        for fmt, streaming in ways if i % 2 == 0 else list(reversed(ways)):
            runs[f"{'streaming' if streaming else 'in_memory'}_{fmt}"].append(rate(fmt, streaming))
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {
        "rows": sum(1 for line in jsonl.read_text().splitlines() if line.strip()),
        "batch": cfg.train.per_device_batch_size,
        "timed_batches": batches,
        "bytes": {"jsonl": jsonl.stat().st_size, "parquet": parquet.stat().st_size},
        "samples_per_sec": {k: [round(x, 1) for x in v] for k, v in runs.items()},
        "median_samples_per_sec": {k: round(v, 1) for k, v in med.items()},
        "parquet_over_jsonl": {
            m: round(med[f"{m}_parquet"] / med[f"{m}_jsonl"], 3) for m in ("streaming", "in_memory")
        },
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    from shardtrain.data import make_data

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        os.environ["HF_DATASETS_CACHE"] = str(tmp / "loader-cache")  # before datasets is imported: not in $HOME
        mm = make_data("multimodal", tmp / "mm", n_train=256, n_val=64, seed=0)
        ld = make_data("longdoc", tmp / "ld", n_train=4000, n_val=400, seed=0, min_words=60, max_words=300)
        result = {
            "machine": "2-core shared VM, CPU only",
            "startup": {
                "multimodal_tiny_256_rows": measure_startup("mm", "multimodal", mm, tmp, args.pairs),
                "longformer_tiny_4000_rows": measure_startup("ld", "longformer", ld, tmp, args.pairs),
            },
            "loader": {
                "longformer_tiny_4000_rows": loader_rates("longformer", ld, tmp, args.reps, 60),
                "multimodal_tiny_256_rows": loader_rates("multimodal", mm, tmp, args.reps, 12),
            },
        }
    out = REPO / "benchmarks" / "results" / "data_startup.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
