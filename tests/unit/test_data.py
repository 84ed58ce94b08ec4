"""shardtrain.data: formats, tokenizer, collate, resumable stream, eval sharding, bad-data errors."""

import json
from pathlib import Path

import pytest
import torch

from shardtrain import cli
from shardtrain.config.settings import Config, ConfigError, parse_cli, replace_fields
from shardtrain.data import build_datasets, build_loaders, build_tokenizer, check_data, make_data

REPO = Path(__file__).resolve().parents[2]


def make_cfg(data_dir, name="multimodal", **data):
    cfg = Config()
    settings = dict(
        name=name, num_labels=3, attention_window=16, pretrained=False, data_dir=str(data_dir), max_length=64,
        image_size=32, num_workers=0, pin_memory=False, per_device_batch_size=4,
    )  # fmt: skip
    return replace_fields(cfg, **{**settings, **data})


@pytest.fixture(scope="module")
def mm_dir(tmp_path_factory):
    return make_data("multimodal", tmp_path_factory.mktemp("mm") / "data", n_train=40, n_val=10)


@pytest.fixture(scope="module")
def ld_dir(tmp_path_factory):
    return make_data("longdoc", tmp_path_factory.mktemp("ld") / "data", n_train=24, n_val=7, min_words=30, max_words=80)


@pytest.fixture(scope="module")
def mm_tok(mm_dir, tmp_path_factory):
    return build_tokenizer(make_cfg(mm_dir), tmp_path_factory.mktemp("run"), True, lambda: None)


def mm_setup(mm_dir, tok, world_size=1, rank=0, **train):
    cfg = replace_fields(make_cfg(mm_dir), **train)
    train_ds, eval_ds = build_datasets(cfg, tok)
    return build_loaders(cfg, tok, train_ds, eval_ds, rank, world_size, "cpu")


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---- make-data -----------------------------------------------------------------------------------------


def test_make_data_formats(mm_dir, ld_dir):
    mm = [json.loads(line) for line in (mm_dir / "train.jsonl").read_text().splitlines()]
    assert len(mm) == 40 and set(mm[0]) == {"text", "image", "label"}
    assert all((mm_dir / r["image"]).is_file() and r["label"] in (0, 1, 2) for r in mm)
    ld = [json.loads(line) for line in (ld_dir / "validation.jsonl").read_text().splitlines()]
    assert len(ld) == 7 and set(ld[0]) == {"text", "label"}
    assert all(30 <= len(r["text"].split()) <= 80 for r in ld)
    assert check_data(mm_dir, "multimodal") == [] and check_data(ld_dir, "longdoc") == []


def test_make_data_refuses_non_empty_folder(mm_dir):
    with pytest.raises(ConfigError, match=str(mm_dir)):
        make_data("multimodal", mm_dir)


def test_make_data_is_deterministic(tmp_path):
    a = make_data("longdoc", tmp_path / "a", n_train=5, n_val=2, min_words=20, max_words=30)
    b = make_data("longdoc", tmp_path / "b", n_train=5, n_val=2, min_words=20, max_words=30)
    assert (a / "train.jsonl").read_text() == (b / "train.jsonl").read_text()


# ---- tokenizer -----------------------------------------------------------------------------------------


def test_tokenizer_trains_saves_and_reloads(mm_dir, tmp_path):
    from transformers import AutoTokenizer

    calls = []
    tok = build_tokenizer(make_cfg(mm_dir), tmp_path, True, lambda: calls.append(1))
    assert calls == [1]
    again = AutoTokenizer.from_pretrained(str(tmp_path / "tokenizer"))
    assert again.pad_token_id == 1 and tok.pad_token_id == 1
    assert [again.convert_tokens_to_ids(t) for t in ("<s>", "<pad>", "</s>", "<unk>", "<mask>")] == [0, 1, 2, 3, 4]
    ids = again("excellent film").input_ids
    assert ids[0] == 0 and ids[-1] == 2 and ids == tok("excellent film").input_ids
    # A second rank (or a resumed run) loads the saved one instead of training.
    other = build_tokenizer(make_cfg(tmp_path / "no-data-needed"), tmp_path, False, lambda: None)
    assert other.get_vocab() == tok.get_vocab()


