"""The GPU suite: one prepared run on one NVIDIA GPU (~8 minutes) -> one JSON file and a printed table.

    bash benchmarks/gpu_suite.sh                   # on the GPU machine (installs carried wheels if needed)
    python benchmarks/gpu_suite.py --dry-run       # CPU: every case for 2 steps at tiny shapes (the test)

Cases (all world size 1, bf16, random init from known architectures: nothing is downloaded):
- fusion: RoBERTa-base + ResNet-50, per-device batch 32, 128 tokens, 224 px: plain eager; + channels_last;
  + channels_last + torch.compile. samples/s, MFU, peak memory.
- longformer: Longformer-base at 4096 tokens, batch 4, with and without activation checkpointing.
- strategies: the fusion model (channels_last, eager) under DDP, FSDP2, ZeRO-2, ZeRO-2 + optimizer offload,
  ZeRO-3, ZeRO-3 + optimizer and parameter offload, side by side.
Every case also records the planner's prediction (shardtrain.memory.planner.predict_run, if present) against the
measured peak.

Each case is a fresh child process running shardtrain.loop.train.train(cfg) (so peak memory and failures stay per
case); --dry-run runs them all in one CPU process to stay fast. Speed is measured as in overhead.py: from
metrics.jsonl's per-step wall-clock stamps after the warm-up steps (compilation and cuDNN autotuning fall in
the warm-up). MFU = shardtrain.memory.flops' counted training FLOPs per sample (forward counted once with
FlopCounterMode on a meta-device copy, x3) x samples/s / the GPU's dense bf16 peak (shardtrain.memory.flops table:
H100/H200 989, A100 312 TFLOP/s; V100 has no bf16).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CONF = REPO / "benchmarks" / "configs"
DS = REPO / "ds_configs"
FUSION, LONGFORMER = CONF / "gpu_fusion.yaml", CONF / "gpu_longformer.yaml"
CL = ["--channels-last", "true"]
# (name, group, config, flags, steps, warm-up steps excluded from the rate)
CASES = [
    ("fusion_eager", "fusion", FUSION, ["--strategy", "ddp"], 30, 8),
    ("fusion_channels_last", "fusion", FUSION, ["--strategy", "ddp", *CL], 30, 8),
    ("fusion_channels_last_compile", "fusion", FUSION, ["--strategy", "ddp", *CL, "--compile", "inductor"], 40, 15),
    ("longformer_4096", "longformer", LONGFORMER, ["--strategy", "ddp"], 12, 4),
    ("longformer_4096_ac", "longformer", LONGFORMER, ["--strategy", "ddp", "--activation-checkpointing", "true"],
     12, 4),
    ("strategy_ddp", "strategies", FUSION, ["--strategy", "ddp", *CL], 20, 6),
    ("strategy_fsdp", "strategies", FUSION, ["--strategy", "fsdp", *CL], 20, 6),
    ("strategy_zero2", "strategies", FUSION, ["--ds", str(DS / "zero2.json"), *CL], 20, 6),
    ("strategy_zero2_offload", "strategies", FUSION, ["--ds", str(DS / "zero2_offload.json"), *CL], 10, 4),
    ("strategy_zero3", "strategies", FUSION, ["--ds", str(DS / "zero3.json"), *CL], 20, 6),
    ("strategy_zero3_offload", "strategies", FUSION, ["--ds", str(DS / "zero3_offload.json"), *CL], 10, 4),
]
# --dry-run: the same cases and code paths at shapes a CPU runs in seconds. torch.compile traces with the
# "aot_eager" backend there (AOTAutograd as inductor, minus minutes of C++ codegen); the GPU uses inductor.
DRY_FLAGS = ["--device", "cpu", "--text-config",
             json.dumps({"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                         "intermediate_size": 64}),
             "--per-device-batch-size", "2", "--eval-batch-size", "2", "--num-workers", "0",
             "--pin-memory", "false", "--tokenizer-vocab-size", "300", "--warmup-steps", "0"]
DRY_MODEL = {FUSION: ["--image-model", "resnet18", "--image-config", json.dumps({"layers": [1, 1, 1, 1]}),
                      "--image-size", "32", "--max-length", "16", "--fusion-hidden", "16"],
             LONGFORMER: ["--attention-window", "16", "--max-length", "64"]}
FUSION_MFU_TARGET = 0.40


# ---- data: the suite's own synthetic sets, sized so every sequence fills max_length ----------------------
def make_suite_data(work: Path, dry: bool) -> dict[Path, Path]:
    from shardtrain.data import make_data

    mm, ld = work / "data" / "multimodal", work / "data" / "longdoc"
    if not (mm / "train.jsonl").exists():
        # Read through an image cache (`shardtrain cache-images`, below): at 40% MFU an H200 trains ~4000
        # samples/s of this model, more than decoding images every epoch feeds from 16 cores
        # (benchmarks/loader.py). The suite measures the model and the loop; loader.py measures the loader.
        make_data("multimodal", mm, n_train=64 if dry else 512, n_val=8 if dry else 64, seed=0, overwrite=True,
                  image_size=32 if dry else 224)
        # Captions repeated to ~200 words so that every batch is max_length (128) tokens wide, as in the
        # FLOP count; short synthetic captions would measure a 30-token model.
        for split in ("train.jsonl", "validation.jsonl"):
            path = mm / split
            rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            for r in rows:
                r["text"] = " ".join([r["text"]] * 16)
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    from shardtrain.data.image_cache import build_image_cache
    for split in ("train.jsonl", "validation.jsonl"):
        if not (mm / "cache" / f"{split.split('.')[0]}-{32 if dry else 224}.json").exists():
            build_image_cache(mm / split, "multimodal", 3, mm / "cache", 32 if dry else 224)
    if not (ld / "train.jsonl").exists():
        make_data("longdoc", ld, n_train=16 if dry else 48, n_val=4 if dry else 8, seed=0, overwrite=True,
                  min_words=80 if dry else 4200, max_words=100 if dry else 4600)
    return {FUSION: mm, LONGFORMER: ld}


def case_args(case, work: Path, data: dict, dry: bool) -> list[str]:
    name, _, config, flags, steps, _ = case
    args = ["--config", str(config), "--data-dir", str(data[config]), "--output-dir", str(work / "runs" / name),
            "--resume", "none", "--max-steps", str(2 if dry else steps), "--eval-every", "0", *flags]
    if config == FUSION:
        args += ["--image-cache", str(data[config] / "cache")]
    if dry:
        args += DRY_FLAGS + DRY_MODEL[config]
        args = ["aot_eager" if a == "inductor" else a for a in args]
    return args


# ---- one case, in this process ----------------------------------------------------------------------------
def planner_prediction(cfg) -> dict:
    """The planner's per-rank peak, through the same optional contract the startup banner uses."""
    from shardtrain.memory.planner import memory_prediction

    pred = memory_prediction(cfg, 1)
    # predict_run gives the parts (model states + saved activations), not one peak: their sum is the
    # prediction compared here (it leaves out communication buffers and allocator overhead).
    parts = [pred.get("model_state_gib"), pred.get("activations_gib")]
    value = sum(parts) if all(isinstance(v, (int, float)) for v in parts) else None
    return {"predicted_peak_gib": value, "raw": pred,
            "note": pred.get("note") if value is None else "model_state_gib + activations_gib of predict_run"}


