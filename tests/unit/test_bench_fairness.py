"""benchmarks/overhead.py compares like with like: every contender's loader gives shardtrain's own batches.

Before, the hand-written loops and the peers tokenised the text in collate, on the training process, while
shardtrain tokenised it once ahead (data/preprocess.py); that, not the loop, was shardtrain's 12-31% lead on
the Longformer cells."""

import sys
from pathlib import Path

import pytest
import torch

from shardtrain.config.settings import parse_cli
from shardtrain.data import build_datasets, build_loaders, build_tokenizer, make_data

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import bench_common  # noqa: E402

WORLD = 2


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    """The benchmark's own longformer_tiny cell, on a small corpus of varied lengths."""
    data = make_data("longdoc", tmp_path_factory.mktemp("ld") / "data", n_train=40, n_val=8, min_words=20, max_words=90)
    out = tmp_path_factory.mktemp("run")
    return parse_cli(["--config", str(REPO / "configs" / "longformer_tiny.yaml"), "--data-dir", str(data),
                      "--output-dir", str(out), "--per-device-batch-size", "4"])  # fmt: skip


def shardtrain_batches(cfg, rank: int, n: int) -> list[dict]:
    """What shardtrain's loop gets: the built-in workload's path (datasets tokenised ahead, TrainStream)."""
    tok = build_tokenizer(cfg, Path(cfg.checkpoint.output_dir), True, lambda: None)
    train_ds, eval_ds = build_datasets(cfg, tok)
    train_ds.tokenize(tok, cfg.data.max_length, None, True, lambda: None)
    stream = build_loaders(cfg, tok, train_ds, eval_ds, rank, WORLD, "cpu").train
    return [stream.next_batch() for _ in range(n)]


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_contenders_get_text_tokenised_ahead(cfg):
    for shard in (True, False):
        loader, _ = bench_common.data_and_model(cfg, 0, WORLD, lambda: None, shard=shard)
        assert "input_ids" in loader.dataset[0], "the contender's collate would tokenise on the training process"


def test_a_hand_written_loop_gets_shardtrains_batches_on_every_rank(cfg):
    per_epoch = 40 // WORLD // 4
    for rank in range(WORLD):
        loader, _ = bench_common.data_and_model(cfg, rank, WORLD, lambda: None)
        ours = bench_common.batches(loader)
        theirs = shardtrain_batches(cfg, rank, per_epoch + 2)  # into the second, reshuffled epoch
        assert all(same(next(ours), b) for b in theirs)


def test_frameworks_that_shard_the_loader_themselves_get_the_same_samples_per_step(cfg):
    """Unsharded, the loader runs through the whole epoch's order: strided by sample (Fabric's wrapper), it
    is each rank's shardtrain share; cut in batches handed out in turn (Accelerate, the HF Trainer), every
    optimizer step holds the samples shardtrain's step holds."""
    loader, _ = bench_common.data_and_model(cfg, 0, WORLD, lambda: None, shard=False)
    tok = build_tokenizer(cfg, Path(cfg.checkpoint.output_dir), True, lambda: None)
    train_ds, eval_ds = build_datasets(cfg, tok)
    for epoch in (0, 1):
        loader.sampler.set_epoch(epoch)
        order = list(loader.sampler)
        shares = []
        for rank in range(WORLD):
            stream = build_loaders(cfg, tok, train_ds, eval_ds, rank, WORLD, "cpu").train
            stream.epoch = epoch
            shares.append(stream.epoch_indices())
            assert order[rank::WORLD][: len(shares[rank])] == shares[rank]
        micro = cfg.train.per_device_batch_size
        for step in range(len(shares[0]) // micro):
            global_batch = order[step * micro * WORLD : (step + 1) * micro * WORLD]
            assert sorted(global_batch) == sorted(i for s in shares for i in s[step * micro : (step + 1) * micro])
