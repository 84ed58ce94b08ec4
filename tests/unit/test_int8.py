"""export --int8 on torchao: Linear and embedding weights int8, saved as torchao documents it
(torch.save of the quantized state_dict), loaded back with transformers + torch alone; no deprecation warnings;
a cut-off file is one line. The CLI round trip (export --int8, predict --int8): tests/dist/test_export_files.py."""

from __future__ import annotations

import warnings

import pytest
import torch

from shardtrain.builtin_workloads.networks import build_model
from shardtrain.checkpointing.export import load_int8_weights, save_int8
from shardtrain.config.settings import ConfigError, parse_cli


@pytest.fixture
def longformer(tmp_path):
    """A fresh tiny model per test: save_int8 quantizes in place."""
    cfg = parse_cli(["--config", "configs/longformer_tiny.yaml", "--output-dir", str(tmp_path / "run")])
    torch.manual_seed(0)
    return build_model(cfg.model, cfg.data, 300, load_weights=False).eval()


def test_longformer_int8_loads_into_a_plain_transformers_model(longformer, tmp_path):
    from safetensors.torch import save_file
    from torchao.quantization import Int8Tensor
    from transformers import LongformerForSequenceClassification

    save_file({k: v.contiguous() for k, v in longformer.hf.state_dict().items()}, str(tmp_path / "fp32.safetensors"))
    batch = {"input_ids": torch.randint(3, 300, (2, 40)), "attention_mask": torch.ones(2, 40, dtype=torch.long)}
    with torch.no_grad():
        fp32 = longformer(**batch)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            save_int8(longformer.hf, tmp_path / "model_int8.pt")  # quantizes in place
            int8 = longformer(**batch)
    assert not [w for w in caught if issubclass(w.category, (DeprecationWarning, FutureWarning))], [
        str(w.message) for w in caught
    ]
    # Weights 4x smaller; what stays fp32 (LayerNorm, biases) keeps the file above a quarter.
    ratio = (tmp_path / "fp32.safetensors").stat().st_size / (tmp_path / "model_int8.pt").stat().st_size
    assert ratio > 2.5, ratio
    assert (int8.argmax(-1) == fp32.argmax(-1)).all() and (int8 - fp32).abs().max() < 0.05 * fp32.abs().max() + 1e-3

    # The README's lines: transformers builds the architecture, torchao's documented load fills it.
    plain = LongformerForSequenceClassification(longformer.hf.config).eval()
    plain.load_state_dict(torch.load(tmp_path / "model_int8.pt", weights_only=True), assign=True)
    assert isinstance(plain.longformer.embeddings.word_embeddings.weight, Int8Tensor)
    assert isinstance(plain.classifier.dense.weight, Int8Tensor)
    with torch.no_grad():
        assert torch.equal(plain(**batch).logits, int8)


def test_a_cut_off_int8_file_is_one_line(longformer, tmp_path):
    save_int8(longformer.hf, tmp_path / "model_int8.pt")
    data = (tmp_path / "model_int8.pt").read_bytes()
    (tmp_path / "model_int8.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(ConfigError, match=r"model_int8.pt: cannot load the INT8 weights \(truncated"):
        load_int8_weights(longformer.hf, tmp_path / "model_int8.pt")
    with pytest.raises(ConfigError, match="not found; `shardtrain export CKPT OUT --int8` writes it"):
        load_int8_weights(longformer.hf, tmp_path / "missing.pt")


# A user's own model, loaded in a process that has not imported torchao (or transformers, which imports it).
PLAIN_LOAD = """
import sys
from pathlib import Path
import torch
from torch import nn
from shardtrain.checkpointing.export import load_int8_weights
assert "torchao" not in sys.modules
model = load_int8_weights(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3)), Path(sys.argv[1]))
print(type(model[0].weight).__name__)
"""


def test_a_users_int8_model_loads_in_a_process_without_torchao_imported(tmp_path):
    """`predict EXPORT --int8` of a user's workload: torch.load(weights_only=True) refused torchao's tensor
    types ("Unsupported global") until torchao was imported."""
    import subprocess
    import sys

    from launch import test_env
    from torch import nn

    torch.manual_seed(0)
    save_int8(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3)), tmp_path / "model_int8.pt")
    done = subprocess.run(
        [sys.executable, "-c", PLAIN_LOAD, str(tmp_path / "model_int8.pt")],
        env=test_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "Int8Tensor"