def flops_per_sample(cfg) -> float | None:
    import torch

    from shardtrain.memory import flops
    from shardtrain.models import build_model

    def factory(on_meta=True):
        with torch.device("meta"):
            return build_model(cfg.model, cfg.data, cfg.data.tokenizer_vocab_size, load_weights=False)

    m, d = cfg.model, cfg.data
    length = d.max_length + (-d.max_length % m.attention_window if m.name == "longformer" else 0)
    batch = {"input_ids": torch.ones(1, length, dtype=torch.long),
             "attention_mask": torch.ones(1, length, dtype=torch.long)}
    if m.name == "multimodal":
        batch["pixel_values"] = torch.zeros(1, 3, d.image_size, d.image_size)
    trainable = sum(p.numel() for p in factory().parameters())
    return flops.train_flops_per_sample(factory, batch, trainable)


def steady_rate(metrics_path: Path, global_batch: int, warmup: int) -> dict:
    stamps = [json.loads(line)["wall_time"] for line in metrics_path.read_text().splitlines() if line.strip()]
    kept = stamps[max(0, min(warmup, len(stamps) - 2)):]
    periods = [b - a for a, b in zip(kept, kept[1:])]
    if not periods:  # the run stopped before a second step (e.g. a preemption signal)
        return {"samples_per_sec": None, "step_ms_median": None, "steps_timed": 0}
    return {"samples_per_sec": global_batch * len(periods) / (kept[-1] - kept[0]),
            "step_ms_median": 1000 * statistics.median(periods), "steps_timed": len(periods)}


