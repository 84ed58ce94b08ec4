"""A user's workload for the OOM tests (tests/dist/test_oom_points.py), written as users write theirs: its forward
keeps the error it re-raises in a local, as retry helpers and loggers keep the last error. That makes a cycle
(error -> traceback -> this frame -> error) that holds the frame's activations until the garbage collector runs."""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.utils.data import TensorDataset

from shardtrain import Workload


class Net(nn.Module):
    def __init__(self, fits: int):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 512), nn.GELU(), nn.Dropout(0.1))
        self.head = nn.Linear(512, 3)
        self.fits = fits  # the largest micro-batch this "GPU" holds
        self.failed: list[weakref.ref] = []  # the activations of forwards that ran out of memory

    def forward(self, x, labels=None):
        hidden = self.body(x)
        alive = sum(ref() is not None for ref in self.failed)
        if alive:
            raise AssertionError(f"{alive} activation(s) of a forward that ran out of memory still held at its redo")
        if x.shape[0] > self.fits:
            self.failed.append(weakref.ref(hidden))
            failure = None
            try:
                torch.empty(2**50, dtype=torch.uint8, device=x.device)  # the next allocation fails, as on a full GPU
            except RuntimeError as err:
                failure = err
            if failure is not None:
                raise failure
        return self.head(hidden)


class KeepsTheError(Workload):
    def __init__(self, cfg, fits: int = 2):
        super().__init__(cfg, fits=fits)

    def build_model(self):
        return Net(self.args["fits"])

    def datasets(self):
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(64, 16, generator=g), torch.randint(0, 3, (64,), generator=g)
        return TensorDataset(x, y), None

    def collate(self, samples):
        return {"x": torch.stack([s[0] for s in samples]), "labels": torch.stack([s[1] for s in samples])}
