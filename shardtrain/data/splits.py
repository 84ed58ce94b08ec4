"""Train/validation datasets built from the validated records, and the collate function that tokenizes.

The text side lives in a `datasets.Dataset` (Arrow: compact, picklable to DataLoader workers, no cache files
since it is built in memory). Images are decoded lazily in __getitem__.

Bad data policy:
- skip_bad_samples=False: the first bad record raises ConfigError `file:line: message` before training starts.
  A corrupt image (one that exists but does not decode) is only found when it is loaded, and raises the
  same kind of error from __getitem__ (inside a worker process the DataLoader re-raises it in the main process).
- skip_bad_samples=True: every record is checked up front, images fully decoded once, so a bad sample never
  reaches training and nothing has to be substituted mid-epoch (which would break deterministic resume).
  The messages are kept in `dataset.skipped`. Cost: one decode of every image at start-up.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from torch.utils.data import Dataset

from shardtrain.config.errors import BadRow
from shardtrain.config.labels import ClassLabels
from shardtrain.config.settings import Config, ConfigError, pad_multiple, reads_images, record_kinds, where
from shardtrain.data.image_cache import ImageCache, UndecodableImage, open_image_cache
from shardtrain.data.images import BAD_IMAGE_HINT, image_problem, load_image
from shardtrain.data.layouts import check_num_labels, read_layout
from shardtrain.data.records import Record, config_split_path, data_kind, has_images, iter_split


class JsonlDataset(Dataset):
    """Items: {"text": str, "label": int} (+ "image": uint8 tensor [3, S, S] for multimodal), the image
    decoded from its file or, with an image cache, read from the cache's memory map; + "text_pair": str when
    the records have one."""

    def __init__(
        self,
        path: Path,
        kind: str,
        records: list[Record],
        image_size: int,
        skipped: list[str],
        cache: Optional[ImageCache] = None,
    ):
        import datasets  # heavy import, only when data is actually built

        self.path, self.kind, self.image_size, self.cache = path, kind, image_size, cache
        self.root = path.parent
        self.skipped = skipped
        self.truncated: Optional[int] = None  # texts cut at max_length, once tokenize() has counted them
        rows = {
            "line": [r.line for r in records],
            "text": [r.text for r in records],
            "label": [r.label for r in records],
        }
        if has_images(kind):
            rows["image"] = [r.image for r in records]
        if any(r.text_pair is not None for r in records):
            rows["text_pair"] = [r.text_pair for r in records]
        self.table = datasets.Dataset.from_dict(rows)

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, i: int) -> dict:
        row = self.table[int(i)]
        item = {"text": row["text"], "label": row["label"]}
        if "text_pair" in row:
            item["text_pair"] = row["text_pair"]
        if "input_ids" in row:  # tokenised ahead by tokenize(); collate only pads
            item["input_ids"], item["attention_mask"] = row["input_ids"], row["attention_mask"]
        if has_images(self.kind):
            try:
                item["image"] = (
                    self.cache.load(row["image"])
                    if self.cache is not None
                    else load_image(self.root / row["image"], self.image_size)
                )
            except Exception as e:
                why = str(e) if isinstance(e, UndecodableImage) else f"{type(e).__name__}: {e}"
                at = f"{self.path}:{row['line']}"
                raise ConfigError(f"{at}: cannot decode image {row['image']}: {why}{BAD_IMAGE_HINT}") from None
        return item

    def lengths(self) -> list[int]:
        """Each row's token count (--group-by-length), read from the ids tokenize() wrote."""
        from shardtrain.data.preprocess import token_counts

        return token_counts(self.table)

    def tokenize(self, tokenizer, max_length: int, num_proc: Optional[int], is_rank0: bool, barrier):
        """Adds input_ids / attention_mask to every row, through datasets.map's cache (data/preprocess.py)."""
        from shardtrain.data.preprocess import tokenize_table

        done = tokenize_table(self.table, tokenizer, max_length, num_proc, is_rank0, barrier)
        self.table, self.truncated = done.dataset, done.truncated
        return done


def read_split(
    path: Path, kind: str, num_labels: int, skip_bad: bool, limit: Optional[int], cache: Optional[ImageCache] = None
):
    """(records, skipped messages). Raises on the first problem unless skip_bad. Stops at `limit` good records.
    With skip_bad every image is decoded once here, unless a cache already knows which ones do not decode."""
    records, skipped = [], []
    for rec, problem in iter_split(path, kind, num_labels):
        if rec is not None and skip_bad and has_images(kind):
            err = cache.problem(rec.image) if cache is not None else image_problem(path.parent / rec.image)
            if err:
                rec, problem = None, f"{path}:{rec.line}: cannot decode image {rec.image}: {err}"
        if problem:
            if not skip_bad:
                raise BadRow(problem)
            skipped.append(problem)
            continue
        records.append(rec)
        if limit is not None and len(records) >= limit:
            break
    return records, skipped