def test_tokenizer_bad_name_names_the_flag(mm_dir, tmp_path):
    cfg = make_cfg(mm_dir, tokenizer=str(tmp_path / "missing-tokenizer"))
    with pytest.raises(ConfigError, match=r"--tokenizer \(data.tokenizer\)"):
        build_tokenizer(cfg, tmp_path, True, lambda: None)


# ---- datasets + collate --------------------------------------------------------------------------------


def test_multimodal_batches(mm_dir, mm_tok):
    loaders = mm_setup(mm_dir, mm_tok)
    b = loaders.train.next_batch()
    assert set(b) == {"input_ids", "attention_mask", "labels", "pixel_values"}
    # uint8 off the workers; batch_to_device normalises on the device (tests/unit/test_images.py)
    assert b["pixel_values"].shape == (4, 3, 32, 32) and b["pixel_values"].dtype == torch.uint8
    assert b["input_ids"].shape == b["attention_mask"].shape and b["input_ids"].shape[0] == 4
    assert b["labels"].dtype == torch.long
    assert loaders.train_size == 40 and loaders.eval_size == 10 and loaders.steps_per_epoch == 10


def test_longdoc_pads_to_attention_window(ld_dir, tmp_path):
    cfg = make_cfg(ld_dir, name="longformer", max_length=50)
    tok = build_tokenizer(cfg, tmp_path, True, lambda: None)
    train_ds, eval_ds = build_datasets(cfg, tok)
    b = build_loaders(cfg, tok, train_ds, eval_ds, 0, 1, "cpu").train.next_batch()
    assert set(b) == {"input_ids", "attention_mask", "labels"}
    assert b["input_ids"].shape[1] % 16 == 0 and b["input_ids"].shape[1] <= 64  # truncated at 50, padded to 64
    assert (b["input_ids"][b["attention_mask"] == 0] == 1).all()


def test_max_samples_caps(mm_dir, mm_tok):
    train_ds, eval_ds = build_datasets(make_cfg(mm_dir, max_train_samples=7, max_eval_samples=3), mm_tok)
    assert len(train_ds) == 7 and len(eval_ds) == 3


# ---- resumable train stream ----------------------------------------------------------------------------


@pytest.mark.parametrize("k", [3, 10, 12])  # 10 batches/epoch: mid-epoch, exactly at and past the boundary
def test_resume_gives_the_next_batch(mm_dir, mm_tok, k):
    ref = mm_setup(mm_dir, mm_tok).train
    expected = [ref.next_batch() for _ in range(k + 2)][k:]
    first = mm_setup(mm_dir, mm_tok).train
    for _ in range(k):
        first.next_batch()
    state = first.state_dict()
    assert state["epoch"] == k // 10 and state["batch_in_epoch"] == k % 10
    resumed = mm_setup(mm_dir, mm_tok).train
    resumed.load_state_dict(state)
    assert same(resumed.next_batch(), expected[0]) and same(resumed.next_batch(), expected[1])


def test_epochs_are_reshuffled_and_ranks_disjoint(mm_dir, mm_tok):
    s = mm_setup(mm_dir, mm_tok, world_size=2).train
    assert s.batches_per_epoch == 5
    e0 = [seq for _ in range(5) for seq in unpadded(s.next_batch())]
    e1 = [seq for _ in range(5) for seq in unpadded(s.next_batch())]
    assert s.state_dict()["epoch"] == 2 and e0 != e1
    ranks = [mm_setup(mm_dir, mm_tok, world_size=2, rank=r).train for r in (0, 1)]
    assert not set(ranks[0].epoch_indices()) & set(ranks[1].epoch_indices())


# The stream over sample ids alone (a list of ints, collated to a tensor): which samples each rank sees.
def id_streams(n, world, micro=2, seed=3):
    from shardtrain.data.loaders import TrainStream

    return [TrainStream(list(range(n)), torch.tensor, micro, r, world, seed, {}) for r in range(world)]


def take(streams, batches):
    return [i for _ in range(batches) for s in streams for i in s.next_batch().tolist()]


def test_an_epoch_starts_as_distributed_sampler_splits_it():
    from torch.utils.data import DistributedSampler

    for world in (1, 2, 3):
        for epoch in (0, 1):
            for r, s in enumerate(id_streams(41, world)):
                s.epoch = epoch
                ref = DistributedSampler(list(range(41)), num_replicas=world, rank=r, seed=3, drop_last=True)
                ref.set_epoch(epoch)
                assert s.epoch_indices() == list(ref)


