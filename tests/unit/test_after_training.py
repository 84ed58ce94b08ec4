"""After training, in one process: what `predict --file` reads (every row, in order, labels optional, the user's ids),
the content hash that compare, parity --runs and a resume judge the data by, and the smaller traps (where a
relative data path is read from, check-data's per-file count, plan's launch line and flag errors). The trained
round trips: tests/dist/test_export_predict_runs.py."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from launch import REPO

from shardtrain import cli
from shardtrain.config.settings import ConfigError, from_dict, validate
from shardtrain.data.sources import content_sha256, load_splits, prediction_rows


def config(**data):
    cfg = from_dict({"model": {"name": "longformer", "pretrained": False}, "data": data})
    return validate(cfg)


def write_csv(path: Path, header: list[str], rows: list[list]) -> Path:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return path


def run_config(tmp_path):
    """A run's config as predict has it: its columns and the class names training found."""
    train = write_csv(
        tmp_path / "train.csv",
        ["id", "document", "category"],
        [[f"d{i}", f"text number {i}", ["arts", "law", "sports"][i % 3]] for i in range(9)],
    )
    cfg = config(train_file=str(train), text_column_names=["document"], label_column_name="category")
    cfg = load_splits(cfg).labels.applied_to(cfg)  # as the built-in workload resolves its own config
    assert cfg.data.label_names == ["arts", "law", "sports"]
    return cfg


def test_a_save_to_disk_split_is_a_file_to_predict_with_its_unlabelled_rows(tmp_path):
    """A user kept their data as `DatasetDict.save_to_disk`: `predict --file` took files only (`unknown extension
    ''`), and the run's --dataset-name path refuses an unlabelled row. One split's folder is now read as a file
    is: every row in order, unlabelled ones too; the DatasetDict's own folder names its splits."""
    import datasets

    cfg = run_config(tmp_path)
    rows = {"id": ["a", "b", "c"], "document": ["one", "two", "three"], "category": ["law", None, "arts"]}
    datasets.DatasetDict({"validation": datasets.Dataset.from_dict(rows)}).save_to_disk(tmp_path / "saved")
    read = prediction_rows(cfg, str(tmp_path / "saved" / "validation"), None)
    assert list(read.table["label"]) == [1, -1, 0] and read.labelled == 2 and read.ids == ["a", "b", "c"]
    with pytest.raises(ConfigError) as e:
        prediction_rows(cfg, str(tmp_path / "saved"), None)
    assert str(e.value) == (
        f"predict --file {tmp_path / 'saved'}: a DatasetDict's save_to_disk folder (splits: validation): name one "
        f"split's folder, e.g. --file {tmp_path / 'saved' / 'validation'}"
    )
    with pytest.raises(ConfigError, match="a folder, and not one that datasets' save_to_disk wrote"):
        prediction_rows(cfg, str(tmp_path), None)


def test_a_file_without_labels_is_every_row_in_order_with_its_ids(tmp_path):
    cfg = run_config(tmp_path)
    new = write_csv(tmp_path / "new.csv", ["id", "document"], [[f"n{i}", f"new text {i}"] for i in range(7)])
    read = prediction_rows(cfg, str(new), None)
    assert list(read.table["row"]) == list(range(7)) and read.ids == [f"n{i}" for i in range(7)]
    assert list(read.table["text"]) == [f"new text {i}" for i in range(7)]
    assert list(read.table["label"]) == [-1] * 7 and read.labelled == 0
    # Some labels, some empty cells (the issue's `no label`), an empty text: nothing is left out.
    mixed = write_csv(
        tmp_path / "mixed.csv",
        ["key", "document", "category"],
        [["a", "one", "law"], ["b", "two", ""], ["c", "", "sports"], ["d", "four", "arts"]],
    )
    read = prediction_rows(cfg, str(mixed), "key")
    assert list(read.table["label"]) == [1, -1, 2, 0] and read.labelled == 3 and read.ids == ["a", "b", "c", "d"]
    assert prediction_rows(cfg, str(mixed), None).ids is None  # no `id` column: no ids
    with pytest.raises(
        ConfigError,
        match=r"--id-column doc: no column 'doc' in .*mixed.csv \(columns: key, "
        r"document, category\)",
    ):
        prediction_rows(cfg, str(mixed), "doc")
    unseen = write_csv(tmp_path / "unseen.csv", ["document", "category"], [["x", "law"], ["y", "cooking"]])
    with pytest.raises(
        ConfigError,
        match=r"unseen.csv row 1 .*label 'cooking' is not a class .*arts, law, sports.*"
        r"drop the column 'category'",
    ):
        prediction_rows(cfg, str(unseen), None)
    other = write_csv(tmp_path / "other.csv", ["id", "body"], [["a", "x"]])
    with pytest.raises(
        ConfigError,
        match=r"predict --file .*other.csv: no column 'document' \(the run read its text "
        r"from document; the file's columns: id, body\)",
    ):
        prediction_rows(cfg, str(other), None)


