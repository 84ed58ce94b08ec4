"""Every strategy once through the files users run: shardtrain/main.py under torchrun or the deepspeed
launcher, and `python -m shardtrain train --nproc 2` (the demo's path). The broad matrix is test_matrix.py."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from launch import REPO, cli, deepspeed_launcher, tiny_args, torchrun

# (strategy flags, workload, launcher, extra flags): each strategy once, both workloads and both
# checkpointing modes spread over them.
ENTRIES = {
    "ddp": (["--strategy", "ddp"], "longformer", torchrun, ["--activation-checkpointing"]),
    "fsdp_sgo": (
        ["--strategy", "fsdp", "--fsdp-policy", "fsdp_policies/shard_grad_op.yaml"],
        "multimodal",
        torchrun,
        ["--activation-checkpointing"],
    ),
    "zero2_offload": (["--strategy", "zero2_offload"], "longformer", torchrun, []),  # the shipped JSON by name
    "zero3_offload": (["--ds", "ds_configs/zero3_offload.json"], "multimodal", torchrun, []),
    "zero2": (["--ds", "ds_configs/zero2.json"], "multimodal", deepspeed_launcher, []),
    "zero3": (["--ds", "ds_configs/zero3.json"], "longformer", deepspeed_launcher, ["--activation-checkpointing"]),
}
EXPECTED = {
    "ddp": ("ddp", False),
    "fsdp_sgo": ("fsdp", False),
    "zero2_offload": ("zero2", True),
    "zero3_offload": ("zero3", True),
    "zero2": ("zero2", False),
    "zero3": ("zero3", False),
}
STEPS = 3


@pytest.mark.parametrize("entry", ENTRIES)
def test_strategy_through_main_py(entry, data_dirs, tmp_path):
    flags, workload, launcher, extra = ENTRIES[entry]
    out = tmp_path / "run"
    run = launcher(
        tiny_args(
            workload,
            data_dirs[workload],
            out,
            *flags,
            *extra,
            "--max-steps",
            str(STEPS),
            "--max-eval-samples",
            "16",
            "--report",
            "false",
            "--predict-memory",
            "false",
        )
    )
    s = run.summary
    assert (s["strategy"], s["offload"]) == EXPECTED[entry]
    assert s["world_size"] == 2 and s["precision"] == "fp32"
    assert s["global_batch_size"] == s["micro_batch_size"] * s["grad_accum"] * 2
    assert len(s["train_loss"]) == STEPS and all(math.isfinite(x) for x in s["train_loss"])
    assert s["eval"]["n_examples"] == 16 and set(s["eval"]) >= {"accuracy", "macro_f1"}
    assert (s["recompute_blocks"] > 0) == ("--activation-checkpointing" in extra)
    assert {"torch", "deepspeed", "transformers"} <= set(s["versions"])
    rows = run.metrics
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all({"loss", "lr", "grad_norm", "samples_per_sec"} <= set(r) for r in rows)
    assert "Traceback" not in run.output
    # Library chatter stays hidden on every rank (ZeRO-3's reduce_scatter_tensor FutureWarning came every step).
    assert "FutureWarning" not in run.output, run.tail()
    if launcher is deepspeed_launcher:  # its LOCAL_SIZE turns on DeepSpeed's shared-memory all-reduce on CPU
        port = run.cmd[run.cmd.index("--master_port") + 1]
        left = [p.name for p in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*")]
        assert left == [], f"{left}: 66 MiB each, in memory until a reboot"


def test_demo_settings_learn_the_synthetic_data(tmp_path):
    """`make demo`: make-data's default 512/128 examples, multimodal_tiny, FSDP full shard, 2 CPU processes
    started by `python -m shardtrain train --nproc 2`, 60 steps. Chance is 1/3."""
    from shardtrain.data import make_data

    data = make_data("multimodal", tmp_path / "data", n_train=512, n_val=128, seed=0)
    out = tmp_path / "demo"
    run = cli(
        [
            "train",
            "--config",
            str(REPO / "configs/multimodal_tiny.yaml"),
            "--strategy",
            "fsdp",
            "--device",
            "cpu",
            "--nproc",
            "2",
            "--data-dir",
            str(data),
            "--output-dir",
            str(out),
            "--resume",
            "none",
            "--report",
            "false",
            "--predict-memory",
            "false",
        ]
    )
    s = run.summary
    print(
        f"\ndemo: accuracy {s['eval']['accuracy']:.4f}, macro-F1 {s['eval']['macro_f1']:.4f}, "
        f"{s['wall_seconds']:.1f}s, final loss {s['train_loss'][-1]:.4f}"
    )
    assert (s["strategy"], s["sharding"], s["world_size"]) == ("fsdp", "FULL_SHARD", 2)
    assert len(s["train_loss"]) == 60 and s["eval"]["n_examples"] == 128
    assert s["eval"]["accuracy"] >= 0.8, s["eval"]


def test_image_cache_trains_on_the_same_pixels(data_dirs, tmp_path):
    """`shardtrain cache-images` once, then torchrun with --image-cache and 2 loader workers per rank: the same
    losses and gradient norms, bit for bit, as decoding every image (the cache holds exactly what decode_image
    returns; workers read the memory map)."""
    data, cache = data_dirs["multimodal"], tmp_path / "cache"
    made = cli(
        [
            "cache-images",
            "--config",
            str(REPO / "configs/multimodal_tiny.yaml"),
            "--data-dir",
            str(data),
            "--output-dir",
            str(tmp_path / "o"),
            "--image-cache",
            str(cache),
            "--jobs",
            "2",
        ]
    )
    assert f"train with: --image-cache {cache}" in made.output
    runs = [
        torchrun(
            tiny_args(
                "multimodal",
                data,
                tmp_path / name,
                "--strategy",
                "ddp",
                "--max-steps",
                "4",
                "--num-workers",
                "2",
                "--max-eval-samples",
                "16",
                *extra,
            )
        )
        for name, extra in (("decoded", []), ("cached", ["--image-cache", str(cache)]))
    ]
    decoded, cached = ([(r["loss"], r["grad_norm"]) for r in run.metrics] for run in runs)
    assert decoded == cached and len(decoded) == 4
    assert runs[0].summary["eval"] == runs[1].summary["eval"]
    assert f"images from cache {cache}" in runs[1].output and "images from cache" not in runs[0].output
