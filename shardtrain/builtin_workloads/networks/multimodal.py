"""RoBERTa text encoder + torchvision image encoder + a small fusion head."""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch
import torchvision
from torch import nn
from torchvision.models.densenet import DenseNet, _DenseBlock
from torchvision.models.resnet import BasicBlock, Bottleneck, ResNet
from transformers import PretrainedConfig, RobertaModel
from transformers.models.roberta.modeling_roberta import RobertaLayer

from shardtrain.builtin_workloads.networks.archs import config_from_dict, load_pretrained
from shardtrain.builtin_workloads.settings import BuiltinModelConfig
from shardtrain.config.settings import ConfigError, where

# Constructor defaults of the torchvision builders; image_config overrides them. Calling ResNet/DenseNet
# directly (not resnet50(**kw)) is what lets image_config change `layers` or `block_config`.
IMAGE_ARCHS = {
    "resnet18": (ResNet, dict(block=BasicBlock, layers=[2, 2, 2, 2])),
    "resnet50": (ResNet, dict(block=Bottleneck, layers=[3, 4, 6, 3])),
    "densenet121": (DenseNet, dict(growth_rate=32, block_config=(6, 12, 24, 16), num_init_features=64)),
}
HEAD_PREFIXES = ("fc.", "classifier.")  # the ImageNet classifier we replace, so its weights may be missing
# torchvision's DenseNet checkpoints use old names ("norm.1"); torchvision remaps them the same way.
_LEGACY_DENSENET = re.compile(
    r"^(.*denselayer\d+\.(?:norm|relu|conv))\.((?:[12])\.(?:weight|bias|running_mean|running_var))$"
)


