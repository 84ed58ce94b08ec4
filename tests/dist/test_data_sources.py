"""The data sources (docs/data.md), each trained for a few steps on 2 ranks through the CLI users run, from
copies of the session's tiny data in the shapes users keep it: a folder of parquet files with a ClassLabel (IMDB /
arXiv style, some rows unlabelled), a Hyperpartisan-style jsonl with a bool label, a CSV pair with other column names,
string labels and image paths relative to the CSV, an image folder with metadata.csv, a save_to_disk folder
with embedded images; then check-data and cache-images on them."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest
from launch import cli, tiny_args

NAMES = ["negative", "neutral", "positive"]
# No final checkpoint where nothing reads one (--final-model-dir still commits the one it exports).
FAST = [
    "--nproc",
    "2",
    "--max-steps",
    "3",
    "--per-device-batch-size",
    "4",
    "--eval-every",
    "0",
    "--log-every",
    "1",
    "--save-final",
    "false",
]


def records(folder: Path, split: str) -> list[dict]:
    return [json.loads(line) for line in (folder / f"{split}.jsonl").read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def layouts(mm_data, ld_data, tmp_path_factory) -> dict[str, Path]:
    import datasets

    root = tmp_path_factory.mktemp("sources")
    out = {}

    # IMDB / arXiv-classification style: train and test parquet files, label a ClassLabel, 5 rows labelled -1.
    imdb = root / "imdb"
    imdb.mkdir()
    features = datasets.Features({"text": datasets.Value("string"), "label": datasets.ClassLabel(names=NAMES)})
    for split, name in (("train", "train"), ("validation", "test")):
        rows = records(ld_data, split)
        labels = [-1 if split == "train" and i < 5 else r["label"] for i, r in enumerate(rows)]
        datasets.Dataset.from_dict({"text": [r["text"] for r in rows], "label": labels}, features=features).to_parquet(
            imdb / f"{name}.parquet"
        )
    out["imdb"] = imdb

    # Hyperpartisan style: one jsonl, a bool label under its own name, no validation split.
    hyper = root / "hyperpartisan.jsonl"
    hyper.write_text(
        "".join(
            json.dumps({"text": r["text"], "hyperpartisan": r["label"] == 2}) + "\n" for r in records(ld_data, "train")
        )
    )
    out["hyperpartisan"] = hyper

    # A CSV export: other column names, string labels, image paths relative to the CSV's folder (not the cwd).
    tweets = root / "tweets"
    tweets.mkdir()
    (tweets / "pics").symlink_to(mm_data / "images", target_is_directory=True)
    for split in ("train", "validation"):
        with open(tweets / f"{split}.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["title", "tweet", "photo", "sentiment"])
            for r in records(mm_data, split):
                w.writerow(["re:", r["text"], r["image"].replace("images/", "pics/", 1), NAMES[r["label"]]])
    out["tweets"] = tweets

    # An image folder per split with metadata.csv (file_name, text, label), as datasets' imagefolder reads it.
    for split, n in (("train", 64), ("validation", 16)):
        folder = root / "imagefolder" / split
        folder.mkdir(parents=True)
        with open(folder / "metadata.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["file_name", "text", "label"])
            for r in records(mm_data, split)[:n]:
                name = Path(r["image"]).name
                shutil.copy(mm_data / r["image"], folder / name)
                w.writerow([name, r["text"], r["label"]])
    out["imagefolder"] = root / "imagefolder"

    # DatasetDict.save_to_disk: images embedded (an Image feature), labels a ClassLabel.
    features = datasets.Features(
        {"text": datasets.Value("string"), "image": datasets.Image(), "label": datasets.ClassLabel(names=NAMES)}
    )
    splits = {}
    for split in ("train", "validation"):
        rows = records(mm_data, split)
        splits[split] = datasets.Dataset.from_dict(
            {
                "text": [r["text"] for r in rows],
                "image": [str(mm_data / r["image"]) for r in rows],
                "label": [r["label"] for r in rows],
            },
            features=features,
        )
    datasets.DatasetDict(splits).save_to_disk(str(root / "saved"))
    out["saved"] = root / "saved"
    return out


def train(workload: str, data_dir: Path, out: Path, *flags: str):
    return cli(["train", *tiny_args(workload, data_dir, out, *FAST, *flags)], timeout=300)


def test_every_source_trains_on_two_ranks(layouts, ld_data, mm_data, tmp_path):
    # --data-dir is left at the session's jsonl folders: each source's flag must take precedence over it.
    imdb = train(
        "longformer",
        ld_data,
        tmp_path / "imdb",
        "--dataset-name",
        str(layouts["imdb"]),
        "--validation-split-name",
        "test",
        "--strategy",
        "fsdp",
    )
    s = imdb.summary
    assert s["final_step"] == 3 and s["resolved"]["labels"]["label_names"] == NAMES, imdb.tail()
    # What the data decided is recorded apart from what the user asked for (no --label-names, no --num-labels).
    assert s["config"]["data"]["label_names"] == [] and s["config"]["model"]["num_labels"] is None
    assert s["unlabelled_dropped"] == {"train": 5, "validation": 0}, s["unlabelled_dropped"]
    assert s["train_examples"] == 128 - 5 and s["eval"]["n_examples"] == 32
    assert "label -1 dropped: 5 train" in imdb.output
    labels = json.loads((tmp_path / "imdb" / "labels.json").read_text())
    assert labels["label2id"] == {"negative": 0, "neutral": 1, "positive": 2}

    hyper = train(
        "longformer",
        ld_data,
        tmp_path / "hyper",
        "--train-file",
        str(layouts["hyperpartisan"]),
        "--label-column-name",
        "hyperpartisan",
        "--validation-split-percentage",
        "25",
        "--strategy",
        "ddp",
    )
    s = hyper.summary
    assert s["resolved"]["labels"] == {"num_labels": 2, "label_names": ["false", "true"]}
    split = s["data_source"]["validation_split"]
    assert (split["percentage"], split["seed"], split["validation_rows"]) == (25, 42, 32), split
    assert s["train_examples"] == 96 and s["eval"]["n_examples"] == 32

    tweets = train(
        "multimodal",
        mm_data,
        tmp_path / "tweets",
        "--train-file",
        str(layouts["tweets"] / "train.csv"),
        "--validation-file",
        str(layouts["tweets"] / "validation.csv"),
        "--text-column-names",
        "title,tweet",
        "--label-column-name",
        "sentiment",
        "--image-column-name",
        "photo",
        "--strategy",
        "ddp",
    )
    s = tweets.summary
    # Sorted, not in order of appearance: the same mapping from any shuffle of the file.
    assert s["resolved"]["labels"]["label_names"] == NAMES and s["eval"]["n_examples"] == 64, tweets.tail()

    folder = train(
        "multimodal",
        mm_data,
        tmp_path / "imagefolder",
        "--train-dir",
        str(layouts["imagefolder"] / "train"),
        "--validation-dir",
        str(layouts["imagefolder"] / "validation"),
        "--strategy",
        "fsdp",
    )
    assert folder.summary["train_examples"] == 64 and folder.summary["eval"]["n_examples"] == 16, folder.tail()

    # Embedded images, decoded once by cache-images (keyed by their bytes' sha256) and read from the cache.
    source = [
        "--dataset-name",
        str(layouts["saved"]),
        "--max-train-samples",
        "40",
        "--max-eval-samples",
        "10",
        "--image-cache",
        str(tmp_path / "cache"),
    ]
    cached = cli(["cache-images", "--jobs", "1", *tiny_args("multimodal", mm_data, tmp_path / "saved", *source)])
    assert "train split: 40 images at 32px" in cached.output, cached.tail()
    saved = train(
        "multimodal",
        mm_data,
        tmp_path / "saved",
        *source,
        "--strategy",
        "ddp",
        "--final-model-dir",
        str(tmp_path / "saved_model"),
    )
    assert saved.summary["train_examples"] == 40 and saved.summary["eval"]["n_examples"] == 10, saved.tail()
    assert "images from cache" in saved.output
    exported = json.loads((tmp_path / "saved_model" / "config.json").read_text())
    assert exported["id2label"] == {"0": "negative", "1": "neutral", "2": "positive"}, exported
    assert exported["label2id"] == {"negative": 0, "neutral": 1, "positive": 2}


def test_check_data_reads_a_source_as_training_does_and_train_refuses_before_launching(
    layouts, mm_data, ld_data, tmp_path
):
    flags = [
        "--train-file",
        str(layouts["tweets"] / "train.csv"),
        "--validation-file",
        str(layouts["tweets"] / "validation.csv"),
        "--text-column-names",
        "title,tweet",
        "--label-column-name",
        "sentiment",
        "--image-column-name",
        "photo",
    ]
    ok = cli(["check-data", *tiny_args("multimodal", mm_data, tmp_path / "x", *flags)])
    clean = [line for line in ok.output.splitlines() if line.endswith("no problems found")]
    assert clean and "train.csv" in clean[-1], ok.tail()  # every file it read is named, each with its own count
    wrong = cli(
        ["check-data", *tiny_args("multimodal", mm_data, tmp_path / "x", *flags, "--image-column-name", "pic")],
        check=False,
    )
    assert (
        wrong.returncode == 1
        and "no column 'pic' in" in wrong.output
        and "(columns: title, tweet, photo, sentiment)" in wrong.output
    ), wrong.tail()
    # The same reading refuses a contradicting --num-labels in the launcher, in one line, before any rank starts.
    refused = cli(
        [
            "train",
            *tiny_args(
                "longformer",
                ld_data,
                tmp_path / "y",
                *FAST,
                "--train-file",
                str(layouts["hyperpartisan"]),
                "--label-column-name",
                "hyperpartisan",
                "--num-labels",
                "3",
            ),
        ],
        check=False,
    )
    assert (
        refused.returncode == 2
        and "--num-labels (model.num_labels)=3, but the data has 2 classes (false, true)" in refused.output
        and "ChildFailedError" not in refused.output
    ), refused.tail()


def test_a_resume_refused_for_other_classes_leaves_the_folders_labels_as_they_were(ld_data, tmp_path):
    """labels.json says which class each output id of the folder's checkpoints stands for. A resume on data with
    another class was refused, but only after it had written the new classes over it: a pipeline reading the folder
    then named the checkpoints' outputs wrongly, without an error."""
    for name, classes in (("two", "ab"), ("three", "abc")):
        with open(tmp_path / f"{name}.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["text", "label"])
            w.writerows([f"words of record {i}", classes[i % len(classes)]] for i in range(24))
    out = tmp_path / "run"

    def train(data: str, *flags: str):
        files = ["--train-file", str(tmp_path / data), "--validation-file", str(tmp_path / data)]
        return cli(["train", *tiny_args("longformer", ld_data, out, "--nproc", "1", *files, *flags)], check=False)

    first = train("two.csv", "--max-steps", "2", "--per-device-batch-size", "4", "--eval-every", "0")
    assert first.returncode == 0, first.tail()
    labels = (out / "labels.json").read_bytes()
    assert json.loads(labels)["id2label"] == {"0": "a", "1": "b"}
    refused = train("three.csv", "--max-steps", "4", "--per-device-batch-size", "4", "--resume", "auto")
    assert refused.returncode == 2 and "trained on the classes ['a', 'b'], but the data now has" in refused.output, (
        refused.tail()
    )
    assert (out / "labels.json").read_bytes() == labels
