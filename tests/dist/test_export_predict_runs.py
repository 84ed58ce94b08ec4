"""After training on the user's own data (CSV files with `id,document,category`, string labels,
trained with flags only), the export loads with plain transformers and reproduces `predict`, predict takes new
unlabelled files row for row with their ids, `export --eval` reads the run's own data source, and a resume on
other data says so. One launch of 2 ranks (tests/dist/matrix_driver.py) trains a tiny Longformer, a tiny
multimodal model and the resume; the tests share it."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from launch import REPO, run_plan
from plain_transformers import fresh

from shardtrain import cli

LABELS = ["arts", "business", "politics", "science", "sports"]
COMMON = [
    "--resume",
    "none",
    "--predict-memory",
    "false",
    "--report",
    "false",
    "--num-workers",
    "0",
    "--log-every",
    "100",
    "--strategy",
    "ddp",
    "--device",
    "cpu",
]


def write_csv(path: Path, header: list[str], rows: list[list]) -> Path:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return path


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def shardtrain(capsys, *argv: str) -> str:
    """`shardtrain ARGV` through the console script's own function, in this process: the launch above is the
    multi-process part, and each command's interpreter start (torch, transformers) would cost more than its work."""
    capsys.readouterr()
    code = cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    assert code == 0, out.out[-2000:] + out.err[-2000:]
    return out.out


