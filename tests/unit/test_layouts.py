"""--dataset-format: the research datasets read in their published layouts (shardtrain/data/layouts.py), on small
copies built here (tests/layout_copies.py), and the text pairs the Twitter layouts give to the collator."""

import shutil

import pytest
from layout_copies import DROPPED_MVSA_MULTIPLE, DROPPED_MVSA_SINGLE, DROPPED_TWITTER, jpeg, make_mvsa, make_twitter

from shardtrain.cli import main as cli_main
from shardtrain.config.settings import ConfigError, from_dict, replace_fields, validate
from shardtrain.data import build_datasets, build_loaders, build_tokenizer
from shardtrain.data.layouts import decode_leniently, layout_files, read_layout
from shardtrain.data.precheck import check_splits
from shardtrain.data.splits import Collator
from shardtrain.data.tokenizer import training_texts


@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    return {
        "mvsa-single": make_mvsa(root / "single"),
        "mvsa-multiple": make_mvsa(root / "multiple", multiple=True),
        "twitter2015": make_twitter(root / "t15"),
        "twitter2017": make_twitter(root / "t17", "twitter2017"),
    }


def layout_cfg(fmt, data_dir, tmp_path, **data):
    cfg = from_dict(
        {
            "model": {"pretrained": False},
            "train": {"per_device_batch_size": 4},
            "data": {"dataset_format": fmt, "data_dir": str(data_dir), "image_size": 16, "num_workers": 0, **data},
            "checkpoint": {"output_dir": str(tmp_path / "run")},
        }
    )
    return validate(cfg)


def by_post(layout):
    return {int(r.text.split()[1]) if r.text.startswith("post") else 7: r for r in layout.splits["train"]}


# ---- the readers ---------------------------------------------------------------------------------------


def test_mvsa_single_keeps_agreeing_posts_and_counts_the_rest(copies):
    layout = read_layout("mvsa-single", copies["mvsa-single"])
    assert dict(layout.dropped) == DROPPED_MVSA_SINGLE
    assert layout.labels == ("negative", "neutral", "positive")
    posts = by_post(layout)
    assert len(posts) == 40 - sum(DROPPED_MVSA_SINGLE.values())
    assert posts[2].label == "positive"  # text positive, image neutral: the other's label
    assert posts[1].label == "neutral"  # neutral, neutral
    assert posts[10].label == "neutral" and posts[11].label == "positive" and posts[12].label == "negative"
    assert all(r.text_pair is None for r in posts.values())
    # Each reason names one example, file:line and the post.
    ex = layout.examples
    assert ex["labels_disagree"].endswith("labelResultAll.txt:4: post 3: text positive, image negative")
    assert ex["missing_image"].endswith(":6: post 5: data/5.jpg not found")
    assert ex["missing_text"].endswith(":7: post 6: data/6.txt not found")
    assert ":9:" in ex["malformed_line"] and "happy" in ex["malformed_line"]
    assert ex["empty_text"].endswith(":10: post 9: data/9.txt is empty")
    # Images are absolute paths to real files.
    assert posts[1].image == str(copies["mvsa-single"].resolve() / "data" / "1.jpg")


def test_mvsa_text_that_is_not_utf8_is_read_as_windows_1252_and_counted(copies):
    layout = read_layout("mvsa-single", copies["mvsa-single"])
    assert by_post(layout)[7].text == "café \ufffd post 7 neutral"
    assert (layout.non_utf8_bytes, layout.replaced_bytes) == (1, 1)
    assert layout.report()["non_utf8_bytes"] == 1 and layout.report()["replaced_bytes"] == 1
    # Valid UTF-8 around a stray byte stays as it is; a byte-order mark goes.
    assert decode_leniently("🏀 ".encode() + b"\xe9t\xe9") == ("🏀 été", 2, 0)
    assert decode_leniently(b"\xef\xbb\xbfok") == ("ok", 0, 0)


def test_mvsa_multiple_majority_vote_and_tie(copies):
    layout = read_layout("mvsa-multiple", copies["mvsa-multiple"])
    assert dict(layout.dropped) == DROPPED_MVSA_MULTIPLE
    assert "post 4: the three annotators' text labels all differ" in layout.examples["no_majority"]
    # post 3: text positive, positive, neutral -> positive; image negative x3: disagree.
    assert layout.examples["labels_disagree"].endswith("post 3: text positive, image negative")
    posts = by_post(layout)
    assert 4 not in posts and 3 not in posts and posts[2].label == "positive"


