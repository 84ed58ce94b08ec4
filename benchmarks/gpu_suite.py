"""The GPU suite: one prepared run on one NVIDIA GPU (~9 minutes at most) -> one JSON file and a printed table.

    bash benchmarks/gpu_suite.sh --out $OUT/gpu_suite.json --work /tmp/gpu-suite   # on a lent GPU machine
    python benchmarks/gpu_suite.py --dry-run --cases ...                             # CPU: tiny shapes (the test)

Cases, all world size 1, random init from known architectures (nothing is downloaded), in this order: first the
paths that have never run anywhere (CUDA-only), then the throughput and memory rows:
- fp16: DDP with torch's GradScaler on CUDA, and DeepSpeed's own fp16 engine (ZeRO-2) - the V100 path, on
  Longformer (DeepSpeed fp16 refuses the BatchNorm model);
- a real CUDA out-of-memory: the case fills the GPU 1 GiB at a time until the allocator fails, gives back all
  but a few GiB, then trains a micro-batch that cannot fit: --oom-recovery must shrink it and finish;
- FSDP2 CPU offload; torch.compile (inductor) on the fusion model;
- fusion: RoBERTa-base + ResNet-50, per-device batch 32, 128 tokens, 224 px: eager; + channels_last (also the
  DDP row of the strategies); longformer: Longformer-base at 4096 tokens, batch 4, with and without activation
  checkpointing; strategies: the fusion model (channels_last) under FSDP2, ZeRO-2 (+ offload), ZeRO-3 (+ offload).
Every case records the planner's whole prediction (model states, activations, communication buffers and overhead:
`shardtrain plan`'s row for the case, less the CUDA context, which no allocator counts) against the peak the
allocator saw over one training step (step 2, after the optimizer state exists: the run's own per-step
monitor), the FLOP count's method, and what CUDA math was on (TF32, cudnn.benchmark).

The cases run shardtrain.loop.train.Trainer(cfg).train() in as few child processes as they can: one runs every case
up to the next that must be alone (the OOM case, which fills the GPU), and after a crash or a case that outruns
--case-timeout-s the driver starts a new one for the cases behind it (--per-case-process: one each). Peak memory is
per case (reset at its start; the run's own monitor measures step 2). The JSON is rewritten after every case, by the
process that ran it, so a crash, a timeout or a hard stop keeps every finished case. Speed is measured as in
overhead.py: from metrics.jsonl's per-step wall-clock stamps after the warm-up steps (compilation and cuDNN
autotuning fall in the warm-up). MFU = counted training FLOPs per sample x samples/s / the GPU's dense peak at
the case's precision (shardtrain.memory.flops table: H100/H200 989, A100 312 TFLOP/s bf16).
"""

from __future__ import annotations