def trained_ids(run: Path, text: str) -> list[int]:
    """`text`'s token ids, untruncated, by the run's own trained tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(run / "tokenizer"))(text)["input_ids"]


def printed_metrics(output: str, what: str) -> dict:
    line = next(x for x in output.splitlines() if x.startswith(f"{what} metrics"))
    return json.loads(line.split(": ", 1)[1])


def jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


@pytest.fixture(scope="module")
def runs(ld_data, mm_data, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("after_training")
    docs = [json.loads(x) for x in (ld_data / "train.jsonl").read_text().splitlines()[:60]]
    files = {
        "docs": write_csv(
            root / "docs.csv",
            ["id", "document", "category"],
            [[f"doc-{i:03d}", d["text"], LABELS[d["label"]]] for i, d in enumerate(docs)],
        ),
        "small": write_csv(
            root / "small.csv",
            ["id", "document", "category"],
            [[f"doc-{i:03d}", d["text"], LABELS[d["label"]]] for i, d in enumerate(docs[:20])],
        ),
    }
    for split, n in (("train", 96), ("validation", 24)):  # the multimodal records as a csv with class names
        recs = [json.loads(x) for x in (mm_data / f"{split}.jsonl").read_text().splitlines()[:n]]
        files[f"mm_{split}"] = write_csv(
            root / f"mm_{split}.csv",
            ["id", "text", "image", "label"],
            [
                [f"post-{i}", r["text"], str(mm_data / r["image"]), ["neg", "neu", "pos"][r["label"]]]
                for i, r in enumerate(recs)
            ],
        )
    ld = [
        "--config",
        str(REPO / "configs/longformer_tiny.yaml"),
        *COMMON,
        "--text-column-names",
        "document",
        "--label-column-name",
        "category",
        "--validation-split-percentage",
        "10",
        "--per-device-batch-size",
        "4",
        "--lr",
        "5e-3",
        "--warmup-steps",
        "0",
    ]
    plan = [
        {
            "name": "ld",
            "args": [*ld, "--train-file", str(files["docs"]), "--output-dir", str(root / "ld"), "--max-steps", "8"],
        },
        {
            "name": "mm",
            "args": [
                "--config",
                str(REPO / "configs/multimodal_tiny.yaml"),
                *COMMON,
                "--train-file",
                str(files["mm_train"]),
                "--validation-file",
                str(files["mm_validation"]),
                "--output-dir",
                str(root / "mm"),
                "--max-steps",
                "4",
                "--per-device-batch-size",
                "8",
                "--lr",
                "5e-3",
                "--warmup-steps",
                "0",
            ],
        },
        # The Longformer run resumed on another file (60 -> 20 rows) for one more step, into
        # a folder of its own (with the run's tokenizer, as a resume in place would have) to leave `ld` as is.
        {
            "name": "ld_changed",
            "args": [
                *ld,
                "--train-file",
                str(files["small"]),
                "--output-dir",
                str(root / "ld_changed"),
                "--resume",
                str(root / "ld"),
                "--max-steps",
                "9",
                "--tokenizer",
                str(root / "ld" / "tokenizer"),
            ],
        },
    ]
    _, results = run_plan(plan, root, timeout=600)
    return {"root": root, "files": files, "results": results}


def test_a_longformer_export_is_two_lines_of_plain_transformers_and_reproduces_predict(runs, tmp_path, capsys):
    """Item 1 (and 4): `AutoTokenizer` / `AutoModelForSequenceClassification.from_pretrained(EXPORT)` in a fresh
    process agree with `shardtrain predict EXPORT --file` on every row; the tokenizer truncates where training
    did and config.json names the classes. `export --eval` evaluates the --train-file run on its own hold-out."""
    run, export = runs["root"] / "ld", tmp_path / "export"
    done = shardtrain(capsys, "export", run, export, "--eval")
    summary = json.loads((run / "summary.json").read_text())
    meta = json.loads((export / "shardtrain_export.json").read_text())
    assert meta["eval_fp32"] == pytest.approx(summary["eval"], rel=1e-9), done
    assert [line.split(" ")[0] for line in done.splitlines()] == ["exported", "fp32"], done
    assert not (export / "tokenizer").exists() and (export / "tokenizer.json").is_file()

    # The user's file with every other label cell empty (item 2): every row predicted, metrics over the labelled.
    rows = read_csv(runs["files"]["docs"])
    partial = write_csv(
        tmp_path / "partial.csv",
        ["id", "document", "category"],
        [[r["id"], r["document"], r["category"] if i % 2 else ""] for i, r in enumerate(rows)],
    )
    out = shardtrain(capsys, "predict", export, "--file", partial, "--output", tmp_path / "preds.jsonl")
    preds = jsonl(tmp_path / "preds.jsonl")
    assert [p["row"] for p in preds] == list(range(60)) and [p["id"] for p in preds] == [r["id"] for r in rows]
    assert "file metrics (over the 30 labelled rows): " in out, out
    longer = [len(trained_ids(run, r["document"])) > 256 for r in rows]
    assert [p.get("truncated", False) for p in preds] == longer, (sum(longer), out)
    metrics = printed_metrics(out, "file")
    assert metrics["n_examples"] == 30 == sum("true_label" in p for p in preds)
    # Each class's F1 by the run's class names, as its evaluations logged them (the ids, f1_0, before)
    scored = {f"f1_{p['true_label']}" for p in preds if "true_label" in p}
    assert {key for key in metrics if key.startswith("f1_")} == scored and "f1_0" not in scored, metrics
    assert metrics["accuracy"] == pytest.approx(
        sum(p["label"] == p["true_label"] for p in preds if "true_label" in p) / 30
    )

    got = fresh(export, [r["document"] for r in rows], tmp_path / "plain.json")
    from transformers import AutoTokenizer

    trained = AutoTokenizer.from_pretrained(str(run / "tokenizer"))
    assert got["vocab"] == len(trained) and got["model_max_length"] == 256
    assert got["input_ids"] == [trained(r["document"], truncation=True, max_length=256)["input_ids"] for r in rows]
    names = [got["id2label"][str(i)] for i in range(len(got["id2label"]))]
    assert names == summary["run"]["label_names"] == sorted({r["category"] for r in rows})
    gap = max(
        abs(p["probs"].get(name, 0.0) - got["probs"][p["row"]][i])
        for p in preds
        for i, name in enumerate(names)
        if name in p["probs"]
    )
    agree = sum(p["label"] == names[max(range(len(names)), key=lambda i: got["probs"][p["row"]][i])] for p in preds)
    print(f"\nplain transformers vs shardtrain predict: {agree}/60 rows agree, max probability gap {gap:.2e}")
    assert agree == 60 and gap <= 1e-5, (agree, gap)
    spread = max(max(x) - min(x) for x in got["probs"])
    assert spread > 0.05, f"an untrained model would hide a wrong tokenizer: the widest row is {spread:.3f}"


def test_predict_takes_new_unlabelled_files_row_for_row_with_their_ids(runs, tmp_path, capsys):
    """Items 2 and 3: a file without the label column, its ids in another column, the rows reversed: every row
    once, in the file's order, each with its row and id, no metrics; the run's own held-out split by row and id."""
    run, rows = runs["root"] / "ld", read_csv(runs["files"]["docs"])
    new = write_csv(
        tmp_path / "new.csv",
        ["doc_id", "document"],
        [[f"new-{i}", r["document"]] for i, r in enumerate(reversed(rows))],
    )
    out = shardtrain(capsys, "predict", run, "--file", new, "--id-column", "doc_id", "--output", tmp_path / "p.jsonl")
    preds = jsonl(tmp_path / "p.jsonl")
    assert [p["row"] for p in preds] == list(range(60)) and [p["id"] for p in preds] == [f"new-{i}" for i in range(60)]
    assert not any("true_label" in p for p in preds) and "no metrics: " in out, out
    # The run's own validation split: which rows of docs.csv it holds, by row and id.
    out = shardtrain(capsys, "predict", run, "--output", tmp_path / "v.jsonl")
    held = jsonl(tmp_path / "v.jsonl")
    assert printed_metrics(out, "validation") == pytest.approx(
        json.loads((run / "summary.json").read_text())["eval"], rel=1e-9
    )
    assert all(p["id"] == rows[p["row"]]["id"] and p["true_label"] == rows[p["row"]]["category"] for p in held)
    assert "shuffled (--validation-split-percentage 10" in out


def test_a_multimodal_export_hands_plain_transformers_its_tokenizer_and_class_names(runs, tmp_path, capsys):
    """Item 1 for the fusion model (RoBERTa + a torchvision CNN + a fusion head: no transformers architecture):
    the export's tokenizer loads with AutoTokenizer alone and gives the run's ids, truncated at the run's
    length; config.json names the classes; the weights are one safetensors file; `predict EXPORT --file` (which
    rebuilds the model from config.json) reproduces the run's final evaluation."""
    run, export = runs["root"] / "mm", tmp_path / "export"
    shardtrain(capsys, "export", run, export)
    rows = read_csv(runs["files"]["mm_validation"])
    texts = [r["text"] for r in rows] + [" ".join(["long"] * 200)]  # one text past max_length (64)
    got = fresh(export, texts, tmp_path / "plain.json", "--tokenizer-only")
    from transformers import AutoTokenizer

    trained = AutoTokenizer.from_pretrained(str(run / "tokenizer"))
    assert got["model_max_length"] == 64 and got["vocab"] == len(trained)
    assert got["input_ids"] == [trained(t, truncation=True, max_length=64)["input_ids"] for t in texts]
    assert len(got["input_ids"][-1]) == 64
    assert got["id2label"] == {"0": "neg", "1": "neu", "2": "pos"}
    # The run's --validation-file, predicted from the export, is the run's final eval.
    out = shardtrain(
        capsys, "predict", export, "--file", runs["files"]["mm_validation"], "--output", tmp_path / "p.jsonl"
    )
    assert printed_metrics(out, "file") == pytest.approx(
        json.loads((run / "summary.json").read_text())["eval"], rel=1e-9
    ), out
    assert [p["id"] for p in jsonl(tmp_path / "p.jsonl")] == [r["id"] for r in rows]
    # A text longer than max_length is cut to it, as in training: predict says how many, and marks each one.
    past = [" ".join(["long"] * 200) if k == "text" else v for k, v in rows[0].items()]
    long = write_csv(tmp_path / "long.csv", list(rows[0]), [list(r.values()) for r in rows[:3]] + [past])
    out = shardtrain(capsys, "predict", export, "--file", long, "--output", tmp_path / "long.jsonl")
    assert [p.get("truncated", False) for p in jsonl(tmp_path / "long.jsonl")] == [False, False, False, True]
    assert "predict: 1 of 4 texts longer than --max-length (data.max_length) 64 were cut to it, as in" in out, out
    # predict's own --max-length: the line says it is not the length the model trained at.
    out = shardtrain(
        capsys, "predict", export, "--file", long, "--max-length", "8", "--output", tmp_path / "short.jsonl"
    )
    assert "texts longer than predict's --max-length 8 were cut to it, not 64 as in training" in out, out
    # Longer than it trained at: positions it never trained (RoBERTa has 512): one line, not torch's index error.
    assert cli.main(["predict", str(export), "--file", str(long), "--max-length", "1000"]) == 2
    err = capsys.readouterr().err
    assert "predict --max-length 1000: the model trained at 64 tokens; predict at that length or less" in err, err


def test_a_resume_on_other_data_is_in_the_changed_settings_line(runs):
    """Item 6: another --train-file (60 -> 20 rows) is said beside --max-steps, by content hash."""
    summary = json.loads((runs["root"] / "ld_changed" / "summary.json").read_text())
    changes = summary["run"]["resumed_with_changes"]
    assert any(c.startswith("--max-steps 8 -> 9") for c in changes), changes
    train = [c for c in changes if c.startswith("the train data changed (content sha256 ")]
    assert len(train) == 1 and "54 -> 18 rows" in train[0], changes
