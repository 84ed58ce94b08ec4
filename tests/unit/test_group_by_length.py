"""--group-by-length: batches of texts of similar length, in an order that resumes exactly at any world size."""

import random

import pytest
import torch

from shardtrain.config.settings import ConfigError, parse_cli
from shardtrain.data import build_datasets, build_loaders, build_tokenizer, make_data
from shardtrain.data.loaders import TrainStream

N, GROUP = 200, 40
_rng = random.Random(7)
LENGTHS = [min(4096, max(64, int(_rng.lognormvariate(6.5, 0.9)))) for _ in range(N)]  # 64..4096, like a corpus


def streams(world, micro=4, lengths=LENGTHS, group=GROUP, n=N):
    return [TrainStream(list(range(n)), torch.tensor, micro, r, world, 3, {}, lengths, group) for r in range(world)]


def take(ss, batches):
    return [[i for s in ss for i in s.next_batch().tolist()] for _ in range(batches)]


def micro_batches(ss, steps):
    """Each rank's micro-batch of each step, as the ranks pad them: one by one."""
    return [s.next_batch().tolist() for _ in range(steps) for s in ss]


def padding(batches) -> float:
    """The share of a padded batch that is padding, over the batches given."""
    padded = sum(len(b) * max(LENGTHS[i] for i in b) for b in batches)
    return 1 - sum(LENGTHS[i] for b in batches for i in b) / padded


def test_each_run_of_the_permutation_is_sorted_longest_first_and_the_epoch_holds_every_sample():
    plain, grouped = streams(1, lengths=None)[0], streams(1)[0]
    for epoch in (0, 1):
        plain.epoch = grouped.epoch = epoch
        perm, order = plain.epoch_order(), grouped.epoch_order()
        assert sorted(order) == list(range(N))
        for k in range(0, N, GROUP):
            assert sorted(order[k : k + GROUP]) == sorted(perm[k : k + GROUP])  # the same random runs
            assert [LENGTHS[i] for i in order[k : k + GROUP]] == sorted((LENGTHS[i] for i in perm[k : k + GROUP]),
                                                                      reverse=True)  # fmt: skip
    assert streams(1)[0].epoch_order() != order  # epochs reshuffled


def test_ranks_get_batches_of_similar_length_and_pad_far_less():
    """Every step's micro-batches, over both ranks, against the plain order (the samples are alike)."""
    steps = N // (2 * 4)
    grouped, plain = micro_batches(streams(2), steps), micro_batches(streams(2, lengths=None), steps)
    assert padding(grouped) < 0.3 and padding(plain) > 0.5  # measured: 0.27 and 0.53


@pytest.mark.parametrize("new_world", [1, 3])
def test_resume_at_another_world_size_sees_every_sample_once(new_world):
    """4 steps at world size 2, then the rest of the epoch at another world size (an elastic resize)."""
    before = streams(2)
    seen = [i for b in take(before, 4) for i in b]
    state = before[0].checkpoint_state()
    assert state["length_group_size"] == GROUP
    after = streams(new_world)
    for s in after:
        s.load_state_dict(state)
    while after[0].epoch == 0:
        seen += take(after, 1)[0]
    assert len(seen) == len(set(seen))
    assert sorted(seen) == sorted(before[0].epoch_order()[: len(seen)])  # the grouped order, nothing skipped
    assert N - len(seen) < new_world * 4


def test_a_resume_with_the_setting_changed_is_refused_by_name():
    state = streams(2)[0].checkpoint_state()
    with pytest.raises(ConfigError, match=r"--group-by-length \(data.group_by_length\) is off.*ordered with it on"):
        streams(2, lengths=None)[0].load_state_dict(state)


def test_a_changed_micro_batch_keeps_the_order():
    """OOM recovery halves the micro-batch (and doubles accumulation): the same samples follow, in order."""
    ref, s = streams(1)[0], streams(1)[0]
    first = s.next_batch().tolist()
    s.set_micro_batch_size(2)
    assert first + s.next_batch().tolist() + s.next_batch().tolist() == ref.epoch_indices()[:8]


@pytest.fixture(scope="module")
def longdoc(tmp_path_factory):
    return make_data("longdoc", tmp_path_factory.mktemp("ld") / "data", n_train=48, n_val=8, min_words=5, max_words=200)


def cfg_for(data, out, *extra):
    return parse_cli(["--config", "configs/longformer_tiny.yaml", "--data-dir", str(data), "--output-dir", str(out),
                      "--per-device-batch-size", "4", *extra])  # fmt: skip


def test_the_builtin_datasets_give_token_counts_and_the_loader_groups_by_them(longdoc, tmp_path):
    cfg = cfg_for(longdoc, tmp_path, "--group-by-length")
    tok = build_tokenizer(cfg, tmp_path, True, lambda: None)
    train, val = build_datasets(cfg, tok)
    train.tokenize(tok, cfg.data.max_length, None, True, lambda: None)
    lengths = train.lengths()
    assert lengths == [len(train[i]["input_ids"]) for i in range(len(train))] and len(set(lengths)) > 10
    stream = build_loaders(cfg, tok, train, val, 0, 1, "cpu").train
    assert stream.group_size == 50 * 4  # HF's 50 batches
    batch = stream.next_batch()
    longest = max(lengths)
    assert batch["attention_mask"].sum(1).max().item() == longest  # one run holds the whole small set


def test_a_dataset_without_lengths_and_a_stream_are_refused_by_name(longdoc, tmp_path):
    from shardtrain.data.loaders import train_lengths

    with pytest.raises(ConfigError, match=r"--group-by-length .*lengths\(\) method.*TensorDataset has none"):
        train_lengths(torch.utils.data.TensorDataset(torch.arange(4)))
    with pytest.raises(ConfigError, match=r"--group-by-length .*--streaming"):
        cfg_for(longdoc, tmp_path, "--group-by-length", "--streaming")


@pytest.mark.parametrize("fmt", ["mvsa-single", "twitter2015"])
def test_the_seed_layouts_give_token_counts_that_group(fmt, tmp_path):
    """The reports' own layouts (MVSA; Twitter, whose items are text pairs) read through SplitDataset."""
    from layout_copies import make_mvsa, make_twitter

    from shardtrain.config.settings import from_dict, validate

    root = make_mvsa(tmp_path / "mvsa") if fmt.startswith("mvsa") else make_twitter(tmp_path / "t15")
    cfg = validate(from_dict({
        "model": {"pretrained": False}, "train": {"per_device_batch_size": 2},
        "data": {"dataset_format": fmt, "data_dir": str(root), "image_size": 16, "num_workers": 0,
                 "group_by_length": True},
        "checkpoint": {"output_dir": str(tmp_path / "run")},
    }))  # fmt: skip
    tok = build_tokenizer(cfg, tmp_path / "run", True, lambda: None)
    train, val = build_datasets(cfg, tok)
    train.tokenize(tok, cfg.data.max_length, None, True, lambda: None)
    lengths = train.lengths()
    assert lengths == [len(train[i]["input_ids"]) for i in range(len(train))]  # MVSA's copy: all alike
    stream = build_loaders(cfg, tok, train, val, 0, 1, "cpu").train
    order = stream.epoch_order()
    assert [lengths[i] for i in order] == sorted(lengths, reverse=True)  # the small set is one run
    assert stream.next_batch()["input_ids"].shape[0] == 2
