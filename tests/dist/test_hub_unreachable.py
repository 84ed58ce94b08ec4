"""A hub model name while the hub is unreachable, through `python -m shardtrain train`: one line naming the model
and its flag within seconds, or, when the files are in the local HF cache, a run that goes offline by itself.

HF_ENDPOINT points at 127.0.0.1 only (a socket that listens and never answers, a port that refuses); HF_HUB_OFFLINE
is unset in these runs' environment alone. Before shardtrain/runtime/hub.py the first took ~56 s of retries and blamed
--tokenizer, the second ~220 s (every file retried before the cache was used)."""

from __future__ import annotations

import socket
import time
from pathlib import Path

from launch import cli, test_env, tiny_args

MODEL = "shardtrain-test/tiny-roberta"


def unreachable_env(hf_home: Path, endpoint: str) -> dict:
    env = test_env(HF_HOME=str(hf_home), HF_ENDPOINT=endpoint)
    env.pop("HF_HUB_OFFLINE")
    return env


def hub_args(data: Path, out: Path, *extra: str) -> list[str]:
    return [
        "train",
        *tiny_args(
            "multimodal",
            data,
            out,
            "--pretrained",
            "true",
            "--text-model",
            MODEL,
            "--text-config",
            "{}",
            "--max-length",
            "32",
            "--max-steps",
            "2",
            "--max-eval-samples",
            "8",
            *extra,
        ),
    ]


def cache_tiny_model(hf_home: Path, data: Path) -> None:
    """A tiny RoBERTa and its tokenizer where huggingface_hub would have downloaded them."""
    from transformers import RobertaConfig, RobertaModel

    from shardtrain.data.records import read_texts, split_path
    from shardtrain.data.tokenizer import train_bpe

    folder = hf_home / "hub" / ("models--" + MODEL.replace("/", "--"))
    snapshot = folder / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text("0" * 40)
    tok = train_bpe(list(read_texts(split_path(str(data), "train"))), 300)
    tok.save_pretrained(str(snapshot))
    RobertaModel(
        RobertaConfig(
            vocab_size=len(tok),
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=40,
        )
    ).save_pretrained(str(snapshot))


def test_silent_hub_fails_in_seconds_naming_the_model(mm_data, tmp_path):
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        env = unreachable_env(tmp_path / "hf", f"http://127.0.0.1:{silent.getsockname()[1]}")
        start = time.monotonic()
        run = cli(hub_args(mm_data, tmp_path / "out"), check=False, timeout=40, env=env)
        seconds = time.monotonic() - start
    print(f"\nsilent hub: exit {run.returncode} after {seconds:.1f} s")
    lines = [line for line in run.output.splitlines() if line.startswith("shardtrain: error")]
    assert run.returncode == 2 and len(lines) == 1 and "Traceback" not in run.output, run.tail()
    assert lines[0].startswith(
        f"shardtrain: error: --text-model (model.text_model) {MODEL}: the Hugging Face hub http://127.0.0.1:"
    )
    assert "(no answer within 3 s)" in lines[0] and "not in the local cache" in lines[0]
    assert seconds < 25  # interpreter + imports + the 3 s probe; before: ~56 s, then --tokenizer was blamed
    assert not (tmp_path / "out").exists()


def test_cached_model_runs_offline_by_itself(mm_data, tmp_path):
    """One process: huggingface_hub read HF_HUB_OFFLINE at import, so the check also switches its constant
    (launched workers inherit the variable; tests/unit/test_hub.py checks both are set)."""
    cache_tiny_model(tmp_path / "hf", mm_data)
    with socket.socket() as refused:
        refused.bind(("127.0.0.1", 0))  # bound, not listening: every connection is refused
        env = unreachable_env(tmp_path / "hf", f"http://127.0.0.1:{refused.getsockname()[1]}")
        start = time.monotonic()
        run = cli(hub_args(mm_data, tmp_path / "out", "--nproc", "1"), timeout=90, env=env)
        seconds = time.monotonic() - start
    print(f"\ncached model, hub refused: {seconds:.1f} s for 2 steps")
    assert f"{MODEL} is in the local cache: running offline (HF_HUB_OFFLINE=1)" in run.output
    assert "Retrying" not in run.output and len(run.summary["train_loss"]) == 2
