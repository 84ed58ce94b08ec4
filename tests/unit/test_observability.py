"""Banner, console progress, library chatter, W&B failure handling, FLOPs, report/compare and parity logic:
everything of observability that needs no process group."""

from __future__ import annotations

import io
import json
import logging
import sys
import types
from pathlib import Path

import pytest

from shardtrain.commands.parity import compare, parse_args_for, parse_strategies
from shardtrain.config.settings import Config, ConfigError
from shardtrain.memory.flops import mfu, peak_flops, train_flops_per_sample
from shardtrain.memory.planner import memory_prediction
from shardtrain.observability.banner import format_banner
from shardtrain.observability.loggers import logged_values
from shardtrain.observability.progress import Progress
from shardtrain.observability.report import write_compare, write_report
from shardtrain.observability.wandb_run import WandbRun

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MIB = 2**20


def run_info(**over) -> dict:
    info = {
        "strategy": "zero3",
        "offload": True,
        "world_size": 2,
        "precision": "bf16",
        "micro_batch_size": 4,
        "grad_accum": 8,
        "global_batch_size": 64,
        "train_examples": 1000,
        "eval_examples": 100,
        "steps_per_epoch": 15,
        "activation_checkpointing": True,
        "params_total": 1234567,
        "params_trainable": 1000000,
        "params_frozen": 234567,
        "max_steps": 30,
        "ranks": [
            {"rank": 0, "host": "node-a", "local_rank": 0, "device": "cuda:0", "device_name": "NVIDIA A100"},
            {"rank": 1, "host": "node-b", "local_rank": 0, "device": "cuda:0", "device_name": "NVIDIA A100"},
        ],
        "strategy_settings": {
            "strategy": "zero3",
            "stage": 3,
            "offload_optimizer": "cpu",
            "recompute_blocks": 12,
            "ds_config": {"zero_optimization": {"stage": 3}},
        },
        "memory_prediction": {"note": "no prediction: test"},
    }
    info.update(over)
    return info


def test_banner_shows_ranks_strategy_batch_arithmetic_and_data():
    text = format_banner(run_info())
    assert "node-a" in text and "node-b" in text and "NVIDIA A100" in text
    assert "micro 4 x accum 8 x world 2 = global 64" in text
    assert "1,234,567 total | 1,000,000 trainable | 234,567 frozen" in text
    assert "stage=3" in text and "offload_optimizer=cpu" in text and '"stage": 3' in text
    assert "15 steps/epoch" in text and "bf16" in text and "(12 blocks)" in text
    assert "no prediction: test" in text


def test_banner_names_the_frozen_modules():
    """A user's banner counted the 183,840 parameters its own build_model() froze, but named none of them: the
    user could not see which layers the run would leave alone."""
    from shardtrain.loop.run_info import frozen_parts

    names = [
        "text.embeddings.word_embeddings.weight",
        "text.embeddings.LayerNorm.weight",
        *(f"text.encoder.layer.{i}.{w}.weight" for i in range(4) for w in ("query", "value")),
        "image.conv1.weight",
        "image.bn1.weight",
        "image.bn1.bias",
        "image.layer1.0.conv1.weight",
        "image.layer2.0.conv1.weight",
        "head.fc.weight",
    ]
    frozen = {n for n in names if n.startswith(("text.embeddings", "image.conv1", "image.bn1", "image.layer1"))}
    frozen |= {f"text.encoder.layer.{i}.{w}.weight" for i in (0, 1, 2) for w in ("query", "value")}
    frozen.add("text.encoder.layer.3.query.weight")  # a part of a block: the parameter's own path
    parts = frozen_parts(names, frozen)
    assert parts == [
        "text.embeddings",
        "text.encoder.layer.0-2",
        "text.encoder.layer.3.query",
        "image.conv1",
        "image.bn1",
        "image.layer1",
    ]
    assert frozen_parts(names, set()) == [] and frozen_parts(names, set(names)) == ["text", "image", "head"]
    text = format_banner(run_info(frozen_parts=parts))
    assert "234,567 frozen (text.embeddings, text.encoder.layer.0-2, text.encoder.layer.3.query, image.conv1, " in text
    many = format_banner(run_info(frozen_parts=[f"m{i}" for i in range(11)]))
    assert "234,567 frozen (m0, m1, m2, m3, m4, m5, m6, m7, +3 more)" in many


