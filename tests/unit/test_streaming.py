"""--streaming's loader (shardtrain/data/streaming.py): exact state round trip, per-rank passes, shuffling."""

import json

import datasets
import pytest

from shardtrain.config.settings import ConfigError, replace_fields
from shardtrain.data.streaming import StreamingTrainStream


def source(n: int, shards: int = 1):
    return datasets.Dataset.from_dict({"x": list(range(n))}).to_iterable_dataset(num_shards=shards)


def ids(items):
    return [it["x"] for it in items]


def stream(n=23, rank=0, world=2, micro=3, buffer=5, shards=1, seed=7):
    return StreamingTrainStream(source(n, shards), ids, micro, rank, world, seed, buffer_size=buffer)


def take(s, batches):
    return [x for _ in range(batches) for x in s.next_batch()]


@pytest.mark.parametrize("shards", [1, 2])  # every world-size-th example, or whole shards per rank
@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("k", [0, 1, 3, 4, 9])  # 23 examples over 2 ranks: 12 / 11, passes end mid-batch
def test_state_round_trip_continues_exactly(k, rank, shards):
    """A position saved after k batches, through JSON as the checkpoint stores it, continues with the very
    examples an uninterrupted stream gives next, across the ends of passes and a refilling buffer."""
    a = stream(rank=rank, shards=shards)
    take(a, k)
    state = json.loads(json.dumps(a.state_dict()))
    expected = take(a, 12)
    b = stream(rank=rank, shards=shards)
    b.load_state_dict(state)
    assert take(b, 12) == expected
    assert b.epoch == a.epoch and b.examples_seen == a.examples_seen


def test_ranks_read_disjoint_parts_and_never_run_out():
    """Uneven parts (12 and 11 of 23): each rank passes over its own part, reshuffled each pass, and always
    has a next batch; together the ranks' first passes cover every example once."""
    r0, r1 = stream(rank=0), stream(rank=1)
    first0, first1 = take(r0, 4), take(r1, 4)[:11]  # 12 = 4 batches of 3; rank 1's pass ends at 11
    assert sorted(first0 + first1) == list(range(23))
    assert r1.epoch == 1  # rank 1 is already one example into its second pass
    second0 = take(r0, 4)
    assert r0.epoch == 1
    assert sorted(second0) == sorted(first0) and second0 != first0
    take(r0, 40)  # many passes on
    assert r0.epoch >= 10


def test_runs_with_the_same_seed_agree_and_other_seeds_differ():
    assert take(stream(seed=1), 8) == take(stream(seed=1), 8) != take(stream(seed=2), 8)


def test_new_micro_batch_size_keeps_the_example_position():
    """OOM recovery rolls back to the step's start and halves the micro-batch: the same examples follow."""
    a, b = stream(micro=4), stream(micro=4)
    take(a, 1)
    take(b, 1)
    position = b.state_dict()
    take(b, 1)  # the step that ran out of memory
    b.load_state_dict(position)
    b.set_micro_batch_size(2)
    assert take(b, 4) == take(a, 2)


def test_checkpoint_state_of_another_world_size_is_refused():
    s = stream()
    saved = {**s.checkpoint_state(), "world_size": 3}
    with pytest.raises(ConfigError, match="--streaming .*3 processes, this run has 2"):
        s.load_state_dict(saved)


def test_a_rank_without_examples_is_a_clear_error():
    with pytest.raises(ConfigError, match="rank 2 of 3 got no training example"):
        stream(n=2, rank=2, world=3).next_batch()


def test_build_loaders_streams_a_datasets_iterable_and_refuses_other_iterables(tmp_path):
    """The loader follows the dataset's type: a datasets.IterableDataset streams (no length, so no steps per
    epoch); a plain torch IterableDataset has no position to checkpoint and is refused by name."""
    import torch

    from shardtrain.config.settings import Config
    from shardtrain.data import build_loaders

    cfg = Config()
    cfg = replace_fields(cfg, per_device_batch_size=3)
    loaders = build_loaders(cfg, None, source(10), None, 0, 1, "cpu", collate=ids)
    assert isinstance(loaders.train, StreamingTrainStream) and loaders.steps_per_epoch is None
    assert len(loaders.train.next_batch()) == 3

    class Plain(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(3))

    with pytest.raises(ConfigError, match="Workload.datasets.. returned a Plain .*datasets.IterableDataset"):
        build_loaders(cfg, None, Plain(), None, 0, 1, "cpu", collate=ids)


def test_jsonl_stream_checks_lines_first_and_skips_bad_ones_by_row(tmp_path):
    """--streaming checks every line before training (file:line, as in memory); --skip-bad-samples leaves
    those rows out of the stream, which still reads through datasets' json loader."""
    from shardtrain.config.settings import Config
    from shardtrain.data.streaming import jsonl_train_stream

    rows = [{"text": f"doc {i}", "label": i % 3} for i in range(6)]
    rows[2]["label"] = 7
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = Config()
    cfg = replace_fields(cfg, name="longformer", num_labels=3, data_dir=str(tmp_path))
    with pytest.raises(ConfigError, match=r"train.jsonl:3: label 7 is outside 0..2"):
        jsonl_train_stream(cfg)
    cfg = replace_fields(cfg, skip_bad_samples=True)
    stream = jsonl_train_stream(cfg)
    assert [r["text"] for r in stream] == ["doc 0", "doc 1", "doc 3", "doc 4", "doc 5"]
    assert len(stream.skipped) == 1 and stream.column_names == ["text", "label"]
    (tmp_path / "train.jsonl").write_text((tmp_path / "train.jsonl").read_text() + "{oops\n")
    with pytest.raises(ConfigError, match=r"train.jsonl:7: invalid JSON.*cannot skip invalid JSON"):
        jsonl_train_stream(cfg)


def test_a_checkpoint_of_the_other_kind_is_refused_by_name():
    """--streaming on or off must match the checkpoint: the two positions mean different things."""
    import torch

    from shardtrain.data.loaders import TrainStream

    s = stream()
    in_memory = TrainStream(torch.utils.data.TensorDataset(torch.arange(12)), list, 3, 0, 1, 0, {})
    with pytest.raises(ConfigError, match="saved with --streaming .* on; resume with it on"):
        in_memory.load_state_dict(s.checkpoint_state())
    with pytest.raises(ConfigError, match="--streaming .* is on, but the checkpoint was saved without it"):
        s.load_state_dict(in_memory.checkpoint_state())
