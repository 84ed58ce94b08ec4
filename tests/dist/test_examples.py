"""The examples outside the package (issue 13), trained under ddp / fsdp / zero2 / zero3 on 2 CPU ranks in one
launch (tests/dist/matrix_driver.py), with parity against DDP: fp32 step-1 grad-norm within 1e-5 relative and
10-step losses within 1e-4 relative; evaluation counts every validation example once.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from launch import REPO, strategy_variants, torchrun

DRIVER = REPO / "tests" / "dist" / "matrix_driver.py"
STRATEGIES = ("ddp", "fsdp", "zero2", "zero3")
STEPS, GRAD_NORM_RTOL, LOSS_RTOL = 10, 1e-5, 1e-4


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def bert_tokenizer(data_dir: Path, out: Path) -> Path:
    """A word-level BERT tokenizer over the data's own words: no download."""
    from transformers import BertTokenizerFast

    words = sorted({w for line in (data_dir / "train.jsonl").read_text().splitlines() if line.strip()
                    for w in json.loads(line)["text"].lower().split()})
    out.mkdir(parents=True, exist_ok=True)
    (out / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    BertTokenizerFast(vocab_file=str(out / "vocab.txt")).save_pretrained(str(out / "tok"))
    return out / "tok"


@pytest.fixture(scope="module")
def hf_text(mm_data, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("hf_text")
    tok = bert_tokenizer(mm_data, root / "tokenizer")
    from transformers import AutoTokenizer
    args = {"data_dir": str(mm_data), "tokenizer": str(tok), "num_labels": 3, "max_length": 32,
            "model_config": {"model_type": "bert", "vocab_size": len(AutoTokenizer.from_pretrained(str(tok))),
                             "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
                             "intermediate_size": 64, "max_position_embeddings": 64,
                             "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}}
    variants = strategy_variants()
    plan = [{"name": s, "args": ["--config", str(REPO / "examples/hf_text_classifier/config.yaml"),
                                 "--workload-args", json.dumps(args), *variants[s], "--device", "cpu",
                                 "--output-dir", str(root / s), "--resume", "none", "--max-steps", str(STEPS),
                                 "--per-device-batch-size", "8", "--lr", "1e-3", "--warmup-steps", "0",
                                 "--num-workers", "0", "--log-every", "100", "--save-final", "false",
                                 "--predict-memory", "false", "--report", "false"]}
            for s in STRATEGIES]
    (root / "plan.json").write_text(json.dumps(plan))
    torchrun([str(root / "plan.json"), str(root)], script=DRIVER, timeout=600)
    return json.loads((root / "results.json").read_text())


def test_hf_text_classifier_trains_on_every_strategy_with_parity(hf_text):
    ref = hf_text["ddp"]
    print("\nexamples/hf_text_classifier parity against ddp: strategy | step-1 grad-norm rel | max loss rel")
    for s in STRATEGIES:
        r = hf_text[s]
        assert r["ok"] and len(r["losses"]) == STEPS, (s, r)
        g = rel(r["grad_norms"][0], ref["grad_norms"][0])
        loss = max(rel(a, b) for a, b in zip(r["losses"], ref["losses"]))
        print(f"  {s:6s} | {g:.2e} | {loss:.2e}")
        assert g <= GRAD_NORM_RTOL, (s, r["grad_norms"][0], ref["grad_norms"][0])
        assert loss <= LOSS_RTOL, (s, r["losses"], ref["losses"])
        assert r["eval"]["n_examples"] == 64, (s, r["eval"])  # every validation example once across 2 ranks
    assert all(math.isfinite(x) for x in ref["losses"]) and ref["losses"][-1] < ref["losses"][0], ref["losses"]