@pytest.mark.parametrize("new_world", [1, 2, 3])
@pytest.mark.parametrize("old_format", [False, True])
def test_resume_at_another_world_size_sees_every_sample_once(new_world, old_format):
    """5 micro-batches of 2 at world size 2 (20 of 41 samples), then a resume at world size 1, 2 or 3 to the
    epoch's end: every sample exactly once but the permutation's last few, fewer than new_world (drop_last)
    plus new_world x (micro - 1) (whole micro-batches). A checkpoint from before the global position was kept
    (old_format: per-rank samples and world size only) resumes as exactly."""
    before = id_streams(41, 2)
    seen = take(before, 5)
    state = before[0].checkpoint_state()
    assert state["global_samples_in_epoch"] == 20 and state["epoch"] == 0
    if old_format:
        state = {k: v for k, v in state.items() if k != "global_samples_in_epoch"}
    after = id_streams(41, new_world)
    for s in after:
        s.load_state_dict(state)
    while after[0].epoch == 0:
        seen += take(after, 1)
    assert len(seen) == len(set(seen))  # nothing twice
    before[0].order.set_epoch(0)
    perm = list(before[0].order)
    assert sorted(seen) == sorted(perm[: len(seen)])  # nothing skipped: the permutation up to a tail
    assert 41 - len(seen) < new_world + new_world * (2 - 1)
    # The next epoch is a plain one at the new world size.
    assert all(s.state_dict()["global_samples_in_epoch"] == 0 and s.epoch == 1 for s in after)
    assert after[0].epoch_indices()[:2] == after[0].next_batch().tolist()


def test_the_position_carries_over_twice():
    """2 -> 1 -> 2 within one epoch, as an elastic job that loses a node and gets it back."""
    two = id_streams(40, 2)
    seen = take(two, 3)
    one = id_streams(40, 1)
    one[0].load_state_dict(two[0].checkpoint_state())
    seen += take(one, 2)
    assert one[0].checkpoint_state()["global_samples_in_epoch"] == 16  # the 24 left divide into whole batches
    again = id_streams(40, 2)
    for s in again:
        s.load_state_dict(one[0].checkpoint_state())
    while again[0].epoch == 0:
        seen += take(again, 1)
    assert sorted(seen) == list(range(40))


def unpadded(batch):
    return [ids[m.bool()].tolist() for ids, m in zip(batch["input_ids"], batch["attention_mask"])]


def test_set_micro_batch_size_keeps_sample_position(mm_dir, mm_tok):
    ref = mm_setup(mm_dir, mm_tok).train
    ref.next_batch()
    want = ref.next_batch()
    s = mm_setup(mm_dir, mm_tok).train
    s.next_batch()
    s.set_micro_batch_size(2)
    a, b = s.next_batch(), s.next_batch()
    assert unpadded(a) + unpadded(b) == unpadded(want)
    assert torch.equal(torch.cat([a["labels"], b["labels"]]), want["labels"])
    assert torch.equal(torch.cat([a["pixel_values"], b["pixel_values"]]), want["pixel_values"])
    assert s.state_dict()["epoch"] == 0 and s.state_dict()["samples_in_epoch"] == 8


def test_workers_give_the_same_stream(mm_dir, mm_tok):
    cfg = make_cfg(mm_dir, num_workers=1)
    train_ds, eval_ds = build_datasets(cfg, mm_tok)
    s = build_loaders(cfg, mm_tok, train_ds, eval_ds, 0, 1, "cpu").train
    ref = mm_setup(mm_dir, mm_tok).train
    for _ in range(12):  # across an epoch boundary with persistent workers
        assert same(s.next_batch(), ref.next_batch())


# ---- eval sharding -------------------------------------------------------------------------------------


@pytest.mark.parametrize("eval_batch_size", [1, 2, 4])
def test_eval_shards_cover_every_example_once(mm_dir, mm_tok, eval_batch_size):
    seen, counts = [], []
    for rank in range(3):
        loaders = mm_setup(mm_dir, mm_tok, world_size=3, rank=rank, eval_batch_size=eval_batch_size)
        batches = list(loaders.eval)
        counts.append(len(batches))
        for b in batches:
            assert len(b["labels"]) <= eval_batch_size
            seen += unpadded(b)
    _, eval_ds = build_datasets(make_cfg(mm_dir), mm_tok)
    every = [mm_tok(eval_ds[i]["text"]).input_ids for i in range(len(eval_ds))]
    assert sorted(seen) == sorted(every) and len(seen) == 10
    if eval_batch_size > 1:  # 10 over 3 ranks = 4/3/3: batch counts still match, for FSDP's collectives
        assert len(set(counts)) == 1 and counts[0] == loaders.eval_batches


