"""`shardtrain predict` in one process: its flags and one-line errors, the blocks --nproc splits the
examples into, and how the blocks become one preds.jsonl. Real predictions from real runs: tests/dist/test_matrix.py,
tests/dist/test_examples.py and tests/dist/test_export_files.py."""

from __future__ import annotations

import json

import pytest
import torch

from shardtrain import cli
from shardtrain.commands import predict
from shardtrain.config.settings import Config, ConfigError, parse_cli
from shardtrain.workloads.base import Workload


def one_line_error(capsys, argv: list[str]) -> str:
    assert cli.main(["predict", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize(
    "argv, says",
    [
        (["RUN", "--lr", "1e-3"], "--lr is a training setting"),
        (["RUN", "--strategy", "fsdp"], "--strategy is a training setting"),
        (["RUN", "--config", "x.yaml"], "--config is a training setting"),
        (["RUN", "--no-such-flag"], "unknown argument '--no-such-flag'"),
        (["RUN", "--top-k", "0"], "--top-k must be positive"),
        (["RUN", "--batch-size", "0"], "--batch-size must be positive"),
        (["RUN", "--nproc", "0"], "--nproc must be positive"),
        (["RUN", "--int8", "--precision", "bf16"], "drop --precision bf16"),
        (["RUN", "--split", "test"], "invalid choice: 'test'"),
        ([], "the following arguments are required: source"),
    ],
)
def test_bad_flags_are_one_line_before_anything_is_read(capsys, argv, says):
    assert says in one_line_error(capsys, argv)


def test_sources_that_are_not_a_checkpoint_or_export(capsys, tmp_path):
    assert "not found" in one_line_error(capsys, [str(tmp_path / "nothing"), "--output", str(tmp_path / "p.jsonl")])
    err = one_line_error(capsys, [str(tmp_path), "--output", str(tmp_path / "p.jsonl")])
    assert "no committed checkpoint" in err, err
    err = one_line_error(capsys, [str(tmp_path), "--int8", "--output", str(tmp_path / "p.jsonl")])
    assert "is not an export" in err, err
    err = one_line_error(capsys, [str(tmp_path), "--output", str(tmp_path)])
    assert "is a folder" in err, err
    err = one_line_error(capsys, [str(tmp_path), "--output", str(tmp_path / "no" / "p.jsonl")])
    assert "does not exist" in err, err
    export = tmp_path / "export"
    export.mkdir()
    (export / "shardtrain_export.json").write_text('{"model": "multim')  # cut off mid-write
    assert "truncated export" in one_line_error(capsys, [str(export), "--output", str(tmp_path / "p.jsonl")])
    assert not list(tmp_path.glob("*.jsonl*")), list(tmp_path.iterdir())


def test_data_flags_are_train_spellings():
    args, given = predict.parse_args(
        [
            "RUN",
            "--data-dir",
            "d",
            "--max-eval-samples",
            "none",
            "--validation-file",
            "v.csv",
            "--text-column-names",
            "title,body",
            "--device",
            "cpu",
            "--skip-bad-samples",
            "--max-seq-length",
            "32",
        ]
    )
    assert args.source == "RUN" and args.split == "validation" and args.output == "preds.jsonl"
    assert given == {
        "data_dir": "d",
        "max_eval_samples": "none",
        "validation_file": "v.csv",
        "text_column_names": "title,body",
        "device": "cpu",
        "skip_bad_samples": "true",
        "max_length": "32",
    }


def test_other_data_replaces_the_runs_own_source(tmp_path):
    saved = Config().to_dict()
    saved["data"].update(dataset_name="imdb", image_cache="cache", streaming=True, max_eval_samples=16)
    saved["model"].update(pretrained=False)
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "tokenizer" / "tokenizer.json").write_text("{}")
    cfg = predict._with_flags(saved, {"data_dir": str(tmp_path)}, tmp_path, "ckpt")
    d = cfg.data
    assert (d.data_dir, d.dataset_name, d.image_cache, d.streaming) == (str(tmp_path), None, None, False)
    assert d.max_eval_samples == 16  # the run's, so that its validation split is the one it evaluated
    assert d.tokenizer == str(tmp_path / "tokenizer")  # the run's own, never one trained anew
    with pytest.raises(ConfigError, match="max_eval_samples: expected an integer"):
        predict._with_flags(saved, {"max_eval_samples": "many"}, tmp_path, "ckpt")


def test_a_deepspeed_run_with_its_engine_files_predicts_and_evaluates(tmp_path):
    """A ZeRO run trained with --engine-files (for DeepSpeed's zero_to_fp32.py, as docs/checkpoints.md says) could
    not be predicted from nor `export --eval`ed: its saved engine_files met predict's ddp, a refused pair, and the
    line named flags the user never gave those commands."""
    saved = parse_cli(["--ds", "ds_configs/zero2.json", "--engine-files"]).to_dict()
    saved["model"].update(pretrained=False)
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "tokenizer" / "tokenizer.json").write_text("{}")
    cfg = predict._with_flags(saved, {}, tmp_path, "ckpt")
    assert (cfg.parallel.strategy, cfg.parallel.ds, cfg.checkpoint.engine_files) == ("ddp", None, False)