import argparse
import itertools
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
FP16 = ["--precision", "fp16"]
# (name, group, config, flags, steps, warm-up steps excluded from the rate). Never-run paths first (see above).
CASES = [
    ("fp16_ddp_grad_scaler", "fp16", LONGFORMER, ["--strategy", "ddp", *FP16], 12, 4),
    ("fp16_deepspeed_zero2", "fp16", LONGFORMER, ["--ds", str(DS / "zero2.json"), *FP16], 12, 4),
    ("oom_recovery_real", "oom", FUSION, ["--strategy", "ddp", *CL, "--per-device-batch-size", "256"], 6, 2),
    (
        "fsdp_offload",
        "offload",
        FUSION,
        ["--strategy", "fsdp", "--fsdp-policy", str(REPO / "fsdp_policies" / "offload.yaml"), *CL],
        10,
        4,
    ),
    ("fusion_channels_last_compile", "compile", FUSION, ["--strategy", "ddp", *CL, "--compile", "inductor"], 40, 15),
    ("fusion_eager", "fusion", FUSION, ["--strategy", "ddp"], 30, 8),
    ("fusion_channels_last", "fusion", FUSION, ["--strategy", "ddp", *CL], 30, 8),  # also the strategies' DDP row
    ("longformer_4096", "longformer", LONGFORMER, ["--strategy", "ddp"], 12, 4),
    (
        "longformer_4096_ac",
        "longformer",
        LONGFORMER,
        ["--strategy", "ddp", "--activation-checkpointing", "true"],
        12,
        4,
    ),
    ("strategy_fsdp", "strategies", FUSION, ["--strategy", "fsdp", *CL], 20, 6),
    ("strategy_zero2", "strategies", FUSION, ["--ds", str(DS / "zero2.json"), *CL], 20, 6),
    ("strategy_zero2_offload", "strategies", FUSION, ["--ds", str(DS / "zero2_offload.json"), *CL], 10, 4),
    ("strategy_zero3", "strategies", FUSION, ["--ds", str(DS / "zero3.json"), *CL], 20, 6),
    ("strategy_zero3_offload", "strategies", FUSION, ["--ds", str(DS / "zero3_offload.json"), *CL], 10, 4),
    # --profile-steps on CUDA (CPU and CUDA activities, the synchronize before the trace): where a step's time goes.
    ("profile_ddp", "profile", FUSION, ["--strategy", "ddp", *CL, "--profile-steps", "2"], 4, 2),
    ("profile_fsdp", "profile", FUSION, ["--strategy", "fsdp", *CL, "--profile-steps", "2"], 4, 2),  # dry run: 2 steps
    # torchao's AdamW8bit (--optim adamw_8bit, refused on CPU): compiled per parameter shape, a long warm-up. Last:
    # a slow compile must not take the time of the cases above (the JSON keeps every finished case).
    ("optim_adamw_8bit_ddp", "optim", FUSION, ["--strategy", "ddp", *CL, "--optim", "adamw_8bit"], 16, 6),
    ("optim_adamw_8bit_fsdp", "optim", FUSION, ["--strategy", "fsdp", *CL, "--optim", "adamw_8bit"], 16, 6),
]
# Paths a CPU cannot take, with the error the dry run must then record (it checks the case still reaches them).
CPU_EXPECTED_ERRORS = {
    "fp16_deepspeed_zero2": "fp16 is not supported",
    "optim_adamw_8bit_ddp": "adamw_8bit on cpu",
    "optim_adamw_8bit_fsdp": "adamw_8bit on cpu",
}
# The OOM case: free memory left on the GPU once the allocator has failed (model states + a small batch fit).
OOM_HEADROOM_GIB = 8
PREFLIGHT = ("torch", "transformers", "datasets", "deepspeed")
# --dry-run: the same cases and code paths at shapes a CPU runs in seconds. torch.compile traces with the
# "aot_eager" backend there (AOTAutograd as inductor, minus minutes of C++ codegen); the GPU uses inductor.
DRY_FLAGS = [
    "--device",
    "cpu",
    "--text-config",
    json.dumps({"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64}),
    "--per-device-batch-size",
    "2",
    "--eval-batch-size",
    "2",
    "--num-workers",
    "0",
    "--pin-memory",
    "false",
    "--tokenizer-vocab-size",
    "300",
    "--warmup-steps",
    "0",
]
DRY_MODEL = {
    FUSION: [
        "--image-model",
        "resnet18",
        "--image-config",
        json.dumps({"layers": [1, 1, 1, 1]}),
        "--image-size",
        "32",
        "--max-length",
        "16",
        "--fusion-hidden",
        "16",
    ],
    LONGFORMER: ["--attention-window", "16", "--max-length", "64"],
}
FUSION_MFU_TARGET = 0.40


# ---- data: the suite's own synthetic sets, sized so every sequence fills max_length ----------------------
def make_suite_data(work: Path, dry: bool) -> dict[Path, Path]:
    from shardtrain.data import make_data

    mm, ld = work / "data" / "multimodal", work / "data" / "longdoc"
    if not (mm / "train.jsonl").exists():
        # Read through an image cache (`shardtrain cache-images`, below): at 40% MFU an H200 trains ~4000
        # samples/s of this model, more than decoding images every epoch feeds from 16 cores
        # (benchmarks/loader.py). The suite measures the model and the loop; loader.py measures the loader.
        make_data(
            "multimodal",
            mm,
            n_train=64 if dry else 512,
            n_val=8 if dry else 64,
            seed=0,
            overwrite=True,
            image_size=32 if dry else 224,
        )
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
        make_data(
            "longdoc",
            ld,
            n_train=16 if dry else 48,
            n_val=4 if dry else 8,
            seed=0,
            overwrite=True,
            min_words=80 if dry else 4200,
            max_words=100 if dry else 4600,
        )
    return {FUSION: mm, LONGFORMER: ld}


def case_args(case, work: Path, data: dict, dry: bool) -> list[str]:
    name, _, config, flags, steps, _ = case
    # No checkpoint: none of these cases is about one (each would cost a save's time and disk); a short final
    # evaluation (the configs' max_eval_samples) still runs, as in every run.
    args = [
        "--config",
        str(config),
        "--data-dir",
        str(data[config]),
        "--output-dir",
        str(work / "runs" / name),
        "--resume",
        "none",
        "--overwrite-output-dir",
        "true",
        "--max-steps",
        str(2 if dry else steps),
        "--eval-every",
        "0",
        "--save-final",
        "false",
        *flags,
    ]
    if config == FUSION:
        args += ["--image-cache", str(data[config] / "cache")]
    if dry:
        args += DRY_FLAGS + DRY_MODEL[config]
        args = ["aot_eager" if a == "inductor" else a for a in args]
        if name == "oom_recovery_real":
            # No CUDA allocator to fill: the test-only injection raises a real torch.OutOfMemoryError instead
            # (above micro-batch 2: at 1 the tiny ResNet's BatchNorm would see one value per channel).
            args += ["--per-device-batch-size", "4", "--inject-oom-above", "2"]
    return args


# ---- one case, in this process ----------------------------------------------------------------------------
def planner_prediction(cfg, cuda: bool | None = None) -> dict:
    """`shardtrain plan`'s whole row for this case (model states, activations, communication buffers, overhead)
    at world size 1, without the CUDA context (the allocator's peak does not see it). `cuda`: activations as
    CUDA's kernels save them (memory/planner.py _kernels_of); None: where the case trains."""
    from shardtrain.memory.planner import CUDA_CONTEXT, GIB, plan, variant_of

    cuda = cfg.parallel.device == "cuda" if cuda is None else cuda
    try:
        p = plan(cfg, 1, float("inf"), cuda=cuda)
        variant = variant_of(cfg)
        row = next(
            r
            for r in p["rows"]
            if r["variant"] == variant and r["activation_checkpointing"] == cfg.train.activation_checkpointing
        )
    except Exception as e:  # noqa: BLE001 - a prediction that fails is a finding, not a failed case
        return {"predicted_peak_gib": None, "note": f"planner failed: {type(e).__name__}: {str(e)[:200]}"}
    context = CUDA_CONTEXT if cuda else 0.0
    parts = {**row["gpu_bytes"], "overhead": row["gpu_bytes"]["overhead"] - context}
    return {
        "predicted_peak_gib": (row["total_bytes"] - context) / GIB,
        "variant": variant,
        "parts_gib": {k: v / GIB for k, v in parts.items()},
        "note": "shardtrain plan's total for the case's variant: params + grads + optimizer + activations + "
        "comm + overhead, CUDA context left out",
    }


def flops_per_sample(cfg) -> tuple[float | None, str]:
    import torch

    from shardtrain.builtin_workloads.networks import build_model
    from shardtrain.memory import flops

    def factory(on_meta=True):
        with torch.device("meta"):
            return build_model(cfg.model, cfg.data, cfg.data.tokenizer_vocab_size, load_weights=False)

    m, d = cfg.model, cfg.data
    length = d.max_length + (-d.max_length % m.attention_window if m.name == "longformer" else 0)
    batch = {
        "input_ids": torch.ones(1, length, dtype=torch.long),
        "attention_mask": torch.ones(1, length, dtype=torch.long),
    }
    if m.name == "multimodal":
        batch["pixel_values"] = torch.zeros(1, 3, d.image_size, d.image_size)
    trainable = sum(p.numel() for p in factory().parameters())
    return flops.counted_train_flops(factory, batch, trainable)


def steady_rate(metrics_path: Path, global_batch: int, warmup: int) -> dict:
    stamps = [json.loads(line)["wall_time"] for line in metrics_path.read_text().splitlines() if line.strip()]
    kept = stamps[max(0, min(warmup, len(stamps) - 2)) :]
    periods = [b - a for a, b in zip(kept, kept[1:])]
    if not periods:  # the run stopped before a second step (e.g. a preemption signal)
        return {"samples_per_sec": None, "step_ms_median": None, "steps_timed": 0}
    return {
        "samples_per_sec": global_batch * len(periods) / (kept[-1] - kept[0]),
        "step_ms_median": 1000 * statistics.median(periods),
        "steps_timed": len(periods),
    }


def fill_gpu(headroom_gib: float) -> dict:
    """A real CUDA out-of-memory: allocate 1 GiB blocks until the allocator fails, then give back all but
    `headroom_gib` of what was free. Returns the blocks still held (freed when the case's process exits)."""
    import torch

    blocks, gib = [], 2**30
    try:
        while True:
            blocks.append(torch.empty(gib, dtype=torch.uint8, device="cuda"))
    except torch.OutOfMemoryError as e:
        first_line = str(e).splitlines()[0][:200]
    filled = len(blocks)
    del blocks[max(0, filled - int(headroom_gib)) :]
    torch.cuda.empty_cache()
    return {"filled_gib_at_oom": filled, "oom_error": first_line, "left_free_gib": headroom_gib, "_blocks": blocks}


def run_case_here(case, args: list[str], dry: bool) -> dict:
    import torch

    from shardtrain.config.settings import parse_cli
    from shardtrain.loop.train import Trainer
    from shardtrain.memory.accounting import peak_rss_bytes
    from shardtrain.memory.flops import mfu, peak_flops

    name, group, _, flags, steps, warmup = case
    cfg = parse_cli(args)
    row = {
        "name": name,
        "group": group,
        "flags": flags,
        "strategy": None,
        "offload": None,
        "activation_checkpointing": cfg.train.activation_checkpointing,
        "compile": cfg.train.compile,
        "channels_last": cfg.model.channels_last,
        "precision": cfg.train.precision,
        "per_device_batch_size": cfg.train.per_device_batch_size,
        "max_length": cfg.data.max_length,
    }
    cuda = cfg.parallel.device == "cuda"
    held = None
    if name == "oom_recovery_real" and cuda:
        held = fill_gpu(OOM_HEADROOM_GIB)
        row["oom_fill"] = {k: v for k, v in held.items() if not k.startswith("_")}
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    summary = Trainer(cfg).train()
    row["wall_seconds"] = time.time() - t0
    # Where the case's time went before its first step (seconds from Trainer entry): the suite's budget is
    # spent mostly outside the timed steps, and a user's job pays the same start-up.
    entry = (summary.get("startup") or {}).get("train_entry")
    row["startup_seconds"] = {
        k: (v - entry if k != "model_build_seconds" else v)
        for k, v in (summary.get("startup") or {}).items()
        if entry is not None and k != "train_entry"
    }
    filled, held = held is not None, None  # the ballast goes back before anything else is measured
    row.update(
        {
            "strategy": summary.get("strategy"),
            "offload": summary.get("offload"),
            "params_total": summary.get("params_total"),
            "cuda_math": summary.get("cuda_math"),
            "skipped_steps": summary.get("skipped_steps"),
            "final_step": summary.get("final_step"),
            "strategy_settings": {
                k: v for k, v in (summary.get("strategy_settings") or {}).items() if k != "ds_config"
            },
        }
    )
    if name == "oom_recovery_real":
        row["oom_recovery"] = summary.get("oom_recovery")
        # The run's geometry, not the config's: the config keeps what the flags asked for.
        row["micro_batch_after_recovery"] = summary["resolved"]["batch_geometry"]["micro_batch_size"]
    if summary.get("profile"):
        row["profile"] = summary["profile"]  # each rank's step split into parts (observability/step_profile.py)
    global_batch = summary.get("global_batch_size") or cfg.train.per_device_batch_size
    rate = steady_rate(Path(cfg.checkpoint.output_dir) / "metrics.jsonl", global_batch, 0 if dry else warmup)
    row.update(rate)
    t_post = time.time()
    row["flops_per_sample"], row["flops_method"] = flops_per_sample(cfg)
    device_name = torch.cuda.get_device_name() if cuda else "cpu"
    peak = peak_flops(device_name, cfg.train.precision) if cuda else None
    row["mfu"] = mfu(row["flops_per_sample"], rate["samples_per_sec"], 1, peak) if rate["samples_per_sec"] else None
    gib = 2**30
    row["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / gib if cuda else None  # the whole case
    row["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / gib if cuda else None
    per_step = ((summary.get("memory") or {}).get("per_rank") or {}).get("0") or {}
    row["step_peak_allocated_gib"] = per_step["after_step/peak"] / gib if "after_step/peak" in per_step else None
    row["step_measured"] = (summary.get("memory") or {}).get("step")
    row["peak_host_rss_gib"] = peak_rss_bytes() / gib
    row["planner"] = planner_prediction(cfg)
    row["after_train_seconds"] = time.time() - t_post  # the FLOP count and the planner's row, not the run
    if filled:  # the ballast is in every allocator figure of this case: no comparison
        row["planner"]["note"] = "not compared: the case holds the GPU filled to its headroom"
        row["step_peak_allocated_gib"] = None
    pred, seen = row["planner"]["predicted_peak_gib"], row["step_peak_allocated_gib"]
    row["planner_error"] = (pred - seen) / seen if pred is not None and seen else None
    row["status"] = "ok"
    return row


def failed_row(case, e: BaseException) -> dict:
    err = f"{type(e).__name__}: {str(e).strip()[:500]}"
    expected = CPU_EXPECTED_ERRORS.get(case[0])
    return {
        "name": case[0],
        "group": case[1],
        "flags": case[3],
        "error": err,
        "status": "cpu_expected_error" if expected and expected in err else "failed",
    }


def child_main(names: list[str], work: Path, dry: bool, lines: Path, out: Path, meta: dict) -> int:
    """Runs the named cases in this process: after each, its JSON line goes to `lines` and the whole result file
    `out` is rewritten, failures included."""
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"})
    if "MASTER_PORT" not in os.environ:
        from shardtrain.runtime.distributed import free_port

        os.environ["MASTER_PORT"] = str(free_port())
    data = make_suite_data(work, dry)
    deadline = meta["started_at"] + meta["budget_s"]
    for case in [c for n in names for c in CASES if c[0] == n]:  # in --cases' order
        if time.time() > deadline:
            break  # the driver records the rest as skipped
        print(f"[gpu_suite] {case[0]}: starting", flush=True)
        # The driver reads this to stop a case that outruns --case-timeout-s, and to name a case this process died in.
        (work / RUNNING).write_text(json.dumps({"name": case[0], "started": time.time()}))
        if os.environ.get("GPU_SUITE_TEST_DIE_IN") == case[0]:
            os._exit(9)  # test-only: the process dies inside a case, as a CUDA fault or the OOM killer would
        try:
            row = run_case_here(case, case_args(case, work, data, dry), dry)
        except BaseException as e:  # noqa: BLE001 - one failed case must not lose the others' results
            if isinstance(e, KeyboardInterrupt):
                raise
            row = failed_row(case, e)
            traceback.print_exc()
        with open(lines, "a") as f:
            f.write(json.dumps(row, default=str) + "\n")
        write_result(out, meta, lines)
        print(f"[gpu_suite] {case[0]}: {row['status']}", flush=True)
    from shardtrain.runtime.distributed import teardown_and_exit

    teardown_and_exit(0)
    return 0


# ---- the result file, rewritten after every case -------------------------------------------------------------
def read_rows(lines: Path) -> dict[str, dict]:
    done = {}
    if lines.exists():
        for line in lines.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                done[row["name"]] = row
    return done


def note_unreported(lines: Path, names: list[str], status: str, error: str) -> None:
    """Cases whose process died, timed out or never started: a row in `lines` like a finished case's, so every
    later rewrite of the result (by any process) keeps it."""
    done = read_rows(lines)
    with open(lines, "a") as f:
        for case in [c for c in CASES if c[0] in names and c[0] not in done]:
            f.write(
                json.dumps({"name": case[0], "group": case[1], "flags": case[3], "status": status, "error": error})
                + "\n"
            )


def write_result(out: Path, meta: dict, lines: Path, complete: bool = False) -> dict:
    """The JSON as it stands: every reported case, the others pending. Written to a temporary file and renamed,
    so a kill mid-write leaves the previous version whole."""
    done = read_rows(lines)
    rows = []
    for case in [c for c in CASES if c[0] in meta["cases"]]:
        name, group, _, flags = case[:4]
        rows.append(done.get(name) or {"name": name, "group": group, "flags": flags, "status": "pending"})
    fusion_mfu = [r["mfu"] for r in rows if r["group"] in ("fusion", "compile") and isinstance(r.get("mfu"), float)]
    result = {
        **{k: v for k, v in meta.items() if k != "cases"},
        "complete": complete,
        "targets": {
            "fusion_mfu_min": FUSION_MFU_TARGET,
            "fusion_mfu_best": max(fusion_mfu) if fusion_mfu else None,
            "met": (max(fusion_mfu) >= FUSION_MFU_TARGET) if fusion_mfu else None,
        },
        "wall_seconds": time.time() - meta["started_at"],
        "cases": rows,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=2, default=str) + "\n")
    os.replace(tmp, out)
    return result


# ---- the driver ----------------------------------------------------------------------------------------------
def preflight() -> str | None:
    """Import what the cases need before any case runs: one line naming the package that is missing (and
    what it lacked), or None."""
    import importlib

    for name in PREFLIGHT:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - an import can fail with anything (a missing dependency's error)
            return (
                f"preflight: cannot import {name} ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                f"carry its wheels in .whl/ (docs/performance.md, 'GPU suite')"
            )
    return None


def environment() -> dict:
    import torch

    from shardtrain.observability.tracking import library_versions

    env = {
        "versions": library_versions(),
        "cuda_available": torch.cuda.is_available(),
        "ds_accelerator": os.environ.get("DS_ACCELERATOR"),
    }
    if torch.cuda.is_available():
        from shardtrain.memory.flops import peak_flops

        name = torch.cuda.get_device_name()
        env.update(
            {
                "gpu": name,
                "gpu_memory_gib": torch.cuda.get_device_properties(0).total_memory / 2**30,
                "peak_bf16_flops": peak_flops(name, "bf16"),
            }
        )
    return env


def child_env(dry: bool, base: dict | None = None) -> dict:
    """The cases' environment. DS_ACCELERATOR=cpu is for the CPU dry run alone: inherited by a GPU run (the
    Makefile's CPU targets, a shell) it would put DeepSpeed on its CPU accelerator beside CUDA."""
    env = dict(os.environ if base is None else base)
    env.update(
        {
            "PYTHONPATH": str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
        }
    )
    if dry:
        env.setdefault("OMP_NUM_THREADS", "1")
        env["DS_ACCELERATOR"] = "cpu"
    elif env.get("DS_ACCELERATOR") == "cpu":
        print(
            "[gpu_suite] DS_ACCELERATOR=cpu is set in this shell: dropped for the GPU cases (DeepSpeed finds "
            "CUDA itself)",
            flush=True,
        )
        del env["DS_ACCELERATOR"]
    return env


def print_table(rows: list[dict]) -> None:
    def f(v, fmt):
        return format(v, fmt) if isinstance(v, (int, float)) and v is not None else "-"

    print(
        f"\n{'case':30s} {'strategy':9s} {'status':7s} {'samples/s':>10s} {'step ms':>8s} {'MFU':>6s} "
        f"{'step GiB':>9s} {'plan GiB':>9s}"
    )
    for r in rows:
        mfu = f"{100 * r['mfu']:.1f}%" if isinstance(r.get("mfu"), float) else "-"
        print(
            f"{r['name']:30s} {str(r.get('strategy') or '-'):9s} {r['status']:7s} "
            f"{f(r.get('samples_per_sec'), '10.1f')} {f(r.get('step_ms_median'), '8.1f')} {mfu:>6s} "
            f"{f(r.get('step_peak_allocated_gib'), '9.2f')} "
            f"{f((r.get('planner') or {}).get('predicted_peak_gib'), '9.2f')}"
        )
        if r["status"] not in ("ok",) and r.get("error"):
            print(f"    {r['error'][:200]}")


RUNNING = "running.json"
# Cases that run in a process of their own: the OOM case fills the GPU with ballast, and what it leaves in the
# allocator must not reach another case's figures.
ISOLATED = {"oom_recovery_real"}


def next_batch(pending: list[str], dry: bool, per_case: bool) -> list[str]:
    """The cases the next child process runs: the next case alone where it must be (or --per-case-process), else
    every pending case up to the next isolated one. On the H200 a process's first case took ~60 s of start-up and
    bookkeeping and each later one ~10 s, so one process per case fitted a third of the cases in a call."""
    alone = set() if dry else ISOLATED  # the dry run's OOM case holds no ballast
    if per_case or pending[0] in alone:
        return pending[:1]
    return list(itertools.takewhile(lambda name: name not in alone, pending))


def watch_child(proc: subprocess.Popen, work: Path, case_timeout_s: float) -> bool:
    """Waits for the child; kills it (True) when its current case has run longer than `case_timeout_s`."""
    while proc.poll() is None:
        try:
            started = json.loads((work / RUNNING).read_text())["started"]
        except (OSError, ValueError, KeyError):
            started = None
        if started is not None and time.time() - started > case_timeout_s:
            proc.kill()
            proc.wait()
            return True
        time.sleep(0.5)
    return False


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="shardtrain GPU suite")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, 2 steps per case")
    ap.add_argument("--cases", default=",".join(c[0] for c in CASES), help="comma-separated case names")
    ap.add_argument("--work", required=True, help="data and runs (e.g. /tmp/gpu-suite on the GPU machine)")
    ap.add_argument(
        "--out",
        required=True,
        help="the result JSON, rewritten after every case (e.g. $OUT/gpu_suite.json on a lent machine)",
    )
    ap.add_argument("--budget-s", type=float, default=300, help="no case starts after this many seconds")
    ap.add_argument("--case-timeout-s", type=float, default=240, help="a case's process is stopped after this")
    ap.add_argument(
        "--per-case-process",
        action="store_true",
        help="a process per case (default: the cases share one, started again after a crash or a timeout)",
    )
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child-meta", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    names = a.cases.split(",")
    unknown = set(names) - {c[0] for c in CASES}
    if unknown:
        ap.error(f"unknown case(s) {sorted(unknown)}; cases: {', '.join(c[0] for c in CASES)}")
    if len(set(names)) != len(names):
        ap.error(f"--cases names a case twice: {a.cases}")
    work, out = Path(a.work), Path(a.out)
    lines = work / "cases.jsonl"
    if a.child:
        return child_main(names, work, a.dry_run, lines, out, json.loads(a.child_meta))

    work.mkdir(parents=True, exist_ok=True)
    lines.unlink(missing_ok=True)
    t_start = time.time()
    meta = {
        "suite": "gpu",
        "dry_run": a.dry_run,
        "started_at": t_start,
        "budget_s": a.budget_s,
        "case_timeout_s": a.case_timeout_s,
        "cases": names,
        "method": "world size 1 per case, cases sharing a process (a new one after a crash or timeout); samples/s "
        "from per-step wall-clock stamps after warm-up; MFU from shardtrain.memory.flops counted "
        "FLOPs x samples/s / dense peak at the case's precision; step peak = the run's own "
        "torch.cuda.max_memory_allocated over step 2, against shardtrain plan's total for the case",
    }
    failure = preflight()
    if failure is None:
        meta["environment"] = environment()
    else:
        meta["preflight_error"] = failure
    write_result(out, meta, lines)
    if failure:
        print(f"gpu_suite: {failure}", file=sys.stderr)
        return 3
    env = child_env(a.dry_run)
    base = [
        sys.executable,
        __file__,
        "--child",
        "--work",
        str(work),
        "--out",
        str(out),
        "--child-meta",
        json.dumps(meta),
    ]
    pending = list(names)
    while pending:
        batch = next_batch(pending, a.dry_run, a.per_case_process)
        if time.time() - t_start > a.budget_s:
            note_unreported(lines, pending, "skipped", f"time budget spent (--budget-s {a.budget_s:g})")
            break
        print(f"[gpu_suite] {', '.join(batch)}", flush=True)
        (work / RUNNING).unlink(missing_ok=True)
        proc = subprocess.Popen(
            base + ["--cases", ",".join(batch)] + (["--dry-run"] if a.dry_run else []), env=env, cwd=REPO
        )
        stopped = watch_child(proc, work, a.case_timeout_s)
        running = json.loads((work / RUNNING).read_text())["name"] if (work / RUNNING).exists() else None
        unreported = running is not None and running not in read_rows(lines)
        if stopped:
            print(f"[gpu_suite] timed out: {running}", flush=True)
            note_unreported(lines, [running], "timed_out", f"stopped after --case-timeout-s {a.case_timeout_s:g}")
        elif proc.returncode != 0 and unreported:
            print(f"[gpu_suite] exit {proc.returncode} in {running}", flush=True)
            note_unreported(
                lines, [running], "died", f"the case's process exited {proc.returncode} inside it (its output is above)"
            )
        write_result(out, meta, lines)
        done = read_rows(lines)
        # A new process for what is left: after a crash or a timeout the cases behind it still run.
        pending = [n for n in pending if n not in done]
        if pending and not any(n in done for n in batch) and time.time() - t_start <= a.budget_s:
            # The process ended before any case of its batch (its start-up failed): not again for the same case.
            note_unreported(lines, pending[:1], "died", f"its process exited {proc.returncode} before starting it")
            write_result(out, meta, lines)
            pending = pending[1:]
    result = write_result(out, meta, lines, complete=True)
    print_table(result["cases"])
    print(f"wrote {out} in {result['wall_seconds']:.0f} s")
    return 0 if all(r["status"] in ("ok", "cpu_expected_error") for r in result["cases"]) else 1


if __name__ == "__main__":
    sys.exit(main())
