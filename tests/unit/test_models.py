"""Tiny, CPU-only checks of shardtrain.builtin_workloads.networks (no hub, no downloads)."""

import json
from dataclasses import replace

import pytest
import torch
import torchvision
from safetensors.torch import save_file

from shardtrain.builtin_workloads.networks import batchnorm_modules, build_model, build_model_from_export
from shardtrain.builtin_workloads.settings import BuiltinModelConfig as ModelConfig
from shardtrain.config.settings import ConfigError, DataConfig

TINY_TEXT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
VOCAB = 300
B, L = 2, 16


def mm_cfg(image_model="resnet18", fusion="concat", **kw):
    image_config = (
        {"layers": [1, 1, 1, 1]}
        if image_model.startswith("resnet")
        else {"growth_rate": 8, "block_config": (2, 2), "num_init_features": 16}
    )
    return ModelConfig(
        name="multimodal",
        text_model="roberta-base",
        pretrained=False,
        text_config=TINY_TEXT,
        image_model=image_model,
        image_config=image_config,
        fusion=fusion,
        fusion_hidden=16,
        dropout=0.0,
        num_labels=3,
        **kw,
    )


def lf_cfg():
    return ModelConfig(
        name="longformer",
        text_model="allenai/longformer-base-4096",
        pretrained=False,
        text_config=TINY_TEXT,
        attention_window=8,
        dropout=0.0,
        num_labels=3,
    )


def batch(seq=L, images=True):
    torch.manual_seed(0)
    b = {"input_ids": torch.randint(3, VOCAB, (B, seq)), "attention_mask": torch.ones(B, seq, dtype=torch.long)}
    b["attention_mask"][1, seq // 2 :] = 0
    if images:
        b["pixel_values"] = torch.randn(B, 3, 32, 32)
    return b


DCFG = DataConfig(max_length=64, image_size=32)
MODELS = {
    "resnet18-concat": lambda: mm_cfg("resnet18", "concat"),
    "resnet50-gated": lambda: mm_cfg("resnet50", "gated"),
    "densenet-concat": lambda: mm_cfg("densenet121", "concat"),
    "densenet-gated": lambda: mm_cfg("densenet121", "gated"),
    "longformer": lf_cfg,
}


@pytest.mark.parametrize("kind", MODELS)
def test_forward_shape_and_blocks(kind):
    mcfg = MODELS[kind]()
    model = build_model(mcfg, DCFG, vocab_size=VOCAB)
    b = batch(seq=64 if kind == "longformer" else L, images=mcfg.name == "multimodal")
    assert set(model.batch_keys) == set(b)
    logits = model(**b)
    assert logits.shape == (B, 3)
    assert torch.isfinite(logits).all()
    blocks = model.block_classes()
    assert blocks and all(any(isinstance(m, c) for m in model.modules()) for c in blocks)
    if mcfg.name == "multimodal":
        assert len(blocks) == 2 and blocks[0].__name__ == "RobertaLayer"
        assert batchnorm_modules(model)
    else:
        assert [c.__name__ for c in blocks] == ["LongformerLayer"]


@pytest.mark.parametrize("kind", MODELS)
def test_freezable_names(kind):
    model = build_model(MODELS[kind](), DCFG, vocab_size=VOCAB)
    params = dict(model.named_parameters())
    assert model.freezable_parameter_names(0) == []
    names = model.freezable_parameter_names(1)
    assert names and all(n in params for n in names)
    assert any(".embeddings." in n for n in names)
    assert any(".layer.0." in n for n in names) and not any(".layer.1." in n for n in names)
    if kind.startswith("resnet"):  # 1 of 2 text layers -> stem + layer1, layer2
        assert "image.conv1.weight" in names and any(n.startswith("image.layer2.") for n in names)
        assert not any(n.startswith("image.layer3.") for n in names)
    elif kind.startswith("densenet"):  # 1 of 2 text layers -> stem + first dense block
        assert "image.features.conv0.weight" in names and "image.features.norm0.weight" in names
        assert any(n.startswith("image.features.denseblock1.") for n in names)
        assert not any(n.startswith("image.features.denseblock2.") for n in names)
    assert not any(n.startswith("head.") for n in model.freezable_parameter_names(99))


@pytest.mark.parametrize("kind", ["resnet50-gated", "densenet-concat", "longformer"])
def test_export_round_trip(kind):
    model = build_model(MODELS[kind](), DCFG, vocab_size=VOCAB)
    exported = json.loads(json.dumps(model.export_config()))  # must survive JSON, as `shardtrain export` writes it
    rebuilt = build_model_from_export(exported)
    a, b = model.state_dict(), rebuilt.state_dict()
    assert a.keys() == b.keys()
    assert all(a[k].shape == b[k].shape for k in a)
    rebuilt.load_state_dict(a)
    bt = batch(seq=64 if kind == "longformer" else L, images=kind != "longformer")
    model.eval(), rebuilt.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(**bt), rebuilt(**bt))


