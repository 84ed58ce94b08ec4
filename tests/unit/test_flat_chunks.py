"""ZeRO partitions as DCP chunks (shardtrain/checkpointing/flat_chunks.py): a contiguous range of a row-major tensor
is written as rectangles of the tensor's own shape, each a view of the range (no copy), and read back resharded."""

from __future__ import annotations

import math
import warnings

import torch
import torch.distributed.checkpoint as dcp

from shardtrain.checkpointing.flat_chunks import FlatRange, LoadPlanner, SavePlanner, range_boxes


def test_every_range_of_every_shape_is_at_most_2n_minus_1_rectangles_that_tile_it_in_order():
    for shape in [(), (7,), (3, 4), (2, 3, 5), (4, 1, 3), (1, 1), (5, 0)]:
        n = math.prod(shape)
        full = torch.arange(n, dtype=torch.float32).reshape(shape)
        for s in range(n + 1):
            for e in range(s, n + 1):
                boxes = range_boxes(shape, s, e - s)
                assert len(boxes) <= max(1, 2 * len(shape) - 1), (shape, s, e, boxes)
                part = torch.arange(s, e, dtype=torch.float32)
                ranged = FlatRange(shape, part, s)
                covered = 0
                for offsets, view in ranged.views.items():
                    assert view.data_ptr() >= part.data_ptr() or view.numel() == 0  # a view of the range
                    region = full[tuple(slice(o, o + z) for o, z in zip(offsets, view.shape))]
                    assert torch.equal(region, view), (shape, s, e, offsets)
                    covered += view.numel()
                assert covered == e - s


def test_a_range_written_as_rectangles_reads_back_into_another_range_and_a_plain_region(tmp_path):
    weight = torch.randn(5, 7)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    # One process (no_dist): rank 0 of a 2-rank ZeRO-3 layout would own elements [0, 18); here the range [5, 30)
    # gives a head, whole rows and a tail.
    saved = FlatRange((5, 7), weight.flatten()[5:30].clone(), 5)
    dcp.save({"model": {"w": saved}}, checkpoint_id=str(tmp_path), planner=SavePlanner(), no_dist=True)
    chunks = dcp.FileSystemReader(str(tmp_path)).read_metadata().state_dict_metadata["model.w"].chunks
    assert [(tuple(c.offsets), tuple(c.sizes)) for c in chunks] == [
        ((0, 5), (1, 2)),
        ((1, 0), (3, 7)),
        ((4, 0), (1, 2)),
    ]
    into = torch.zeros(20)
    dcp.load(
        {"model": {"w": FlatRange((5, 7), into, 9)}}, checkpoint_id=str(tmp_path), planner=LoadPlanner(), no_dist=True
    )
    assert torch.equal(into, weight.flatten()[9:29])