# ---- bad data ------------------------------------------------------------------------------------------


def write_split(folder: Path, name: str, lines: list[str]):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text("\n".join(lines) + "\n")


@pytest.fixture
def bad_dir(tmp_path, mm_dir):
    """A multimodal folder whose train split has one bad record of each kind, at known lines."""
    d = tmp_path / "bad"
    (d / "img").mkdir(parents=True)
    good = (mm_dir / "images" / "train" / "000000.png").read_bytes()
    (d / "img" / "ok.png").write_bytes(good)
    (d / "img" / "corrupt.png").write_bytes(good[:40])  # header intact, pixel data truncated
    ok = {"text": "great film", "image": "img/ok.png", "label": 0}
    lines = (
        [json.dumps(ok)] * 3
        + [
            '{"text": "broken", ',  # 4: JSON
            json.dumps({"text": "no label", "image": "img/ok.png"}),  # 5: missing field
            json.dumps({**ok, "label": 5}),  # 6: label out of range
            json.dumps({**ok, "label": "1"}),  # 7: label not an int
            json.dumps({**ok, "text": "  "}),  # 8: empty text
            json.dumps({**ok, "image": "img/missing.png"}),  # 9: image missing
            json.dumps({**ok, "image": "img/corrupt.png"}),  # 10: corrupt image
        ]
        + [json.dumps(ok)] * 2
    )
    write_split(d, "train.jsonl", lines)
    write_split(d, "validation.jsonl", [json.dumps(ok)] * 2)
    return d


EXPECTED = {
    4: "invalid JSON",
    5: "missing field 'label'",
    6: r"label 5 is outside 0\.\.2 \(model.num_labels=3\)",
    7: 'label "1" is not an integer',
    8: "empty text",
    9: "image not found: img/missing.png",
    10: "cannot decode image img/corrupt.png",
}


@pytest.mark.parametrize("line", sorted(EXPECTED))
def test_each_bad_record_raises_with_file_and_line(bad_dir, mm_tok, line):
    lines = (bad_dir / "train.jsonl").read_text().splitlines()
    good = lines[0]
    # Keep only the one bad line (at its own line number), so each case is checked on its own.
    write_split(bad_dir, "train.jsonl", [text if i + 1 == line else good for i, text in enumerate(lines)])
    cfg = make_cfg(bad_dir)
    path = f"{bad_dir / 'train.jsonl'}:{line}: "
    with pytest.raises(ConfigError, match=path.replace(".", r"\.") + EXPECTED[line]):
        train_ds, eval_ds = build_datasets(cfg, mm_tok)
        # A corrupt (existing) image is only found when it is decoded.
        for i in range(len(train_ds)):
            train_ds[i]


def test_skip_bad_samples_counts_them(bad_dir, mm_tok):
    train_ds, eval_ds = build_datasets(make_cfg(bad_dir, skip_bad_samples=True), mm_tok)
    assert len(train_ds) == 5 and len(train_ds.skipped) == 7 and eval_ds.skipped == []
    assert [m.split(f"{bad_dir / 'train.jsonl'}:")[1].split(":")[0] for m in train_ds.skipped] == [
        str(n) for n in sorted(EXPECTED)
    ]
    for i in range(len(train_ds)):
        assert train_ds[i]["image"].shape == (3, 32, 32)


def test_check_data_lists_every_problem(bad_dir):
    problems = check_data(bad_dir, "multimodal", 3)
    assert len(problems) == 7
    for problem, (line, pattern) in zip(problems, sorted(EXPECTED.items())):
        assert problem.startswith(f"{bad_dir / 'train.jsonl'}:{line}: ")
        assert pytest.importorskip("re").search(pattern, problem)


