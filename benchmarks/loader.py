"""Can the data pipeline feed the multimodal workload? Loader samples/s against the training step rate.

    ~/.cache/shardtrain/venv/bin/python benchmarks/loader.py            # -> benchmarks/results/loader.json
    ~/.cache/shardtrain/venv/bin/python benchmarks/loader.py --dry-run  # seconds

Loader: shardtrain's own training stream (build_loaders -> TrainStream: tokenize + collate + images as uint8)
with the shipped config (configs/multimodal_sentiment.yaml: batch 32, 224 px, 4 workers per GPU), for three
image sources:
  jpeg_500x375    decode + resize every epoch (a typical web photo; too small for JPEG draft decoding)
  jpeg_1600x1200  decode + resize every epoch (a camera photo: libjpeg decodes it at 1/4 scale, images.py)
  cache           `shardtrain cache-images` once, then rows of a memory map (data/image_cache.py)
and, on one core, the decode alone before and after uint8 + draft decoding (decode_images_per_sec_one_core)
at num_workers 0, 2, 4, interleaved (every source and worker count once per repetition); 2 warm-up batches
(worker start-up) are excluded and 24 are timed (well past the prefetch depth). Per-worker rate: the median at
as many workers as this machine has cores (more only share the same cores).

What the loader must match, per GPU:
  - the FLOP-implied rate at the issue's 40% MFU target: 0.4 x peak bf16 FLOP/s / counted training FLOPs per
    sample (shardtrain.memory.flops, RoBERTa-base + ResNet-50 at 128 tokens), for an A100 and an H100;
  - the measured GPU rate from benchmarks/results/gpu_suite.json when that exists (null until it runs on a GPU);
  - this CPU's own training rate (fp32, micro-batch 4), for scale.
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
MFU_TARGET = 0.40
SOURCES = {"jpeg_500x375": (500, 375), "jpeg_1600x1200": (1600, 1200), "cache": (500, 375)}


def make_jpeg_data(out: Path, n: int, size: tuple[int, int]) -> Path:
    """Synthetic records whose images are JPEG photos of `size`, so decode + resize cost is real."""
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
            Image.open(src).convert("RGB").resize(size, Image.BICUBIC).save(dst, quality=90)
            src.unlink()
            r["image"] = str(dst.relative_to(out))
        (out / split).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def config(data: Path, work: Path, workers: int, batch: int, cache: Path | None = None):
    from shardtrain.config.settings import parse_cli, replace_fields

    cfg = parse_cli(
        [
            "--config",
            str(SHIPPED),
            "--data-dir",
            str(data),
            "--output-dir",
            str(work / "run"),
            "--pretrained",
            "false",
            "--num-workers",
            str(workers),
            "--per-device-batch-size",
            str(batch),
            "--device",
            "cpu",
            "--precision",
            "fp32",
            "--freeze-layers",
            "0",
            "--unfreeze-at-step",
            "none",
            "--resume",
            "none",
            *(["--image-cache", str(cache)] if cache else []),
        ]
    )
    # random init: nothing to download (no flag spells None for a str option)
    cfg = replace_fields(cfg, image_weights=None)
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

    from shardtrain.builtin_workloads.networks import build_model
    from shardtrain.data import batch_to_device, build_loaders

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


def decode_rates(folders: dict, size: int, reps: int, n: int = 60) -> dict:
    """Images/s on one core for one photo size: the decode before this change (float32 normalised on the host,
    no draft), uint8 without draft, and images.decode_image (uint8 + draft), interleaved."""
    import numpy as np
    import torch
    from PIL import Image

    from shardtrain.data.images import decode_image

    def float_on_host(path):
        with Image.open(path) as img:
            arr = np.asarray(img.convert("RGB").resize((size, size), Image.BILINEAR), dtype=np.float32) / 255.0
        x = torch.from_numpy(arr).permute(2, 0, 1)
        return (x - torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)) / torch.tensor([0.229, 0.224, 0.225]).view(
            3, 1, 1
        )

    def uint8_no_draft(path):
        with Image.open(path) as img:
            return np.array(img.convert("RGB").resize((size, size), Image.BILINEAR))

    ways = {
        "float32_on_host_no_draft": float_on_host,
        "uint8_no_draft": uint8_no_draft,
        "uint8_draft (shipped)": lambda path: decode_image(path, size),
    }
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = {}
    for name, folder in folders.items():
        files = sorted((folder / "images" / "train").glob("*.jpg"))[:n]
        runs: dict[str, list[float]] = {w: [] for w in ways}
        for _ in range(reps):
            for way, fn in ways.items():
                t0 = time.perf_counter()
                for f in files:
                    fn(f)
                runs[way].append(len(files) / (time.perf_counter() - t0))
        out[name] = {way: statistics.median(r) for way, r in runs.items()}
    torch.set_num_threads(threads)
    return out


def gpu_rates_at_target(cfg, tok) -> dict:
    """Samples/s per GPU that 40% MFU means for this model at full max_length (128 tokens, as in the GPU
    suite), from counted FLOPs (no GPU needed)."""
    import torch

    from shardtrain.builtin_workloads.networks import build_model
    from shardtrain.memory import flops

    d = cfg.data
    batch = {
        "input_ids": torch.ones(1, d.max_length, dtype=torch.long),
        "attention_mask": torch.ones(1, d.max_length, dtype=torch.long),
        "pixel_values": torch.zeros(1, 3, d.image_size, d.image_size),
    }

    def on_meta(on_meta=True):
        import torch

        with torch.device("meta"):
            return build_model(cfg.model, cfg.data, len(tok), load_weights=False)

    per_sample = flops.train_flops_per_sample(on_meta, batch, 0)
    return {
        "flops_per_sample": per_sample,
        "tokens_per_sample": int(batch["input_ids"].shape[1]),
        **{gpu: MFU_TARGET * flops.PEAK_FLOPS[gpu]["bf16"] / per_sample for gpu in ("A100", "H100")},
    }


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
    work = Path(a.work) / ("dry" if a.dry_run else "full")
    n = 64 if a.dry_run else 1024
    from shardtrain.data import build_datasets, build_tokenizer
    from shardtrain.data.image_cache import build_image_cache

    data = {
        name: make_jpeg_data(work / f"data-{w}x{h}", n, (w, h)) for name, (w, h) in SOURCES.items() if name != "cache"
    }
    data["cache"] = data["jpeg_500x375"]
    cache_dir = work / "cache-500x375"
    t0 = time.perf_counter()
    for split in ("train.jsonl", "validation.jsonl"):
        build_image_cache(data["cache"] / split, "multimodal", 3, cache_dir, 224)
    cache_build = (n + 8) / (time.perf_counter() - t0)

    base = config(data["jpeg_500x375"], work, 0, 32)
    tok = build_tokenizer(base, work / "run", True, lambda: None)
    setups = {name: (d, cache_dir if name == "cache" else None) for name, d in data.items()}
    datasets = {name: build_datasets(config(d, work, 0, 32, c), tok) for name, (d, c) in setups.items()}
    workers = [int(w) for w in a.workers.split(",")]
    rates: dict[str, dict[int, list[float]]] = {name: {w: [] for w in workers} for name in setups}
    for rep in range(a.reps):  # interleaved: every source and worker count once per repetition
        for name, (d, c) in setups.items():
            for w in workers:
                rates[name][w].append(loader_rate(config(d, work, w, 32, c), tok, datasets[name], a.batches))
                print(
                    f"rep {rep + 1}/{a.reps} {name:15s} num_workers {w}: {rates[name][w][-1]:8.1f} samples/s",
                    flush=True,
                )
    med = {name: {w: statistics.median(r) for w, r in by_w.items()} for name, by_w in rates.items()}
    decode = decode_rates({k: v for k, v in data.items() if k != "cache"}, 224, a.reps, 8 if a.dry_run else 60)
    cpu_train = (
        None
        if a.dry_run
        else train_rate(config(data["jpeg_500x375"], work, 0, a.train_batch), tok, datasets["jpeg_500x375"], steps=2)
    )
    target = gpu_rates_at_target(base, tok)
    gpu_json = REPO / "benchmarks" / "results" / "gpu_suite.json"
    gpu_rate = None
    if gpu_json.exists():
        suite = json.loads(gpu_json.read_text())
        if not suite.get("dry_run"):
            ok = [r["samples_per_sec"] for r in suite["cases"] if r["group"] == "fusion" and r["status"] == "ok"]
            gpu_rate = max(ok) if ok else None
    from shardtrain.config.settings import load_yaml

    shipped = load_yaml(SHIPPED)["data"]["num_workers"]
    # Per worker from the most workers that still have a core each (more only share the same cores).
    fit = max([w for w in workers if 0 < w <= (os.cpu_count() or 1)], default=None)
    per_worker = {name: m[fit] / fit if fit else None for name, m in med.items()}
    needed = {
        name: {gpu: (target[gpu] / pw if pw else None) for gpu in ("A100", "H100")} for name, pw in per_worker.items()
    }
    result = {
        "benchmark": "loader",
        "dry_run": a.dry_run,
        "cpus": os.cpu_count(),
        "workload": "configs/multimodal_sentiment.yaml data path: batch 32, synthetic captions (~20 tokens), "
        "images -> 224 px uint8",
        "shipped_num_workers": shipped,
        "loader_samples_per_sec_median": {name: {str(w): r for w, r in m.items()} for name, m in med.items()},
        "loader_runs": {name: {str(w): r for w, r in by_w.items()} for name, by_w in rates.items()},
        "samples_per_sec_per_worker": per_worker,
        "decode_images_per_sec_one_core": decode,
        "cache_build_images_per_sec": cache_build,
        "cache_build_note": f"shardtrain cache-images, 500x375 JPEG -> 224 px, {os.cpu_count()} processes",
        "gpu_rate_at_40pct_mfu": target,
        "gpu_rate_note": "samples/s per GPU at 40% MFU (bf16 dense peak), from counted FLOPs; not a measurement",
        "workers_needed_per_gpu_at_40pct_mfu": needed,
        "keeps_up_at_shipped_workers": {
            name: {gpu: (v is not None and v <= shipped) for gpu, v in by_gpu.items()}
            for name, by_gpu in needed.items()
        },
        "cpu_train_samples_per_sec": cpu_train,
        "cpu_train_note": f"RoBERTa-base + ResNet-50, fp32, micro-batch {a.train_batch}, all cores, this CPU",
        "gpu_train_samples_per_sec": gpu_rate,
        "gpu_note": "from benchmarks/results/gpu_suite.json (best fusion case); null: the suite has not run on a GPU",
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "loader_runs"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
