"""Text architectures known offline, and resolution of the text model's HF config.

The table lets `pretrained: false` (random init) and the memory planner work with no network: the values are
those of the real configs on the Hugging Face hub, so a random-init run has the same shapes as the real model.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from transformers import AutoConfig, PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from shardtrain.builtin_workloads.settings import BuiltinModelConfig
from shardtrain.config.settings import ConfigError, DataConfig, where

_ROBERTA_COMMON = dict(
    model_type="roberta",
    vocab_size=50265,
    type_vocab_size=1,
    pad_token_id=1,
    bos_token_id=0,
    eos_token_id=2,
    layer_norm_eps=1e-5,
    hidden_act="gelu",
    initializer_range=0.02,
    hidden_dropout_prob=0.1,
    attention_probs_dropout_prob=0.1,
)
_BASE = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)
_LARGE = dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096)

KNOWN_TEXT_ARCHS: dict[str, dict] = {
    "roberta-base": {**_ROBERTA_COMMON, **_BASE, "max_position_embeddings": 514},
    "roberta-large": {**_ROBERTA_COMMON, **_LARGE, "max_position_embeddings": 514},
    "allenai/longformer-base-4096": {
        **_ROBERTA_COMMON,
        **_BASE,
        "model_type": "longformer",
        "sep_token_id": 2,
        "max_position_embeddings": 4098,
        "attention_window": [512] * 12,
    },
    "allenai/longformer-large-4096": {
        **_ROBERTA_COMMON,
        **_LARGE,
        "model_type": "longformer",
        "sep_token_id": 2,
        "max_position_embeddings": 4098,
        "attention_window": [512] * 24,
    },
}
# Which HF model_type each model.name builds on (multimodal uses RobertaModel, longformer its own classes).
MODEL_TYPE_OF = {"multimodal": "roberta", "longformer": "longformer"}


def config_from_dict(d: dict) -> PretrainedConfig:
    """Rebuild a config from `PretrainedConfig.to_dict()` output (also after a JSON round trip)."""
    d = dict(d)
    return CONFIG_MAPPING[d.pop("model_type")](**d)


def _base_config(mcfg: BuiltinModelConfig) -> PretrainedConfig:
    name = mcfg.text_model
    local = Path(name)
    if mcfg.pretrained or (local / "config.json").is_file():
        # The real code path: a hub name (downloaded or from the HF cache) or a local folder.
        try:
            return AutoConfig.from_pretrained(name)
        except (OSError, ValueError) as e:
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(
                f"{where('text_model')}: cannot load the config of '{name}' ({msg}); offline, "
                f"use pretrained: false with one of {', '.join(KNOWN_TEXT_ARCHS)}"
            ) from None
    if name in KNOWN_TEXT_ARCHS:
        return config_from_dict(copy.deepcopy(KNOWN_TEXT_ARCHS[name]))
    raise ConfigError(
        f"{where('text_model')}: unknown architecture '{name}' with pretrained: false and no "
        f"{name}/config.json; known: {', '.join(KNOWN_TEXT_ARCHS)}"
    )


def text_config_for(mcfg: BuiltinModelConfig, dcfg: DataConfig, vocab_size: int | None = None) -> PretrainedConfig:
    """The resolved HF config of the text model: base config, then dropout, overrides, vocab and window."""
    cfg = _base_config(mcfg)
    want = MODEL_TYPE_OF[mcfg.name]
    if cfg.model_type != want:
        examples = [n for n, a in KNOWN_TEXT_ARCHS.items() if a["model_type"] == want]
        raise ConfigError(
            f"{where('text_model')}: '{mcfg.text_model}' is a {cfg.model_type} model but "
            f"{where('name')} '{mcfg.name}' needs a {want} one, e.g. {examples[0]}"
        )
    # Our dropout goes into the encoder too, so `dropout: 0` makes a run deterministic for parity checks.
    cfg.hidden_dropout_prob = mcfg.dropout
    cfg.attention_probs_dropout_prob = mcfg.dropout
    # Weights are trained in fp32 (autocast does the rest); transformers 5 would otherwise keep a config dtype.
    cfg.dtype = "float32"
    for key, value in mcfg.text_config.items():
        if not hasattr(cfg, key):
            raise ConfigError(f"{where('text_config')}: '{key}' is not a field of the {cfg.model_type} config")
        setattr(cfg, key, value)
    if vocab_size is not None:  # a locally trained tokenizer
        cfg.vocab_size = vocab_size
    if dcfg.label_names:  # the data's class names (sources.py): an exported HF model carries them
        cfg.id2label = dict(enumerate(dcfg.label_names))
        cfg.label2id = {name: i for i, name in enumerate(dcfg.label_names)}
    cfg.num_labels = mcfg.num_labels

    if cfg.model_type == "longformer":
        # An explicit text_config.attention_window (e.g. a per-layer list) is more specific than the flag.
        window = mcfg.text_config.get("attention_window", mcfg.attention_window)
        windows = [window] * cfg.num_hidden_layers if isinstance(window, int) else list(window)
        if len(windows) != cfg.num_hidden_layers or any(w <= 0 or w % 2 for w in windows):
            raise ConfigError(
                f"{where('attention_window')}: {window} must be a positive even number "
                f"(or one per layer, {cfg.num_hidden_layers} layers)"
            )
        cfg.attention_window = windows
    # RoBERTa-style positions start at pad_token_id + 1, so max_length tokens need max_length + 2 positions.
    need = dcfg.max_length + cfg.pad_token_id + 1
    if cfg.max_position_embeddings < need:
        if mcfg.pretrained:
            raise ConfigError(
                f"{where('max_length')}={dcfg.max_length} is more than '{mcfg.text_model}' supports "
                f"({cfg.max_position_embeddings - cfg.pad_token_id - 1} tokens)"
            )
        cfg.max_position_embeddings = need
    return cfg


def load_pretrained(model_cls, name: str, cfg: PretrainedConfig, **kwargs):
    """`model_cls.from_pretrained(name, config=cfg)` in fp32, resizing embeddings for another tokenizer's vocab.

    transformers 5 loads in the checkpoint's dtype by default (dtype="auto"); master weights must be fp32.
    A different vocab_size cannot go into from_pretrained (shape mismatch), so load with the hub's and resize.
    """
    vocab = cfg.vocab_size
    cfg = copy.deepcopy(cfg)
    cfg.vocab_size = AutoConfig.from_pretrained(name).vocab_size
    model = model_cls.from_pretrained(name, config=cfg, dtype=torch.float32, **kwargs)
    if vocab != cfg.vocab_size:
        model.resize_token_embeddings(vocab)
    return model