def test_text_config_resolution():
    model = build_model(lf_cfg(), DataConfig(max_length=600), vocab_size=VOCAB)
    cfg = model.text_cfg
    assert cfg.attention_window == [8, 8] and cfg.vocab_size == VOCAB
    assert cfg.max_position_embeddings == 4098 and cfg.hidden_dropout_prob == 0.0
    big = build_model(mm_cfg(), DataConfig(max_length=1000), vocab_size=VOCAB)
    assert big.text_cfg.max_position_embeddings == 1002  # grown for random init (positions start at pad+1)


@pytest.mark.parametrize(
    "change, says",
    [
        ({"hidden_size": 63}, "is not a multiple of the number of attention heads"),
        ({"hidden_dropout_prob": 3}, "dropout probability has to be between 0 and 1"),
    ],
)
def test_a_text_config_transformers_cannot_build_is_named_in_one_line(change, says):
    """transformers checks these as it builds the layers: the run ended in `ValueError: ...` (exit 1) that named
    neither --text-config nor model.text_config."""
    mcfg = replace(mm_cfg(), text_config={**TINY_TEXT, **change})
    with pytest.raises(ConfigError) as e:
        build_model(mcfg, DataConfig(max_length=32), vocab_size=VOCAB)
    assert str(e.value).startswith("--text-config (model.text_config) {") and says in str(e.value), str(e.value)
    assert "the text model cannot be built: " in str(e.value)


def test_local_safetensors_image_weights(tmp_path):
    ref = torchvision.models.resnet.ResNet(torchvision.models.resnet.BasicBlock, [1, 1, 1, 1])
    good = tmp_path / "resnet.safetensors"
    save_file(ref.state_dict(), str(good))
    model = build_model(mm_cfg(image_weights=str(good)), DCFG, vocab_size=VOCAB)
    torch.testing.assert_close(model.image.conv1.weight, ref.conv1.weight)
    torch.testing.assert_close(model.image.layer4[0].bn2.running_var, ref.layer4[0].bn2.running_var)

    bad = tmp_path / "other.safetensors"  # a different architecture: missing and unexpected keys
    sd = {k: v for k, v in ref.state_dict().items() if not k.startswith("layer4.")}
    sd["extra.weight"] = torch.zeros(1)
    save_file(sd, str(bad))
    with pytest.raises(ConfigError, match="--image-weights.*missing"):
        build_model(mm_cfg(image_weights=str(bad)), DCFG, vocab_size=VOCAB)

    wrong_shape = tmp_path / "resnet50.pt"  # same names (mostly), other shapes
    torch.save(
        torchvision.models.resnet.ResNet(torchvision.models.resnet.Bottleneck, [1, 1, 1, 1]).state_dict(), wrong_shape
    )
    with pytest.raises(ConfigError, match="--image-weights"):
        build_model(mm_cfg(image_weights=str(wrong_shape)), DCFG, vocab_size=VOCAB)


def test_unknown_text_model_raises():
    mcfg = replace(mm_cfg(), text_model="no-such/model")
    with pytest.raises(ConfigError, match="--text-model") as e:
        build_model(mcfg, DCFG)
    assert "roberta-base" in str(e.value)  # lists the known names


def test_wrong_family_and_bad_window_raise():
    mcfg = replace(lf_cfg(), text_model="roberta-base")
    with pytest.raises(ConfigError, match="--text-model"):
        build_model(mcfg, DCFG)
    mcfg = replace(lf_cfg(), attention_window=7)
    with pytest.raises(ConfigError, match="--attention-window"):
        build_model(mcfg, DCFG)


def test_pretrained_from_local_folder(tmp_path):
    """The real from_pretrained path, offline: a saved tiny model loads back in fp32, and a bigger vocab resizes."""
    model = build_model(mm_cfg(), DCFG, vocab_size=VOCAB)
    model.text.save_pretrained(tmp_path)
    mcfg = replace(mm_cfg(), text_model=str(tmp_path), pretrained=True)
    loaded = build_model(mcfg, DCFG, vocab_size=VOCAB + 4)
    emb = loaded.text.embeddings.word_embeddings.weight
    assert emb.dtype == torch.float32 and emb.shape == (VOCAB + 4, 32)
    torch.testing.assert_close(emb[:VOCAB], model.text.embeddings.word_embeddings.weight)
    torch.testing.assert_close(
        loaded.text.encoder.layer[1].output.dense.weight, model.text.encoder.layer[1].output.dense.weight
    )
