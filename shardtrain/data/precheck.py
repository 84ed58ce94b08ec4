"""The data a run will read, checked before any process starts: records, and the image cache if one is named.

Above records.py, sources.py and image_cache.py (the cache is built from the records), so none of them needs
the others' checks.
"""

from __future__ import annotations

from shardtrain.config.geometry import no_batch_problem
from shardtrain.config.labels import ClassLabels
from shardtrain.config.settings import ConfigError, reads_images, record_kinds, where
from shardtrain.data.image_cache import open_image_cache, open_source_image_cache
from shardtrain.data.layouts import check_num_labels, layout_files
from shardtrain.data.records import (
    all_lack_images,
    all_name_their_labels,
    config_split_path,
    data_kind,
    has_images,
    iter_split,
    named_labels_hint,
    workload_reading,
)
from shardtrain.data.sources import column_values, image_key, load_splits, source_of


def check_splits(cfg, world_size: int = 1) -> ClassLabels | None:
    """Both splits' records, before any process, process group or model exists: the first bad one raises
    `file:line: message`. Cheap (no torch, no image decoding; images are only checked to exist). With
    --skip-bad-samples only the files must exist: the dataset skips and counts the bad records. A training set
    too small for one micro-batch per rank at `world_size` ranks is refused here too, not by every rank after
    the launch, the data and the model. Returns the classes where the check learnt them (None: a published
    layout's, known once it is read)."""
    if source_of(cfg) != "data_dir":
        # Columns, labels, num_labels and every row of another source: what load_splits raises on each rank
        # later, once, now. Images are only checked to exist here, as below.
        try:
            splits = load_splits(cfg, check_images=False)
        except ConfigError as e:
            raise ConfigError(str(e) + _how_many_more_rows(cfg)) from None
        if cfg.data.image_cache is not None and reads_images(cfg):
            for split, table in (("train", splits.train), ("validation", splits.validation)):
                if table is not None:  # missing or stale: one line now, as below
                    open_source_image_cache(cfg, split, [image_key(v) for v in column_values(table, "image")])
        _check_one_batch_fits(cfg, len(splits.train), world_size)
        return splits.labels
    if cfg.data.dataset_format:
        # A published layout: its files and folders, not its thousands of posts (read once, by the run).
        layout_files(cfg.data.dataset_format, cfg.data.data_dir)
        check_num_labels(cfg.data.dataset_format, cfg.model.num_labels)
        if cfg.data.image_cache is not None:  # missing or stale: one line now, as below
            from shardtrain.data.layouts import read_layout
            from shardtrain.data.splits import open_layout_image_cache

            open_layout_image_cache(cfg, read_layout(cfg.data.dataset_format, cfg.data.data_dir))
        return None
    kind = data_kind(cfg)
    for split, limit in (("train", cfg.data.max_train_samples), ("validation", cfg.data.max_eval_samples)):
        path = config_split_path(cfg, split)
        if cfg.data.image_cache is not None:
            open_image_cache(cfg, path)  # missing or stale: one line now, not one per rank after the launch
        good, skipped = 0, []
        for _rec, problem in iter_split(path, kind, cfg.model.num_labels):
            if problem and cfg.data.skip_bad_samples:
                skipped.append(problem)
                continue
            if problem:
                raise ConfigError(problem + _how_many_more(path, kind, cfg.model.num_labels))
            good += 1
            if limit is not None and good >= limit:
                break
        if not good:
            # Under --skip-bad-samples this passed --check-only, and the ranks found nothing to train on.
            why = f": {named_labels_hint(path)}" if all_name_their_labels(skipped) else ""
            skips = f" ({len(skipped)} bad records skipped by {where('skip_bad_samples')}{why})" if skipped else ""
            raise ConfigError(f"{where('data_dir')}: no usable records in {path}{skips}")
        if split == "train":
            _check_one_batch_fits(cfg, good, world_size)
    return ClassLabels(cfg.model.num_labels, tuple(cfg.data.label_names))  # the records' ids, named by the config


def _check_one_batch_fits(cfg, examples: int, world_size: int) -> None:
    """Each rank's share of the training set holds a micro-batch. Not under a token budget (its batches are cut by
    tokens) nor streaming (the stream's length is unknown), which say so themselves."""
    if cfg.data.max_tokens_per_batch or cfg.data.streaming:
        return
    problem = no_batch_problem(cfg.train.per_device_batch_size, examples, world_size)
    if problem:
        raise ConfigError(problem)


def _how_many_more_rows(cfg) -> str:
    """After a source's first bad row, as after a jsonl file's: how many there are, and the two ways on. Read again
    collecting the rows' problems (images only checked to exist); nothing to add when the source cannot be read
    at all (a missing file or column), whose error says why."""
    problems: list[str] = []
    try:
        load_splits(cfg, check_images=False, report=problems)
    except ConfigError:
        return ""
    if not problems:
        return ""
    if len(problems) == 1:
        return f" (the only bad row; {where('skip_bad_samples')} leaves such rows out)"
    return (
        f" ({len(problems)} bad rows: shardtrain check-data with the same data flags lists them all, "
        f"{where('skip_bad_samples')} leaves them out)"
    )


def _how_many_more(path, kind: str, num_labels: int) -> str:
    """After the first bad record: how many the split has, and the two ways on, so that a user does not fix one
    line per run. Records only (no image decoding): a second pass over a file the check just read."""
    problems = [problem for _rec, problem in iter_split(path, kind, num_labels) if problem]
    bad = len(problems)
    if has_images(kind) and all_lack_images(problems):
        # Text records under the multimodal workload: skipping them all trains on nothing.
        text_only = record_kinds()[1]
        reader = workload_reading(text_only)
        return f" (no record of {path.name} names one: these are {text_only} records, which {reader} reads)"
    if all_name_their_labels(problems):
        return f" ({bad} records like it: {named_labels_hint(path)})"  # skipping them all would leave nothing
    if bad == 1:
        return f" (the only bad record in {path.name}; {where('skip_bad_samples')} leaves such records out)"
    return (
        f" ({bad} bad records in {path.name}: shardtrain check-data {path.parent} --kind {kind} lists them all, "
        f"{where('skip_bad_samples')} leaves them out)"
    )
