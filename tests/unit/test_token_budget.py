"""--max-tokens-per-batch: micro-batches sized by a token budget, weighted exactly, resumable at any world size."""

import random

import pytest
import torch

from shardtrain.config.settings import ConfigError, parse_cli
from shardtrain.data import build_loaders, make_data
from shardtrain.data.token_budget import Budget, TokenBudgetStream, budget_batches

N, GROUP, BUDGET = 300, 60, 4096
_rng = random.Random(11)
LENGTHS = [min(4096, max(64, int(_rng.lognormvariate(6.5, 0.9)))) for _ in range(N)]  # 64..4096, like a corpus


def streams(world, budget=BUDGET, micro=4, loss_items=None, n=N, lengths=LENGTHS):
    return [
        TokenBudgetStream(
            list(range(n)), torch.tensor, micro, r, world, 3, {}, lengths, GROUP, budget=Budget(budget, loss_items)
        )  # fmt: skip
        for r in range(world)
    ]


def step(ss, accum=1):
    """One optimizer step's micro-batches, per rank: [[rank 0's], [rank 1's], ...]."""
    return [[s.next_batch().tolist() for _ in range(accum)] for s in ss]


def padded(batch) -> int:
    return len(batch) * max(LENGTHS[i] for i in batch)


def test_batches_fill_the_budget_and_every_rank_gets_as_many():
    ss = streams(2)
    batches = [b for _ in range(20) for rank in step(ss, accum=2) for b in rank]
    assert all(padded(b) <= BUDGET for b in batches)
    sizes = [len(b) for b in batches]
    assert min(sizes) == 1 and max(sizes) >= 8  # a 4096-token report alone; short posts many at a time
    # greedy: one more text of the order would have broken the budget
    cut = budget_batches(ss[0].epoch_order(), LENGTHS, BUDGET)
    assert all(padded(a + b[:1]) > BUDGET for a, b in zip(cut, cut[1:]))
    # an odd count: the fullest is split in two, so both ranks get as many (none left over)
    assert ss[0].batches_per_epoch == ss[1].batches_per_epoch == -(-len(cut) // 2)


def test_the_epoch_sees_every_sample_once_in_the_grouped_order():
    ss = streams(2)
    seen = []
    while ss[0].epoch == 0:
        seen += [i for rank in step(ss) for b in rank for i in b]
    assert sorted(seen) == list(range(N))  # every text, the shortest too: none is dropped at the epoch's end


@pytest.mark.parametrize("accum", [1, 3])
def test_the_weights_make_the_step_the_mean_over_all_its_samples(accum):
    """sum over ranks and micro-batches of weight x (micro-batch mean) / (world x accum): what the strategies'
    mean of the weighted losses makes of it, against the mean over the step's samples. A plain mean of the
    micro-batch means is far from it."""
    ss = streams(2)
    value = [random.Random(i).random() for i in range(N)]
    plain_error = 0.0
    for _ in range(5):
        shares = [s.step_share(accum) for s in ss]
        batches = step(ss, accum)
        means = [[sum(value[i] for i in b) / len(b) for b in rank] for rank in batches]
        weighted = sum(w * m for sh, ms in zip(shares, means) for w, m in zip(sh.weights, ms)) / (2 * accum)
        samples = [i for rank in batches for b in rank for i in b]
        assert shares[0].samples == shares[1].samples == len(samples)
        mean = sum(value[i] for i in samples) / len(samples)
        assert weighted == pytest.approx(mean, rel=1e-12)
        plain_error = max(plain_error, abs(sum(m for ms in means for m in ms) / (2 * accum) - mean))
    assert plain_error > 1e-2


def test_token_weights_count_what_loss_items_counts():
    """A token-level loss (the causal LM's shifted targets: n - 1 per text) is the mean over every token."""
    ss = streams(2, loss_items=lambda lengths: sum(n - 1 for n in lengths))
    shares = [s.step_share(2) for s in ss]
    batches = step(ss, 2)
    tokens = [[sum(LENGTHS[i] - 1 for i in b) for b in rank] for rank in batches]
    total = sum(map(sum, tokens))
    for share, rank in zip(shares, tokens):
        assert share.weights == pytest.approx([t * 2 * 2 / total for t in rank], rel=1e-12)


def test_the_share_reaches_into_the_next_epoch_as_the_batches_do():
    ss = streams(2)
    while ss[0]._share - ss[0].batches_taken > 1:
        step(ss)
    share = ss[0].step_share(3)  # one batch left in epoch 0, two from epoch 1
    batches = step(ss, 3)
    assert ss[0].epoch == 1
    assert share.samples == sum(len(b) for rank in batches for b in rank)


@pytest.mark.parametrize("new_world,new_budget", [(1, BUDGET), (3, BUDGET), (2, 2 * BUDGET)])
def test_resume_at_another_world_size_or_budget_sees_every_sample_once(new_world, new_budget):
    before = streams(2)
    seen = [i for _ in range(6) for rank in step(before, 2) for b in rank for i in b]
    state = before[0].checkpoint_state()
    assert state["global_samples_in_epoch"] == len(seen) and state["max_tokens_per_batch"] == BUDGET
    after = streams(new_world, budget=new_budget)
    for s in after:
        s.load_state_dict(state)
    while after[0].epoch == 0:
        seen += [i for rank in step(after) for b in rank for i in b]
    assert len(seen) == len(set(seen))
    assert N - len(seen) < new_world  # only single texts that cannot be split, fewer than a rank each


def test_oom_recovery_halves_the_budget_and_keeps_the_position():
    ref, s = streams(1)[0], streams(1)[0]
    first = s.next_batch().tolist()
    position = s.state_dict()
    s.next_batch()  # the step that ran out of memory
    s.load_state_dict(position)
    s.set_micro_batch_size(2)
    assert s.budget == BUDGET // 2
    after = [i for _ in range(4) for i in s.next_batch().tolist()]
    assert first + after == ref.epoch_order()[: len(first) + len(after)]


def test_bad_settings_are_refused_by_name(tmp_path):
    with pytest.raises(ConfigError, match=r"--max-tokens-per-batch \(data.max_tokens_per_batch\)=1000 is less "
                                          r"than the longest training text \(4096 tokens"):  # fmt: skip
        streams(2, budget=1000)
    with pytest.raises(ConfigError, match=r"fewer than one per rank at world size 3"):
        streams(3, n=2, lengths=[4096, 4096])
    with pytest.raises(ConfigError, match=r"Workload.loss_items\(lengths\) must return a positive number"):
        streams(1, loss_items=lambda lengths: 0)
    with pytest.raises(ConfigError, match=r"--max-tokens-per-batch \(data.max_tokens_per_batch\) must be positive"):
        parse_cli(["--config", "configs/longformer_tiny.yaml", "--max-tokens-per-batch", "0"])
    with pytest.raises(ConfigError, match=r"--max-tokens-per-batch .*--streaming"):
        parse_cli(["--config", "configs/longformer_tiny.yaml", "--max-tokens-per-batch", "4096", "--streaming"])
    from shardtrain.data.loaders import train_lengths

    with pytest.raises(ConfigError, match=r"--max-tokens-per-batch .*lengths\(\) method.*TensorDataset has none"):
        train_lengths(torch.utils.data.TensorDataset(torch.arange(4)), "max_tokens_per_batch")


def test_the_builtin_longformer_batches_stay_within_the_budget_as_collated(tmp_path):
    """The built-in's collate pads to a multiple of the attention window: the budget bounds that tensor."""
    from shardtrain.workloads.base import load_workload

    data = make_data("longdoc", tmp_path / "data", n_train=64, n_val=8, min_words=5, max_words=400, lengths="lognormal")
    args = ["--config", "configs/longformer_tiny.yaml", "--data-dir", str(data), "--output-dir", str(tmp_path / "o"),
            "--max-tokens-per-batch", "1024", "--max-length", "512", "--num-workers", "0"]  # fmt: skip
    cfg = parse_cli(args)
    workload = load_workload(cfg)
    train, val = workload.datasets()
    stream = build_loaders(cfg, None, train, val, 0, 2, "cpu", collate=workload.collate, workload=workload).train
    shapes = [tuple(stream.next_batch()["input_ids"].shape) for _ in range(12)]
    window = cfg.model.attention_window
    assert all(n * length <= 1024 and length % window == 0 for n, length in shapes)
    assert len({n for n, _ in shapes}) > 1  # the number of texts follows their length


@pytest.mark.parametrize("fmt", ["mvsa-single", "twitter2015"])
def test_the_seed_layouts_batch_within_a_budget_through_the_builtin_workload(fmt, tmp_path):
    """The reports' own layouts (MVSA; Twitter's text pairs) read and collated by the built-in workload, as a run
    reads them: every micro-batch's padded text tensor within the budget, and each epoch's samples once."""
    from layout_copies import make_mvsa, make_twitter

    from shardtrain.config.settings import from_dict, validate
    from shardtrain.workloads.base import load_workload

    root = make_mvsa(tmp_path / "mvsa") if fmt.startswith("mvsa") else make_twitter(tmp_path / "t15")
    cfg = validate(from_dict({
        "model": {"pretrained": False}, "train": {"per_device_batch_size": 2},
        "data": {"dataset_format": fmt, "data_dir": str(root), "image_size": 16, "num_workers": 0,
                 "max_tokens_per_batch": 96},
        "checkpoint": {"output_dir": str(tmp_path / "run")},
    }))  # fmt: skip
    workload = load_workload(cfg)
    train, val = workload.datasets()
    stream = build_loaders(cfg, None, train, val, 0, 1, "cpu", collate=workload.collate, workload=workload).train
    seen = 0
    while stream.epoch == 0:
        ids = stream.next_batch()["input_ids"]
        assert ids.numel() <= 96, ids.shape
        seen += ids.shape[0]
    assert seen == len(train)  # one rank: the whole epoch, every text once


def test_the_banner_predicts_a_micro_batch_as_the_budgets_worth_of_longest_texts(tmp_path):
    from shardtrain.config.geometry import BatchGeometry
    from shardtrain.config.recompute import RecomputePlan
    from shardtrain.loop.run_info import predicted_memory
    from shardtrain.memory.planner import memory_prediction

    base = ["--config", "configs/longformer_tiny.yaml", "--output-dir", str(tmp_path), "--max-length", "256"]
    budget = parse_cli([*base, "--per-device-batch-size", "1", "--max-tokens-per-batch", "1000"])
    four = parse_cli([*base, "--per-device-batch-size", "4"])
    plan = RecomputePlan()
    got = predicted_memory(budget, BatchGeometry(1, 1, 2), None, True, "T", True, plan)
    assert got == memory_prediction(four, 2, None, recompute=plan)  # 1000 tokens: 4 texts of 256, rounded up


def test_split_to_multiple_keeps_every_text_and_halves_the_fullest():
    from shardtrain.data.token_budget import split_to_multiple

    assert split_to_multiple([[1, 2, 3, 4], [5], [6, 7]], 2) == [[1, 2], [3, 4], [5], [6, 7]]
    assert split_to_multiple([[1], [2], [3]], 2) == [[1], [2], [3]]  # single texts: the stream leaves one out
    assert split_to_multiple([[1, 2], [3]], 3) == [[1], [2], [3]]


def test_auto_checkpointing_plans_for_the_budgets_micro_batch(tmp_path, monkeypatch):
    """--activation-checkpointing auto under a budget picks blocks for the largest micro-batch the run can meet."""
    from shardtrain.config.geometry import BatchGeometry
    from shardtrain.memory import recompute_choice
    from shardtrain.runtime.distributed import DistInfo

    seen = []
    monkeypatch.setattr(recompute_choice, "fewest_blocks", lambda c, v, m, n, micro, *a: seen.append(micro) or 0)
    cfg = parse_cli(["--config", "configs/longformer_tiny.yaml", "--output-dir", str(tmp_path), "--max-length",
                     "256", "--max-tokens-per-batch", "1000", "--activation-checkpointing", "auto",
                     "--memory-budget-gb", "1"])  # fmt: skip
    recompute_choice.choose_blocks(cfg, DistInfo(0, 0, 2, torch.device("cpu"), "gloo"), BatchGeometry(1, 1, 2))
    assert seen == [4]  # 1000 tokens: four 256-token texts


def test_a_changed_budget_at_resume_is_said_and_a_changed_order_is_refused_by_its_setting(tmp_path):
    from shardtrain.data.train_stream import TrainStream
    from shardtrain.loop.resume_changes import resume_changes

    cfg = parse_cli(["--config", "configs/longformer_tiny.yaml", "--output-dir", str(tmp_path),
                     "--max-tokens-per-batch", "2048"])  # fmt: skip
    saved = {"step": 4, "config": {"train": {}, "data": {"max_tokens_per_batch": 1024}}}
    assert "--max-tokens-per-batch 1024 -> 2048: the rest of the epoch" in "; ".join(
        resume_changes(saved, cfg, 2).changes
    )
    budget_state = streams(2)[0].checkpoint_state()
    plain = TrainStream(list(range(N)), torch.tensor, 4, 0, 2, 3, {})
    saved_budget = r"saved with --max-tokens-per-batch \(data.max_tokens_per_batch\) 4096, whose epoch is sorted"
    with pytest.raises(ConfigError, match=saved_budget + r" by length in runs of 60; resume with a token budget"):
        plain.load_state_dict(budget_state)
    random_order = r"sorts the epoch by length in runs of 60, but the checkpoint's epoch was in random order"
    with pytest.raises(ConfigError, match=r"--max-tokens-per-batch .*" + random_order):
        streams(2)[0].load_state_dict(plain.checkpoint_state())
