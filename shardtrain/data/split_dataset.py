"""A canonical split (shardtrain/data/sources.py) as the built-in workloads' torch Dataset.

Items are what the Collator takes, as JsonlDataset gives them: {"text", "label"} (+ "text_pair" when the split
has one) and, for a model that reads images, "image": a uint8 [3, S, S] tensor decoded from the image's file or its
embedded bytes, or read from the image cache's memory map.
"""

from __future__ import annotations

from typing import Optional

from torch.utils.data import Dataset

from shardtrain.config.settings import ConfigError, reads_images
from shardtrain.data.image_cache import ImageCache, UndecodableImage
from shardtrain.data.images import BAD_IMAGE_HINT, load_image
from shardtrain.data.sources import RowNames, column_values, image_key, image_source


class SplitDataset(Dataset):
    def __init__(
        self,
        table,
        origin: str,
        image_size: int,
        images: bool,
        skipped: list[str],
        cache: Optional[ImageCache] = None,
        unlabelled: int = 0,
        source: Optional[dict] = None,
        row_names: Optional[RowNames] = None,
    ):
        self.table, self.origin, self.image_size = table, origin, image_size
        self.row_names = row_names or RowNames(origin)
        self.images, self.cache = images, cache
        # Read by the loop for the banner and summary.json: bad rows left out (--skip-bad-samples), rows
        # labelled -1 dropped, and where the splits came from (a percentage split's seed and rows).
        self.skipped, self.unlabelled, self.source = skipped, unlabelled, source or {}
        self.has_pair = "text_pair" in table.column_names
        self.tokens = None  # token ids row by row, once tokenize() has run
        self.truncated: Optional[int] = None  # texts cut at max_length, once tokenize() has counted them

    def __len__(self) -> int:
        return len(self.table)

    def lengths(self) -> list[int]:
        """Each row's token count (--group-by-length), read from the ids tokenize() wrote."""
        from shardtrain.data.preprocess import token_counts

        return token_counts(self.tokens)

    def tokenize(self, tokenizer, max_length: int, num_proc: Optional[int], is_rank0: bool, barrier):
        """Token ids for every row, through datasets.map's cache (data/preprocess.py). Only the text columns are
        mapped: an image column of embedded bytes would otherwise be copied into the cache file too."""
        from shardtrain.data.preprocess import tokenize_table

        text = self.table.select_columns(["text", "text_pair"] if self.has_pair else ["text"])
        done = tokenize_table(text, tokenizer, max_length, num_proc, is_rank0, barrier)
        self.tokens = done.dataset.select_columns(["input_ids", "attention_mask"])
        self.truncated = done.truncated
        return done

    def __getitem__(self, i: int) -> dict:
        row = self.table[int(i)]
        item = {"text": row["text"], "label": row["label"]}
        if self.has_pair:
            item["text_pair"] = row["text_pair"]
        if self.tokens is not None:  # collate only pads
            item.update(self.tokens[int(i)])
        if self.images:
            image = row["image"]
            try:
                item["image"] = (
                    self.cache.load(image_key(image))
                    if self.cache is not None
                    else load_image(image_source(image), self.image_size)
                )
            except Exception as e:
                why = str(e) if isinstance(e, UndecodableImage) else f"{type(e).__name__}: {e}"
                name = image if isinstance(image, str) else image.get("path") or "(embedded)"
                at = self.row_names(row["row"])
                raise ConfigError(f"{at}: cannot decode image {name}: {why}{BAD_IMAGE_HINT}") from None
        return item


LABELS_FILE = "labels.json"  # in the run folder: the class names a run's ids stand for


def write_label_file(cfg, label_names: list[str]) -> None:
    """labels.json in the run folder (rank 0): which class name each id stands for."""
    import json
    from pathlib import Path

    out = Path(cfg.checkpoint.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / LABELS_FILE).write_text(
        json.dumps(
            {"id2label": dict(enumerate(label_names)), "label2id": {n: i for i, n in enumerate(label_names)}}, indent=1
        )
        + "\n"
    )


def source_datasets(cfg) -> tuple[SplitDataset, Optional[SplitDataset]]:
    """(train, validation) of the source the config names, validated and wrapped for the loop. The train
    dataset carries `labels`, the classes the data decided (config/labels.py), which the Trainer writes into the
    run folder."""
    from shardtrain.data.image_cache import open_source_image_cache
    from shardtrain.data.sources import load_splits

    # With an image cache, the images that did not decode are known from its build: none is decoded here.
    splits = load_splits(cfg, check_images=False if cfg.data.image_cache else None)
    images = reads_images(cfg)
    made = []
    for split, table in (("train", splits.train), ("validation", splits.validation)):
        if table is None:
            made.append(None)
            continue
        skipped, cache = splits.skipped.get(split, []), None
        if images and cfg.data.image_cache:
            keys = [image_key(v) for v in column_values(table, "image")]
            cache = open_source_image_cache(cfg, split, keys)
            names = splits.row_names[split]
            table, dropped = _without_undecodable(table, keys, cache, names, cfg.data.skip_bad_samples)
            skipped = skipped + dropped
        made.append(
            SplitDataset(
                table,
                splits.source[split],
                cfg.data.image_size,
                images,
                skipped,
                cache,
                splits.unlabelled.get(split, 0),
                splits.source,
                splits.row_names.get(split),
            )
        )
    made[0].labels = splits.labels
    return made[0], made[1]


def _without_undecodable(table, keys: list[str], cache: ImageCache, row_names: RowNames, skip: bool):
    """(table without the rows whose image the cache could not decode, their messages) with --skip-bad-samples;
    without it, the rows stay and the first one raises when it is loaded, as a decode would."""
    bad = [i for i, key in enumerate(keys) if cache.problem(key)]
    if not skip or not bad:
        return table, []
    rows = column_values(table, "row")
    messages = [f"{row_names(rows[i])}: cannot decode image {keys[i]}: {cache.problem(keys[i])}" for i in bad]
    drop = set(bad)
    return table.select([i for i in range(len(table)) if i not in drop]), messages