def test_a_validation_file_alone_predicts_for_a_run_that_read_a_dataset(tmp_path):
    """A trial's run read a save_to_disk folder (--dataset-name): `predict --validation-file new.csv` was refused,
    "needs --train-file beside it", though predict reads no training data."""
    saved = Config().to_dict()
    saved["data"].update(dataset_name="reviews_disk", label_names=["negative", "neutral", "positive"])
    saved["model"].update(pretrained=False)
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "tokenizer" / "tokenizer.json").write_text("{}")
    cfg = predict._with_flags(saved, {"validation_file": "new.csv"}, tmp_path, "ckpt")
    d = cfg.data
    assert (d.dataset_name, d.train_file, d.validation_file) == (None, "new.csv", "new.csv")
    assert d.label_names == ["negative", "neutral", "positive"]  # the run's classes, whatever the file holds
    saved["data"].update(dataset_name=None, train_file="train.csv")  # a run of files keeps its training file
    assert predict._with_flags(saved, {"validation_file": "new.csv"}, tmp_path, "ckpt").data.train_file == "train.csv"


@pytest.mark.parametrize("n, world", [(0, 2), (1, 3), (7, 2), (64, 3), (10, 10)])
def test_blocks_cover_every_example_once_in_order(n, world):
    bounds = [predict.block_bounds(n, r, world) for r in range(world)]
    assert [i for lo, hi in bounds for i in range(lo, hi)] == list(range(n))
    sizes = [hi - lo for lo, hi in bounds]
    assert max(sizes) - min(sizes) <= 1


def _write_block(parts, rank, rows, confusion=None):
    with open(parts / f"rank-{rank}.jsonl", "w") as f:
        for i in rows:
            f.write(json.dumps({"index": i}) + "\n")
    sums = {"confusion": confusion} if confusion is not None else {}
    torch.save({"rows": len(rows), "expected": len(rows), "sums": sums}, parts / f"rank-{rank}.pt")


def test_blocks_join_in_rank_order_with_summed_metrics(tmp_path):
    parts, out = tmp_path / "parts", tmp_path / "preds.jsonl"
    parts.mkdir()
    _write_block(parts, 1, [3, 4], torch.tensor([[1.0, 0.0], [1.0, 0.0]]))
    _write_block(parts, 0, [0, 1, 2], torch.tensor([[1.0, 0.0], [0.0, 2.0]]))
    metrics = predict.join_blocks(parts, 2, out, Workload(Config()))
    assert [json.loads(x)["index"] for x in out.read_text().splitlines()] == [0, 1, 2, 3, 4]
    assert metrics["_rows"] == 5 and metrics["n_examples"] == 5 and metrics["accuracy"] == pytest.approx(4 / 5)
    assert [p.name for p in tmp_path.iterdir() if p.name != "parts"] == ["preds.jsonl"]  # no temporary left


def test_a_missing_block_leaves_no_preds_file(tmp_path):
    parts, out = tmp_path / "parts", tmp_path / "preds.jsonl"
    parts.mkdir()
    _write_block(parts, 0, [0, 1])
    with pytest.raises(ConfigError, match="worker 1 of 2 wrote no predictions"):
        predict.join_blocks(parts, 2, out, Workload(Config()))
    assert [p.name for p in tmp_path.iterdir()] == ["parts"]
