"""Longformer for long-document classification: HF's classifier, wrapped to the ShardtrainModel contract."""

from __future__ import annotations

import torch
from torch import nn
from transformers import LongformerForSequenceClassification, PretrainedConfig
from transformers.models.longformer.modeling_longformer import LongformerLayer

from shardtrain.builtin_workloads.networks.archs import config_from_dict, load_pretrained
from shardtrain.builtin_workloads.networks.multimodal import present_classes
from shardtrain.builtin_workloads.settings import BuiltinModelConfig


class LongformerClassifier(nn.Module):
    batch_keys = ("input_ids", "attention_mask")

    def __init__(self, mcfg: BuiltinModelConfig, text_cfg: PretrainedConfig):
        super().__init__()
        self.mcfg, self.text_cfg = mcfg, text_cfg
        # No SDPA here: Longformer's sliding-window attention is its own kernel (transformers has no SDPA path).
        if mcfg.pretrained:
            self.hf = load_pretrained(LongformerForSequenceClassification, mcfg.text_model, text_cfg)
        else:
            self.hf = LongformerForSequenceClassification(text_cfg)

    def forward(self, input_ids, attention_mask, pixel_values=None):
        # Global attention on <s> (CLS): the classification head reads it, so it must see the whole document.
        # HF pads the inputs to a multiple of the attention window itself.
        global_mask = torch.zeros_like(input_ids)
        global_mask[:, 0] = 1
        return self.hf(input_ids=input_ids, attention_mask=attention_mask, global_attention_mask=global_mask).logits

    def block_classes(self) -> tuple[type[nn.Module], ...]:
        return present_classes(self, (LongformerLayer,))

    def freezable_parameter_names(self, freeze_layers: int) -> list[str]:
        if freeze_layers <= 0:
            return []
        n = min(freeze_layers, self.text_cfg.num_hidden_layers)
        prefixes = ("hf.longformer.embeddings.",) + tuple(f"hf.longformer.encoder.layer.{i}." for i in range(n))
        return [name for name, _ in self.named_parameters() if name.startswith(prefixes)]

    def export_config(self) -> dict:
        m = self.mcfg
        return {
            "name": "longformer",
            "text_model": m.text_model,
            "text_config": self.text_cfg.to_dict(),
            "dropout": m.dropout,
            "num_labels": m.num_labels,
        }


def rebuild(d: dict) -> LongformerClassifier:
    mcfg = BuiltinModelConfig(
        name="longformer",
        text_model=d["text_model"],
        pretrained=False,
        dropout=d["dropout"],
        num_labels=d["num_labels"],
    )
    return LongformerClassifier(mcfg, config_from_dict(d["text_config"]))
