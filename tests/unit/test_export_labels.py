"""A workload's export of a transformers model names the run's classes in its config.json, as the built-ins' do."""

from __future__ import annotations

import json

from transformers import AutoConfig, AutoModelForSequenceClassification

from shardtrain.checkpointing.export import name_the_classes


def tiny(**config):
    small = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, vocab_size=50)
    return AutoModelForSequenceClassification.from_config(AutoConfig.for_model("bert", **small, **config))


def test_the_runs_class_names_replace_transformers_own_in_the_saved_config(tmp_path):
    """A trial's colleagues got LABEL_0..2 from pipeline("text-classification") on an export of a run that trained
    on "negative", "neutral", "positive": the example's export() saves the config build_model() made."""
    model = tiny(num_labels=3)
    name_the_classes(model, ["negative", "neutral", "positive"])
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["id2label"] == {"0": "negative", "1": "neutral", "2": "positive"}
    assert saved["label2id"] == {"negative": 0, "neutral": 1, "positive": 2}


def test_names_the_users_model_has_and_other_models_are_left_alone():
    own = tiny(num_labels=2, id2label={0: "spam", 1: "ham"}, label2id={"spam": 0, "ham": 1})
    name_the_classes(own, ["bad", "good"])
    assert own.config.id2label == {0: "spam", 1: "ham"}
    other = tiny(num_labels=3)
    name_the_classes(other, ["bad", "good"])  # a head of another size: not these classes
    assert other.config.id2label == {0: "LABEL_0", 1: "LABEL_1", 2: "LABEL_2"}
    name_the_classes(tiny(num_labels=2), [])  # integer labels: nothing to name