def test_banner_says_when_a_step_is_bigger_than_the_training_set():
    """A trial's 512 examples at a global batch of 2,048 read `1 steps/epoch`: each step was four epochs."""
    text = format_banner(run_info(train_examples=512, global_batch_size=2048, steps_per_epoch=1))
    assert "512 train | 100 eval | 1 step = 4.0 epochs (global batch 2,048 > 512 examples) | 30 steps" in text


def test_memory_prediction_falls_back_to_a_note(monkeypatch):
    import shardtrain.memory.planner as planner

    def broken(cfg, world_size, vocab_size, batch_shape, recompute, cuda):
        raise RuntimeError("cannot measure")

    monkeypatch.setattr(planner, "predict_run", broken)
    assert memory_prediction(Config(), 2) == {"note": "no prediction: planner failed (RuntimeError: cannot measure)"}
    monkeypatch.setattr(
        planner,
        "predict_run",
        lambda cfg, n, vocab, shape, recompute, cuda: {"variant": "zero2", "params_gib": 2.5, "activations_gib": 0.25},
    )
    text = format_banner(run_info(memory_prediction=memory_prediction(Config(), 2)))
    assert "variant zero2, params 2.50 GiB, activations 256.0 MiB" in text


def test_plain_progress_lines_have_no_control_characters():
    out = io.StringIO()
    progress = Progress(total=4, initial=0, log_every=2, stream=out, tty=False)
    for step in range(1, 5):
        progress.update(
            {"step": step, "loss": 1.0 / step, "lr": 1e-3, "grad_norm": 0.5, "samples_per_sec": 10.0}, peak_gb=1.5
        )
    lines = out.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == ["2/4", "4/4"]
    assert "peak mem 1.50 GB" in lines[0] and "ETA" in lines[0]
    assert not any(c in out.getvalue() for c in "\r\x1b")


def test_tty_progress_is_a_bar():
    out = io.StringIO()
    progress = Progress(total=3, initial=1, log_every=1, stream=out, tty=True)
    progress.update({"step": 2, "loss": 0.5, "lr": 1e-3, "grad_norm": 0.5, "samples_per_sec": 12.0}, peak_gb=0.25)
    progress.write("a message")
    progress.close()
    text = out.getvalue()
    assert "\r" in text and "2/3" in text and "12.0 samples/s" in text and "a message" in text


def test_chatter_filter_drops_noise_keeps_warnings(capsys):
    from shardtrain.runtime.chatter import _PRINTED_NOISE, _DropNoise, _LineFilter

    f = _DropNoise()
    rec = lambda level, msg: logging.LogRecord("DeepSpeed", level, __file__, 1, msg, None, None)  # noqa: E731
    assert not f.filter(rec(logging.INFO, "Setting ds_accelerator to cpu"))
    assert not f.filter(rec(logging.WARNING, "No CUDA runtime is found, using CUDA_HOME='/usr/local'"))
    assert f.filter(rec(logging.WARNING, "a real problem"))
    out = io.StringIO()
    stream = _LineFilter(out, _PRINTED_NOISE)
    print("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully", file=stream)
    print("kept line", file=stream)
    assert out.getvalue() == "kept line\n"


def test_wandb_missing_or_failing_is_one_warning(monkeypatch, tmp_path):
    warnings = []
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    run = WandbRun(True, warnings.append, tmp_path, None, {})
    run.log(1, {"train/loss": 1.0})
    run.finish({})
    assert len(warnings) == 1 and "not installed" in warnings[0]

    def boom(**kw):
        raise RuntimeError("network is unreachable\nsecond line")

    fake = types.SimpleNamespace(init=boom, Settings=lambda **kw: None)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    warnings.clear()
    run = WandbRun(True, warnings.append, tmp_path, "abc123", {})
    run.log(1, {"train/loss": 1.0})
    assert run.run_id == "abc123" and not run.active
    assert warnings == ["W&B init failed (RuntimeError: network is unreachable); continuing without W&B"]


def test_wandb_log_failure_disables_without_raising(tmp_path):
    warnings = []
    run = WandbRun(False, warnings.append, tmp_path, None, {})

    class Broken:
        def log(self, values):
            raise OSError("disk full")

        def finish(self, exit_code=0):
            pass

    run.run = Broken()
    run.log(3, {"train/loss": 1.0})
    run.log(4, {"train/loss": 1.0})
    assert len(warnings) == 1 and "disk full" in warnings[0] and not run.active