def test_missing_split_and_folder_name_the_flag(bad_dir, mm_tok, tmp_path):
    write_split(bad_dir, "train.jsonl", (bad_dir / "train.jsonl").read_text().splitlines()[:3])
    (bad_dir / "validation.jsonl").unlink()
    with pytest.raises(ConfigError, match=r"--data-dir \(data.data_dir\).*validation\.jsonl"):
        build_datasets(make_cfg(bad_dir), mm_tok)
    with pytest.raises(ConfigError, match=r"--data-dir \(data.data_dir\).*nowhere"):
        build_datasets(make_cfg(tmp_path / "nowhere"), mm_tok)
    assert any("validation.jsonl" in p for p in check_data(bad_dir, "multimodal", 3))


def test_corrupt_image_in_a_worker_is_still_one_line(bad_dir, mm_tok):
    lines = (bad_dir / "train.jsonl").read_text().splitlines()
    write_split(bad_dir, "train.jsonl", [lines[0], lines[9]] * 2)  # the corrupt image at lines 2 and 4
    cfg = make_cfg(bad_dir, num_workers=1)
    cfg = replace_fields(cfg, per_device_batch_size=4)
    train_ds, eval_ds = build_datasets(cfg, mm_tok)
    stream = build_loaders(cfg, mm_tok, train_ds, eval_ds, 0, 1, "cpu").train
    with pytest.raises(ConfigError) as e:
        stream.next_batch()
    assert "\n" not in str(e.value) and "train.jsonl:" in str(e.value) and "cannot decode image" in str(e.value)


def test_the_trained_tokenizer_encodes_as_the_roberta_processor_would():
    """The trained BPE's post-processor is written out as a template (data/ names no built-in model); it must give
    what tokenizers' RoBERTa processor gave before: the same ids, segment ids, special-token masks and offsets,
    for single texts and for pairs (a layout's tweet and its target)."""
    from tokenizers import Tokenizer, processors

    from shardtrain.data.tokenizer import train_bpe

    ours = train_bpe(["a wonderful film with a lovely story", "the service was terrible and slow"] * 20, 300)
    theirs = Tokenizer.from_str(ours.backend_tokenizer.to_str())
    theirs.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    for args in [("a wonderful  film ",), ("the story was slow", " a lovely service")]:
        got, want = ours.backend_tokenizer.encode(*args), theirs.encode(*args)
        assert (got.ids, got.type_ids, got.special_tokens_mask, got.offsets) == (
            want.ids,
            want.type_ids,
            want.special_tokens_mask,
            want.offsets,
        )


def test_make_data_overwrite_never_deletes_data_it_did_not_write(tmp_path):
    """A user's own jsonl folder with its images/ (the layout docs/data.md describes): `make-data --overwrite`
    into it used to delete images/ and replace the splits. It refuses now; over its own earlier output it still
    replaces what it wrote, and leaves what a user added beside it."""
    from PIL import Image

    mine = tmp_path / "mine"
    (mine / "images").mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(mine / "images" / "cat.png")
    (mine / "train.jsonl").write_text('{"text": "a cat", "image": "images/cat.png", "label": 0}\n')
    with pytest.raises(ConfigError, match=r"train\.jsonl, images that make-data did not write .*choose a new folder"):
        make_data("multimodal", mine, n_train=4, n_val=2, overwrite=True)
    assert (mine / "images" / "cat.png").is_file() and "a cat" in (mine / "train.jsonl").read_text()

    made = make_data("multimodal", tmp_path / "made", n_train=6, n_val=2, seed=0)
    Image.new("RGB", (8, 8)).save(made / "images" / "train" / "added.png")
    make_data("multimodal", made, n_train=3, n_val=2, seed=1, overwrite=True)
    assert sorted(p.name for p in (made / "images" / "train").iterdir()) == [
        "000000.png",
        "000001.png",
        "000002.png",
        "added.png",
    ]
    assert len((made / "train.jsonl").read_text().splitlines()) == 3


