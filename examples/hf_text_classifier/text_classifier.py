"""Any `AutoModelForSequenceClassification`, on text classification records (jsonl: {"text": ..., "label": ...}).

    workload:
      target: text_classifier:TextClassifier            # this file, beside the config: its folder is on the import path
      args: {model: bert-base-uncased, num_labels: 2, data_dir: data/my_text}

`model` is a hub name or a local folder; `model_config` instead builds the architecture from a config (random
init, nothing downloaded), which is how the tests use it.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

from shardtrain import Workload


class TextClassifier(Workload):
    def __init__(
        self,
        cfg,
        data_dir: str,
        tokenizer: str | None = None,
        model: str | None = None,
        model_config: dict | None = None,
        num_labels: int = 2,
        max_length: int = 128,
    ):
        super().__init__(
            cfg,
            data_dir=data_dir,
            tokenizer=tokenizer,
            model=model,
            model_config=model_config,
            num_labels=num_labels,
            max_length=max_length,
        )
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer or model)

    def build_model(self):
        if self.args["model_config"] is not None:
            config = AutoConfig.for_model(**self.args["model_config"], num_labels=self.args["num_labels"])
            return AutoModelForSequenceClassification.from_config(config)
        name = self.args["model"]
        # A copy that gets its weights from rank 0 (the meta device, ZeRO-3's partitions): shapes only.
        if not self.loads_weights or torch.get_default_device().type == "meta":
            return AutoModelForSequenceClassification.from_config(
                AutoConfig.from_pretrained(name, num_labels=self.args["num_labels"])
            )
        return AutoModelForSequenceClassification.from_pretrained(
            name, num_labels=self.args["num_labels"], dtype=torch.float32
        )

    def datasets(self):
        folder = Path(self.args["data_dir"])
        return read_jsonl(folder / "train.jsonl"), read_jsonl(folder / "validation.jsonl")

    def collate(self, samples):
        batch = self.tokenizer(
            [s["text"] for s in samples],
            padding="longest",
            truncation=True,
            max_length=self.args["max_length"],
            return_tensors="pt",
        )
        return {**batch, "labels": torch.tensor([s["label"] for s in samples])}

    def export(self, model, out_dir):
        """A Hugging Face folder (`shardtrain export RUN OUT` calls this): the two standard lines load it,
        AutoModelForSequenceClassification.from_pretrained(OUT) and AutoTokenizer.from_pretrained(OUT), and the
        tokenizer truncates where training did (max_length), so `tokenizer(texts, truncation=True)` is collate's."""
        model.save_pretrained(out_dir)
        tokenizer = copy.copy(self.tokenizer)
        tokenizer.model_max_length = self.args["max_length"]
        tokenizer.save_pretrained(out_dir)

    def freezable_parameter_names(self, n):
        with torch.device("meta"):
            model = self.build_model()
        base = model.base_model_prefix  # "bert", "roberta", ...
        prefixes = (f"{base}.embeddings.",) + tuple(f"{base}.encoder.layer.{i}." for i in range(n))
        return [name for name, _ in model.named_parameters() if name.startswith(prefixes)]


def read_jsonl(path: Path) -> list[dict]:
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [{"text": r["text"], "label": int(r["label"])} for r in rows]
