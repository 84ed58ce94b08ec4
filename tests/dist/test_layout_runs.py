"""--dataset-format through the real CLI: the tiny multimodal config trains on a copy of MVSA-Single and of
Twitter-2015 as they unpack (tests/layout_copies.py), under 2 processes, and reports what the readers dropped."""

from __future__ import annotations

import json

from launch import cli, tiny_args, torchrun
from layout_copies import DROPPED_MVSA_MULTIPLE, DROPPED_MVSA_SINGLE, DROPPED_TWITTER, make_mvsa, make_twitter


def test_layouts_train_and_report_their_drops(tmp_path):
    for fmt, make, dropped in (
        ("mvsa-single", make_mvsa, DROPPED_MVSA_SINGLE),
        ("twitter2015", make_twitter, DROPPED_TWITTER),
    ):
        check_one(fmt, make(tmp_path / fmt), dropped, tmp_path / fmt / "run")


def check_one(fmt, top, dropped, out):
    args = tiny_args(
        "multimodal",
        top,
        out,
        "--dataset-format",
        fmt,
        "--strategy",
        "ddp",
        "--max-steps",
        "2",
        "--per-device-batch-size",
        "4",
        "--eval-every",
        "2",
    )
    if fmt == "mvsa-single":  # the images decoded once by cache-images, then read from the cache
        cache = out.parent / "image-cache"
        args += ["--image-cache", str(cache)]
        cached = cli(["cache-images", "--jobs", "1", *args])
        assert "mvsa-single split: 35 images" in cached.output, cached.tail()
    run = torchrun(args)
    data = run.summary["data"]
    assert data["dataset_format"] == fmt and data["labels"] == ["negative", "neutral", "positive"]
    assert data["dropped"] == dropped and set(data["dropped_examples"]) == set(dropped)
    assert run.summary["final_step"] == 2 and run.summary["eval"]["n_examples"] > 0
    # The class names travel as every source's do: labels.json and the run's resolved record (checkpoints,
    # exports), apart from the config the user gave.
    names = ["negative", "neutral", "positive"]
    assert json.loads((out / "labels.json").read_text())["id2label"] == {
        "0": "negative",
        "1": "neutral",
        "2": "positive",
    }
    assert (
        run.summary["resolved"]["labels"]["label_names"] == names and run.summary["config"]["data"]["label_names"] == []
    )
    # One console line per reason, from rank 0 only.
    for reason in dropped:
        assert run.output.count(f"--dataset-format {fmt}: dropped 1 ({reason}), e.g. ") == 1, run.tail()
    if fmt == "mvsa-single":
        assert data["non_utf8_bytes"] == 1 and data["replaced_bytes"] == 1
        # MVSA has no validation split: --validation-split-percentage of it, 10 unless given.
        assert data["validation_held_out"]["posts"] == run.summary["eval_examples"] == 4
    else:
        assert data["kept"] == {"train": 21, "validation": 8, "test": 6} and run.summary["eval_examples"] == 8


def test_mvsa_multiple_and_twitter2017_train_through_the_cli(tmp_path):
    """The other two layouts, one process each (`shardtrain train --nproc 1`): the readers' behaviour is in
    tests/unit/test_layouts.py; this is the CLI path a user runs."""
    for fmt, top in (
        ("mvsa-multiple", make_mvsa(tmp_path / "multiple", multiple=True)),
        ("twitter2017", make_twitter(tmp_path / "t17", "twitter2017")),
    ):
        out = tmp_path / fmt / "run"
        run = cli(
            [
                "train",
                "--nproc",
                "1",
                *tiny_args(
                    "multimodal", top, out, "--dataset-format", fmt, "--max-steps", "1", "--per-device-batch-size", "4"
                ),
            ]
        )
        summary = json.loads((out / "summary.json").read_text())
        assert summary["final_step"] == 1 and summary["eval"]["n_examples"] > 0, run.tail()
        assert summary["data"]["dropped"] == (DROPPED_MVSA_MULTIPLE if fmt == "mvsa-multiple" else DROPPED_TWITTER)
