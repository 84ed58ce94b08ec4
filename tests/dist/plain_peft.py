"""A user's three lines on a LoRA export, in a fresh process that imports only peft, transformers and torch (never
shardtrain):

    python -I plain_peft.py BASE EXPORT TEXTS.json OUT.json

    base = AutoModelForSequenceClassification.from_pretrained(BASE)
    model = PeftModel.from_pretrained(base, EXPORT)
    tokenizer = AutoTokenizer.from_pretrained(EXPORT)

OUT.json: {"probs": one list per text, "adapters": {name: the loaded values, as lists} (peft's own
get_peft_model_state_dict, the names its adapter files use), "shardtrain_imported"}. Tests call `fresh_peft`.
"""

import json
import sys
from pathlib import Path


def main(base: str, export: str, texts_file: str, out_file: str) -> None:
    import torch
    from peft import PeftModel, get_peft_model_state_dict
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = PeftModel.from_pretrained(AutoModelForSequenceClassification.from_pretrained(base), export).eval()
    tokenizer = AutoTokenizer.from_pretrained(export)
    texts = json.loads(Path(texts_file).read_text())
    with torch.no_grad():
        probs = model(**tokenizer(texts, truncation=True, padding=True, return_tensors="pt")).logits.softmax(-1)
    result = {
        "probs": probs.tolist(),
        "adapters": {k: v.tolist() for k, v in get_peft_model_state_dict(model).items()},
        "shardtrain_imported": sorted(m for m in sys.modules if m.split(".")[0] == "shardtrain"),
    }
    Path(out_file).write_text(json.dumps(result))


def fresh_peft(base: Path, export: Path, texts: list, out: Path) -> dict:
    """This file in a fresh `python -I`: peft, transformers and torch, nothing of the repository."""
    from plain_transformers import run_isolated

    return run_isolated(Path(__file__), [str(base), str(export)], texts, out)


if __name__ == "__main__":
    main(*sys.argv[1:5])
