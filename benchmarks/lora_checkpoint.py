"""LoRA checkpoints against a full fine-tune's: bytes per checkpoint and seconds per save, on the
example text classifier (examples/hf_text_classifier/) with a BERT base of ~30M parameters saved as a local
pretrained folder, 2 CPU ranks, under DDP and ZeRO-3.

    ~/.cache/shardtrain/venv/bin/python benchmarks/lora_checkpoint.py   -> benchmarks/results/lora_checkpoint.json
    ~/.cache/shardtrain/venv/bin/python benchmarks/lora_checkpoint.py --rounds 1 --strategies ddp   # quick

Each run is the real entry point (torchrun shardtrain/main.py, through tests/launch.py), 4 optimizer steps,
a checkpoint every 2 steps (2 saves per run; summary.json's checkpoint_save_seconds). Per round and strategy
the two contenders run back to back, their order alternating between rounds (full, lora / lora, full), so that
drift on the shared machine hits both alike; the ratio is taken per round, and its median quoted with the
spread of the rounds (the noise floor).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "dist"))  # test_examples' tokenizer builder
sys.path.insert(0, str(REPO))

STRATEGIES = {"ddp": ["--strategy", "ddp"], "zero3": ["--ds", str(REPO / "ds_configs" / "zero3.json")]}
BERT = {
    "model_type": "bert",
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "intermediate_size": 2048,
    "max_position_embeddings": 64,
}


def setup(work: Path) -> dict:
    """Records, a word-level tokenizer over them and the base, saved as a pretrained folder."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    from shardtrain.data import make_data

    data = make_data("multimodal", work / "data", n_train=64, n_val=16, seed=0)
    from test_examples import bert_tokenizer

    tok = bert_tokenizer(data, work / "tokenizer")
    torch.manual_seed(0)
    config = AutoConfig.for_model(**BERT, vocab_size=len(AutoTokenizer.from_pretrained(str(tok))), num_labels=3)
    model = AutoModelForSequenceClassification.from_config(config)
    model.save_pretrained(work / "base")
    params = sum(p.numel() for p in model.parameters())
    return {
        "data_dir": str(data),
        "tokenizer": str(tok),
        "model": str(work / "base"),
        "num_labels": 3,
        "params": params,
    }


def one_run(args: dict, strategy: str, lora: bool, out: Path) -> dict:
    from launch import torchrun

    workload_args = {k: v for k, v in args.items() if k != "params"} | {"max_length": 32}
    run = torchrun(
        [
            *("--config", str(REPO / "examples" / "hf_text_classifier" / "config.yaml")),
            *("--workload-args", json.dumps(workload_args), *STRATEGIES[strategy]),
            *("--device", "cpu", "--output-dir", str(out), "--resume", "none", "--max-steps", "4"),
            *("--save-every", "2", "--keep-last", "2", "--per-device-batch-size", "4", "--num-workers", "0"),
            *("--predict-memory", "false", "--report", "false", "--eval-every", "0", "--log-every", "1"),
            *(["--peft", "lora"] if lora else []),
        ],
        timeout=900,
    )
    summary = json.loads((run.output_dir / "summary.json").read_text())
    step_dir = run.output_dir / "checkpoints" / "step-000004"
    return {
        "checkpoint_bytes": sum(f.stat().st_size for f in step_dir.rglob("*") if f.is_file()),
        "save_seconds": summary["checkpoint_save_seconds"],
        "params_trainable": summary["params_trainable"],
        "params_frozen": summary["params_frozen"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--strategies", default="ddp,zero3")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "lora_checkpoint.json"))
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    with tempfile.TemporaryDirectory(prefix="lora_ckpt_") as tmp:
        work = Path(tmp)
        base = setup(work)
        result = {
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "loadavg_start": os.getloadavg()},
            "base_params": base["params"],
            "steps": 4,
            "saves_per_run": 2,
            "strategies": {},
        }
        for strategy in args.strategies.split(","):
            rounds = []
            for r in range(args.rounds):
                order = ("full", "lora") if r % 2 == 0 else ("lora", "full")
                row = {c: one_run(base, strategy, c == "lora", work / f"{strategy}-{r}-{c}") for c in order}
                row["order"] = list(order)
                rounds.append(row)
                print(json.dumps({strategy: row}), flush=True)
            result["strategies"][strategy] = summarise(rounds)
        result["machine"]["loadavg_end"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


def summarise(rounds: list[dict]) -> dict:
    size = [r["lora"]["checkpoint_bytes"] / r["full"]["checkpoint_bytes"] for r in rounds]
    time = [statistics.median(r["lora"]["save_seconds"]) / statistics.median(r["full"]["save_seconds"]) for r in rounds]
    return {
        "rounds": rounds,
        "full_checkpoint_bytes": statistics.median(r["full"]["checkpoint_bytes"] for r in rounds),
        "lora_checkpoint_bytes": statistics.median(r["lora"]["checkpoint_bytes"] for r in rounds),
        "bytes_ratio_lora_over_full": statistics.median(size),
        "save_seconds_full_median": statistics.median(s for r in rounds for s in r["full"]["save_seconds"]),
        "save_seconds_lora_median": statistics.median(s for r in rounds for s in r["lora"]["save_seconds"]),
        "save_time_ratio_lora_over_full_paired_median": statistics.median(time),
        "save_time_ratio_spread": [min(time), max(time)],
    }


if __name__ == "__main__":
    main()