def build_datasets(cfg: Config, tokenizer=None) -> tuple[JsonlDataset, JsonlDataset]:
    """(train_ds, eval_ds), validated. `tokenizer` is unused here (JsonlDataset.tokenize adds the ids), kept for
    the API."""
    if cfg.data.dataset_format:
        return layout_datasets(cfg)
    return build_split(cfg, "train"), build_split(cfg, "validation")


def build_split(cfg: Config, split: str) -> JsonlDataset:
    kind = data_kind(cfg)
    limit = cfg.data.max_train_samples if split == "train" else cfg.data.max_eval_samples
    path = config_split_path(cfg, split)
    cache = open_image_cache(cfg, path)
    records, skipped = read_split(path, kind, cfg.model.num_labels, cfg.data.skip_bad_samples, limit, cache)
    if not records:
        why = f" ({len(skipped)} bad records skipped)" if skipped else ""
        raise ConfigError(f"{where('data_dir')}: no usable records in {path}{why}")
    return JsonlDataset(path, kind, records, cfg.data.image_size, skipped, cache)


# ---- --dataset-format: a published layout (data/layouts.py) as the same datasets as the jsonl splits.
# MVSA has no validation split: --validation-split-percentage of its posts (chosen by train.seed) are held out,
# this many unless it is given, since the reports evaluate on MVSA.
LAYOUT_VALIDATION_PERCENT = 10


def layout_datasets(cfg: Config) -> tuple[JsonlDataset, JsonlDataset]:
    """The train dataset carries `data_report` (summary.json's `data`), `data_report_lines` (the console) and
    `labels`, the layout's classes (config/labels.py), as every source's train dataset does."""
    d = cfg.data
    layout = read_layout(d.dataset_format, d.data_dir)
    check_num_labels(d.dataset_format, cfg.model.num_labels)
    splits = dict(layout.splits)
    held_out = "validation" not in splits
    percent = d.validation_split_percentage if d.validation_split_percentage is not None else LAYOUT_VALIDATION_PERCENT
    if held_out:
        splits["train"], splits["validation"] = hold_out(splits["train"], percent, cfg.train.seed)
    cache = open_layout_image_cache(cfg, layout)
    out = []
    for split, limit in (("train", d.max_train_samples), ("validation", d.max_eval_samples)):
        path = layout.files.get(split, layout.files["train"])
        records = [Record(r.line, r.text, layout.labels.index(r.label), r.image, r.text_pair) for r in splits[split]]
        records, skipped = _decodable(path, records, d.skip_bad_samples, limit, cache)
        if not records:
            dropped = "; ".join(f"{n} {why}" for why, n in sorted(layout.dropped.items())) or "nothing dropped"
            raise ConfigError(
                f"--dataset-format {d.dataset_format}: no usable {split} posts in {layout.root} "
                f"({dropped}; shardtrain check-data {layout.root} --dataset-format "
                f"{d.dataset_format} shows why)"
            )
        out.append(JsonlDataset(path, record_kinds()[0], records, d.image_size, skipped, cache))
    report, lines = layout.report(), layout.report_lines()
    if held_out:
        report["validation_held_out"] = {"percent": percent, "seed": cfg.train.seed, "posts": len(splits["validation"])}
        lines.insert(
            1,
            f"--dataset-format {d.dataset_format}: no validation split of its own; "
            f"{len(splits['validation'])} posts (--validation-split-percentage {percent}, chosen by train.seed "
            f"{cfg.train.seed}) held out for validation",
        )
    out[0].data_report, out[0].data_report_lines = report, lines
    out[0].labels = ClassLabels(len(layout.labels), tuple(layout.labels))
    return out[0], out[1]


def hold_out(rows: list, percent: int, seed: int) -> tuple[list, list]:
    """(kept, held out), each in file order: the rows datasets' train_test_split holds out for this seed, so a
    workload of one's own that reads the layout through load_splits evaluates on the same posts."""
    import datasets

    if len(rows) < 2:
        return rows, []
    index = datasets.Dataset.from_dict({"i": list(range(len(rows)))})
    chosen = set(index.train_test_split(test_size=percent / 100, seed=seed, shuffle=True)["test"]["i"])
    return ([r for i, r in enumerate(rows) if i not in chosen], [r for i, r in enumerate(rows) if i in chosen])


