"""Can the data pipeline feed the multimodal workload? Loader samples/s against the training step rate.

    ~/.cache/shardtrain/venv/bin/python benchmarks/loader.py            # -> benchmarks/results/loader.json
    ~/.cache/shardtrain/venv/bin/python benchmarks/loader.py --dry-run  # seconds

Loader: shardtrain's own training stream (build_loaders -> TrainStream: tokenize + collate, PIL decode of a
500x375 JPEG, RGB, bilinear resize to 224, normalize) with the shipped config (configs/multimodal_sentiment.yaml:
batch 32, 4 workers per GPU) at num_workers 0, 2, 4, interleaved across repetitions; 2 warm-up batches (worker
start-up) are excluded and 24 are timed (well past the prefetch depth). Training: the same config's model (RoBERTa-base + ResNet-50, random init) on this
machine's CPU, fp32, forward + backward + AdamW, after one warm-up step. The GPU rate the loader must match
comes from benchmarks/results/gpu_suite.json when that exists (it has not run on a GPU yet: null otherwise).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
SHIPPED = REPO / "configs" / "multimodal_sentiment.yaml"


def make_jpeg_data(out: Path, n: int) -> Path:
    """Synthetic records whose images are 500x375 JPEGs (a typical photo), so decode + resize cost is real."""
    from PIL import Image

    from shardtrain.data import make_data
    if (out / "train.jsonl").exists():
        return out
    make_data("multimodal", out, n_train=n, n_val=8, seed=0, overwrite=True, image_size=64)
    for split in ("train.jsonl", "validation.jsonl"):
        rows = [json.loads(line) for line in (out / split).read_text().splitlines() if line.strip()]
        for r in rows:
            src = out / r["image"]
            dst = src.with_suffix(".jpg")
            Image.open(src).convert("RGB").resize((500, 375), Image.BICUBIC).save(dst, quality=90)
            src.unlink()
            r["image"] = str(dst.relative_to(out))
        (out / split).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def config(data: Path, work: Path, workers: int, batch: int):
    from shardtrain.config import parse_cli
    cfg = parse_cli(["--config", str(SHIPPED), "--data-dir", str(data), "--output-dir", str(work / "run"),
                     "--pretrained", "false", "--num-workers", str(workers),
                     "--per-device-batch-size", str(batch), "--device", "cpu", "--precision", "fp32",
                     "--freeze-layers", "0", "--unfreeze-at-step", "none", "--resume", "none"])
    cfg.model.image_weights = None  # random init: nothing to download (no flag spells None for a str option)
    return cfg


def loader_rate(cfg, tok, datasets, batches: int) -> float:
    from shardtrain.data import build_loaders
    stream = build_loaders(cfg, tok, *datasets, 0, 1, "cpu").train
    for _ in range(2):  # worker start-up and first prefetch
        stream.next_batch()
    t0 = time.perf_counter()
    for _ in range(batches):
        stream.next_batch()
    rate = batches * cfg.train.per_device_batch_size / (time.perf_counter() - t0)
    del stream  # ends its workers before the next configuration starts its own
    return rate


def train_rate(cfg, tok, datasets, steps: int) -> float:
    import torch
    import torch.nn.functional as F

    from shardtrain.data import batch_to_device, build_loaders
    from shardtrain.models import build_model
    stream = build_loaders(cfg, tok, *datasets, 0, 1, "cpu").train
    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.data, len(tok)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    batches = [stream.next_batch() for _ in range(steps + 1)]  # loaded up front: time the model alone
    times = []
    for b in batches:
        t0 = time.perf_counter()
        b = batch_to_device(b, torch.device("cpu"))
        loss = F.cross_entropy(model(b["input_ids"], b["attention_mask"], b["pixel_values"]), b["labels"])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return cfg.train.per_device_batch_size / statistics.median(times[1:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", default="0,2,4")
    ap.add_argument("--reps", type=int, default=3)
    # Far more than workers x prefetch_factor (8 batches at 4 workers) so that batches prefetched during the
    # warm-up do not inflate the rate: this times the pipeline's steady state.
    ap.add_argument("--batches", type=int, default=24)
    ap.add_argument("--train-batch", type=int, default=4, help="micro-batch of the CPU training-rate probe")
    ap.add_argument("--work", default="/tmp/shardtrain-bench/loader")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "loader.json"))
    ap.add_argument("--dry-run", action="store_true")
    a = ap.parse_args(argv)
    if a.dry_run:
        a.workers, a.reps, a.batches = "0,2", 1, 1
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    work = Path(a.work)
    data = make_jpeg_data(work / ("data-dry" if a.dry_run else "data"), 64 if a.dry_run else 1024)

    from shardtrain.data import build_datasets, build_tokenizer
    base = config(data, work, 0, 32)
    tok = build_tokenizer(base, work / "run", True, lambda: None)
    datasets = build_datasets(base, tok)
    workers = [int(w) for w in a.workers.split(",")]
    rates: dict[int, list[float]] = {w: [] for w in workers}
    for rep in range(a.reps):  # interleaved: w0 w2 w4 w0 w2 w4 ...
        for w in workers:
            rates[w].append(loader_rate(config(data, work, w, 32), tok, datasets, a.batches))
            print(f"rep {rep + 1}/{a.reps} num_workers {w}: {rates[w][-1]:7.1f} samples/s", flush=True)
    med = {w: statistics.median(r) for w, r in rates.items()}
    train_cfg = config(data, work, 0, a.train_batch)
    cpu_train = None if a.dry_run else train_rate(train_cfg, tok, datasets, steps=2)
    gpu_json = REPO / "benchmarks" / "results" / "gpu_suite.json"
    gpu_rate = None
    if gpu_json.exists():
        suite = json.loads(gpu_json.read_text())
        if not suite.get("dry_run"):
            ok = [r["samples_per_sec"] for r in suite["cases"] if r["group"] == "fusion" and r["status"] == "ok"]
            gpu_rate = max(ok) if ok else None
    from shardtrain.config import load_yaml
    shipped = load_yaml(SHIPPED)["data"]["num_workers"]
    # Per worker from the most workers that still have a core each (more only share the same cores).
    fit = [w for w in workers if 0 < w <= (os.cpu_count() or 1)]
    per_worker = med[max(fit)] / max(fit) if fit else None
    result = {
        "benchmark": "loader", "dry_run": a.dry_run, "cpus": os.cpu_count(),
        "workload": "configs/multimodal_sentiment.yaml data path: batch 32, 128 tokens, 500x375 JPEG -> 224",
        "shipped_num_workers": shipped,
        "loader_samples_per_sec_median": {str(w): r for w, r in med.items()},
        "loader_runs": {str(w): r for w, r in rates.items()},
        "cpu_train_samples_per_sec": cpu_train,
        "cpu_train_note": f"RoBERTa-base + ResNet-50, fp32, micro-batch {a.train_batch}, all cores, this CPU",
        "loader_over_cpu_train": (med[min(workers, key=lambda w: abs(w - shipped))] / cpu_train) if cpu_train else None,
        "gpu_train_samples_per_sec": gpu_rate,
        "gpu_note": "from benchmarks/results/gpu_suite.json (best fusion case); null: the suite has not run on a GPU",
        "workers_needed_for_gpu": (gpu_rate / per_worker) if gpu_rate and per_worker else None,
        "samples_per_sec_per_worker_estimate": per_worker,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "loader_runs"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