def test_one_mvsa_read_as_the_other_is_one_line(copies):
    wrong = (
        r"--dataset-format mvsa-single: .*labelResultAll.txt:2 has 3 text,image label pair\(s\), mvsa-single has "
        r"1 \(is this mvsa-multiple\?\)"
    )
    with pytest.raises(ConfigError, match=wrong):
        read_layout("mvsa-single", copies["mvsa-multiple"])
    with pytest.raises(ConfigError, match=wrong):  # at start-up, before any process is launched
        layout_files("mvsa-single", copies["mvsa-multiple"])
    with pytest.raises(ConfigError, match="labelResultAll.txt:2 has 1 text,image label pair"):
        layout_files("mvsa-multiple", copies["mvsa-single"])


@pytest.mark.parametrize("name", ["twitter2015", "twitter2017"])
def test_twitter_splits_target_put_back_and_paired(copies, name):
    layout = read_layout(name, copies[name])
    assert {s: len(r) for s, r in layout.splits.items()} == {"train": 24 - 3, "validation": 8, "test": 6}
    assert dict(layout.dropped) == DROPPED_TWITTER
    first = layout.splits["train"][0]
    assert first.text == "RT @ fan1 : Team 1 was neutral at the game 🏀" and first.text_pair == "Team 1"
    assert first.label == "neutral" and first.line == 2  # label 1; line 1 is the header
    assert layout.splits["train"][1].text.endswith("game 🏀\u2028second line")  # one row, not split in two
    assert {r.label for r in layout.splits["validation"]} == {"negative", "neutral", "positive"}
    assert layout.examples["missing_image"].endswith(
        f"train.tsv:3: image 404.jpg not found in {copies[name].resolve() / (name + '_images')}"
    )
    assert "train.tsv:4: the tweet has no $T$" in layout.examples["no_target_marker"]
    assert "train.tsv:5: expected index, label 0/1/2" in layout.examples["malformed_line"]
    # The TSVs' own folder (TomBERT's --data_dir) reads the same rows, images from the sibling folder.
    assert read_layout(name, copies[name] / name).splits == layout.splits
    ds = layout.to_dataset("validation")
    assert ds.features["label"].names == ["negative", "neutral", "positive"]
    assert ds.column_names == ["text", "image", "label", "text_pair"]


def test_missing_files_name_the_flag_and_the_file(copies, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match=f"^--dataset-format mvsa-single: labelResultAll.txt not found in {empty} "):
        read_layout("mvsa-single", empty)
    with pytest.raises(ConfigError, match=f"^--dataset-format twitter2015: train.tsv not found in {empty}"):
        read_layout("twitter2015", empty)
    moved = tmp_path / "t15"
    shutil.copytree(copies["twitter2015"] / "twitter2015", moved / "twitter2015")
    with pytest.raises(ConfigError, match="twitter2015_images/ not found beside"):
        read_layout("twitter2015", moved)


# ---- start-up, config and the datasets a run trains on --------------------------------------------------


def test_config_and_startup_checks(copies, tmp_path):
    with pytest.raises(ConfigError, match="data.dataset_format: 'mvsa' is not one of mvsa-single, mvsa-multiple"):
        from_dict({"data": {"dataset_format": "mvsa"}})
    cfg = layout_cfg("mvsa-single", copies["mvsa-single"], tmp_path)
    cfg = replace_fields(cfg, name="longformer")
    with pytest.raises(ConfigError, match=r"--dataset-format mvsa-single \(data.dataset_format\): .*multimodal"):
        validate(cfg)
    cfg = layout_cfg("twitter2017", copies["twitter2015"], tmp_path)
    with pytest.raises(ConfigError, match="--dataset-format twitter2017: train.tsv not found"):
        check_splits(cfg)
    cfg = layout_cfg("mvsa-single", copies["mvsa-single"], tmp_path)
    check_splits(cfg)
    cfg = replace_fields(cfg, num_labels=2)
    with pytest.raises(
        ConfigError,
        match=r"--dataset-format mvsa-single has 3 labels \(negative, neutral, positive\), "
        r"but --num-labels \(model.num_labels\) is 2",
    ):
        check_splits(cfg)