def test_logged_metric_names():
    """The names W&B, TensorBoard and MLflow all plot."""
    values = logged_values(
        {
            "step": 3,
            "loss": 1.0,
            "lr": 0.1,
            "grad_norm": 2.0,
            "skipped_steps": 0,
            "samples_per_sec": 5.0,
            "tokens_per_sec": 50.0,
            "mfu": None,
            "mem": {"0": {"params": MIB, "grads": 2 * MIB}, "1": {"params": MIB}},
        },
        peak_mem_gib=1.5,
    )
    assert values == {
        "train/loss": 1.0,
        "train/lr": 0.1,
        "train/grad_norm": 2.0,
        "train/skipped_steps": 0,
        "perf/samples_per_sec": 5.0,
        "perf/tokens_per_sec": 50.0,
        "mem/rank0/params": 1.0,
        "mem/rank0/grads": 2.0,
        "mem/rank1/params": 1.0,
        "sys/peak_mem_gib": 1.5,
    }


def test_peak_flops_table_and_mfu():
    assert peak_flops("NVIDIA H100 PCIe", "bf16") == 756e12
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989e12
    assert peak_flops("NVIDIA H200", "bf16") == 989e12
    assert peak_flops("NVIDIA A100-SXM4-80GB", "fp32") == 19.5e12
    assert peak_flops("Tesla V100-SXM2-32GB", "bf16") is None  # V100 has no bf16
    assert peak_flops("NVIDIA GeForce GTX 1080", "fp16") is None
    assert mfu(1e12, 100.0, 4, 100e12) == pytest.approx(0.25)
    assert mfu(1e12, 100.0, 4, None) is None


def test_counted_flops_include_the_cnn(tmp_path):
    """Counted on a meta copy: more than 6 x params x tokens because convolutions reuse their weights."""
    import torch
    from torch import nn

    class Tiny(nn.Module):
        batch_keys = ("input_ids", "pixel_values")

        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(100, 16)
            self.conv = nn.Conv2d(3, 8, 3, padding=1)
            self.head = nn.Linear(16 + 8, 3)

        def forward(self, input_ids, pixel_values):
            img = self.conv(pixel_values).mean(dim=(2, 3))
            return self.head(torch.cat([self.emb(input_ids).mean(1), img], dim=-1))

    def factory(on_meta=False):
        if on_meta:
            with torch.device("meta"):
                return Tiny()
        return Tiny()

    batch = {
        "input_ids": torch.zeros(4, 10, dtype=torch.long),
        "pixel_values": torch.zeros(4, 3, 32, 32),
        "labels": torch.zeros(4, dtype=torch.long),
    }
    flops = train_flops_per_sample(factory, batch, trainable_params=sum(p.numel() for p in Tiny().parameters()))
    conv_forward = 2 * 8 * 3 * 9 * 32 * 32
    assert flops >= 3 * conv_forward


def test_the_hf_text_encoder_is_counted_not_estimated():
    """RoBERTa's mask helpers read mask values (no such thing on meta): the count runs without the mask, so the
    fusion model gets its real FLOPs, not the 6 x params x tokens fallback (which is off for a CNN)."""
    import torch

    from shardtrain.builtin_workloads.networks import build_model
    from shardtrain.config.settings import parse_cli

    cfg = parse_cli(["--config", "configs/multimodal_tiny.yaml"])

    def factory(on_meta=False):
        with torch.device("meta" if on_meta else "cpu"):
            return build_model(cfg.model, cfg.data, 1000, load_weights=False)

    params = sum(p.numel() for p in factory().parameters())
    tokens = 16
    batch = {
        "input_ids": torch.ones(2, tokens, dtype=torch.long),
        "attention_mask": torch.ones(2, tokens, dtype=torch.long),
        "pixel_values": torch.zeros(2, 3, 32, 32),
    }
    counted = train_flops_per_sample(factory, batch, trainable_params=params)
    assert counted != 6.0 * params * tokens and counted > 0


