"""A user's two lines on an export, in a fresh process that imports only transformers and torch (never
shardtrain):

    python -I plain_transformers.py EXPORT TEXTS.json OUT.json [--tokenizer-only]

TEXTS.json: a list of strings. OUT.json: {"probs": one list per text (not with --tokenizer-only), "input_ids"
(each text's, unpadded), "id2label", "model_max_length", "vocab", "shardtrain_imported"}. Tests call `fresh`.
"""

import json
import subprocess
import sys
from pathlib import Path


def main(export: str, texts_file: str, out_file: str, tokenizer_only: bool) -> None:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    texts = json.loads(Path(texts_file).read_text())
    tokenizer = AutoTokenizer.from_pretrained(export)
    encoded = tokenizer(texts, truncation=True, padding=True, return_tensors="pt")
    result = {
        "input_ids": [ids[mask.bool()].tolist() for ids, mask in zip(encoded["input_ids"], encoded["attention_mask"])],
        "model_max_length": tokenizer.model_max_length,
        "vocab": len(tokenizer),
        "id2label": json.loads((Path(export) / "config.json").read_text()).get("id2label"),
    }
    if not tokenizer_only:
        model = AutoModelForSequenceClassification.from_pretrained(export).eval()
        with torch.no_grad():
            result["probs"] = model(**encoded).logits.softmax(-1).tolist()
        result["id2label"] = {str(k): v for k, v in model.config.id2label.items()}
    result["shardtrain_imported"] = sorted(m for m in sys.modules if m.split(".")[0] == "shardtrain")
    Path(out_file).write_text(json.dumps(result))


def fresh(export: Path, texts: list, out: Path, *flags: str) -> dict:
    """This file in a fresh `python -I`: the venv's transformers and torch, nothing of the repository."""
    return run_isolated(Path(__file__), [str(export)], texts, out, *flags)


def run_isolated(script: Path, leading: list[str], texts: list, out: Path, *flags: str) -> dict:
    """`python -I script *leading TEXTS.json OUT.json *flags` (no PYTHONPATH, no working directory on sys.path);
    asserts that shardtrain was never imported and returns OUT.json."""
    from launch import test_env

    texts_file = out.parent / f"{out.stem}-texts.json"
    texts_file.write_text(json.dumps(texts))
    env = {k: v for k, v in test_env().items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-I", str(script), *leading, str(texts_file), str(out), *flags],
        cwd=out.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["shardtrain_imported"] == [], result["shardtrain_imported"]
    return result


if __name__ == "__main__":
    main(*sys.argv[1:4], tokenizer_only="--tokenizer-only" in sys.argv)
