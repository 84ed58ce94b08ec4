"""The examples outside the package (issue 13), trained under ddp / fsdp / zero2 / zero3 on 2 CPU ranks in one
launch (tests/dist/matrix_driver.py), with parity against DDP: fp32 step-1 grad-norm within 1e-5 relative and
10-step losses within 1e-4 relative; evaluation counts every validation example (token) once.
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


def lm_text(data_dir: Path, out: Path) -> Path:
    """Local text for the causal LM: the records' sentences, one per line."""
    out.mkdir(parents=True, exist_ok=True)
    for split in ("train", "validation"):
        lines = [json.loads(x)["text"].lower() for x in (data_dir / f"{split}.jsonl").read_text().splitlines() if x.strip()]
        (out / f"{split}.txt").write_text("\n".join(lines) + "\n")
    return out


@pytest.fixture(scope="module")
def examples(mm_data, tmp_path_factory) -> dict:
    """Every example under every strategy, in ONE launch of 2 ranks."""
    root = tmp_path_factory.mktemp("examples")
    tok = bert_tokenizer(mm_data, root / "tokenizer")
    from transformers import AutoTokenizer
    vocab = len(AutoTokenizer.from_pretrained(str(tok)))
    hf_text = {"data_dir": str(mm_data), "tokenizer": str(tok), "num_labels": 3, "max_length": 32,
               "model_config": {"model_type": "bert", "vocab_size": vocab, "hidden_size": 32, "num_hidden_layers": 2,
                                "num_attention_heads": 2, "intermediate_size": 64, "max_position_embeddings": 64,
                                "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}}
    causal_lm = {"text_dir": str(lm_text(mm_data, root / "text")), "tokenizer": str(tok), "block_size": 32,
                 "model_config": {"model_type": "gpt2", "vocab_size": vocab, "n_embd": 32, "n_layer": 2, "n_head": 2,
                                  "n_positions": 64, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
                                  "tie_word_embeddings": True}}
    variants = strategy_variants()
    plan = []
    for example, args, extra in (("hf_text_classifier", hf_text, []),
                                 ("causal_lm", causal_lm, ["--activation-checkpointing"])):
        for s in STRATEGIES:
            plan.append({"name": f"{example}/{s}", "args": [
                "--config", str(REPO / "examples" / example / "config.yaml"), "--workload-args", json.dumps(args),
                *variants[s], "--device", "cpu", "--output-dir", str(root / example / s), "--resume", "none",
                "--max-steps", str(STEPS), "--per-device-batch-size", "8", "--lr", "1e-3", "--warmup-steps", "0",
                "--num-workers", "0", "--log-every", "100", "--save-final", "false", "--predict-memory", "false",
                "--report", "false", *extra]})
    (root / "plan.json").write_text(json.dumps(plan))
    torchrun([str(root / "plan.json"), str(root)], script=DRIVER, timeout=900)
    return json.loads((root / "results.json").read_text())


def check_parity(results: dict, example: str) -> dict:
    ref = results[f"{example}/ddp"]
    print(f"\nexamples/{example} parity against ddp: strategy | step-1 grad-norm rel | max loss rel")
    for s in STRATEGIES:
        r = results[f"{example}/{s}"]
        assert r["ok"] and len(r["losses"]) == STEPS, (s, r)
        g = rel(r["grad_norms"][0], ref["grad_norms"][0])
        loss = max(rel(a, b) for a, b in zip(r["losses"], ref["losses"]))
        print(f"  {s:6s} | {g:.2e} | {loss:.2e}")
        assert g <= GRAD_NORM_RTOL, (s, r["grad_norms"][0], ref["grad_norms"][0])
        assert loss <= LOSS_RTOL, (s, r["losses"], ref["losses"])
    assert all(math.isfinite(x) for x in ref["losses"]) and ref["losses"][-1] < ref["losses"][0], ref["losses"]
    return ref


def test_hf_text_classifier_trains_on_every_strategy_with_parity(examples):
    check_parity(examples, "hf_text_classifier")
    for s in STRATEGIES:  # every validation example once across 2 ranks
        assert examples[f"hf_text_classifier/{s}"]["eval"]["n_examples"] == 64, (s, examples[f"hf_text_classifier/{s}"])


def test_causal_lm_with_tied_embeddings_and_checkpointed_blocks(examples):
    """Tied lm_head / token embeddings train alike under FSDP2 (one unit: both live in the root) and ZeRO-3;
    perplexity is exp(summed NLL / summed tokens) over the whole validation set."""
    check_parity(examples, "causal_lm")
    ppl = {s: examples[f"causal_lm/{s}"]["eval"] for s in STRATEGIES}
    for s, e in ppl.items():
        assert e["n_tokens"] == ppl["ddp"]["n_tokens"] > 0 and math.isclose(e["perplexity"], math.exp(e["nll"])), (s, e)
        assert rel(e["perplexity"], ppl["ddp"]["perplexity"]) <= LOSS_RTOL, ppl
        assert examples[f"causal_lm/{s}"]["describe"]["recompute_blocks"] == 2, examples[f"causal_lm/{s}"]["describe"]
