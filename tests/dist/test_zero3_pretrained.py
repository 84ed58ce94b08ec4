"""Pretrained weights under ZeRO-3: a local tiny RoBERTa (multimodal, plus torchvision image weights) and a tiny
Longformer, each trained under ZeRO-3 and DDP in one launch (tests/dist/matrix_driver.py, 2 CPU ranks).

Before the fix the partitioned copy built under `deepspeed.zero.Init` ran `from_pretrained` itself, into size-0
parameter partitions: "You set `ignore_mismatched_sizes` to `False`..." at start-up, on both workloads.

Checked: after one step at lr 1e-5 every pretrained weight in ZeRO-3's checkpoint is within Adam's per-element
step (<= lr) of the files; step-1 loss and gradient norm match DDP's; --final-model-dir exports the checkpoint's
weights; a resume from step 1 reproduces step 2.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from launch import run_plan, tiny_args

from shardtrain.checkpointing.portable import read_portable

ZERO3 = ["--ds", "ds_configs/zero3.json"]
DDP = ["--strategy", "ddp"]
LR = 1e-5  # Adam moves each weight by at most ~lr in one step: the checkpoint still shows the initial weights
GRAD_NORM_RTOL, LOSS_RTOL = 1e-5, 1e-5  # step 1 sees only the initial weights (test_matrix: 1e-5 / 1e-4)


def _randomise(module: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Every parameter away from any default init (LayerNorm's ones and zeros included), so that no tensor
    matches by accident; returns them."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05 + 0.1)
    return {k: v.detach().clone() for k, v in module.named_parameters()}


def _tokenizer(data: Path, folder: Path):
    from shardtrain.data.records import read_texts, split_path
    from shardtrain.data.tokenizer import train_bpe

    tok = train_bpe(list(read_texts(split_path(str(data), "train"))), 300)
    tok.save_pretrained(str(folder))
    return tok


def pretrained_roberta(data: Path, folder: Path) -> dict[str, torch.Tensor]:
    from transformers import RobertaConfig, RobertaModel

    tok = _tokenizer(data, folder)
    model = RobertaModel(
        RobertaConfig(
            vocab_size=len(tok),
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=40,
        )
    )
    weights = _randomise(model, 1)
    model.save_pretrained(str(folder))
    return {f"text.{k}": v for k, v in weights.items() if not k.startswith("pooler.")}  # multimodal has no pooler


def pretrained_resnet(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import save_file
    from torchvision.models.resnet import BasicBlock, ResNet

    net = ResNet(BasicBlock, [1, 1, 1, 1])  # configs/multimodal_tiny.yaml's image_config
    weights = _randomise(net, 2)
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(path))
    return {f"image.{k}": v for k, v in weights.items() if not k.startswith("fc.")}  # replaced by Identity


def pretrained_longformer(data: Path, folder: Path) -> dict[str, torch.Tensor]:
    from transformers import LongformerConfig, LongformerForSequenceClassification

    tok = _tokenizer(data, folder)
    model = LongformerForSequenceClassification(
        LongformerConfig(
            vocab_size=len(tok),
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=260,
            attention_window=16,
            num_labels=3,
        )
    )
    weights = _randomise(model, 3)
    model.save_pretrained(str(folder))
    return {f"hf.{k}": v for k, v in weights.items()}


def max_diff(got: dict, want: dict) -> float:
    missing = set(want) - set(got)
    assert not missing, f"not in the checkpoint: {sorted(missing)[:5]}"
    return max((got[k].double() - want[k].double()).abs().max().item() for k in want)


@pytest.fixture(scope="module")
def runs(mm_data, ld_data, tmp_path_factory) -> tuple[Path, dict, dict]:
    root = tmp_path_factory.mktemp("zero3_pretrained")
    want = {
        "multimodal": {
            **pretrained_roberta(mm_data, root / "roberta"),
            **pretrained_resnet(root / "resnet.safetensors"),
        },
        "longformer": pretrained_longformer(ld_data, root / "longformer"),
    }
    common = [
        "--pretrained",
        "true",
        "--text-config",
        "{}",
        "--lr",
        str(LR),
        "--warmup-steps",
        "0",
        "--max-eval-samples",
        "8",
        "--log-every",
        "100",
        "--save-every",
        "1",
        "--keep-last",
        "5",
    ]
    mm = [
        *common,
        "--text-model",
        str(root / "roberta"),
        "--image-weights",
        str(root / "resnet.safetensors"),
        "--max-length",
        "32",
        "--per-device-batch-size",
        "8",
    ]
    ld = [*common, "--text-model", str(root / "longformer"), "--per-device-batch-size", "4"]
    plan = [
        {"name": "mm/ddp", "args": tiny_args("multimodal", mm_data, root / "mm_ddp", *mm, *DDP, "--max-steps", "2")},
        {
            "name": "mm/zero3",
            "args": tiny_args(
                "multimodal",
                mm_data,
                root / "mm_zero3",
                *mm,
                *ZERO3,
                "--max-steps",
                "2",
                "--final-model-dir",
                str(root / "mm_final"),
            ),
        },
        {
            "name": "mm/zero3/resumed",
            "args": tiny_args(
                "multimodal",
                mm_data,
                root / "mm_resumed",
                *mm,
                *ZERO3,
                "--max-steps",
                "2",
                "--resume",
                str(root / "mm_zero3" / "checkpoints" / "step-000001"),
            ),
        },
        {"name": "ld/ddp", "args": tiny_args("longformer", ld_data, root / "ld_ddp", *ld, *DDP, "--max-steps", "1")},
        {
            "name": "ld/zero3",
            "args": tiny_args("longformer", ld_data, root / "ld_zero3", *ld, *ZERO3, "--max-steps", "1"),
        },
    ]
    _, results = run_plan(plan, root, timeout=300)
    print(f"\nzero3 pretrained: {len(plan)} runs, {sum(r['seconds'] for r in results.values()):.0f}s of train()")
    return root, results, want


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.mark.parametrize("workload", ["mm", "ld"])
def test_zero3_starts_from_the_pretrained_weights(runs, workload):
    root, results, want = runs
    want = want["multimodal" if workload == "mm" else "longformer"]
    step1 = read_portable(root / f"{workload}_zero3" / "checkpoints" / "step-000001")["model"]
    diff = max_diff(step1, want)
    z3, ddp = results[f"{workload}/zero3"], results[f"{workload}/ddp"]
    g, loss = rel(z3["grad_norms"][0], ddp["grad_norms"][0]), rel(z3["losses"][0], ddp["losses"][0])
    print(
        f"\n{workload}: {len(want)} pretrained tensors, max |step-1 weight - file| {diff:.2e} (lr {LR}); "
        f"step 1 vs ddp: grad norm rel {g:.2e}, loss rel {loss:.2e}"
    )
    assert diff <= 1.5 * LR
    assert g <= GRAD_NORM_RTOL and loss <= LOSS_RTOL, (z3["losses"], ddp["losses"], z3["grad_norms"], ddp["grad_norms"])


def test_zero3_pretrained_exports_and_resumes(runs):
    root, results, _ = runs
    from safetensors.torch import load_file

    final = read_portable(root / "mm_zero3" / "checkpoints" / "step-000002")["model"]
    exported = load_file(str(root / "mm_final" / "model.safetensors"))
    assert set(exported) == set(final) and max_diff(exported, final) == 0.0
    full, resumed = results["mm/zero3"]["losses"], results["mm/zero3/resumed"]["losses"]
    assert len(resumed) == 1 and abs(resumed[0] - full[1]) <= 1e-6, (full, resumed)
    again = read_portable(root / "mm_resumed" / "checkpoints" / "step-000002")["model"]
    assert max_diff(again, final) <= 1e-6
