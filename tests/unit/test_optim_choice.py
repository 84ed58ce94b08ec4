"""--optim: HF's four choices where they can work, one line naming the reason where they cannot, and the
optimizer state each keeps (what `plan` counts)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardtrain.config.settings import ConfigError, parse_cli
from shardtrain.runtime.distributed import DistInfo
from shardtrain.strategies.optim import build_optimizer, optim_state_bytes, param_groups

TINY = ["--config", "configs/multimodal_tiny.yaml"]
CPU = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend="gloo")


@pytest.mark.parametrize(
    "optim,cls",
    [("adamw", "AdamW"), ("sgd", "SGD"), ("adafactor", "Adafactor"), ("adamw_8bit", "AdamW8bit")],
)
def test_each_choice_builds_its_optimizer_with_the_groups_weight_decay(optim, cls):
    cfg = parse_cli([*TINY, "--optim", optim, "--lr", "1e-3", "--weight-decay", "0.05"])
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    opt = build_optimizer(param_groups(model.named_parameters(), 0.05, set()), cfg.train, CPU.device)
    assert type(opt).__name__ == cls
    assert [g["weight_decay"] for g in opt.param_groups] == [0.05, 0.0]
    assert all(g["lr"] == 1e-3 for g in opt.param_groups)


CUDA = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cuda"), backend="nccl")


@pytest.mark.parametrize(
    "flags,optim,device,why",
    [
        (["--strategy", "fsdp"], "adafactor", CPU, "does not work under fsdp: transformers' Adafactor"),
        (["--ds", "ds_configs/zero2.json"], "adafactor", CPU, "does not work under zero: DeepSpeed hands"),
        # nothing touches the GPU before the refusal: this runs without one
        (["--ds", "ds_configs/zero3.json"], "adamw_8bit", CUDA, "does not work under zero: its 8-bit moments"),
        (["--strategy", "ddp"], "adamw_8bit", CPU, "on cpu: torchao's AdamW8bit compiles"),
    ],
)
def test_a_choice_a_strategy_cannot_run_is_one_line_before_anything_is_built(flags, optim, device, why):
    from shardtrain.strategies import make_strategy

    cfg = parse_cli([*TINY, *flags, "--optim", optim])
    with pytest.raises(ConfigError) as e:
        make_strategy(cfg, device)
    line = str(e.value)
    assert line.startswith(f"--optim (train.optim) {optim} ") and why in line, line
    assert "\n" not in line


def test_a_resume_under_another_optimizer_is_refused_in_one_line():
    from shardtrain.loop.resume_changes import resume_changes

    cfg = parse_cli([*TINY, "--optim", "sgd"])
    with pytest.raises(ConfigError, match=r"trained with adamw.*resume with --optim adamw"):
        resume_changes({"step": 4, "config": {"train": {}}}, cfg, 1)  # a checkpoint from before --optim
    resume_changes({"step": 4, "config": {"train": {"optim": "sgd"}}}, cfg, 1)


def test_the_state_bytes_per_optimizer():
    shapes = [(64, 32), (32,)]
    n = 64 * 32 + 32
    assert optim_state_bytes("adamw", shapes) == 8 * n
    assert optim_state_bytes("sgd", shapes) == 0
    assert optim_state_bytes("adamw_8bit", shapes) == int(n * (2 + 8 / 256))
    assert optim_state_bytes("adafactor", shapes) == 4 * (64 + 32) + 4 * 32  # a row and a column; the vector whole


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torchao's AdamW8bit compiles its update: CUDA runs only")
def test_the_8bit_state_is_what_optim_state_bytes_counts():
    cfg = parse_cli([*TINY, "--optim", "adamw_8bit"])
    model = nn.Linear(512, 512, bias=False)
    model = model.cuda()
    opt = build_optimizer(param_groups(model.named_parameters(), 0.0, set()), cfg.train, CUDA.device)
    model(torch.randn(2, 512, device="cuda")).sum().backward()
    opt.step()
    state = opt.state[model.weight]

    def nbytes(t):
        inner = [getattr(t, a) for a in t.__tensor_flatten__()[0]] if hasattr(t, "__tensor_flatten__") else [t]
        return sum(x.numel() * x.element_size() for x in inner)

    measured = nbytes(state["exp_avg"]) + nbytes(state["exp_avg_sq"])
    assert measured == pytest.approx(optim_state_bytes("adamw_8bit", [(512, 512)]), rel=0.01)


def test_plan_counts_each_optimizers_state():
    from shardtrain.memory.planner import count_model, model_states

    states = {}
    for optim in ("adamw", "adamw_8bit", "sgd"):
        cfg = parse_cli([*TINY, "--optim", optim])
        m = count_model(cfg)
        states[optim] = {v: model_states(v, m, 2, "fp32")["gpu"]["optimizer"] for v in ("ddp", "fsdp", "zero2")}
        trained = m.params - m.frozen
    assert states["adamw"]["ddp"] == 8 * trained and states["adamw"]["fsdp"] == 4 * trained
    assert states["adamw_8bit"]["ddp"] == pytest.approx(trained * (2 + 8 / 256), rel=1e-6)
    assert states["sgd"]["ddp"] == 0 and states["sgd"]["zero2"] == 4 * trained / 2  # ZeRO's fp32 master alone