def write_fake_run(path: Path, strategy: str, losses, memory: bool = True, rate: float = 50.0) -> Path:
    path.mkdir(parents=True)
    mem = {
        "0": {"params": 4 * MIB, "grads": 4 * MIB, "optimizer": 8 * MIB, "activations": 20 * MIB},
        "1": {"params": 4 * MIB, "grads": 4 * MIB, "optimizer": 8 * MIB, "activations": 21 * MIB},
    }
    with open(path / "metrics.jsonl", "w") as f:
        for i, loss in enumerate(losses, 1):
            rec = {"step": i, "loss": loss, "lr": 1e-3, "grad_norm": 1.0, "samples_per_sec": rate + i}
            if memory and i == 2:
                rec["mem"] = mem
            f.write(json.dumps(rec) + "\n")
    (path / "eval.jsonl").write_text(
        json.dumps({"step": len(losses), "final": True, "accuracy": 0.75, "macro_f1": 0.7, "n_examples": 8}) + "\n"
    )
    (path / "summary.json").write_text(
        json.dumps(
            {
                "run": run_info(strategy=strategy, offload=False),
                "eval": {"accuracy": 0.75, "macro_f1": 0.7},
                "samples_per_sec": rate,
            }
        )
    )
    return path


def test_report_contains_the_runs_numbers_and_valid_pngs(tmp_path):
    run = write_fake_run(tmp_path / "ddp-run", "ddp", [1.1, 0.9, 0.61234])
    html = write_report(run).read_text()
    assert "0.6123" in html and "0.7500" in html and "50.0" in html and "node-b" in html
    assert "37.0" in html  # largest rank: 4 + 4 + 8 + 21 MiB
    for name in ("curves.png", "throughput.png", "memory.png"):
        data = (run / name).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 10_000, name


def test_report_without_memory_records_says_so(tmp_path):
    run = write_fake_run(tmp_path / "r", "fsdp", [1.0, 0.9], memory=False)
    assert "no memory records" in write_report(run).read_text()


def test_compare_table_and_verdict(tmp_path):
    a = write_fake_run(tmp_path / "a", "ddp", [1.0, 0.5], rate=80.0)
    b = write_fake_run(tmp_path / "b", "zero3", [1.0, 0.5001], rate=40.0)
    path, text = write_compare([str(a), str(b)], tmp_path / "cmp")
    assert "fastest: a (ddp, 80.0 samples/s)" in text
    html = path.read_text()
    assert "zero3" in html and "80.0" in html and "0.5001" in html
    assert (tmp_path / "cmp" / "memory.png").stat().st_size > 10_000


def test_report_of_a_missing_dir_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="no such run directory"):
        write_report(tmp_path / "nope")


def test_parity_compare_finds_first_divergence():
    base = {1: {"loss": 1.0, "grad_norm": 2.0}, 2: {"loss": 0.9, "grad_norm": 2.0}, 3: {"loss": 0.8, "grad_norm": 2.0}}
    same = {k: dict(v) for k, v in base.items()}
    off = {1: {"loss": 1.0, "grad_norm": 2.0}, 2: {"loss": 0.9, "grad_norm": 2.0}, 3: {"loss": 0.81, "grad_norm": 2.0}}
    scaled = {k: {"loss": v["loss"], "grad_norm": 2 * v["grad_norm"]} for k, v in base.items()}
    assert compare({"ddp": base, "fsdp": same}, 1e-4, 1e-3)["first_divergence"] is None
    div = compare({"ddp": base, "fsdp": same, "zero2": off}, 1e-4, 1e-3)["first_divergence"]
    assert div["step"] == 3 and div["strategy"] == "zero2"
    assert compare({"ddp": base, "zero3": scaled}, 1e-4, 1e-3)["first_divergence"]["step"] == 1


def test_parity_argument_errors():
    assert parse_strategies("ddp, zero3_offload") == ["ddp", "zero3_offload"]
    with pytest.raises(ConfigError, match="unknown 'zero4'"):
        parse_strategies("ddp,zero4")
    with pytest.raises(ConfigError, match="at least two"):
        parse_strategies("ddp")
    assert parse_args_for(["fsdp=--lr 2e-3"], ["ddp", "fsdp"]) == {"fsdp": ["--lr", "2e-3"]}
    with pytest.raises(ConfigError, match="--args-for"):
        parse_args_for(["zero2=--lr 1"], ["ddp", "fsdp"])
