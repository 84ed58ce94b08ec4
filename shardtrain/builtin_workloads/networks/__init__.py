"""The built-in workloads' networks, built from the config: RoBERTa + ResNet/DenseNet fusion and Longformer,
and their inverse for exports (`build_model(mcfg, dcfg, vocab_size)`).

Every model is an nn.Module with forward(input_ids, attention_mask, pixel_values=None) -> logits,
block_classes(), freezable_parameter_names(n), export_config() and batch_keys (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import dataclasses

from torch import nn

from shardtrain.builtin_workloads.networks.archs import KNOWN_TEXT_ARCHS, text_config_for
from shardtrain.builtin_workloads.settings import BuiltinModelConfig
from shardtrain.config.settings import ConfigError, DataConfig, where

__all__ = [
    "build_model",
    "uses_batchnorm",
    "build_model_from_export",
    "batchnorm_modules",
    "text_config_for",
    "KNOWN_TEXT_ARCHS",
]


def build_model(
    mcfg: BuiltinModelConfig, dcfg: DataConfig, vocab_size: int | None = None, load_weights: bool = True
) -> nn.Module:
    """`load_weights=False` gives the same architecture (hub config included) with nothing loaded:
    what ranks that receive their weights from rank 0 build, usually on the meta device."""
    text_cfg = text_config_for(mcfg, dcfg, vocab_size)
    if not load_weights:
        mcfg = dataclasses.replace(mcfg, pretrained=False, image_weights=None)
    if mcfg.name == "longformer":
        from shardtrain.builtin_workloads.networks.longformer import LongformerClassifier as classifier
    else:
        from shardtrain.builtin_workloads.networks.multimodal import MultimodalClassifier as classifier
    try:
        return classifier(mcfg, text_cfg)
    except ValueError as e:
        if not mcfg.text_config:
            raise
        # transformers checks a config's values only as it builds the layers (a hidden size the heads do not
        # divide, a dropout above 1): name the setting the user wrote, not transformers' ValueError.
        raise ConfigError(f"{where('text_config')} {mcfg.text_config}: the text model cannot be built: {e}") from None


def build_model_from_export(d: dict) -> nn.Module:
    """Rebuild the architecture (random init, no hub access) from `model.export_config()`; load weights after."""
    if d.get("name") == "longformer":
        from shardtrain.builtin_workloads.networks.longformer import rebuild
    elif d.get("name") == "multimodal":
        from shardtrain.builtin_workloads.networks.multimodal import rebuild
    else:
        raise ConfigError(f"exported model config: unknown model name {d.get('name')!r}")
    return rebuild(d)


def batchnorm_modules(model: nn.Module) -> list[nn.Module]:
    """BatchNorm layers, which the precision code keeps in fp32 (bf16 BN fails under FSDP2 / DeepSpeed)."""
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def uses_batchnorm(mcfg: BuiltinModelConfig) -> bool:
    """Known from the config alone, before anything is built (the DeepSpeed fp16 check needs it)."""
    return mcfg.name == "multimodal"