def test_a_relative_data_dir_not_found_names_the_working_directory(tmp_path, monkeypatch):
    """docs/data.md's promise, for --data-dir as for --train-file: a relative path is read from the working
    directory, and a folder or split not found there says which directory that was."""
    from shardtrain.data.records import split_path

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=f"folder not found: nodir \\(relative paths are read from the working "
                       f"directory, {tmp_path}\\)"):  # fmt: skip
        split_path("nodir", "train")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=f"split file not found: empty/train.jsonl \\(.*directory, {tmp_path}\\)"):
        split_path("empty", "train")
    with pytest.raises(ConfigError, match=f"folder not found: {tmp_path / 'nope'}$"):
        split_path(tmp_path / "nope", "train")
    # A folder holding the split in another form (a SageMaker channel of csv): the line says how to name it.
    (tmp_path / "empty" / "validation.csv").write_text("text,label\n")
    with pytest.raises(ConfigError, match=r"the folder holds validation.csv: name it with --validation-file \("):
        split_path("empty", "validation")
    # A trial's DatasetDict.save_to_disk folder was pointed to --train-file, which takes one file, by its metadata.
    saved = tmp_path / "reviews"
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a"], "label": [0]})}).save_to_disk(saved)
    with pytest.raises(ConfigError, match=rf"a `datasets` save_to_disk folder: name it with --dataset-name {saved}$"):
        split_path(saved, "train")


def test_under_sagemaker_a_csv_channel_is_named_by_its_hyperparameter(tmp_path, monkeypatch):
    """A SageMaker user sets hyperparameters: the line named the flag --train-file."""
    from shardtrain.data.records import split_path

    channel = tmp_path / "train"
    channel.mkdir()
    (channel / "train.csv").write_text("text,label\n")
    monkeypatch.setenv("SM_CHANNEL_TRAIN", str(channel))
    with pytest.raises(ConfigError) as refused:
        split_path(channel, "train")
    assert str(refused.value).endswith(
        f"the folder holds train.csv: name it with the hyperparameter train_file={channel / 'train.csv'} (and the "
        "hyperparameters text_column_names / label_column_name for other column names), as docs/data.md shows"
    )


def test_check_data_usage_names_the_training_flags_a_source_is_given_by(capsys):
    """The usage line had listed only check-data's own flags, though a source is named by train's: a user reading
    --help did not see that `--train-file` or `--dataset-name` work here."""
    with pytest.raises(SystemExit):
        cli.main(["check-data", "--help"])
    usage = capsys.readouterr().out.split("\n\n")[0]
    for way in (
        "check-data DIR [--kind multimodal|longdoc]",
        "--dataset-format FORMAT",
        "--train-file FILE",
        "--dataset-name NAME",
        "--train-dir DIR",
        "--config FILE",
        "--workload MODULE:CLASS",
    ):
        assert way in usage, usage


def test_check_data_of_text_records_as_image_records_is_one_line_per_split(ld_dir):
    """`check-data data/longdoc --kind multimodal` printed one `missing field 'image'` per record (642 lines);
    it is one line per split now, naming the kind the records are."""
    problems = check_data(ld_dir, "multimodal")
    assert problems == [
        f"{ld_dir / name}: no record names an image: these are longdoc records (--kind longdoc)"
        for name in ("train.jsonl", "validation.jsonl")
    ]


def test_check_data_of_text_records_under_the_multimodal_workload_points_to_the_longformer(ld_dir, capsys):
    """`check-data --workload multimodal DIR` on longdoc records pointed to --kind, a flag about the records,
    although the user had named a workload: the workload that reads them is the fix."""
    assert cli.main(["check-data", "--workload", "multimodal", str(ld_dir)]) == 1
    out = capsys.readouterr().out
    assert out.count("these are longdoc records (--workload longformer)") == 2, out
    assert cli.main(["check-data", str(ld_dir), "--kind", "multimodal"]) == 1
    assert capsys.readouterr().out.count("these are longdoc records (--kind longdoc)") == 2
    # A config names model.name, which --workload longformer would contradict: the workload alone is named.
    config = str(REPO / "configs" / "multimodal_tiny.yaml")
    assert cli.main(["check-data", str(ld_dir), "--config", config]) == 1
    assert capsys.readouterr().out.count("these are longdoc records, which the longformer workload reads") == 2


def test_a_missing_data_folder_set_in_a_config_names_its_file_and_line_and_how_to_make_one(tmp_path, monkeypatch):
    """A new user who skipped make-data met `--data-dir (data.data_dir): folder not found: data/multimodal`: no
    word of the config file that set it, nor of the command that writes one."""
    from shardtrain.data.precheck import check_splits

    monkeypatch.chdir(tmp_path)
    config = REPO / "configs" / "multimodal_tiny.yaml"
    with pytest.raises(ConfigError) as e:
        check_splits(parse_cli(["--config", str(config)]))
    assert str(e.value) == (
        f"{config}:13: data.data_dir: folder not found: data/multimodal (relative paths are read from the working "
        f"directory, {tmp_path}); `shardtrain make-data multimodal data/multimodal` writes synthetic records to try"
    )


