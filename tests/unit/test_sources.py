"""shardtrain/data/sources.py: every source to canonical splits; labels, columns, splits and their errors."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from PIL import Image

from shardtrain.config.labels import ClassLabels
from shardtrain.config.settings import ConfigError, from_dict, replace_fields, validate
from shardtrain.data.check import check_source
from shardtrain.data.sources import load_splits


def config(name="longformer", **data):
    cfg = from_dict({"model": {"name": name, "pretrained": False}, "data": data})
    return validate(cfg)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_csv(path: Path, header: list[str], rows: list[list]) -> Path:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return path


@pytest.fixture
def parquet_dir(tmp_path) -> Path:
    """IMDB style: train/test parquet, a ClassLabel; two unlabelled (-1) training rows."""
    import datasets

    d = tmp_path / "imdb"
    d.mkdir()
    train = datasets.Features({"text": datasets.Value("string"), "label": datasets.ClassLabel(names=["neg", "pos"])})
    datasets.Dataset.from_dict(
        {"text": [f"review {i}" for i in range(10)], "label": [0, 1] * 4 + [-1, -1]}, features=train
    ).to_parquet(d / "train.parquet")
    datasets.Dataset.from_dict({"text": ["good", "bad"], "label": [1, 0]}, features=train).to_parquet(
        d / "test.parquet"
    )
    return d


def test_classlabel_names_become_id2label_and_validation_is_mapped_by_name(parquet_dir, tmp_path):
    import datasets

    cfg = config(dataset_name=str(parquet_dir), validation_split_name="test")
    s = load_splits(cfg)
    assert s.label_names == ["neg", "pos"] and s.id2label == {0: "neg", 1: "pos"}
    assert s.labels == ClassLabels(2, ("neg", "pos"))  # what the data decided is the result's, not the config's
    assert (cfg.model.num_labels, cfg.data.label_names) == (None, [])
    assert list(s.validation["label"]) == [1, 0]
    assert len(s.train) == 8 and s.unlabelled == {"train": 2, "validation": 0}
    assert set(s.train.column_names) == {"row", "text", "label"}
    # A validation file whose ClassLabel lists the names in another order: its ids differ, its names do not.
    other = datasets.Features({"text": datasets.Value("string"), "label": datasets.ClassLabel(names=["pos", "neg"])})
    datasets.Dataset.from_dict({"text": ["good", "bad"], "label": [0, 1]}, features=other).to_parquet(
        tmp_path / "v.parquet"
    )
    s = load_splits(config(train_file=str(parquet_dir / "train.parquet"), validation_file=str(tmp_path / "v.parquet")))
    assert list(s.validation["label"]) == [1, 0]


def test_string_and_bool_labels_are_encoded_in_sorted_order(tmp_path):
    rows = [["b", "zebra"], ["c", "ant"], ["d", "moth"], ["e", "ant"]]
    s = load_splits(
        config(
            train_file=str(write_csv(tmp_path / "a.csv", ["text", "label"], rows)),
            validation_file=str(write_csv(tmp_path / "v.csv", ["text", "label"], [["x", "moth"]])),
        )
    )
    assert s.label_names == ["ant", "moth", "zebra"] and list(s.train["label"]) == [2, 0, 1, 0]
    assert list(s.validation["label"]) == [1]
    reordered = load_splits(
        config(
            train_file=str(write_csv(tmp_path / "b.csv", ["text", "label"], rows[::-1])), validation_split_percentage=50
        )
    )
    assert reordered.label_names == ["ant", "moth", "zebra"]  # the file's order does not matter
    hp = write_jsonl(tmp_path / "hp.jsonl", [{"text": f"t{i}", "hyperpartisan": i % 3 == 0} for i in range(6)])
    s = load_splits(config(train_file=str(hp), label_column_name="hyperpartisan", validation_split_percentage=50))
    assert s.label_names == ["false", "true"] and s.num_labels == 2


def test_a_validation_label_unseen_in_training_is_an_error_listing_the_known_labels(tmp_path):
    train = write_csv(tmp_path / "t.csv", ["text", "label"], [["a", "pos"], ["b", "neg"]])
    val = write_csv(tmp_path / "v.csv", ["text", "label"], [["c", "neg"], ["d", "neutral"]])
    with pytest.raises(
        ConfigError,
        match=r"v\.csv row 1 .*validation label 'neutral' is not a class of the "
        r"training split \(its labels: neg, pos\)",
    ):
        load_splits(config(train_file=str(train), validation_file=str(val)))


def test_an_explicit_num_labels_that_contradicts_the_data_names_both(tmp_path, parquet_dir):
    cfg = config(dataset_name=str(parquet_dir), validation_split_name="test")
    cfg = replace_fields(cfg, num_labels=3)
    with pytest.raises(
        ConfigError,
        match=r"--num-labels \(model.num_labels\)=3, but the data has 2 classes "
        r"\(neg, pos\)",
    ):
        load_splits(cfg)
    # Integer labels: ids as given, num_labels from the largest unless set; out of range is that row's error.
    f = write_jsonl(tmp_path / "ids.jsonl", [{"text": "a", "label": 0}, {"text": "b", "label": 4}])
    assert load_splits(config(train_file=str(f), validation_split_percentage=50)).num_labels == 5
    cfg = config(train_file=str(f), validation_split_percentage=50)
    cfg = replace_fields(cfg, num_labels=3)
    with pytest.raises(ConfigError, match=r"ids\.jsonl:2: label 4 is outside 0\.\.2"):
        load_splits(cfg)


def test_a_wrong_column_is_named_with_the_columns_that_exist(tmp_path):
    f = write_csv(tmp_path / "t.csv", ["review", "stars"], [["a", "1"]])
    with pytest.raises(
        ConfigError,
        match=r"--text-column-names \(data.text_column_names\): no column 'text' in "
        r".*t\.csv \(columns: review, stars\)",
    ):
        load_splits(config(train_file=str(f)))
    with pytest.raises(ConfigError, match=r"--label-column-name .*no column 'label' .*columns: review, stars"):
        load_splits(config(train_file=str(f), text_column_names=["review"]))
    with pytest.raises(ConfigError, match=r"--image-column-name .*no column 'image'"):
        load_splits(config("multimodal", train_file=str(f), text_column_names=["review"], label_column_name="stars"))


def test_text_columns_are_joined_with_the_delimiter(tmp_path):
    f = write_csv(tmp_path / "t.csv", ["title", "body", "y"], [["Hi", "there", "a"], ["Yo", "", "b"]])
    s = load_splits(
        config(
            train_file=str(f),
            validation_file=str(f),
            text_column_names=["title", "body"],
            text_column_delimiter=" | ",
            label_column_name="y",
        )
    )
    assert list(s.train["text"]) == ["Hi | there", "Yo"]  # an empty cell adds no delimiter


def test_percentage_split_is_deterministic_for_a_seed_and_recorded(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", [{"text": f"t{i}", "label": ["x", "y"][i % 2]} for i in range(40)])

    def held_out(seed):
        cfg = config(train_file=str(f), validation_split_percentage=25)
        cfg = replace_fields(cfg, seed=seed)
        s = load_splits(cfg)
        assert len(s.train) == 30 and len(s.validation) == 10
        assert not set(s.train["row"]) & set(s.validation["row"])
        return list(s.validation["row"]), s.source["validation_split"]

    first, record = held_out(1)
    assert held_out(1)[0] == first and held_out(2)[0] != first
    assert (record["percentage"], record["seed"], record["validation_rows"]) == (25, 1, 10)
    assert record["first_rows"] == sorted(first)[:10]


def test_a_missing_validation_split_names_the_splits_and_the_percentage_flag(parquet_dir):
    with pytest.raises(
        ConfigError,
        match=r"--validation-split-name .*no split 'validation' \(splits: train, test\); "
        r"or hold out part of train with --validation-split-percentage",
    ):
        load_splits(config(dataset_name=str(parquet_dir)))


def test_max_samples_apply_to_every_source(parquet_dir):
    s = load_splits(
        config(dataset_name=str(parquet_dir), validation_split_name="test", max_train_samples=3, max_eval_samples=1)
    )
    assert (len(s.train), len(s.validation)) == (3, 1)


def test_two_sources_or_a_lone_validation_flag_are_errors(tmp_path, parquet_dir):
    with pytest.raises(ConfigError, match=r"--dataset-name .* and --train-file .* both name the training data"):
        load_splits(config(dataset_name=str(parquet_dir), train_file="x.csv"))
    with pytest.raises(ConfigError, match=r"--validation-file .* needs --train-file"):
        load_splits(config(validation_file="x.csv"))
    with pytest.raises(ConfigError, match=r"--train-file .*unknown extension '.txt' \(csv, json, jsonl or parquet\)"):
        load_splits(config(train_file=str(tmp_path / "a.txt")))


def test_mixed_label_types_are_named_with_their_lines(tmp_path):
    f = write_jsonl(tmp_path / "m.jsonl", [{"text": "a", "label": 1}, {"text": "b", "label": "pos"}])
    with pytest.raises(
        ConfigError,
        match=r"column 'label' mixes label types \(int at .*m\.jsonl:1, str at "
        r".*m\.jsonl:2\)",
    ):
        load_splits(config(train_file=str(f), validation_split_percentage=50))


def images_csv(tmp_path) -> Path:
    """A CSV whose image paths are relative to its own folder; one image missing, one corrupt."""
    d = tmp_path / "csvdata"
    (d / "pics").mkdir(parents=True)
    for i in range(4):
        Image.new("RGB", (12, 12), (60 * i, 0, 0)).save(d / "pics" / f"{i}.png")
    (d / "pics" / "3.png").write_bytes(b"not a png")
    rows = [
        ["one", "pics/0.png", "a"],
        ["two", "pics/1.png", "b"],
        ["", "pics/2.png", "a"],
        ["four", "pics/3.png", "b"],
        ["five", "pics/9.png", "a"],
        ["six", "pics/2.png", "a"],
    ]
    return write_csv(d / "train.csv", ["tweet", "photo", "label"], rows)


def test_image_paths_are_relative_to_the_data_file_and_bad_rows_are_skipped_and_counted(tmp_path, monkeypatch):
    f = images_csv(tmp_path)
    monkeypatch.chdir(tmp_path)  # not the CSV's folder
    cfg = config(
        "multimodal",
        train_file=str(f.relative_to(tmp_path)),
        validation_file=str(f),
        text_column_names=["tweet"],
        image_column_name="photo",
        skip_bad_samples=True,
    )
    s = load_splits(cfg)
    assert list(s.train["image"]) == [str(f.parent / "pics" / n) for n in ("0.png", "1.png", "2.png")]
    assert [m.split(": ", 1)[1][:20] for m in s.skipped["train"]] == [
        "empty text",
        "cannot decode image ",
        "image not found: pic",
    ]
    cfg = replace_fields(cfg, skip_bad_samples=False)
    with pytest.raises(ConfigError, match=r"train\.csv row 2 \(line 4 if no field spans lines\): empty text"):
        load_splits(cfg)


def test_check_data_lists_every_problem_of_a_source(tmp_path):
    f = images_csv(tmp_path)
    empty = write_csv(tmp_path / "empty.csv", ["tweet", "photo", "label"], [["", "pics/0.png", "a"]])
    cfg = config(
        "multimodal",
        train_file=str(f),
        validation_file=str(empty),
        text_column_names=["tweet"],
        image_column_name="photo",
    )
    problems = check_source(cfg)
    assert len(problems) == 5, problems
    assert "row 2 (line 4 if no field spans lines): empty text" in problems[0]
    assert (
        "row 3 (line 5 if no field spans lines): cannot decode image pics/3.png: UnidentifiedImageError" in problems[1]
    )
    assert "row 4 (line 6 if no field spans lines): image not found: pics/9.png" in problems[2]
    assert "empty.csv row 0 (line 2 if no field spans lines): empty text" in problems[3]
    assert (
        problems[4].startswith("--validation-file (data.validation_file): no usable rows in")
        and "empty.csv" in problems[4]
    )
    cfg = replace_fields(cfg, label_column_name="sentiment")
    assert check_source(cfg) == [
        f"--label-column-name (data.label_column_name): no column 'sentiment' in {f} (columns: tweet, photo, label)"
    ]
    cfg = replace_fields(cfg, label_column_name="label")
    write_csv(tmp_path / "empty.csv", ["tweet", "photo", "label"], [])  # the header only
    assert check_source(cfg) == [f"--validation-file (data.validation_file): {empty} has no rows"]


def test_trains_refusal_of_a_bad_row_says_how_many_there_are_and_the_ways_on(tmp_path):
    """As for a jsonl file's bad record: a trial's CSV with two empty texts was refused by its first alone, with no
    count, no check-data and no --skip-bad-samples (docs/data.md promised the count)."""
    from shardtrain.data.precheck import check_splits

    rows = [["good text", "pos"], ["", "neg"], ["more text", "neg"], ["", "pos"], ["fine", "pos"]]
    cfg = config(train_file=str(write_csv(tmp_path / "reviews.csv", ["review", "sentiment"], rows)),
                 text_column_names=["review"], label_column_name="sentiment")  # fmt: skip
    with pytest.raises(ConfigError) as e:
        check_splits(cfg)
    first = "reviews.csv row 1 (line 3 if no field spans lines): empty text (2 bad rows: shardtrain check-data "
    assert first in str(e.value)
    assert str(e.value).endswith("lists them all, --skip-bad-samples (data.skip_bad_samples) leaves them out)")
    write_csv(tmp_path / "reviews.csv", ["review", "sentiment"], rows[:3])
    with pytest.raises(ConfigError, match=r"empty text \(the only bad row; --skip-bad-samples"):
        check_splits(cfg)


def test_a_csv_too_small_for_a_batch_on_every_rank_is_refused_before_any_process_starts(tmp_path):
    from shardtrain.data.precheck import check_splits

    rows = [[f"text {i}", "pos" if i % 2 else "neg"] for i in range(5)]
    cfg = config(train_file=str(write_csv(tmp_path / "reviews.csv", ["review", "sentiment"], rows)),
                 text_column_names=["review"], label_column_name="sentiment")  # fmt: skip
    cfg = replace_fields(cfg, per_device_batch_size=2, max_train_samples=None)
    check_splits(cfg, world_size=2)  # 5 // 2 = 2 each
    with pytest.raises(ConfigError, match=r"=2 is larger than each rank's share of the training set \(5 examples"):
        check_splits(cfg, world_size=3)


def test_a_class_spelt_two_ways_is_refused_unless_label_names_lists_both(tmp_path):
    """A trial's CSV had one `Pos` among `pos` and `neg`: the run trained three classes (0=Pos, 1=neg, 2=pos), and
    check-data said nothing."""
    from shardtrain.data.check import check_source
    from shardtrain.data.sources import load_splits

    rows = [["good", "pos"], ["bad", "neg"], ["fine", "pos"], ["great", "Pos"], ["awful", "neg"]]
    f = write_csv(tmp_path / "reviews.csv", ["review", "sentiment"], rows)
    cfg = config(train_file=str(f), text_column_names=["review"], label_column_name="sentiment")
    message = (
        f"{f}: column 'sentiment' has labels 'Pos' (1 row) and 'pos' (2 rows), which differ only in case or spaces: "
        "fix the data, or list every class in --label-names (data.label_names) to keep them apart"
    )
    with pytest.raises(ConfigError) as e:
        load_splits(cfg)
    assert str(e.value) == message
    assert check_source(cfg) == [message]
    kept = load_splits(replace_fields(cfg, label_names=["Pos", "neg", "pos"]))
    assert list(kept.labels.names) == ["Pos", "neg", "pos"]


def test_a_rare_label_spelt_like_a_common_one_is_refused_but_numbered_classes_are_not(tmp_path):
    """A user's training file had one `postive` among 239 `positive`: the run trained a fourth class on it, and
    check-data and --check-only said nothing."""
    from shardtrain.data.check import check_source
    from shardtrain.data.sources import load_splits

    rows = [[f"text {i}", ("positive", "negative")[i % 2]] for i in range(40)]
    rows[6][1] = "postive"
    f = write_csv(tmp_path / "reviews.csv", ["review", "sentiment"], rows)
    cfg = config(train_file=str(f), text_column_names=["review"], label_column_name="sentiment")
    message = (
        f"{f} row 6 (line 8 if no field spans lines): label 'postive' (1 row of column 'sentiment') beside "
        "'positive' (19 rows): a typo would train a class of its own; fix the row, or list every class in "
        "--label-names (data.label_names) to keep them apart"
    )
    with pytest.raises(ConfigError) as e:
        load_splits(cfg)
    assert str(e.value) == message and check_source(cfg) == [message]
    kept = load_splits(replace_fields(cfg, label_names=["negative", "positive", "postive"]))
    assert kept.labels.count == 3
    numbered = [[f"text {i}", "label_1" if i else "label_2"] for i in range(40)]
    f = write_csv(tmp_path / "numbered.csv", ["review", "sentiment"], numbered)
    cfg = config(train_file=str(f), text_column_names=["review"], label_column_name="sentiment")
    assert list(load_splits(cfg).labels.names) == ["label_1", "label_2"]


def test_an_image_that_fails_to_decode_mid_run_is_named_by_its_file_and_line(tmp_path):
    """An image is decoded when the run loads it (predict --file, --train-file): a jsonl row is named by its line,
    as check-data names it, and a held-out validation row by the file it came from (it used to be `row N`, from 0,
    of "the held-out share")."""
    from shardtrain.data.split_dataset import source_datasets

    d = tmp_path / "posts"
    (d / "pics").mkdir(parents=True)
    for i in range(6):
        Image.new("RGB", (12, 12), (40 * i, 0, 0)).save(d / "pics" / f"{i}.png")
    (d / "pics" / "4.png").write_bytes(b"not a png")
    rows = [{"text": f"post {i}", "image": f"pics/{i}.png", "label": "ab"[i % 2]} for i in range(6)]
    path = d / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" + ("\n" if i == 1 else "") for i, r in enumerate(rows)))
    train, _ = source_datasets(config("multimodal", train_file=str(path), validation_file=str(path)))
    with pytest.raises(ConfigError, match=rf"^{path}:6: cannot decode image \S*pics/4\.png"):
        train[4]  # the fifth record, on line 6 after a blank line
    held = config("multimodal", train_file=str(path), validation_split_percentage=50)
    corrupt = str(d / "pics" / "4.png")
    bad = next(ds for ds in source_datasets(held) if corrupt in list(ds.table["image"]))
    with pytest.raises(ConfigError, match=rf"^{path}:6: cannot decode image"):
        bad[list(bad.table["image"]).index(corrupt)]
    # predict --file reads the file with its own reader, and its dataset names the row the same way.
    from shardtrain.data.sources import prediction_rows
    from shardtrain.data.split_dataset import SplitDataset

    trained = config("multimodal", train_file=str(path), label_names=["a", "b"])  # the run's classes
    read = prediction_rows(trained, str(path), None)
    data = SplitDataset(read.table, read.origin, 224, True, [], row_names=read.row_names)
    with pytest.raises(ConfigError, match=rf"^{path}:6: cannot decode image"):
        data[4]


def test_the_jsonl_layout_is_one_source_with_its_file_line_messages(tmp_path):
    from shardtrain.data import make_data

    d = make_data("longdoc", tmp_path / "ld", n_train=6, n_val=3, min_words=5, max_words=8)
    s = load_splits(config(data_dir=str(d)))
    assert len(s.train) == 6 and s.label_names == [] and s.num_labels == 3 and list(s.train["row"]) == list(range(1, 7))
    with open(d / "train.jsonl", "a") as out:
        out.write('{"text": "x", "label": 7}\n')
    with pytest.raises(ConfigError, match=r"train\.jsonl:7: label 7 is outside 0\.\.2 \(model.num_labels=3\)"):
        load_splits(config(data_dir=str(d)))


def test_save_to_disk_folders_and_embedded_images_train_from_bytes_or_the_image_cache(tmp_path):
    import datasets
    import torch

    from shardtrain.data.image_cache import build_source_image_cache, open_source_image_cache
    from shardtrain.data.sources import image_key
    from shardtrain.data.split_dataset import SplitDataset

    for i in range(4):
        Image.new("RGB", (16, 16), (0, 60 * i, 0)).save(tmp_path / f"{i}.png")
    features = datasets.Features(
        {"text": datasets.Value("string"), "image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b"])}
    )
    ds = datasets.Dataset.from_dict(
        {"text": ["w", "x", "y", "z"], "image": [str(tmp_path / f"{i}.png") for i in range(4)], "label": [0, 1, 0, 1]},
        features=features,
    )
    ds.save_to_disk(str(tmp_path / "one"))  # a Dataset (not a DatasetDict): the training split
    cfg = config("multimodal", dataset_name=str(tmp_path / "one"), validation_split_percentage=25, image_size=8)
    s = load_splits(cfg)
    assert s.label_names == ["a", "b"] and len(s.train) == 3 and s.train[0]["image"]["bytes"]  # embedded
    decoded = SplitDataset(s.train, "t", 8, True, [])[0]["image"]
    assert decoded.shape == (3, 8, 8) and decoded.dtype == torch.uint8
    cfg = replace_fields(cfg, image_cache=str(tmp_path / "cache"))
    build_source_image_cache("train", list(s.train["image"]), tmp_path / "cache", 8)
    cache = open_source_image_cache(cfg, "train", [image_key(v) for v in s.train["image"]])
    cached = SplitDataset(s.train, "t", 8, True, [], cache)[0]["image"]
    assert torch.equal(cached, decoded)
    with pytest.raises(
        ConfigError, match=r"--image-cache .*the images of the validation split changed|no complete cache"
    ):
        open_source_image_cache(cfg, "validation", ["other"])


def test_label_names_fix_the_order_and_reach_the_hf_config_of_an_export(tmp_path):
    from shardtrain.builtin_workloads.networks import text_config_for

    f = write_csv(tmp_path / "t.csv", ["text", "label"], [["a", "pos"], ["b", "neg"], ["c", "neutral"]])
    cfg = config(train_file=str(f), validation_file=str(f), label_names=["neg", "neutral", "pos"])
    s = load_splits(cfg)
    assert s.label_names == ["neg", "neutral", "pos"] and list(s.train["label"]) == [2, 0, 1]
    cfg = replace_fields(
        s.labels.applied_to(cfg),  # the run's classes, as the built-in workload builds its model
        text_model="allenai/longformer-base-4096",  # in the offline table of known architectures
        text_config={"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64},
    )
    hf = text_config_for(cfg.model, cfg.data, 100)  # Longformer's own config: what save_pretrained writes
    assert hf.id2label == {0: "neg", 1: "neutral", 2: "pos"} and hf.label2id["pos"] == 2 and hf.num_labels == 3
    cfg = config(train_file=str(f), validation_file=str(f), label_names=["neg", "pos"])
    with pytest.raises(ConfigError, match=r"labels \['neutral'\] are not in --label-names \(data.label_names\)"):
        load_splits(cfg)


def test_resuming_on_data_with_other_classes_is_an_error(tmp_path):
    from shardtrain.data.sources import check_resumed_labels

    now = ClassLabels(2, ("neg", "pos"))
    check_resumed_labels({"config": {"data": {"label_names": ["neg", "pos"]}}}, now)  # a checkpoint before the split
    check_resumed_labels({"config": {"data": {}}}, now)  # a checkpoint from integer labels, or from before names
    check_resumed_labels({"config": {}, "resolved": {"labels": {"num_labels": 2, "label_names": ["neg", "pos"]}}}, now)
    with pytest.raises(
        ConfigError,
        match=r"trained on the classes \['neg', 'neutral', 'pos'\], but the data now "
        r"has \['neg', 'pos'\].*--label-names neg,neutral,pos",
    ):
        check_resumed_labels({"resolved": {"labels": {"num_labels": 3, "label_names": ["neg", "neutral", "pos"]}}}, now)


def test_a_users_workload_takes_any_source_through_load_splits(tmp_path):
    """README 'Your data': the public helper, from a workload of one's own (text only, images if the source has
    them): canonical datasets.Dataset splits, map-style, that the loop's DataLoader indexes."""
    from shardtrain import Workload
    from shardtrain.data import load_splits as public

    class Reviews(Workload):
        def datasets(self):
            self.splits = public(self.cfg)
            return self.splits.train, self.splits.validation

        def labels(self):
            return self.splits.labels

    f = write_csv(tmp_path / "r.csv", ["body", "stars"], [["fine", "good"], ["meh", "bad"], ["ok", "good"]])
    cfg = from_dict(
        {
            "workload": "reviews:Reviews",
            "data": {
                "train_file": str(f),
                "validation_file": str(f),
                "text_column_names": "body",
                "label_column_name": "stars",
            },
        }
    )
    reviews = Reviews(cfg)
    train, validation = reviews.datasets()
    assert train[0] == {"row": 0, "text": "fine", "label": 1} and len(validation) == 3
    assert reviews.labels() == ClassLabels(2, ("bad", "good")) and cfg.data.label_names == []