def test_predict_file_flags_are_one_line(capsys, tmp_path):
    for argv, says in (
        (["RUN", "--file", "f.csv", "--data-dir", "d"], "drop --data-dir"),
        (["RUN", "--file", "f.csv", "--split", "train"], "drop --split"),
        (["RUN", "--file", "f.csv", "--train-file", "t.csv"], "drop --train-file"),
    ):
        assert cli.main(["predict", *argv, "--output", str(tmp_path / "p.jsonl")]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "predicts every row of that file" in err and says in err, err


def test_a_validation_file_alone_keeps_the_runs_training_file(tmp_path):
    """The documented `predict RUN --validation-file F`: the run's own train_file stays beside it."""
    from shardtrain.commands import predict

    saved = run_config(tmp_path).to_dict()
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "tokenizer" / "tokenizer.json").write_text("{}")
    cfg = predict._with_flags(saved, {"validation_file": "v.csv"}, tmp_path, "ckpt")
    assert (cfg.data.train_file, cfg.data.validation_file) == (str(tmp_path / "train.csv"), "v.csv")
    cfg = predict._with_flags(saved, {"train_file": "t.csv"}, tmp_path, "ckpt")
    assert (cfg.data.train_file, cfg.data.validation_file) == ("t.csv", None)


def test_the_content_hash_is_the_rows_not_their_path_or_format(tmp_path):
    rows = [{"text": f"t {i}", "label": ["x", "y"][i % 2]} for i in range(6)]
    a = write_csv(tmp_path / "a.csv", ["text", "label"], [[r["text"], r["label"]] for r in rows])
    b = tmp_path / "sub" / "b.jsonl"
    b.parent.mkdir()
    b.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ha, hb = (load_splits(config(train_file=str(f), validation_split_percentage=50)) for f in (a, b))
    assert ha.source["content_sha256"] == hb.source["content_sha256"]
    assert content_sha256(ha.train) != content_sha256(ha.validation)
    rows[0]["label"] = "y"  # one row relabelled
    b.write_text("".join(json.dumps(r) + "\n" for r in rows))
    hc = load_splits(config(train_file=str(b), validation_split_percentage=50))
    assert hc.source["content_sha256"] != hb.source["content_sha256"]


def test_a_resume_on_other_data_is_said_in_the_changed_settings_line():
    from shardtrain.loop.resume_changes import data_changes

    saved = {
        "step": 40,
        "data_source": {
            "source": "train_file",
            "rows": {"train": 270, "validation": 30},
            "content_sha256": {"train": "a" * 64, "validation": "b" * 64},
        },
    }
    now = {
        "source": "train_file",
        "train": "small.csv, the other 90%",
        "rows": {"train": 54, "validation": 6},
        "content_sha256": {"train": "c" * 64, "validation": "b" * 64},
    }
    assert data_changes(saved, now) == [
        "the train data changed (content sha256 aaaaaaaaaaaa -> cccccccccccc, "
        "270 -> 54 rows; now small.csv, the other 90%)"
    ]
    assert data_changes(saved, saved["data_source"]) == []
    assert data_changes({"step": 1}, now) == []  # a checkpoint from before the hash: nothing to compare


def test_a_relative_data_file_names_the_base_it_was_read_from(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        ConfigError,
        match=r"file not found: data/train.csv \(relative paths are read from the "
        r"working directory, " + str(tmp_path),
    ):
        load_splits(config(train_file="data/train.csv"))