def test_mvsa_trains_with_a_held_out_share_and_reports_drops(copies, tmp_path):
    cfg = layout_cfg("mvsa-single", copies["mvsa-single"], tmp_path)
    train, val = build_datasets(cfg)
    kept = 40 - sum(DROPPED_MVSA_SINGLE.values())
    held = -(-kept // 10)  # datasets' train_test_split rounds the held-out share up
    assert (len(train), len(val)) == (kept - held, held)
    again_train, again_val = build_datasets(cfg)
    assert again_val.table["text"] == val.table["text"]  # the same share for the same seed
    assert not set(train.table["text"]) & set(val.table["text"])
    report = train.data_report
    assert report["dropped"] == DROPPED_MVSA_SINGLE and report["kept"] == {"train": kept}
    assert report["validation_held_out"] == {"percent": 10, "seed": 42, "posts": held}
    lines = train.data_report_lines
    assert len(lines) == 2 + len(DROPPED_MVSA_SINGLE) + 1  # kept, held out, one per reason, decoding
    assert any(line.startswith("--dataset-format mvsa-single: dropped 1 (missing_image), e.g. ") for line in lines)
    item = train[0]
    assert item["image"].shape == (3, 16, 16) and "text_pair" not in item
    names = ("negative", "neutral", "positive")  # ids in the sorted names' order
    assert all(
        f" {names[label]}" in text
        for text, label in zip(train.table["text"], train.table["label"])
        if not text.startswith("post 2 ")
    )
    capped, _ = build_datasets(layout_cfg("mvsa-single", copies["mvsa-single"], tmp_path, max_train_samples=5))
    assert len(capped) == 5


def test_twitter_batches_carry_the_target_as_a_pair(copies, tmp_path):
    cfg = layout_cfg("twitter2015", copies["twitter2015"], tmp_path)
    texts, source = training_texts(cfg)
    assert "Team 1" in texts and source.name == "train.tsv"  # the BPE sees the targets too
    tok = build_tokenizer(cfg, tmp_path / "run", True, lambda: None)
    train, val = build_datasets(cfg, tok)
    assert (len(train), len(val)) == (21, 8) and "validation_held_out" not in train.data_report
    assert train[0]["text_pair"] == "Team 1"
    loaders = build_loaders(cfg, tok, train, val, 0, 1, "cpu")
    batch = loaders.train.next_batch()
    assert batch["pixel_values"].shape[1:] == (3, 16, 16)
    # The pair is one sequence with the tokenizer's own separators: <s> tweet </s></s> target </s>.
    items = [train[0], train[1]]
    pair = Collator(tok, 64, images=True)(items)["input_ids"][0]
    alone = Collator(tok, 64, images=True)([{k: v for k, v in it.items() if k != "text_pair"} for it in items])[
        "input_ids"
    ][0]
    expected = tok(items[0]["text"], items[0]["text_pair"])["input_ids"]
    assert pair[: len(expected)].tolist() == expected
    assert expected.count(tok.sep_token_id) == 3 and len(expected) > int((alone != tok.pad_token_id).sum())


def test_skip_bad_samples_and_check_data_on_a_layout(copies, tmp_path, capsys):
    top = tmp_path / "IJCAI2019_data"
    shutil.copytree(copies["twitter2015"], top)
    (top / "twitter2015_images" / "1.jpg").write_bytes(b"not a jpeg")  # train.tsv:2
    jpeg(top / "twitter2015_images" / "spare.jpg", 0)
    train, _ = build_datasets(layout_cfg("twitter2015", top, tmp_path, skip_bad_samples=True))
    assert len(train) == 20 and train.skipped[0].startswith(f"{top.resolve()}/twitter2015/train.tsv:2: cannot decode")
    assert cli_main(["check-data", str(top), "--dataset-format", "twitter2015"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("--dataset-format twitter2015 ") and out[0].endswith("kept 21 train, 8 validation, 6 test")
    assert sum("dropped 1 (" in line for line in out) == len(DROPPED_TWITTER)
    assert "train.tsv:2: cannot decode image" in out[-2] and out[-1] == f"1 problem(s) in {top}"
    assert cli_main(["check-data", str(copies["mvsa-single"]), "--dataset-format", "mvsa-single"]) == 0
    assert capsys.readouterr().out.rstrip().endswith(": no problems found")


# ---- a workload of one's own ----------------------------------------------------------------------------


def test_a_users_workload_gets_a_layout_through_load_splits(copies, tmp_path):
    from shardtrain.data import load_splits

    mvsa = load_splits(layout_cfg("mvsa-single", copies["mvsa-single"], tmp_path))
    assert mvsa.label_names == ["negative", "neutral", "positive"] and mvsa.num_labels == 3
    # No validation split in MVSA: --validation-split-percentage, 10 unless given, of the 35 kept posts.
    assert (len(mvsa.train), len(mvsa.validation)) == (31, 4)
    assert {"text", "label", "image", "row"} <= set(mvsa.train.column_names)
    _, builtin_validation = build_datasets(layout_cfg("mvsa-single", copies["mvsa-single"], tmp_path))
    assert sorted(mvsa.validation["text"]) == sorted(builtin_validation.table["text"])  # the same posts held out
    twitter = load_splits(layout_cfg("twitter2015", copies["twitter2015"], tmp_path))
    assert (len(twitter.train), len(twitter.validation)) == (21, 8)
    row = twitter.train[0]
    assert row["text_pair"] and row["text_pair"] in row["text"] and "$T$" not in row["text"]
    with pytest.raises(ConfigError, match="--dataset-format.*and --train-file.*both name the training data"):
        load_splits(layout_cfg("twitter2015", copies["twitter2015"], tmp_path, train_file="x.csv"))