def test_a_data_folder_the_workload_never_reads_is_warned_about_like_a_train_file(tmp_path, monkeypatch):
    """--data-dir was ignored in silence by a workload that reads its own data (only --train-file and the other
    source flags were warned about); the default folder, which nobody named, is not."""
    from shardtrain.data.sources import source_asks, unread_source_flags

    monkeypatch.chdir(tmp_path)

    asks = source_asks()
    line = unread_source_flags(replace_fields(config("multimodal"), data_dir="myproj/data_missing"), asks)
    assert line.startswith("--data-dir (data.data_dir) names training data, but the workload's datasets() did not")
    assert unread_source_flags(config("multimodal"), asks) is None
    layout = replace_fields(config("multimodal"), dataset_format="mvsa-single")
    assert unread_source_flags(layout, asks).startswith("--dataset-format (data.dataset_format) names training data")
    # Set in a YAML file: the warning names the file and line, as an error about it would.
    yaml = Path("myproj") / "run.yaml"
    yaml.parent.mkdir(exist_ok=True)
    yaml.write_text("model:\n  name: multimodal\ndata:\n  data_dir: myproj/data_missing\n")
    from shardtrain.config.settings import parse_cli

    line = unread_source_flags(parse_cli(["--config", str(yaml)]), asks)
    assert line.startswith("myproj/run.yaml:4: data.data_dir names training data"), line