def run_case_here(case, args: list[str], dry: bool) -> dict:
    import torch

    from shardtrain.config.settings import parse_cli
    from shardtrain.loop.train import train
    from shardtrain.memory.accounting import peak_rss_bytes
    from shardtrain.memory.flops import mfu, peak_flops

    name, group, _, flags, steps, warmup = case
    cfg = parse_cli(args)
    row = {"name": name, "group": group, "flags": flags, "strategy": None, "offload": None,
           "activation_checkpointing": cfg.train.activation_checkpointing, "compile": cfg.train.compile,
           "channels_last": cfg.model.channels_last, "precision": cfg.train.precision,
           "per_device_batch_size": cfg.train.per_device_batch_size, "max_length": cfg.data.max_length}
    cuda = cfg.parallel.device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    summary = train(cfg)
    row["wall_seconds"] = time.time() - t0
    row.update({"strategy": summary.get("strategy"), "offload": summary.get("offload"),
                "params_total": summary.get("params_total")})
    rate = steady_rate(Path(cfg.checkpoint.output_dir) / "metrics.jsonl", cfg.train.per_device_batch_size,
                       0 if dry else warmup)
    row.update(rate)
    row["flops_per_sample"] = flops_per_sample(cfg)
    device_name = torch.cuda.get_device_name() if cuda else "cpu"
    row["mfu"] = mfu(row["flops_per_sample"], rate["samples_per_sec"], 1, peak_flops(device_name, "bf16")
                     if cuda else None) if rate["samples_per_sec"] else None
    gib = 2 ** 30
    row["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / gib if cuda else None
    row["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / gib if cuda else None
    row["peak_host_rss_gib"] = peak_rss_bytes() / gib
    row["planner"] = planner_prediction(cfg)
    pred = row["planner"]["predicted_peak_gib"]
    row["planner_error"] = (pred - row["peak_allocated_gib"]) / row["peak_allocated_gib"] \
        if pred is not None and row["peak_allocated_gib"] else None
    row["status"] = "ok"
    return row


def child_main(names: list[str], work: Path, dry: bool, out: Path) -> int:
    """Runs the named cases in this process, one JSON line each to `out`, failures included."""
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"})
    if "MASTER_PORT" not in os.environ:
        from shardtrain.runtime.distributed import free_port
        os.environ["MASTER_PORT"] = str(free_port())
    data = make_suite_data(work, dry)
    with open(out, "a") as f:
        for case in [c for c in CASES if c[0] in names]:
            try:
                row = run_case_here(case, case_args(case, work, data, dry), dry)
            except BaseException as e:  # noqa: BLE001 - one failed case must not lose the others' results
                if isinstance(e, KeyboardInterrupt):
                    raise
                row = {"name": case[0], "group": case[1], "flags": case[3], "status": "failed",
                       "error": f"{type(e).__name__}: {str(e).strip()[:500]}"}
                traceback.print_exc()
            f.write(json.dumps(row) + "\n")
            f.flush()
            print(f"[gpu_suite] {case[0]}: {row['status']}", flush=True)
    from shardtrain.runtime.distributed import teardown_and_exit
    teardown_and_exit(0)
    return 0


# ---- the driver ----------------------------------------------------------------------------------------------
def environment() -> dict:
    import torch

    from shardtrain.observability.tracking import library_versions
    env = {"versions": library_versions(), "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        from shardtrain.memory.flops import peak_flops
        name = torch.cuda.get_device_name()
        env.update({"gpu": name, "gpu_memory_gib": torch.cuda.get_device_properties(0).total_memory / 2 ** 30,
                    "peak_bf16_flops": peak_flops(name, "bf16")})
    return env


def print_table(rows: list[dict]) -> None:
    def f(v, fmt):
        return format(v, fmt) if isinstance(v, (int, float)) and v is not None else "-"
    print(f"\n{'case':30s} {'strategy':9s} {'status':7s} {'samples/s':>10s} {'step ms':>8s} {'MFU':>6s} "
          f"{'peak GiB':>9s} {'plan GiB':>9s}")
    for r in rows:
        mfu = f"{100 * r['mfu']:.1f}%" if isinstance(r.get("mfu"), float) else "-"
        print(f"{r['name']:30s} {str(r.get('strategy') or '-'):9s} {r['status']:7s} "
              f"{f(r.get('samples_per_sec'), '10.1f')} {f(r.get('step_ms_median'), '8.1f')} {mfu:>6s} "
              f"{f(r.get('peak_allocated_gib'), '9.2f')} {f((r.get('planner') or {}).get('predicted_peak_gib'), '9.2f')}")
        if r["status"] != "ok":
            print(f"    {r.get('error', '')[:200]}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="shardtrain GPU suite")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, 2 steps per case, one process")
    ap.add_argument("--cases", default=",".join(c[0] for c in CASES), help="comma-separated case names")
    ap.add_argument("--work", default="/tmp/shardtrain-gpu-suite")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "gpu_suite.json"))
    ap.add_argument("--budget-s", type=float, default=450, help="stop starting new cases after this")
    ap.add_argument("--case-timeout-s", type=float, default=240)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    names = a.cases.split(",")
    unknown = set(names) - {c[0] for c in CASES}
    if unknown:
        ap.error(f"unknown case(s) {sorted(unknown)}; cases: {', '.join(c[0] for c in CASES)}")
    work = Path(a.work)
    if a.child:
        return child_main(names, work, a.dry_run, Path(a.child_out))

    work.mkdir(parents=True, exist_ok=True)
    lines = work / "cases.jsonl"
    lines.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    if a.dry_run:
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("DS_ACCELERATOR", "cpu")
    t_start = time.time()
    base = [sys.executable, __file__, "--child", "--work", str(work), "--child-out", str(lines)]
    # One process for every case on CPU (fast); on the GPU one per case: its own peak memory and its own crash.
    batches = [names] if a.dry_run else [[n] for n in names]
    skipped = []
    for batch in batches:
        if time.time() - t_start > a.budget_s:
            skipped += batch
            continue
        cmd = base + ["--cases", ",".join(batch)] + (["--dry-run"] if a.dry_run else [])
        print(f"[gpu_suite] {', '.join(batch)}", flush=True)
        try:
            proc = subprocess.run(cmd, env=env, timeout=a.case_timeout_s * len(batch), cwd=REPO)
            if proc.returncode != 0:
                print(f"[gpu_suite] exit {proc.returncode}: {batch}", flush=True)
        except subprocess.TimeoutExpired:
            print(f"[gpu_suite] timed out: {batch}", flush=True)
    done = {}
    if lines.exists():
        for line in lines.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                done[row["name"]] = row
    rows = []
    for case in [c for c in CASES if c[0] in names]:
        name, group, _, flags = case[:4]
        rows.append(done.get(name) or {"name": name, "group": group, "flags": flags,
                                       "status": "skipped" if name in skipped else "failed",
                                       "error": "time budget spent" if name in skipped else
                                       "the case's process died or timed out before reporting"})
    fusion_mfu = [r["mfu"] for r in rows if r["group"] == "fusion" and isinstance(r.get("mfu"), float)]
    result = {"suite": "gpu", "dry_run": a.dry_run, "environment": environment(),
              "method": "world size 1 per case, fresh process per case (one process in --dry-run); samples/s "
                        "from per-step wall-clock stamps after warm-up; MFU from shardtrain.memory.flops counted "
                        "FLOPs x samples/s / dense bf16 peak; peak = torch.cuda.max_memory_allocated",
              "targets": {"fusion_mfu_min": FUSION_MFU_TARGET,
                          "fusion_mfu_best": max(fusion_mfu) if fusion_mfu else None,
                          "met": (max(fusion_mfu) >= FUSION_MFU_TARGET) if fusion_mfu else None},
              "wall_seconds": time.time() - t_start, "cases": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2, default=str) + "\n")
    print_table(rows)
    print(f"wrote {a.out} in {result['wall_seconds']:.0f} s")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
