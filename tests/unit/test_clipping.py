"""Gradient clipping from the loop's one all-reduce: the norm's shares ride on step_health.agree, and clip_to
scales as torch.nn.utils.clip_grad_norm_ does, without a collective or a host sync of its own."""

import math

import pytest
import torch

from shardtrain.loop.step_health import agree
from shardtrain.runtime.distributed import DistInfo
from shardtrain.strategies.base import clip_to, local_grads, squared_norm

INFO = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend="gloo")


def model_with_grads(scale: float) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    model[0].bias.requires_grad_(False)  # a frozen parameter has no gradient and no share
    (model(torch.randn(4, 8)).sum() * scale).backward()
    return model


@pytest.mark.parametrize("scale", [1e-3, 1e3])  # below and above max_norm
def test_clip_from_the_agreed_norm_matches_torch(scale):
    ours, ref = model_with_grads(scale), model_with_grads(scale)
    agreed = agree(torch.tensor(0.5), 1, False, False, INFO, squared_norm(local_grads(ours.parameters()), INFO.device))
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0, foreach=True)
    assert agreed.grad_norm == pytest.approx(float(want), rel=1e-6)
    clip_to(ours.parameters(), 1.0, agreed.grad_norm)
    for a, b in zip(ours.parameters(), ref.parameters()):
        assert (a.grad is None) == (b.grad is None)
        if a.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0)


def test_non_finite_gradients_give_a_non_finite_norm_and_no_share_gives_none():
    model = model_with_grads(1.0)
    model[2].weight.grad[0, 0] = float("inf")
    agreed = agree(torch.tensor(0.5), 1, False, False, INFO, squared_norm(local_grads(model.parameters()), INFO.device))
    assert not math.isfinite(agreed.grad_norm) and agreed.finite  # the loss was fine: the norm decides the skip
    assert agree(torch.tensor(0.5), 1, False, False, INFO).grad_norm is None  # DeepSpeed: its own norm
    assert squared_norm([], INFO.device).item() == 0.0