def test_a_training_set_too_small_for_a_batch_on_every_rank_is_refused_before_any_process_starts(mm_dir, tmp_path):
    """Each rank's loader refused it, after the launch, the data and the model: one line per rank."""
    from shardtrain.data.precheck import check_splits

    config = str(REPO / "configs" / "multimodal_tiny.yaml")
    cfg = parse_cli(["--config", config, "--data-dir", str(mm_dir), "--output-dir", str(tmp_path),
                     "--per-device-batch-size", "8", "--max-train-samples", "15"])  # fmt: skip
    check_splits(cfg, world_size=1)  # 15 examples, 8 to a batch: one batch an epoch
    with pytest.raises(ConfigError) as e:
        check_splits(cfg, world_size=2)
    assert str(e.value) == (
        "--per-device-batch-size (train.per_device_batch_size)=8 is larger than each rank's share of the training "
        "set (15 examples // world size 2 = 7): an epoch would have no batch"
    )
    # A token budget cuts batches by tokens, not by count: its own checks apply.
    check_splits(replace_fields(cfg, max_tokens_per_batch=512), world_size=2)


def test_a_folder_whose_labels_are_class_names_is_pointed_to_the_flags_that_read_them(tmp_path, capsys):
    """Hugging Face's own jsonl ({"text", "label": "politics"}) as --data-dir: check-data printed one line per
    record, the refusal advised --skip-bad-samples (which skips them all), and with it --check-only passed a job
    whose ranks then found no usable records. --train-file reads the same files with named classes."""
    from shardtrain.data.precheck import check_splits

    data = tmp_path / "named"
    for split, n in (("train", 12), ("validation", 4)):
        rows = [{"text": f"document {i} about {c}", "label": c} for i, c in enumerate(["politics", "sports"] * n)]
        write_split(data, f"{split}.jsonl", [json.dumps(r) for r in rows])
    hint = (
        f"train.jsonl's labels are class names: the --data-dir layout takes class ids 0..N-1; --train-file "
        f"{data / 'train.jsonl'} --validation-file {data / 'validation.jsonl'} reads the same files with named "
        f"classes (docs/data.md)"
    )
    config = str(REPO / "configs" / "longformer_tiny.yaml")
    cfg = parse_cli(["--config", config, "--data-dir", str(data), "--output-dir", str(tmp_path / "out")])
    with pytest.raises(ConfigError) as e:
        check_splits(cfg)
    assert str(e.value) == f'{data / "train.jsonl"}:1: label "politics" is not an integer (24 records like it: {hint})'
    with pytest.raises(ConfigError) as e:
        check_splits(replace_fields(cfg, skip_bad_samples=True))
    assert str(e.value) == (
        f"--data-dir (data.data_dir): no usable records in {data / 'train.jsonl'} (24 bad records skipped by "
        f"--skip-bad-samples (data.skip_bad_samples): {hint})"
    )
    assert check_data(data, "longdoc", 3)[0] == f"{data / 'train.jsonl'}: no usable records: {hint}"
    named = parse_cli(["--config", config, "--train-file", str(data / "train.jsonl"), "--validation-file",
                       str(data / "validation.jsonl"), "--output-dir", str(tmp_path / "out")])  # fmt: skip
    assert check_splits(named).names == ("politics", "sports")


def test_training_the_multimodal_model_on_text_records_is_refused_naming_what_reads_them(ld_dir, tmp_path):
    """The refusal's advice was `check-data DIR` (which, reading the folder on its own as longdoc, found no problem)
    and --skip-bad-samples (which would skip every record)."""
    from shardtrain.data.precheck import check_splits

    cfg = parse_cli(["--config", str(REPO / "configs" / "multimodal_tiny.yaml"), "--data-dir", str(ld_dir),
                     "--output-dir", str(tmp_path)])  # fmt: skip
    with pytest.raises(ConfigError) as e:
        check_splits(cfg)
    assert str(e.value) == (
        f"{ld_dir / 'train.jsonl'}:1: missing field 'image' (no record of train.jsonl names one: these are longdoc "
        "records, which longformer reads)"
    )
