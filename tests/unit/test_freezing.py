"""Freezing under DDP and FSDP2, through the strategies' own setup/backward/step/set_frozen: a frozen parameter has
requires_grad False, no .grad and no optimizer state, and its weight does not move, until set_frozen(..., False)
(unfreeze_at_step); then it gets all three. The FSDP unit here mixes frozen and trainable parameters, so freezing
must work inside one sharded unit. What build_model itself returned frozen (the second Block's upper layer, frozen
by hand as users freeze a pretrained part) stays frozen throughout, unfreeze included, though --freeze-layers names
part of it too. One process, world size 1, in a subprocess of its own (a process group is global state)."""

from __future__ import annotations

import json
import subprocess
import sys

from launch import REPO, free_port, test_env

SCRIPT = r"""
import json, math, sys
import torch, torch.distributed as dist
from torch import nn
from shardtrain.config.settings import Config, replace_fields
from shardtrain.runtime.distributed import DistInfo
from shardtrain.strategies.ddp import DDPStrategy
from shardtrain.strategies.fsdp import FSDPStrategy
from shardtrain.workloads.base import Workload

dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=0, world_size=1)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lower, self.upper = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.upper(torch.relu(self.lower(x)))


class Blocks(Workload):
    def build_model(self):
        model = nn.Sequential(Block(), Block(), nn.Linear(8, 3))
        for p in model[1].upper.parameters():
            p.requires_grad = False
        return model

    def block_classes(self):
        return (Block,)


FROZEN = {"0.lower.weight", "0.lower.bias", "1.upper.weight"}  # half of the first FSDP unit, and one user-frozen
out = {}
for cls in (DDPStrategy, FSDPStrategy):
    cfg = Config()
    cfg = replace_fields(cfg, freeze_layers=1, unfreeze_at_step=1)
    cfg = replace_fields(cfg, warmup_steps=0)
    info = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend="gloo")
    s = cls(cfg, info, Blocks(cfg))
    def build(on_meta=False, load_weights=True):
        torch.manual_seed(0)
        if on_meta:
            with torch.device("meta"):
                return Blocks(cfg).build_model()
        return Blocks(cfg).build_model()
    s.setup(build, FROZEN)
    s.train()
    params = dict(s.named_parameters())
    def full(p):
        return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
    def one_step():
        before = {n: full(p) for n, p in params.items()}
        x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
        with s.micro_step(is_last=True):
            loss = nn.functional.cross_entropy(s.model({"input": x}), y)  # the batch, as the loop passes it
            s.backward(loss)
        grads = {n: p.grad is not None for n, p in params.items()}
        norm = float(s.grad_norm_share().sqrt())
        s.step(grad_norm=norm)
        return {"requires_grad": {n: p.requires_grad for n, p in params.items()}, "grad": grads,
                "state": {n: bool(s.optimizer.state.get(p)) for n, p in params.items()},
                "moved": {n: not torch.equal(before[n], full(p)) for n, p in params.items()}}
    rec = {"frozen": [one_step(), one_step()], "user_frozen": sorted(s.user_frozen)}
    s.set_frozen(FROZEN, False)
    params = dict(s.named_parameters())
    rec["unfrozen"] = [one_step(), one_step()]
    if cls is FSDPStrategy:
        rec["units"] = s.unit_count
    out[cls.name] = rec
print("RESULT " + json.dumps(out))
dist.destroy_process_group()
"""


def test_frozen_parameters_have_no_grad_or_optimizer_state_until_unfrozen_ddp_and_fsdp():
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(free_port())],
        cwd=REPO,
        env=test_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    result = json.loads(line[len("RESULT ") :])
    frozen = {"0.lower.weight", "0.lower.bias"}
    user = {"1.upper.weight", "1.upper.bias"}
    for name, rec in result.items():
        assert set(rec["user_frozen"]) == user, rec["user_frozen"]
        for phase, steps in (("frozen", rec["frozen"]), ("unfrozen", rec["unfrozen"])):
            for i, step in enumerate(steps):
                for key in ("requires_grad", "grad", "state", "moved"):
                    names = set(step[key])
                    assert len(names) == 10, (name, names)
                    held = {n for n in names if step[key][n]}
                    want = names - user - (frozen if phase == "frozen" else set())
                    assert held == want, (name, phase, i, key, sorted(held ^ want))
    assert result["fsdp"]["units"] == 2  # the two Blocks: each mixes frozen and trainable parameters
