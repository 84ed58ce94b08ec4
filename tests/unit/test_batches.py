"""Batches of any nesting: every tensor in dicts, lists, tuples, namedtuples, dataclasses and
BatchEncodings moves to the device; the default collate batches the multimodal report's `(text_input_dict, image,
label)` tuples (and dataclasses); the one root module every strategy wraps has exactly the model's names."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, namedtuple

import numpy as np
import pytest
import torch
from torch import nn
from transformers import BatchEncoding

from shardtrain.config.settings import Config, ConfigError
from shardtrain.data import batch_to_device
from shardtrain.strategies.root import WorkloadRoot, workload_root
from shardtrain.workloads.base import CheckedCollate, Workload

META = torch.device("meta")  # another device than the CPU the batch is built on: a move is visible on CPU-only hosts
Pair = namedtuple("Pair", "left right")


@dataclasses.dataclass
class Sample:
    ids: torch.Tensor
    label: int
    note: str = "x"


@dataclasses.dataclass(frozen=True)
class Frozen:
    pixels: torch.Tensor


def devices(obj) -> set[str]:
    from shardtrain.data.batches import leaves

    return {leaf.device.type for _, leaf in leaves(obj) if isinstance(leaf, torch.Tensor)}


def test_every_tensor_of_a_nested_batch_moves_and_every_container_keeps_its_type():
    enc = BatchEncoding({"input_ids": torch.ones(2, 4, dtype=torch.long), "attention_mask": torch.ones(2, 4)})
    batch = {
        "text": enc,
        "pair": Pair(torch.zeros(2), [torch.zeros(3), (torch.zeros(1), "tag")]),
        "sample": Sample(torch.zeros(2, 3), 7),
        "frozen": Frozen(torch.zeros(1)),
        "ordered": OrderedDict(a=torch.zeros(1)),
        "texts": ["a b", "c"],
        "none": None,
        "labels": torch.tensor([0, 1]),
    }
    out = batch_to_device(batch, META)
    assert devices(out) == {"meta"} and devices(batch) == {"cpu"}  # a moved copy; the loader's batch untouched
    assert isinstance(out["text"], BatchEncoding) and out["text"].input_ids.device.type == "meta"
    assert isinstance(out["pair"], Pair) and isinstance(out["pair"].right, list)
    assert isinstance(out["pair"].right[1], tuple) and out["pair"].right[1][1] == "tag"
    assert isinstance(out["sample"], Sample) and out["sample"].label == 7 and out["sample"].note == "x"
    assert isinstance(out["frozen"], Frozen) and isinstance(out["ordered"], OrderedDict)
    assert out["texts"] == ["a b", "c"] and out["none"] is None
    # A top-level list or tuple batch (what the default collate makes of tuple samples) moves too.
    assert devices(batch_to_device([{"ids": torch.zeros(1)}, torch.zeros(2)], META)) == {"meta"}


def test_uint8_images_are_normalised_at_the_top_of_a_dict_batch_only():
    pixels = torch.full((1, 3, 2, 2), 255, dtype=torch.uint8)
    out = batch_to_device({"pixel_values": pixels, "nested": {"pixel_values": pixels}}, torch.device("cpu"))
    assert out["pixel_values"].dtype == torch.float32  # the built-ins' images, as before
    assert out["nested"]["pixel_values"].dtype == torch.uint8  # a user's own tensor is left as it is


def report_samples(n=3):
    """The multimodal report's Dataset items: (text_input_dict, image, label)."""
    return [
        (
            {"input_ids": torch.arange(5) + i, "attention_mask": torch.ones(5, dtype=torch.long)},
            torch.rand(3, 4, 4),
            i % 2,
        )
        for i in range(n)
    ]


def test_the_default_collate_batches_the_reports_tuples():
    batch = CheckedCollate(Workload(Config()))(report_samples())
    text, images, labels = batch  # torch's default_collate: a list of the batched fields
    assert set(text) == {"input_ids", "attention_mask"} and text["input_ids"].shape == (3, 5)
    assert images.shape == (3, 3, 4, 4) and labels.tolist() == [0, 1, 0]
    assert devices(batch_to_device(batch, META)) == {"meta"}