def test_a_data_dir_given_beside_the_source_a_config_file_names_is_said_to_be_unread(tmp_path, monkeypatch):
    """A trial's --data-dir over a config file's dataset_name trained on the dataset without a word."""
    from shardtrain.config.settings import parse_cli
    from shardtrain.data.sources import source_asks, source_of, unread_source_flags

    monkeypatch.chdir(tmp_path)
    Path("run.yaml").write_text("model:\n  name: longformer\ndata:\n  dataset_name: reviews_disk\n")
    cfg = parse_cli(["--config", "run.yaml", "--data-dir", "other_data"])
    asks = source_asks()
    assert source_of(cfg) == "dataset_name"  # the workload read the run's source
    assert unread_source_flags(cfg, asks) == (
        "--data-dir (data.data_dir) other_data is not read: run.yaml:4: data.dataset_name names the training data "
        "(one source per run)"
    )
    # A config file's own data folder, which --train-file and the others replace, is not worth a line.
    Path("ship.yaml").write_text("model:\n  name: longformer\ndata:\n  data_dir: data/longdoc\n")
    cfg = parse_cli(["--config", "ship.yaml", "--train-file", "mine.csv"])
    asks = source_asks()
    source_of(cfg)
    assert unread_source_flags(cfg, asks) is None


def test_a_yaml_that_names_the_default_data_folder_is_warned_about_too(tmp_path, monkeypatch):
    """A file that says `data_dir: data/multimodal` asked for that folder, though it is the default: a workload
    that reads its own data ignored it without a word (only values other than the default were warned about)."""
    from shardtrain.config.settings import FIELDS, parse_cli
    from shardtrain.data.sources import source_asks, unread_source_flags

    monkeypatch.chdir(tmp_path)
    default = FIELDS["data_dir"][1].default
    Path("run.yaml").write_text(f"model:\n  name: multimodal\ndata:\n  data_dir: {default}\n")
    line = unread_source_flags(parse_cli(["--config", "run.yaml"]), source_asks())
    assert line is not None and line.startswith("run.yaml:4: data.data_dir names training data"), line
    # Nobody named it: no warning.
    Path("bare.yaml").write_text("model:\n  name: multimodal\n")
    assert unread_source_flags(parse_cli(["--config", "bare.yaml"]), source_asks()) is None