def _load_weights_file(path: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{where('image_weights')}: file not found: {path}")
    if p.suffix == ".safetensors":
        from safetensors.torch import load_file

        sd = load_file(str(p))
    else:
        sd = torch.load(p, map_location="cpu", weights_only=True)
        if isinstance(sd, dict) and isinstance(sd.get("state_dict"), dict):  # a training checkpoint
            sd = sd["state_dict"]
    return {_LEGACY_DENSENET.sub(r"\1\2", k): v for k, v in sd.items()}


def build_image_encoder(mcfg: BuiltinModelConfig) -> tuple[nn.Module, int]:
    """torchvision backbone with its classifier replaced by Identity -> (module, pooled feature dim)."""
    cls, defaults = IMAGE_ARCHS[mcfg.image_model]
    kwargs = {**defaults, **mcfg.image_config}
    if isinstance(kwargs.get("block"), str):  # YAML can only name the ResNet block
        kwargs["block"] = {"BasicBlock": BasicBlock, "Bottleneck": Bottleneck}[kwargs["block"]]
    try:
        net = cls(**kwargs)
    except TypeError as e:
        raise ConfigError(f"{where('image_config')}: {e}") from None

    w = mcfg.image_weights
    if w:
        if Path(w).suffix in (".pth", ".pt", ".bin", ".safetensors") or Path(w).exists():
            sd = _load_weights_file(w)
        else:
            try:  # a torchvision weights name; downloads into the torch hub cache on first use
                sd = torchvision.models.get_model_weights(mcfg.image_model)[w].get_state_dict(progress=False)
            except KeyError:
                names = [e.name for e in torchvision.models.get_model_weights(mcfg.image_model)]
                raise ConfigError(
                    f"{where('image_weights')}: '{w}' is neither a file nor a {mcfg.image_model} "
                    f"weights name ({', '.join(names)})"
                ) from None
            sd = {_LEGACY_DENSENET.sub(r"\1\2", k): v for k, v in sd.items()}
        sd = {k: v for k, v in sd.items() if not k.startswith(HEAD_PREFIXES)}
        try:
            missing, unexpected = net.load_state_dict(sd, strict=False)
        except RuntimeError as e:  # shape mismatches: weights of another architecture / image_config
            raise ConfigError(
                f"{where('image_weights')}: {w} does not fit {mcfg.image_model} "
                f"{mcfg.image_config or ''}: {' '.join(str(e).split())[:400]}"
            ) from None
        missing = [k for k in missing if not k.startswith(HEAD_PREFIXES)]
        if missing or unexpected:
            raise ConfigError(
                f"{where('image_weights')}: {w} does not fit {mcfg.image_model}: "
                f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
            )

    head = "fc" if isinstance(net, ResNet) else "classifier"
    dim = getattr(net, head).in_features
    setattr(net, head, nn.Identity())  # forward then ends with the pooled, flattened features
    return net, dim


class FusionHead(nn.Module):
    def __init__(self, kind: str, text_dim: int, img_dim: int, hidden: int, num_labels: int, dropout: float):
        super().__init__()
        self.kind = kind
        if kind == "concat":
            self.mlp = nn.Sequential(
                nn.Linear(text_dim + img_dim, hidden), nn.GELU(), nn.Dropout(dropout), nn.Linear(hidden, num_labels)
            )
        else:  # gated: a per-feature learned mix, so either modality can dominate per example
            self.text_proj = nn.Linear(text_dim, hidden)
            self.image_proj = nn.Linear(img_dim, hidden)
            self.gate = nn.Linear(2 * hidden, hidden)
            self.classifier = nn.Sequential(nn.GELU(), nn.Dropout(dropout), nn.Linear(hidden, num_labels))

    def forward(self, t: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        if self.kind == "concat":
            return self.mlp(torch.cat([t, i], dim=-1))
        t, i = self.text_proj(t), self.image_proj(i)
        g = torch.sigmoid(self.gate(torch.cat([t, i], dim=-1)))
        return self.classifier(g * t + (1 - g) * i)


class MultimodalClassifier(nn.Module):
    batch_keys = ("input_ids", "attention_mask", "pixel_values")

    def __init__(self, mcfg: BuiltinModelConfig, text_cfg: PretrainedConfig):
        super().__init__()
        self.mcfg, self.text_cfg = mcfg, text_cfg
        if mcfg.pretrained:
            self.text = load_pretrained(
                RobertaModel, mcfg.text_model, text_cfg, add_pooling_layer=False, attn_implementation=mcfg.attention
            )
        else:
            text_cfg._attn_implementation = mcfg.attention
            self.text = RobertaModel(text_cfg, add_pooling_layer=False)
        self.image, img_dim = build_image_encoder(mcfg)
        self.head = FusionHead(
            mcfg.fusion, text_cfg.hidden_size, img_dim, mcfg.fusion_hidden, mcfg.num_labels, mcfg.dropout
        )

    def forward(self, input_ids, attention_mask, pixel_values=None):
        if pixel_values is None:
            raise ValueError("the multimodal model needs pixel_values")
        # The <s> (CLS) hidden state; no pooler: its tanh layer is pretrained on NSP-like data RoBERTa never saw.
        t = self.text(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state[:, 0]
        if self.mcfg.channels_last:
            # Only the input: a channels-last input makes every convolution run (and emit) channels-last.
            # The weights stay contiguous: FSDP2 and DeepSpeed reject non-contiguous parameters (measured).
            pixel_values = pixel_values.contiguous(memory_format=torch.channels_last)
        return self.head(t, self.image(pixel_values))

    def block_classes(self) -> tuple[type[nn.Module], ...]:
        return present_classes(self, (RobertaLayer, Bottleneck, BasicBlock, _DenseBlock))

    def freezable_parameter_names(self, freeze_layers: int) -> list[str]:
        if freeze_layers <= 0:
            return []
        n_text = self.text_cfg.num_hidden_layers
        n = min(freeze_layers, n_text)
        prefixes = ["text.embeddings."] + [f"text.encoder.layer.{i}." for i in range(n)]
        # The CNN stem always goes with the text embeddings; then a share of its stages matching the text share
        # (floor: freeze no more than asked). BatchNorm running stats are buffers, not listed: keeping them
        # fixed is the trainer's call (eval mode for frozen BN).
        if isinstance(self.image, ResNet):
            stem, tail = ["conv1.", "bn1."], []
            stages = [[f"layer{k}."] for k in range(1, 5)]
        else:  # a DenseNet stage is its dense block plus the transition after it
            stem, tail = ["features.conv0.", "features.norm0."], ["features.norm5."]
            blocks = [name for name, _ in self.image.features.named_children() if name.startswith("denseblock")]
            stages = [[f"features.{b}.", f"features.{b.replace('denseblock', 'transition')}."] for b in blocks]
        k = math.floor(len(stages) * n / n_text)
        img = stem + [p for stage in stages[:k] for p in stage] + (tail if k == len(stages) else [])
        prefixes += ["image." + p for p in img]
        return [name for name, _ in self.named_parameters() if name.startswith(tuple(prefixes))]

    def export_config(self) -> dict:
        m = self.mcfg
        return {
            "name": "multimodal",
            "text_model": m.text_model,
            "text_config": self.text_cfg.to_dict(),
            "image_model": m.image_model,
            "image_config": _plain(m.image_config),
            "fusion": m.fusion,
            "fusion_hidden": m.fusion_hidden,
            "dropout": m.dropout,
            "num_labels": m.num_labels,
        }


def _plain(d: dict) -> dict:
    """JSON-safe copy (a ResNet block class becomes its name, which build_image_encoder accepts)."""
    return {k: (v.__name__ if isinstance(v, type) else v) for k, v in d.items()}


def present_classes(model: nn.Module, candidates: tuple[type, ...]) -> tuple[type[nn.Module], ...]:
    """The candidate classes that actually occur in the model, by isinstance, in first-seen order."""
    found = []
    for mod in model.modules():
        for cls in candidates:
            if isinstance(mod, cls) and cls not in found:
                found.append(cls)
    return tuple(found)


def rebuild(d: dict) -> MultimodalClassifier:
    mcfg = BuiltinModelConfig(
        name="multimodal",
        text_model=d["text_model"],
        pretrained=False,
        image_model=d["image_model"],
        image_config=dict(d["image_config"]),
        fusion=d["fusion"],
        fusion_hidden=d["fusion_hidden"],
        dropout=d["dropout"],
        num_labels=d["num_labels"],
    )
    return MultimodalClassifier(mcfg, config_from_dict(d["text_config"]))
