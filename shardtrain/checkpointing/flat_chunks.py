"""One rank's contiguous range of a tensor's elements, written into and read from DCP in the tensor's own shape.

ZeRO partitions parameters by their flattened (row-major) elements: ZeRO-3 gives each rank one contiguous range of
every parameter, ZeRO-2's flat partitions hold contiguous ranges of the parameters they cover. DCP stores a tensor
as rectangular chunks at global offsets. A contiguous range of a row-major tensor is at most 2·ndim-1 rectangles
(the rest of its first row, whole rows, the start of its last row; recursively for more dimensions), and each
rectangle is itself a contiguous run of the range, so it is a view of the partition: nothing is copied.

The checkpoint then keeps the layout every other writer uses (`model.<fqn>` in the parameter's shape): DDP, FSDP
and `dcp_to_torch_save` read it as they read any checkpoint, DCP reshards between any writers and readers, and a
ZeRO rank reads back only its range, from a checkpoint of any strategy and world size.

`FlatRange` goes into the state dict in place of a tensor; `SavePlanner` / `LoadPlanner` are DCP's default planners
that also look up its rectangles (DCP itself asks it for its write items and chunks: `__create_write_items__`,
`__create_chunk_list__`, as DTensor answers them).
"""

from __future__ import annotations

import math

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType


def range_boxes(shape: tuple[int, ...], start: int, length: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """The rectangles that elements [start, start+length) of a row-major `shape` make up, in order:
    (global offsets, sizes, position of the rectangle's first element inside the range). Empty: no rectangles."""
    return _boxes(tuple(shape), start, start + length)


def _boxes(shape: tuple[int, ...], s: int, e: int) -> list:
    if e <= s:
        return []
    if not shape:  # a scalar: its one element
        return [((), (), 0)]
    if len(shape) == 1:
        return [((s,), (e - s,), 0)]
    inner = math.prod(shape[1:])

    def in_row(row: int, lo: int, hi: int, at: int) -> list:
        return [((row, *o), (1, *z), at + a) for o, z, a in _boxes(shape[1:], lo, hi)]

    first_full, last_full = -(-s // inner), e // inner  # whole rows: [first_full, last_full)
    if first_full > last_full:  # the range lies inside one row
        row = s // inner
        return in_row(row, s - row * inner, e - row * inner, 0)
    out, at = [], 0
    if s % inner:  # the rest of the first row
        out += in_row(s // inner, s % inner, inner, 0)
        at = first_full * inner - s
    if last_full > first_full:
        out.append(((first_full,) + (0,) * (len(shape) - 1), (last_full - first_full, *shape[1:]), at))
        at += (last_full - first_full) * inner
    if e % inner:  # the start of the last row
        out += in_row(last_full, 0, e % inner, at)
    return out


class FlatRange:
    """Elements [start, start + flat.numel()) of a tensor of `shape`, held by this rank as the 1-D `flat` (a view
    of its partition: what it is saved from, or loaded into). Its rectangles are views of `flat`."""

    def __init__(self, shape, flat: torch.Tensor, start: int):
        self.shape = torch.Size(shape)
        self.flat = flat
        self.start = start
        assert flat.dim() == 1 and start + flat.numel() <= math.prod(self.shape), (tuple(shape), start, flat.numel())
        self.views = {}
        for offsets, sizes, at in range_boxes(tuple(self.shape), start, flat.numel()):
            self.views[torch.Size(offsets)] = flat[at : at + math.prod(sizes)].view(sizes)

    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        props = TensorProperties.create_from_tensor(self.flat)
        return [
            WriteItem(
                index=MetadataIndex(fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=view.size()), properties=props, size=self.shape
                ),
            )
            for offsets, view in self.views.items()
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=offsets, sizes=view.size()) for offsets, view in self.views.items()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self.views[torch.Size(index.offset)]


def _find_ranges(obj, out: list) -> None:
    if isinstance(obj, dict):
        for key, value in obj.items():
            if isinstance(value, FlatRange):
                out.append((obj, key, value))
            else:
                _find_ranges(value, out)


def _lookup(state_dict: dict, index: MetadataIndex):
    obj = state_dict.get(index.fqn)
    return obj.__get_tensor_shard__(index) if isinstance(obj, FlatRange) else None


class SavePlanner(DefaultSavePlanner):
    """DCP's default save planner; FlatRange entries are written as their rectangles."""

    def lookup_object(self, index: MetadataIndex):
        found = _lookup(self.state_dict, index)
        return super().lookup_object(index) if found is None else found


class LoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner; FlatRange entries are read into their rectangles (resharded from whatever
    chunks the checkpoint holds)."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        # The default set-up replaces every value it does not know (meta tensors aside) by None (torch 2.14:
        # _init_state_dict): put the ranges back, then flatten again as it did.
        ranges = []
        _find_ranges(state_dict, ranges)
        super().set_up_planner(state_dict, metadata, is_coordinator)
        for parent, key, value in ranges:
            parent[key] = value
        if self.flatten_state_dict:
            self.state_dict, self.mappings = flatten_state_dict(self.original_state_dict)
        else:
            self.state_dict = self.original_state_dict

    def lookup_tensor(self, index: MetadataIndex):
        found = _lookup(self.state_dict, index)
        return super().lookup_tensor(index) if found is None else found
