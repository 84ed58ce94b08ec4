"""Only the loop moves the training stream, so a resumed run draws what an uninterrupted one draws: the
banner's memory prediction, the banner and the tracker, and the model builds the strategies ask for (before the
run, at a resume or mid-run) leave torch's RNG where they found it, and the builds still give the initial weights
a fresh run always had.

The stream the tests hold is an arbitrary one (seed 1234, then some draws), as a resumed run's restored state
is. CUDA's generator is kept the same way (runtime/training_rng.py forks the device in use); this machine has
no GPU, so only the CPU generator is checked here.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from shardtrain.config.settings import parse_cli
from shardtrain.loop.train import make_model_factory
from shardtrain.memory.flops import train_flops_per_sample
from shardtrain.memory.planner import memory_prediction
from shardtrain.observability.tracking import Console, Tracker
from shardtrain.runtime.distributed import DistInfo
from shardtrain.runtime.training_rng import aside, seed_training_stream

REPO = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")


def held_stream() -> torch.Tensor:
    torch.manual_seed(1234)
    torch.rand(17)  # somewhere in the middle of a stream, not at a seed
    return torch.get_rng_state()


class Net(nn.Module):
    batch_keys = ("input_ids",)

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 8)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(8, 3)

    def forward(self, input_ids):
        return self.head(self.drop(self.emb(input_ids)).mean(1))


class UserWorkload:
    """What the loop's model factory needs of a Workload: build_model() and the loads_weights switch."""

    loads_weights = True

    def build_model(self):
        return Net()


def test_the_banners_memory_prediction_leaves_the_stream_alone():
    cfg = parse_cli(
        [
            "--config",
            str(REPO / "configs/multimodal_tiny.yaml"),
            "--max-length",
            "16",
            "--per-device-batch-size",
            "4",
            "--dropout",
            "0.1",
        ]
    )
    before = held_stream()
    prediction = memory_prediction(cfg, 2, 1000)
    assert "activations_gib" in prediction, prediction  # it measured (built and ran models), not a note
    assert torch.equal(torch.get_rng_state(), before)


def test_the_banner_and_the_tracker_leave_the_stream_alone(tmp_path):
    cfg = parse_cli(
        [
            "--config",
            str(REPO / "configs/multimodal_tiny.yaml"),
            "--output-dir",
            str(tmp_path),
            "--max-steps",
            "3",
            "--report",
            "false",
        ]
    )
    dist = DistInfo(rank=0, local_rank=0, world_size=1, device=CPU, backend="gloo")
    factory = make_model_factory(UserWorkload(), seed=42, device=CPU, startup={})
    run_info = {
        "strategy": "ddp",
        "offload": False,
        "world_size": 1,
        "precision": "fp32",
        "micro_batch_size": 2,
        "grad_accum": 1,
        "global_batch_size": 2,
        "train_examples": 8,
        "eval_examples": 0,
        "steps_per_epoch": 4,
        "activation_checkpointing": False,
        "params_total": 10,
        "params_trainable": 10,
        "params_frozen": 0,
        "max_steps": 3,
        "ranks": [{"rank": 0, "host": "here", "local_rank": 0, "device": "cpu"}],
        "strategy_settings": {"strategy": "ddp"},
        "memory_prediction": {"note": "test"},
    }
    before = held_stream()
    tracker = Tracker(cfg, dist, Console(0), tmp_path, 0, run_info, model_factory=factory)  # prints the banner
    batch = {"input_ids": torch.ones(2, 5, dtype=torch.long), "labels": torch.zeros(2, dtype=torch.long)}
    tracker.step(
        {"step": 1, "loss": 1.0, "lr": 1e-3, "grad_norm": 1.0, "samples_per_sec": 2.0, "step_seconds": 1.0}, batch
    )
    # On CUDA the first step also counts FLOPs on a meta copy built by the factory: that call, here on CPU.
    assert train_flops_per_sample(factory, batch, trainable_params=10) > 0
    tracker.finish({})
    assert torch.equal(torch.get_rng_state(), before)


def test_model_builds_keep_the_stream_and_give_the_seeds_initial_weights():
    factory = make_model_factory(UserWorkload(), seed=42, device=CPU, startup={})
    before = held_stream()
    built, again, meta = factory(), factory(load_weights=False), factory(on_meta=True)
    assert torch.equal(torch.get_rng_state(), before)
    assert all(p.is_meta for p in meta.parameters())
    torch.manual_seed(42)  # how a build was seeded before the factory built aside
    reference = Net()
    for name, p in reference.named_parameters():
        assert torch.equal(dict(built.named_parameters())[name], p), name
        assert torch.equal(dict(again.named_parameters())[name], p), name


def test_aside_restores_whatever_ran_inside_and_the_loop_seeds_the_stream():
    before = held_stream()
    with aside(seed=0):
        torch.manual_seed(5)  # even a seed inside
        torch.randn(100)
    assert torch.equal(torch.get_rng_state(), before)
    seed_training_stream(42, CPU)
    first = torch.rand(3)
    torch.manual_seed(42)
    assert torch.equal(first, torch.rand(3))
