"""INT8 (torchao, exactly as `shardtrain export --int8` quantizes and saves) against fp32, at real sizes, on CPU.

    ~/.cache/shardtrain/venv/bin/python benchmarks/int8.py [--demo-run runs/demo]   # -> benchmarks/results/int8.json

Per model: bytes on disk (model.safetensors against model_int8.pt), peak RSS of a process that loads the export
the way `shardtrain predict` does and predicts, and samples/s at batch 8. Random init at the real shapes (the
transformers config classes, shardtrain/builtin_workloads/networks/archs.py: no download). Every measurement is
a fresh process; the fp32 and INT8 processes alternate (fp32 first in even rounds, INT8 first in odd
ones) and the JSON keeps every round and the median. With --demo-run (the folder `make demo` trained) it also
exports that run with --int8 --eval and records the validation accuracy / macro-F1 of both.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

BATCH = 8
# name -> (training flags that build it, vocabulary, tokens per example, timed batches)
MODELS = {
    "roberta-base+resnet50 fusion": (
        [
            "--config",
            "configs/multimodal_sentiment.yaml",
            "--pretrained",
            "false",
            "--image-weights",
            "none",
            "--max-length",
            "128",
            "--image-size",
            "224",
        ],
        50265,
        128,
        3,
    ),
    "longformer-base-4096": (["--config", "configs/longformer_4096.yaml", "--pretrained", "false"], 50265, None, 1),
    "multimodal_tiny": (["--config", "configs/multimodal_tiny.yaml"], 1000, 64, 20),
    "longformer_tiny": (["--config", "configs/longformer_tiny.yaml"], 1000, 256, 20),
}


def config(name: str):
    from shardtrain.config.settings import parse_cli

    return parse_cli(MODELS[name][0] + ["--output-dir", tempfile.gettempdir()])


def write_export(name: str, folder: Path) -> dict:
    """model.safetensors (+ config.json, shardtrain_export.json) and model_int8.pt, as `export --int8` writes them."""
    import torch
    from safetensors.torch import save_file

    from shardtrain.builtin_workloads.networks import build_model
    from shardtrain.checkpointing.export import EXPORT_META, INT8_FILE, save_int8

    cfg = config(name)
    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.data, MODELS[name][1], load_weights=False).eval()
    folder.mkdir(parents=True, exist_ok=True)
    if cfg.model.name == "longformer":
        model.hf.save_pretrained(str(folder), safe_serialization=True)
    else:
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    (folder / EXPORT_META).write_text(json.dumps({"model": cfg.model.name, "export_config": model.export_config()}))
    save_int8(model.hf if cfg.model.name == "longformer" else model, folder / INT8_FILE)
    return {
        "bytes_fp32": (folder / "model.safetensors").stat().st_size,
        "bytes_int8": (folder / INT8_FILE).stat().st_size,
    }


def worker(name: str, folder: Path, variant: str, tokens: int) -> dict:
    """One process: load the export as predict does, predict batches of 8, report samples/s and peak RSS."""
    import torch

    from shardtrain.checkpointing.export import load_export, load_int8

    cfg = config(name)
    model = load_int8(folder) if variant == "int8" else load_export(folder)
    torch.manual_seed(1)
    batch = {
        "input_ids": torch.randint(5, MODELS[name][1], (BATCH, tokens)),
        "attention_mask": torch.ones(BATCH, tokens, dtype=torch.long),
    }
    if cfg.model.name == "multimodal":
        batch["pixel_values"] = torch.randn(BATCH, 3, cfg.data.image_size, cfg.data.image_size)
    n = MODELS[name][3]
    with torch.no_grad():
        model(**batch)  # warm-up: one-time packing and allocator growth are not throughput
        t0 = time.perf_counter()
        for _ in range(n):
            model(**batch)
        seconds = time.perf_counter() - t0
    return {
        "samples_per_sec": BATCH * n / seconds,
        "seconds_per_batch": seconds / n,
        "peak_rss": peak_rss(),
        "threads": torch.get_num_threads(),
    }


def peak_rss() -> int:
    """This program's peak RSS in bytes: VmHWM, which starts afresh at exec. (getrusage's ru_maxrss does not: a
    child started by a parent that built a big model reports the parent's peak as its own.)"""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def run_worker(name: str, folder: Path, variant: str, tokens: int) -> dict:
    cmd = [sys.executable, __file__, "--worker", name, str(folder), variant, str(tokens)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    if proc.returncode != 0:
        raise SystemExit(f"{name} {variant}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def demo_accuracy(run: Path, data_dir: Path, out: Path) -> dict:
    """`shardtrain export RUN OUT --int8 --eval` of the demo run: validation accuracy / macro-F1 of both."""
    cmd = [
        sys.executable,
        "-m",
        "shardtrain",
        "export",
        str(run),
        str(out),
        "--int8",
        "--eval",
        "--data-dir",
        str(data_dir),
    ]
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"export of the demo run: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    info = json.loads((out / "shardtrain_export.json").read_text())
    e32, e8 = info["eval_fp32"], info["eval_int8"]
    return {
        "accuracy_fp32": e32["accuracy"],
        "accuracy_int8": e8["accuracy"],
        "macro_f1_fp32": e32["macro_f1"],
        "macro_f1_int8": e8["macro_f1"],
        "n_examples": e32["n_examples"],
        "demo_run": str(run),
        "demo_bytes_fp32": info["bytes_fp32"],
        "demo_bytes_int8": info["bytes_int8"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--longformer-tokens",
        type=int,
        default=1024,
        help="4096 is the model's length; on a 2-core CPU one batch of 8 at 4096 takes minutes",
    )
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--demo-run", default=None, help="the run `make demo` trained (default: none, no accuracy)")
    ap.add_argument("--demo-data", default=str(REPO / "data" / "multimodal"), help="its data (make demo's default)")
    ap.add_argument("--contended", default=None, help="a note on what else ran on the machine meanwhile")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "int8.json"))
    args = ap.parse_args()
    import torch
    import torchao

    results, load_before = [], os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            folder = Path(tmp) / name.replace(" ", "_").replace("+", "_")
            tokens = MODELS[name][2] or args.longformer_tokens
            entry = {"model": name, "batch": BATCH, "tokens": tokens, **write_export(name, folder)}
            rounds = {"fp32": [], "int8": []}
            for r in range(args.rounds):
                for variant in ("fp32", "int8") if r % 2 == 0 else ("int8", "fp32"):
                    rounds[variant].append(run_worker(name, folder, variant, tokens))
                    print(f"{name} round {r} {variant}: {rounds[variant][-1]}", flush=True)
            for variant, runs in rounds.items():
                entry[f"samples_per_sec_{variant}"] = statistics.median(x["samples_per_sec"] for x in runs)
                entry[f"peak_rss_{variant}"] = statistics.median(x["peak_rss"] for x in runs)
                entry[f"rounds_{variant}"] = runs
            entry["size_ratio"] = entry["bytes_fp32"] / entry["bytes_int8"]
            entry["speedup"] = entry["samples_per_sec_int8"] / entry["samples_per_sec_fp32"]
            if name.startswith("multimodal") or name.startswith("roberta"):
                entry["image_size"] = config(name).data.image_size
            results.append(entry)
        if args.demo_run:
            demo = next(e for e in results if e["model"] == "multimodal_tiny")
            demo.update(demo_accuracy(Path(args.demo_run), Path(args.demo_data), Path(tmp) / "demo_export"))
    out = {
        "what": "fp32 export (model.safetensors) vs `export --int8` (torchao, model_int8.pt), CPU, batch 8, "
        "fresh process per measurement, fp32/int8 interleaved, medians",
        "peak_rss": "VmHWM of the whole process (imports included): load the export, predict warm-up + timed batches",
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "threads": torch.get_num_threads(),
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
            "contended": args.contended or "not stated",
        },
        "versions": {"torch": torch.__version__, "torchao": torchao.__version__},
        "longformer_tokens": args.longformer_tokens,
        "rounds": args.rounds,
        "models": results,
    }
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        from shardtrain.runtime.chatter import quiet_libraries

        quiet_libraries(False)
        print(json.dumps(worker(sys.argv[2], Path(sys.argv[3]), sys.argv[4], int(sys.argv[5]))))
    else:
        main()