def layout_images(layout) -> list[str]:
    """Every image a layout's rows name, in file order: one image cache covers the whole layout, so the share
    held out for validation can change (--validation-split-percentage, the seed) without a rebuild."""
    return [row.image for rows in layout.splits.values() for row in rows]


def open_layout_image_cache(cfg: Config, layout) -> Optional[ImageCache]:
    from shardtrain.data.image_cache import open_source_image_cache

    return open_source_image_cache(cfg, layout.fmt, layout_images(layout))


def _decodable(
    path: Path, records: list[Record], skip_bad: bool, limit: Optional[int], cache: Optional[ImageCache] = None
):
    """(records, skipped messages), at most `limit` records. With skip_bad every image is decoded once here (or
    looked up in the image cache's build), as read_split does for the jsonl splits; without, a bad image stops
    the run when it is loaded."""
    kept, skipped = [], []
    for rec in records:
        if limit is not None and len(kept) >= limit:
            break
        err = None
        if skip_bad:
            err = cache.problem(rec.image) if cache is not None else image_problem(Path(rec.image))
        if err:
            skipped.append(f"{path}:{rec.line}: cannot decode image {rec.image}: {err}")
        else:
            kept.append(rec)
    return kept, skipped


class Collator:
    """Tokenizes a list of items into a padded batch. A class, not a closure, so DataLoader workers can pickle it.

    Padding is dynamic (to the longest in the batch), truncation at max_length. For Longformer the length is
    rounded up to a multiple of the attention window: Longformer would otherwise pad inside forward, on every step.
    """

    def __init__(
        self,
        tokenizer,
        max_length: int,
        images: bool,
        pad_to_multiple_of: Optional[int] = None,
        image_root: Optional[Path] = None,
        image_size: int = 224,
    ):
        self.tokenizer, self.max_length = tokenizer, max_length
        self.images, self.pad_to_multiple_of = images, pad_to_multiple_of
        # Streamed examples carry the image's path (relative to the data file's folder), decoded here.
        self.image_root, self.image_size = image_root, image_size

    def __call__(self, items: list[dict]) -> dict[str, torch.Tensor]:
        if "input_ids" in items[0]:
            # Tokenised (and truncated) ahead through datasets.map: only padding is left, to the same ids.
            enc = self.tokenizer.pad(
                [{"input_ids": it["input_ids"], "attention_mask": it["attention_mask"]} for it in items],
                padding="longest",
                return_tensors="pt",
            )
        else:
            # A sentence pair (a layout's tweet and its target) is encoded as one sequence with the tokenizer's
            # own separators; truncation trims the longer of the two first.
            pairs = [it["text_pair"] for it in items] if "text_pair" in items[0] else None
            enc = self.tokenizer(
                [it["text"] for it in items],
                pairs,
                padding="longest",
                truncation=True,
                max_length=self.max_length,
                return_tensors="pt",
            )
        ids, mask = enc["input_ids"], enc["attention_mask"]
        if self.pad_to_multiple_of:
            # Padded here, not with the tokenizer's pad_to_multiple_of: transformers refuses that unless
            # max_length is itself a multiple, and max_length should stay a limit on content, as the user set it.
            extra = -ids.shape[1] % self.pad_to_multiple_of
            ids = torch.nn.functional.pad(ids, (0, extra), value=self.tokenizer.pad_token_id)
            mask = torch.nn.functional.pad(mask, (0, extra), value=0)
        batch = {
            "input_ids": ids,
            "attention_mask": mask,
            "labels": torch.tensor([it["label"] for it in items], dtype=torch.long),
        }
        if self.images:
            batch["pixel_values"] = torch.stack([self._image(it["image"]) for it in items])
        return batch

    def _image(self, image) -> torch.Tensor:
        if not isinstance(image, str):
            return image
        try:
            return load_image(self.image_root / image, self.image_size)
        except Exception as e:  # noqa: BLE001 - a corrupt file found mid-stream: one line naming it
            raise ConfigError(f"{self.image_root / image}: cannot decode image: {type(e).__name__}: {e}") from None


def make_collator(cfg: Config, tokenizer) -> Collator:
    return Collator(
        tokenizer,
        cfg.data.max_length,
        images=reads_images(cfg),
        pad_to_multiple_of=pad_multiple(cfg),
        image_root=Path(cfg.data.data_dir),
        image_size=cfg.data.image_size,
    )