def test_the_default_collate_batches_dataclasses_namedtuples_and_batch_encodings():
    collate = CheckedCollate(Workload(Config()))
    batch = collate([Sample(torch.zeros(4), i, note=str(i)) for i in range(3)])
    assert isinstance(batch, Sample) and batch.ids.shape == (3, 4) and batch.label.tolist() == [0, 1, 2]
    assert batch.note == ["0", "1", "2"]
    pairs = collate([Pair(torch.zeros(2), i) for i in range(3)])
    assert isinstance(pairs, Pair) and pairs.left.shape == (3, 2)
    enc = collate([BatchEncoding({"input_ids": torch.arange(4)}) for _ in range(2)])
    assert isinstance(enc, BatchEncoding) and enc["input_ids"].shape == (2, 4)


def test_collate_output_the_loop_cannot_move_is_one_line_naming_where():
    class Numpy(Workload):
        def collate(self, samples):
            return {"text": {"ids": np.zeros((len(samples), 3))}, "labels": torch.zeros(len(samples))}

    class Scalar(Workload):
        def collate(self, samples):
            return torch.zeros(len(samples))

    with pytest.raises(ConfigError, match=r"Numpy.collate returns a numpy.ndarray at batch\['text'\]\['ids'\]"):
        CheckedCollate(Numpy(Config()))([0, 1])
    with pytest.raises(ConfigError, match="Scalar.collate must return a dict .* got Tensor"):
        CheckedCollate(Scalar(Config()))([0, 1])


def test_the_defaults_that_read_a_dict_name_the_method_to_override_for_a_list_batch():
    w = Workload(Config())
    batch = CheckedCollate(w)(report_samples())
    with pytest.raises(ConfigError, match=r"Workload.forward passes a dict's keys .* override Workload.forward"):
        w.forward(nn.Linear(2, 2), batch)
    with pytest.raises(
        ConfigError,
        match=r"Workload.loss: the default reads batch\['labels'\], and the batch is a "
        r"list, not a dict,",
    ):
        w.loss(torch.zeros(3, 2, requires_grad=True), batch)


class Fusion(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(6, 2)

    def forward(self, t, i):
        return self.head(torch.cat([t, i], -1))


def report_model() -> nn.ModuleDict:
    return nn.ModuleDict(
        {
            "text": nn.Sequential(nn.Embedding(10, 4), nn.LayerNorm(4)),
            "img": nn.Sequential(nn.Conv2d(3, 2, 3), nn.BatchNorm2d(2), nn.AdaptiveAvgPool2d(1), nn.Flatten()),
            "fusion": Fusion(),
        }
    )


class Report(Workload):
    def forward(self, model, batch):
        return model["fusion"](model["text"](batch["text"]["ids"]).mean(1), model["img"](batch["pixels"]))


def test_the_root_has_the_models_own_names_and_runs_the_workloads_forward_as_its_own():
    model = report_model()
    model.register_parameter("scale", nn.Parameter(torch.ones(1)))  # a parameter of the model object itself
    root = workload_root(model, Report(Config()))
    assert isinstance(root, WorkloadRoot)
    assert [n for n, _ in root.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert all(a is b for (_, a), (_, b) in zip(root.named_parameters(), model.named_parameters()))
    assert list(root.state_dict()) == list(model.state_dict())  # no prefix: checkpoints, export, engine files
    assert [n for n, _ in root.named_buffers()] == [n for n, _ in model.named_buffers()]
    # A parameter replaced on the root (FSDP2 registers its DTensor shards so) is replaced on the model.
    root.scale = nn.Parameter(torch.full((1,), 2.0))
    assert model.scale is root.scale
    calls = []
    root.register_forward_pre_hook(lambda m, args: calls.append("root"))
    model["img"].register_forward_pre_hook(lambda m, args: calls.append("img"))
    batch = {"text": {"ids": torch.randint(0, 10, (4, 5))}, "pixels": torch.randn(4, 3, 6, 6)}
    assert root(batch).shape == (4, 2) and calls == ["root", "img"]  # the submodule ran inside the root's forward
    root.eval()
    assert not model.training and not model["img"][1].training
    root.train()
    assert model.training and model["img"][1].training