def test_check_data_counts_the_problems_in_the_file_they_are_in(tmp_path, capsys):
    train = write_csv(tmp_path / "train.csv", ["text", "label"], [["a", "x"], ["b", "y"]])
    val = write_csv(tmp_path / "val.csv", ["text", "label"], [["", "x"], ["c", ""]])  # every problem here
    assert (
        cli.main(
            [
                "check-data",
                "--config",
                str(REPO / "configs/longformer_tiny.yaml"),
                "--train-file",
                str(train),
                "--validation-file",
                str(val),
            ]
        )
        == 1
    )
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == f"3 problem(s): 3 in {val}", last  # two rows, and then no usable row in it


def test_check_data_on_clean_data_counts_each_splits_rows_by_class(tmp_path, capsys):
    """A user whose data was 60% positive saw only "no problems found": the classes' shares are what an
    imbalanced (or a split missing a class) shows in before training. Class names for a source, ids for a folder."""
    names = ["negative"] * 2 + ["positive"] * 6
    train = write_csv(tmp_path / "train.csv", ["review", "sentiment"], [[f"t{i}", n] for i, n in enumerate(names)])
    val = write_csv(tmp_path / "val.csv", ["review", "sentiment"], [["a", "positive"], ["b", "positive"]])
    flags = ["--text-column-names", "review", "--label-column-name", "sentiment", "--validation-file", str(val)]
    argv = ["check-data", "--config", str(REPO / "configs/longformer_tiny.yaml"), "--train-file", str(train)]
    assert cli.main(argv + flags) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "train: 8 usable rows; by label: negative 2 (25%), positive 6 (75%)",
        "validation: 2 usable rows; by label: positive 2 (100%)",
        f"{train}, {val}: no problems found",
    ], out
    folder = tmp_path / "folder"
    folder.mkdir()
    for split, labels in (("train", [2, 0, 2, 1]), ("validation", [1])):
        lines = [json.dumps({"text": f"text {i}", "label": label}) for i, label in enumerate(labels)]
        (folder / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    assert cli.main(["check-data", str(folder), "--kind", "longdoc"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == [
        f"{folder / 'train.jsonl'}: 4 usable records; by label: 0 1 (25%), 1 1 (25%), 2 2 (50%)",
        f"{folder / 'validation.jsonl'}: 1 usable record; by label: 1 1 (100%)",
    ], out


def test_plan_prints_the_launch_flags_and_takes_data_flags(tmp_path, capsys):
    train = write_csv(tmp_path / "train.csv", ["document", "label"], [["some words here", "x"]] * 4)
    assert (
        cli.main(
            [
                "plan",
                "--config",
                "configs/longformer_tiny.yaml",
                "--gpus",
                "2",
                "--gpu",
                "a100",
                "--train-file",
                str(train),
                "--text-column-names",
                "document",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out.strip().splitlines()
    rec = next(line for line in out if line.startswith("recommendation: "))
    launch = out[-1]
    assert launch.startswith(
        "launch: shardtrain train --nproc 2 --config configs/longformer_tiny.yaml --train-file "
        f"{train} --text-column-names document --strategy "
    ), out
    micro, accum = rec.split("micro-batch ")[1].split(" (")[0].split(" x accum ")
    assert launch.endswith(f"--per-device-batch-size {micro} --grad-accum {accum}") or launch.endswith(
        f"--per-device-batch-size {micro} --grad-accum {accum} --activation-checkpointing"
    ), (rec, launch)
    assert (
        cli.main(["plan", "--config", "configs/longformer_tiny.yaml", "--gpus", "2", "--gpu", "a100", "--lr", "3"]) == 2
    )
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "plan: unrecognized arguments: --lr 3" in err, err


def test_plan_takes_the_model_flags_of_the_model_it_plans(capsys):
    """The Longformer's window changes its padding and activations: `plan --attention-window` was an unrecognized
    argument. The model flags are checked as train checks them, and go into the launch line."""
    base = ["plan", "--config", "configs/longformer_tiny.yaml", "--gpus", "2", "--gpu", "a100"]
    assert cli.main([*base, "--attention-window", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("--attention-window (model.attention_window) must be positive, got 0"), err
    assert cli.main([*base, "--attention-window", "32"]) == 0
    printed = capsys.readouterr()
    launch = printed.out.strip().splitlines()[-1]
    assert "--config configs/longformer_tiny.yaml --attention-window 32 --strategy " in launch, launch
    assert printed.err == ""  # not a terminal: no progress line


def test_plan_takes_the_memory_budget_the_shipped_config_suggests(capsys):
    """configs/longformer_4096.yaml's comment suggests `--memory-budget-gb 13` for more headroom; plan refused it
    ("unrecognized arguments"), so the choice it makes could not be seen before renting."""
    import json

    base = ["plan", "--config", "configs/longformer_tiny.yaml", "--gpus", "2", "--gpu", "v100-16gb", "--json"]
    assert cli.main([*base, "--memory-budget-gb", "13"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert planned["capacity_bytes"] == 13 * 2**30
    assert "--memory-budget-gb 13" in planned["launch"], planned["launch"]
    assert cli.main([*base, "--memory-budget-gb", "0"]) == 2
    assert "--memory-budget-gb (parallel.memory_budget_gb) must be positive" in capsys.readouterr().err


def test_plan_takes_trains_grad_accum_and_plans_its_global_batch(capsys):
    """A train command's flags pasted into plan were refused at `--grad-accum 4` ("unrecognized arguments"), and
    without it plan planned the config's global batch, a quarter of the run's."""
    import json

    base = ["plan", "--config", "configs/longformer_tiny.yaml", "--gpus", "2", "--gpu", "v100-16gb", "--json"]
    for flag in ("--grad-accum", "--gradient-accumulation-steps"):  # train's flag and its HF spelling
        assert cli.main([*base, "--per-device-batch-size", "2", flag, "4"]) == 0
        planned = json.loads(capsys.readouterr().out)
        assert planned["global_batch_size"] == 2 * 4 * 2, planned["global_batch_size"]
        rec, launch = planned["recommendation"], planned["launch"]
        assert rec["micro_batch_size"] * rec["grad_accum"] * 2 == 16, rec
        # One accumulation in the launch line: the recommendation's, which keeps the global batch.
        assert launch.count("--grad-accum") == 1 and "--gradient-accumulation-steps" not in launch, launch
        assert f"--grad-accum {rec['grad_accum']}" in launch, launch
    assert cli.main([*base, "--grad-accum", "0"]) == 2
    assert "--grad-accum (train.grad_accum) must be positive, got 0" in capsys.readouterr().err


def test_plan_with_a_token_budget_plans_the_largest_micro_batch_the_budget_holds(capsys):
    """`plan --max-tokens-per-batch` planned at --per-device-batch-size: with 4 texts of 256 to a budget of 1,024
    and the config's 2, its table and launch line were for half the activations the run would meet."""
    import json

    base = ["plan", "--config", "configs/longformer_tiny.yaml", "--gpus", "2", "--gpu", "v100-16gb", "--json"]
    assert cli.main([*base, "--per-device-batch-size", "2", "--max-tokens-per-batch", "1024"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert planned["micro_batch_size"] == 4 and planned["asked_max_tokens_per_batch"] == 1024
    assert {r["micro_batch_size"] for r in planned["rows"]} == {4}
    # The launch line keeps the budget (the run's micro-batch) and the user's --per-device-batch-size (its length
    # groups and OOM recovery's unit).
    launch = planned["launch"]
    assert "--per-device-batch-size 2 " in launch and launch.count("--per-device-batch-size") == 1, launch
    assert "--max-tokens-per-batch 1024 --grad-accum" in launch, launch
    assert cli.main([*base[:-1], "--max-tokens-per-batch", "1024"]) == 0
    assert "micro-batch 4 (--max-tokens-per-batch 1024 at seq 256: the largest it holds)" in capsys.readouterr().out


def test_plan_on_a_terminal_says_it_measures_first(capsys, monkeypatch):
    """A new user watched `plan` of the 4096-token Longformer print nothing for 63 s."""
    import sys

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert cli.main(["plan", "--config", "configs/longformer_tiny.yaml", "--gpus", "2", "--gpu", "a100"]) == 0
    err = capsys.readouterr().err
    assert err == "plan: measuring the model's activations on this machine's CPU first (up to a minute)\n", err
