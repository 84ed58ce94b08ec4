"""The multimodal report's code as it is: an `nn.ModuleDict` of a RoBERTa encoder, a torchvision ResNet and a
FusionLayer, with no forward of its own; a Dataset that yields `(text_input_dict, image, label)` tuples; a forward
that calls the three submodules itself.

    workload:
      target: report_fusion:ReportFusion              # this file, beside the config: its folder is on the import path
      args: {data_dir: data/my_posts, text_model: roberta-base, image_arch: resnet50, num_labels: 3}

shardtrain runs `forward` below as the forward of the one module each strategy wraps, so DDP's reducer, FSDP's
root unit and the DeepSpeed engine see a single forward although it calls `model["text"]`, `model["img"]` and
`model["fusion"]` one by one. The batch is a dict with a dict inside (`batch["text"]`); the loop moves all of it
to the device.

On your machine the encoders load `roberta-base` and torchvision's ImageNet weights. `text_config` (and a
smaller `image_arch` without `image_weights`) build small architectures instead, which is how the tests use it.
The records are jsonl lines {"text": ..., "image": "images/x.png", "label": 0..N-1}, image paths relative to the
data folder.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from PIL import Image
from torch import nn
from torch.utils.data import Dataset
from torchvision import models, transforms
from transformers import AutoConfig, AutoTokenizer, RobertaConfig, RobertaModel

from shardtrain import Workload

# The repeated block of each torchvision CNN this file knows (its head must be `fc`): resnet50 in the report, the
# small ShuffleNet in the tests.
IMAGE_BLOCKS = {
    "resnet18": "BasicBlock",
    "resnet34": "BasicBlock",
    "resnet50": "Bottleneck",
    "resnet101": "Bottleneck",
    "shufflenet_v2_x0_5": "InvertedResidual",
    "shufflenet_v2_x1_0": "InvertedResidual",
}


class PostDataset(Dataset):
    """One post as the report's loop reads it: (tokenised text as a dict of tensors, normalised image, label)."""

    def __init__(self, records: Path, tokenizer, max_length: int, image_size: int):
        self.folder, self.tokenizer, self.max_length = records.parent, tokenizer, max_length
        with open(records) as f:
            self.rows = [json.loads(line) for line in f if line.strip()]
        self.transform = transforms.Compose(
            [
                transforms.Resize((image_size, image_size)),
                transforms.ToTensor(),
                transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225]),
            ]
        )

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        row = self.rows[i]
        enc = self.tokenizer(
            row["text"], padding="max_length", truncation=True, max_length=self.max_length, return_tensors="pt"
        )
        text_input_dict = {k: v.squeeze(0) for k, v in enc.items()}
        with Image.open(self.folder / row["image"]) as img:
            image = self.transform(img.convert("RGB"))
        return text_input_dict, image, int(row["label"])


class FusionLayer(nn.Module):
    """Each modality projected to `hidden`, concatenated, then the classifier."""

    def __init__(self, text_dim: int, image_dim: int, hidden: int, num_labels: int):
        super().__init__()
        self.text_proj, self.image_proj = nn.Linear(text_dim, hidden), nn.Linear(image_dim, hidden)
        self.classifier = nn.Sequential(nn.ReLU(), nn.Linear(2 * hidden, num_labels))

    def forward(self, text_features, image_features):
        return self.classifier(torch.cat([self.text_proj(text_features), self.image_proj(image_features)], dim=-1))


class ReportFusion(Workload):
    def __init__(
        self,
        cfg,
        data_dir: str,
        tokenizer: str | None = None,
        text_model: str = "roberta-base",
        text_config: dict | None = None,
        image_arch: str = "resnet50",
        image_weights: str | None = "DEFAULT",
        image_size: int = 224,
        max_length: int = 128,
        fusion_hidden: int = 512,
        num_labels: int = 3,
        freeze_lower: bool = True,
    ):
        super().__init__(
            cfg,
            data_dir=data_dir,
            tokenizer=tokenizer,
            text_model=text_model,
            text_config=text_config,
            image_arch=image_arch,
            image_weights=image_weights,
            image_size=image_size,
            max_length=max_length,
            fusion_hidden=fusion_hidden,
            num_labels=num_labels,
            freeze_lower=freeze_lower,
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
        img = models.get_model(a["image_arch"], weights=a["image_weights"] if load else None)
        image_dim = img.fc.in_features
        img.fc = nn.Identity()  # the pooled features go to the fusion layer
        model = nn.ModuleDict(
            {
                "text": text,
                "img": img,
                "fusion": FusionLayer(text.config.hidden_size, image_dim, a["fusion_hidden"], a["num_labels"]),
            }
        )
        if a["freeze_lower"]:  # the report's advice: keep the pretrained lower layers as they are
            for p in model["text"].embeddings.parameters():
                p.requires_grad = False
            for name, p in model["img"].named_parameters():
                if name.startswith(("conv1.", "bn1.")):  # the CNN's stem
                    p.requires_grad = False
        return model

    def datasets(self):
        folder, a = Path(self.args["data_dir"]), self.args
        return tuple(
            PostDataset(folder / f"{split}.jsonl", self.tokenizer, a["max_length"], a["image_size"])
            for split in ("train", "validation")
        )

    def collate(self, samples):
        text, pixels, labels = super().collate(samples)  # the (text_input_dict, image, label) tuples, batched
        return {"text": text, "pixels": pixels, "labels": labels}

    def forward(self, model, batch):
        text_features = model["text"](**batch["text"]).last_hidden_state[:, 0]  # <s>
        image_features = model["img"](batch["pixels"])
        return model["fusion"](text_features, image_features)

    def block_classes(self):
        # FSDP units and activation-checkpointing targets: RoBERTa's layers and the CNN's repeated blocks.
        return ("RobertaLayer", IMAGE_BLOCKS[self.args["image_arch"]])
