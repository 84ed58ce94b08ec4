"""The report's own style: a hand-written FusionLayer over a RoBERTa encoder and a torchvision ResNet, a user
Dataset class that reads text + image records, and dict batches. The lower layers start frozen.

    workload:
      target: fusion:FusionTask                       # this file, beside the config: its folder is on the import path
      args: {data_dir: data/my_posts, text_model: roberta-base, image_weights: IMAGENET1K_V1, num_labels: 3}

On your machine the encoders load `roberta-base` and torchvision's ImageNet weights. `text_config` and
`image_layers` instead build smaller architectures from configs (random init, nothing downloaded), which is
how the tests use it. The records are jsonl lines {"text": ..., "image": "images/x.png", "label": 0..N-1},
image paths relative to the data folder.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import nn
from torch.utils.data import Dataset
from torchvision.models import ResNet18_Weights
from torchvision.models.resnet import BasicBlock, ResNet
from transformers import AutoConfig, AutoTokenizer, RobertaConfig, RobertaModel

from shardtrain import Workload

RESNET18_LAYERS = [2, 2, 2, 2]
# ImageNet statistics: what the pretrained ResNet saw in training.
MEAN, STD = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1), torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)


class MultimodalDataset(Dataset):
    """One post: its text, its image as a normalised [3, size, size] tensor, its label."""

    def __init__(self, records: Path, image_size: int):
        self.folder, self.image_size = records.parent, image_size
        with open(records) as f:
            self.rows = [json.loads(line) for line in f if line.strip()]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        row = self.rows[i]
        with Image.open(self.folder / row["image"]) as img:
            img = img.convert("RGB").resize((self.image_size, self.image_size), Image.BILINEAR)
        pixels = torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0).permute(2, 0, 1)
        return {"text": row["text"], "pixel_values": (pixels - MEAN) / STD, "label": int(row["label"])}


class FusionLayer(nn.Module):
    """A learned per-feature gate between the two modalities, then the classifier."""

    def __init__(self, text_dim: int, image_dim: int, hidden: int, num_labels: int):
        super().__init__()
        self.text_proj = nn.Linear(text_dim, hidden)
        self.image_proj = nn.Linear(image_dim, hidden)
        self.gate = nn.Linear(2 * hidden, hidden)
        self.classifier = nn.Sequential(nn.GELU(), nn.Linear(hidden, num_labels))

    def forward(self, text_features, image_features):
        t, i = self.text_proj(text_features), self.image_proj(image_features)
        g = torch.sigmoid(self.gate(torch.cat([t, i], dim=-1)))
        return self.classifier(g * t + (1 - g) * i)


class FusionModel(nn.Module):
    def __init__(self, text: RobertaModel, image: ResNet, hidden: int, num_labels: int):
        super().__init__()
        self.text, self.image = text, image
        image_dim = image.fc.in_features
        self.image.fc = nn.Identity()  # the ResNet ends with its pooled features
        self.fusion = FusionLayer(text.config.hidden_size, image_dim, hidden, num_labels)

    def forward(self, input_ids, attention_mask, pixel_values):
        text = self.text(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state[:, 0]  # <s>
        return self.fusion(text, self.image(pixel_values))


class FusionTask(Workload):
    def __init__(
        self,
        cfg,
        data_dir: str,
        tokenizer: str | None = None,
        text_model: str = "roberta-base",
        text_config: dict | None = None,
        image_layers: list | None = None,
        image_weights: str | None = "IMAGENET1K_V1",
        image_size: int = 224,
        max_length: int = 128,
        fusion_hidden: int = 256,
        num_labels: int = 3,
    ):
        super().__init__(
            cfg,
            data_dir=data_dir,
            tokenizer=tokenizer,
            text_model=text_model,
            text_config=text_config,
            image_layers=image_layers,
            image_weights=image_weights,
            image_size=image_size,
            max_length=max_length,
            fusion_hidden=fusion_hidden,
            num_labels=num_labels,
        )
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer or text_model)

    def build_model(self):
        a = self.args
        # A copy that gets its weights from rank 0 (the meta device, ZeRO-3's partitions) loads no files.
        load = self.loads_weights and torch.get_default_device().type != "meta"
        if a["text_config"] is not None:
            text = RobertaModel(RobertaConfig(**a["text_config"]), add_pooling_layer=False)
        elif load:
            text = RobertaModel.from_pretrained(a["text_model"], add_pooling_layer=False, dtype=torch.float32)
        else:
            text = RobertaModel(AutoConfig.from_pretrained(a["text_model"]), add_pooling_layer=False)
        layers = a["image_layers"] or RESNET18_LAYERS
        image = ResNet(BasicBlock, layers)
        if load and a["image_weights"] and layers == RESNET18_LAYERS:
            image.load_state_dict(ResNet18_Weights[a["image_weights"]].get_state_dict(progress=False))
        return FusionModel(text, image, a["fusion_hidden"], a["num_labels"])

    def datasets(self):
        folder, size = Path(self.args["data_dir"]), self.args["image_size"]
        return (MultimodalDataset(folder / "train.jsonl", size), MultimodalDataset(folder / "validation.jsonl", size))

    def collate(self, samples):
        text = self.tokenizer(
            [s["text"] for s in samples],
            padding="longest",
            truncation=True,
            max_length=self.args["max_length"],
            return_tensors="pt",
        )
        return {
            "input_ids": text["input_ids"],
            "attention_mask": text["attention_mask"],
            "pixel_values": torch.stack([s["pixel_values"] for s in samples]),
            "labels": torch.tensor([s["label"] for s in samples]),
        }

    def block_classes(self):
        return ("RobertaLayer", "BasicBlock")

    def freezable_parameter_names(self, n):
        """The text embeddings and lowest n transformer layers; the CNN's stem and its lowest n stages."""
        with torch.device("meta"):
            model = self.build_model()
        prefixes = (
            "text.embeddings.",
            "image.conv1.",
            "image.bn1.",
            *(f"text.encoder.layer.{i}." for i in range(n)),
            *(f"image.layer{k + 1}." for k in range(n)),
        )
        return [name for name, _ in model.named_parameters() if name.startswith(prefixes)]
