"""The config never changes after start-up: every section is frozen, and what the run decides (the batch
geometry, the data's classes) lives in the run's state and is recorded apart from the user's config."""

import dataclasses
import json

import pytest

from shardtrain.config.labels import ClassLabels, run_config_dict
from shardtrain.config.settings import Config, from_dict, parse_cli, replace_fields


def test_a_validated_config_and_each_section_refuse_changes():
    cfg = parse_cli(["--config", "configs/multimodal_tiny.yaml", "--max-steps", "3"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train.per_device_batch_size = 1  # what OOM recovery once wrote: now a BatchGeometry of the Trainer
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model.num_labels = 7  # what the data once wrote: now ClassLabels of the workload
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train = cfg.train
    changed = replace_fields(cfg, max_steps=5)  # the one way to another config: a new one
    assert (changed.train.max_steps, cfg.train.max_steps) == (5, 3)
    assert changed.origins is cfg.origins  # errors about untouched values still name the YAML line


def test_the_data_decided_classes_go_into_a_new_config_and_back_out_of_a_record():
    cfg = Config()
    labels = ClassLabels(2, ("neg", "pos"))
    labelled = labels.applied_to(cfg)
    assert (labelled.model.num_labels, labelled.data.label_names) == (2, ["neg", "pos"])
    assert (cfg.model.num_labels, cfg.data.label_names) == (None, [])
    assert ClassLabels.from_record(json.loads(json.dumps(labels.as_record()))) == labels


def test_a_checkpoints_config_and_its_resolved_labels_rebuild_the_run_config():
    state = {
        "config": Config().to_dict(),
        "resolved": {"batch_geometry": {"micro_batch_size": 4}, "labels": {"num_labels": 2, "label_names": ["a", "b"]}},
    }
    run_cfg = from_dict(run_config_dict(state))
    assert (run_cfg.model.num_labels, run_cfg.data.label_names) == (2, ["a", "b"])
    assert state["config"]["model"]["num_labels"] is None  # the record itself is left as it was
    # A checkpoint from before the split kept the labels in its config: it comes back as it was.
    old = {"config": replace_fields(Config(), num_labels=3, label_names=["x", "y", "z"]).to_dict()}
    assert run_config_dict(old) == old["config"]
