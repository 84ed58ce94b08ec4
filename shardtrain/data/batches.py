"""Batches of any shape: dicts (and Mappings such as transformers' BatchEncoding), lists, tuples, namedtuples and
dataclasses, nested in any way, with tensors, strings, numbers or None at the leaves.

`move_batch` copies the structure with every tensor on the device (the containers keep their types: a
BatchEncoding stays one, a dataclass keeps its class); `collate_samples` is torch's `default_collate` plus
dataclasses, which it refuses; `batch_problem` says what in a batch the loop cannot move (one line, naming the
path, e.g. `batch["text"]["ids"]`).
"""

from __future__ import annotations

import abc
import copy
import dataclasses
from collections import UserDict
from collections.abc import Mapping
from typing import Any, Iterator

import torch
from torch.utils.data._utils.collate import collate, default_collate_fn_map

LEAVES = (torch.Tensor, str, bytes, int, float, complex, bool, type(None))


def is_namedtuple(obj) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_fields")


def is_dataclass_instance(obj) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def children(obj) -> Iterator[tuple[str, Any]]:
    """(path step, value) of a container's items; nothing for a leaf."""
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            yield f"[{k!r}]", v
    elif is_dataclass_instance(obj):
        for f in dataclasses.fields(obj):
            yield f".{f.name}", getattr(obj, f.name)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield f"[{i}]", v


def is_container(obj) -> bool:
    return isinstance(obj, (Mapping, list, tuple)) or is_dataclass_instance(obj)


def leaves(obj, path: str = "batch") -> Iterator[tuple[str, Any]]:
    """(path, leaf) for every non-container value inside `obj`, depth first."""
    if not is_container(obj):
        yield path, obj
        return
    for step, value in children(obj):
        yield from leaves(value, path + step)


def rebuild(obj, fn):
    """A copy of the container `obj` with `fn` applied to each child value; the container's own type is kept."""
    if isinstance(obj, UserDict):  # BatchEncoding: copy.copy keeps its encodings and tensor type, not the dict
        out = copy.copy(obj)
        out.data = {k: fn(v) for k, v in obj.data.items()}
        return out
    if isinstance(obj, dict):  # OrderedDict, defaultdict and other subclasses copy themselves
        out = copy.copy(obj)
        for k, v in obj.items():
            out[k] = fn(v)
        return out
    if isinstance(obj, Mapping):
        return {k: fn(v) for k, v in obj.items()}
    if is_dataclass_instance(obj):  # no __init__ / __post_init__ run again on a copy
        out = copy.copy(obj)
        for f in dataclasses.fields(obj):
            object.__setattr__(out, f.name, fn(getattr(obj, f.name)))
        return out
    if is_namedtuple(obj):
        return type(obj)(*(fn(v) for v in obj))
    if isinstance(obj, (list, tuple)):
        values = [fn(v) for v in obj]
        return values if type(obj) is list else type(obj)(values)
    return fn(obj)


def move_batch(obj, device: torch.device):
    """Every tensor inside `obj` on `device` (asynchronously from pinned memory); everything else as it is."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if is_container(obj):
        return rebuild(obj, lambda v: move_batch(v, device))
    return obj


def batch_problem(batch) -> str | None:
    """None if the loop can move `batch`; else what it cannot (a container at the top, leaves it knows)."""
    if not is_container(batch):
        return (
            f"must return a dict (or a list, tuple, namedtuple, dataclass or BatchEncoding) of tensors, got "
            f"{type(batch).__name__}"
        )
    for path, leaf in leaves(batch):
        if not isinstance(leaf, LEAVES):
            return (
                f"returns a {type(leaf).__module__}.{type(leaf).__name__} at {path}: the loop moves tensors to the "
                f"device, so return tensors there (strings, numbers and None pass through as they are)"
            )
    return None


def shape_summary(batch, prefix: str = "") -> str:
    """`input_ids (8, 32), labels (8,)`; nested: `text.input_ids (8, 32), 1 (8, 3, 32, 32)`: what check-data prints."""
    if not is_container(batch):
        return f"{prefix or 'batch'} {tuple(batch.shape) if isinstance(batch, torch.Tensor) else type(batch).__name__}"
    if (
        isinstance(batch, (list, tuple))
        and batch
        and not any(is_container(v) or isinstance(v, torch.Tensor) for v in batch)
    ):
        return f"{prefix or 'batch'} {type(batch).__name__} of {len(batch)} {type(batch[0]).__name__}"  # e.g. texts
    return ", ".join(
        shape_summary(value, f"{prefix}.{step.strip('[].').strip(chr(39))}".lstrip("."))
        for step, value in children(batch)
    )


def top_tensor(batch, key: str) -> torch.Tensor | None:
    """The tensor under `key` at the top of a Mapping batch (the built-ins' `input_ids`), else None."""
    value = batch.get(key) if isinstance(batch, Mapping) else None
    return value if isinstance(value, torch.Tensor) else None


class _Dataclass(abc.ABC):  # noqa: B024 (no abstract method: only __subclasshook__ is wanted)
    """isinstance(x, _Dataclass) for any dataclass instance: torch's collate dispatches on isinstance."""

    @classmethod
    def __subclasshook__(cls, C):
        return True if dataclasses.is_dataclass(C) else NotImplemented


def _collate_dataclass(samples, *, collate_fn_map=None):
    first = samples[0]
    out = copy.copy(first)
    for f in dataclasses.fields(first):
        object.__setattr__(out, f.name, collate([getattr(s, f.name) for s in samples], collate_fn_map=collate_fn_map))
    return out


_COLLATE_FN_MAP = {**default_collate_fn_map, _Dataclass: _collate_dataclass}


def collate_samples(samples: list):
    """torch's default_collate, and dataclasses batched field by field into one of their class. Tuples become lists
    of batched fields as default_collate makes them: `(text_dict, image, label)` samples -> [text_dict batched,
    images stacked, labels as a tensor]."""
    return collate(samples, collate_fn_map=_COLLATE_FN_MAP)
