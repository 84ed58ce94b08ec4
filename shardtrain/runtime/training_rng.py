"""The training stream's random numbers, and how everything else keeps off them.

The training stream is torch's CPU generator and the CUDA generator of the device this process trains on: dropout
draws from them, so an exact resume needs them exactly where the uninterrupted run had them. The loop alone
seeds or restores them (`seed_training_stream`, then the checkpoint's state, loop/train.py) right before its
first step, and only the steps draw from them. Anything else that needs randomness (the model built for identical
initial weights, the banner's memory prediction, the FLOP count's meta copy) runs inside `aside()`: the
stream is saved on entry and put back on exit, whatever ran, seeded or drew inside.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


def _cuda_indices(device: torch.device | None) -> list[int]:
    """The CUDA generators to keep: the given device's; with none given, the current device's once CUDA is in
    use (before that nothing has drawn from it, and nothing inside `aside` seeds it)."""
    if device is not None:
        if device.type != "cuda":
            return []
        return [device.index if device.index is not None else torch.cuda.current_device()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return [torch.cuda.current_device()]
    return []


def _seed(seed: int, cuda: list[int]) -> None:
    # Not torch.manual_seed: with CUDA not yet initialised it queues a seed of every device for later, which
    # would land on the training stream after `aside` has put it back.
    torch.default_generator.manual_seed(seed)
    if cuda:
        torch.cuda.init()  # the device's generator exists once CUDA is initialised
    for index in cuda:
        torch.cuda.default_generators[index].manual_seed(seed)


@contextlib.contextmanager
def aside(seed: int | None = None, device: torch.device | None = None) -> Iterator[None]:
    """Run the body off the training stream: its generators (CPU and `device`'s CUDA one) are restored on exit.
    `seed`: the body starts from this seed, on those generators, as after torch.manual_seed."""
    cuda = _cuda_indices(device)
    with torch.random.fork_rng(devices=cuda):
        if seed is not None:
            _seed(seed, cuda)
        yield


def seed_training_stream(seed: int, device: torch.device) -> None:
    """The stream of a fresh run (and of a rank its checkpoint has no state for): the same on every rank and
    strategy, whatever was built or measured before it."""
    _seed(seed, _cuda_indices(device))
