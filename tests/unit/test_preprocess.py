"""Tokenisation through datasets.map (shardtrain/data/preprocess.py): the ids collate gave, and the cache."""

import pytest
import torch
from test_data import make_cfg, mm_dir  # noqa: F401 - mm_dir: a fixture, shared

from shardtrain.data import build_tokenizer, make_data, preprocess
from shardtrain.data.splits import build_split, make_collator


@pytest.fixture(scope="module")
def ld_dir(tmp_path_factory):
    # Longer documents than test_data's: truncation at max_length must cut some of them.
    return make_data(
        "longdoc", tmp_path_factory.mktemp("ld") / "data", n_train=24, n_val=7, min_words=30, max_words=200
    )


@pytest.fixture
def cache(tmp_path, monkeypatch):
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf")
    return tmp_path / "hf" / preprocess.CACHE_SUBDIR


def tokenized(cfg, tok, split="train", **kw):
    ds = build_split(cfg, split)
    done = ds.tokenize(tok, cfg.data.max_length, kw.get("num_proc"), True, lambda: None)
    return ds, done


def snapshot(folder):
    return {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}


@pytest.mark.parametrize("kind", ["multimodal", "longformer"])
def test_token_ids_are_those_collate_gave(kind, mm_dir, ld_dir, cache, tmp_path):
    """Every batch of the pre-tokenised split equals the one tokenize-in-collate gives: ids, mask (Longformer's
    window padding included) and, at max_length 48, the truncated long documents."""
    cfg = make_cfg(mm_dir if kind == "multimodal" else ld_dir, name=kind, max_length=48)
    tok = build_tokenizer(cfg, tmp_path, True, lambda: None)
    raw = build_split(cfg, "train")
    ds, _ = tokenized(cfg, tok)
    collate = make_collator(cfg, tok)
    truncated = 0
    for start in range(0, len(ds), 6):
        idx = range(start, min(start + 6, len(ds)))
        want, got = collate([raw[i] for i in idx]), collate([ds[i] for i in idx])
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want), start
        truncated += int(want["attention_mask"].sum(1).eq(48).sum())
    assert kind == "multimodal" or truncated > 0  # the long documents did reach the limit


def test_second_run_loads_the_cache_without_tokenising(mm_dir, cache, tmp_path, monkeypatch):
    """The same data, a tokenizer trained again into another run folder, the same max_length: the file the
    first run wrote is loaded, untouched, and the map function is never called."""
    cfg = make_cfg(mm_dir)
    first, done = tokenized(cfg, build_tokenizer(cfg, tmp_path / "run1", True, lambda: None))
    assert not done.from_cache and done.cache_file.is_file()
    files = snapshot(cache)
    calls = []
    original = preprocess.Tokenize.__call__
    monkeypatch.setattr(preprocess.Tokenize, "__call__", lambda self, batch: calls.append(1) or original(self, batch))
    second, again = tokenized(cfg, build_tokenizer(cfg, tmp_path / "run2", True, lambda: None))
    assert again.from_cache and again.cache_file == done.cache_file and calls == []
    assert snapshot(cache) == files
    assert [f["filename"] for f in second.table.cache_files] == [str(done.cache_file)]
    assert second.table["input_ids"] == first.table["input_ids"]


def test_fingerprint_follows_data_tokenizer_and_max_length(mm_dir, ld_dir, cache, tmp_path):
    cfg = make_cfg(mm_dir)
    tok = build_tokenizer(cfg, tmp_path / "a", True, lambda: None)
    base = tokenized(cfg, tok)[1].cache_file
    other_data = tokenized(make_cfg(mm_dir, max_train_samples=30), tok)[1].cache_file
    shorter = tokenized(make_cfg(mm_dir, max_length=32), tok)[1].cache_file
    other_tok = tokenized(cfg, build_tokenizer(make_cfg(ld_dir), tmp_path / "b", True, lambda: None))[1].cache_file
    assert len({base, other_data, shorter, other_tok}) == 4
    assert len(list(cache.glob("*.arrow"))) == 4


def test_preprocessing_num_workers_splits_the_map_and_the_ids_agree(mm_dir, cache, tmp_path):
    cfg = make_cfg(mm_dir)
    tok = build_tokenizer(cfg, tmp_path, True, lambda: None)
    one = tokenized(cfg, tok)[0].table["input_ids"]
    for f in cache.iterdir():
        f.unlink()
    ds, done = tokenized(cfg, tok, num_proc=2)
    assert len(list(cache.glob("*_of_00002.arrow"))) == 2 and ds.table["input_ids"] == one


def test_unwritable_cache_is_one_line_naming_the_variable(mm_dir, tmp_path, monkeypatch):
    import datasets.config

    from shardtrain.config.settings import ConfigError

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", blocker / "hf")  # a folder under a file
    cfg = make_cfg(mm_dir)
    with pytest.raises(ConfigError, match="HF_DATASETS_CACHE: cannot write the tokenised splits in .*a-file"):
        tokenized(cfg, build_tokenizer(cfg, tmp_path, True, lambda: None))


def test_texts_cut_at_max_length_are_counted_from_the_cache_too(ld_dir, cache, tmp_path):
    """A long document cut at --max-length used to be cut in silence: for a 4096-token Longformer run, whether the
    model saw the whole text is the question. Counted exactly (the tokenizer's overflow, not `== max_length`),
    the same when the ids come from the cache, and said in the split's line and in summary.json."""
    cfg = make_cfg(ld_dir, name="longformer", max_length=48)
    tok = build_tokenizer(cfg, tmp_path, True, lambda: None)
    raw = build_split(cfg, "train")
    longer = sum(len(tok(raw[i]["text"])["input_ids"]) > 48 for i in range(len(raw)))
    assert 0 < longer < len(raw)
    ds, done = tokenized(cfg, tok)
    assert not done.from_cache and done.truncated == ds.truncated == longer
    again, done = tokenized(cfg, tok)
    assert done.from_cache and done.truncated == again.truncated == longer
    assert "truncated" not in again[0]  # the count is the split's, not a field of each item
    exact = max(len(tok(raw[i]["text"])["input_ids"]) for i in range(len(raw)))
    _, done = tokenized(make_cfg(ld_dir, name="longformer", max_length=exact), tok)
    assert done.truncated == 0  # the longest text, exactly max_length long: not cut
