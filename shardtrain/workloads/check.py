"""`check-data --workload`: a user's data as the loop will meet it, checked in seconds before any process starts.

The workload's datasets() is called, a few samples of each split are read and batched with its collate, and the
batch keys are matched against the model's forward (the model is built on the meta device: nothing allocated,
no weights loaded). Every problem found is one line naming the workload method to look at.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from shardtrain.config.settings import Config, ConfigError
from shardtrain.data.batches import shape_summary
from shardtrain.data.sources import source_asks, unread_source_flags
from shardtrain.workloads.base import CheckedCollate, Workload, load_workload, model_inputs, model_of, splits_of


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"


# How many samples of each split are batched through collate, also when every one is read (--samples all).
BATCHED = 4


def check_workload_data(cfg: Config, samples: int | None = 4) -> tuple[list[str], list[str], dict[str, tuple]]:
    """(problems, notes on what was checked, split -> (samples read, samples in it)). `samples`: how many of
    each split to read (None: every one). A workload that does not construct raises its ConfigError."""
    workload = load_workload(cfg)
    name = type(workload).__name__
    asks = source_asks()
    try:
        splits = splits_of(workload)
    except ConfigError as e:
        return [str(e)], [], {}
    except Exception as e:  # noqa: BLE001 - the user's code: say which method failed and how
        return [f"{name}.datasets() raised {_one_line(e)}"], [], {}
    problems, notes, batches, read = [], [], [], {}
    unread = unread_source_flags(cfg, asks)  # what train warns about: a data setting its datasets() never read
    if unread:
        notes.append(f"note: {unread}")
    for split, ds in zip(("train", "validation"), splits):
        if ds is None:
            if split == "train":
                problems.append(f"{name}.datasets() returned None for train: nothing to train on")
            continue
        where = f"{name}.datasets() {split}"
        if not (hasattr(ds, "__len__") and hasattr(ds, "__getitem__")):
            problems.append(
                f"{where}: a {type(ds).__name__} is not map-style (no __len__ / __getitem__); shardtrain "
                f"shards datasets by index across ranks"
            )
            continue
        n = len(ds)
        if n == 0:
            problems.append(f"{where} is empty")
            continue
        items = []
        read[split] = (n if samples is None else min(samples, n), n)
        for i in range(read[split][0]):
            try:
                item = ds[i]
            except Exception as e:  # noqa: BLE001
                problems.append(f"{where} item {i}: {_one_line(e)}")
                continue
            if len(items) < (samples or BATCHED):
                items.append(item)
        if not items:
            continue
        try:
            batch = CheckedCollate(workload)(items)
        except ConfigError as e:
            problems.append(f"{split}: {e}")
            continue
        batches.append(batch)  # CheckedCollate refused what the loop cannot move to the device
        notes.append(f"{split}: {n} samples; {len(items)} batched by {name}.collate into {shape_summary(batch)}")
    if batches:
        problems += _check_against_model(workload, name, batches)
    return problems, notes, read


def _check_against_model(workload: Workload, name: str, batches: list[dict]) -> list[str]:
    """The batch keys against what the default forward and loss read. An overridden forward or loss is the
    user's own code, run only in training."""
    problems = []
    default_forward = type(workload).forward is Workload.forward
    if default_forward:
        workload.loads_weights = False
        try:
            with torch.device("meta"):
                model = model_of(workload)
        except ConfigError as e:
            return [str(e)]
        except Exception as e:  # noqa: BLE001
            return [
                f"{name}.build_model() failed on the meta device (check-data builds it there to read its "
                f"forward's arguments): {_one_line(e)}"
            ]
        finally:
            workload.loads_weights = True
        for batch in batches:
            try:
                model_inputs(model, batch, name)
            except ConfigError as e:
                problems.append(str(e))
                break
    if type(workload).loss is Workload.loss:
        if any(not (isinstance(b, Mapping) and "labels" in b) for b in batches):
            problems.append(
                f"{name}.collate gives no 'labels' key, which the default Workload.loss reads; return "
                f"labels from collate or override {name}.loss"
            )
        elif any(not isinstance(b["labels"], torch.Tensor) for b in batches):
            odd = next(type(b["labels"]).__name__ for b in batches if not isinstance(b["labels"], torch.Tensor))
            problems.append(
                f"{name}.collate gives 'labels' as a {odd}, and the default Workload.loss needs a tensor "
                f"of class ids; return torch.tensor(...) from collate or override {name}.loss"
            )
    return problems
