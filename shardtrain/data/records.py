"""Reading and validating the jsonl splits: the user-facing data contract.

Multimodal folder: `train.jsonl` / `validation.jsonl`, one `{"text": str, "image": "rel/path.png", "label": int}`
per line, images relative to the folder. Long-document folder: the same without "image".
Every problem is reported as `file:line: message` so the user can jump straight to it.
Only cheap checks happen here; decoding images is `images.py`'s job.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from shardtrain.config.sagemaker_env import in_sagemaker
from shardtrain.config.settings import (
    BUILTIN_WORKLOADS,
    ConfigError,
    located,
    reads_images,
    record_kind_aliases,
    record_kinds,
    where,
)

SPLIT_FILES = {"train": "train.jsonl", "validation": "validation.jsonl"}


def data_kind(cfg) -> str:
    """The records the configured workload reads: text with an image each, or text alone (config's reads_images)."""
    with_images, text_only = record_kinds()
    return with_images if reads_images(cfg) else text_only


def has_images(kind: str) -> bool:
    """Whether records of this kind name an image each."""
    return kind == record_kinds()[0]


def normalize_kind(kind: str) -> str:
    kind = record_kind_aliases().get(kind, kind)
    if kind not in record_kinds():
        raise ConfigError(f"data kind '{kind}' is not one of {', '.join(record_kinds())}")
    return kind


def workload_reading(kind: str) -> str:
    """The shipped workload that reads records of this kind: the one named by the kind, or by its alias."""
    return next((name for name in BUILTIN_WORKLOADS if record_kind_aliases().get(name, name) == kind), kind)


def all_lack_images(problems: list[str]) -> bool:
    """The problems of image records that are text records instead: every one a missing image field."""
    return bool(problems) and all(p.endswith(": missing field 'image'") for p in problems)


def all_name_their_labels(problems: list[str]) -> bool:
    """The problems of records whose labels are class names ("politics"): the normal Hugging Face jsonl, which
    this layout does not read (its labels are ids), and --train-file does."""
    return bool(problems) and all(re.search(r': label "[^"]*" is not an integer$', p) for p in problems)


def named_labels_hint(path: Path) -> str:
    """The way on for a split file whose labels are names: the same files as a data source."""
    folder = path.parent
    return (
        f"{path.name}'s labels are class names: the --data-dir layout takes class ids 0..N-1; "
        f"--train-file {folder / SPLIT_FILES['train']} --validation-file {folder / SPLIT_FILES['validation']} "
        f"reads the same files with named classes (docs/data.md)"
    )


def guess_kind(data_dir) -> str:
    """The kind of a jsonl folder's records, from its first training record: images named, or not."""
    import json

    try:
        with open(Path(data_dir) / SPLIT_FILES["train"]) as f:
            return record_kinds()[0 if "image" in json.loads(f.readline() or "{}") else 1]
    except (OSError, ValueError):
        return record_kinds()[0]


def config_split_path(cfg, split: str) -> Path:
    """The split file a config trains on: validation.jsonl may live in eval_data_dir (SageMaker's separate
    validation channel)."""
    field = "eval_data_dir" if split == "validation" and cfg.data.eval_data_dir else "data_dir"
    return split_path(getattr(cfg.data, field), split, named=located(cfg, field), kind=data_kind(cfg))


def split_path(data_dir: str | Path, split: str, named: str | None = None, kind: str | None = None) -> Path:
    """The split file, or a ConfigError naming the setting (`named`: the config file and line that set it, where one
    did; else --data-dir) and the path that is missing; given the records' `kind`, how to make a folder to try."""
    root, named = Path(data_dir), named or where("data_dir")
    if not root.is_dir():
        try_one = f"; `shardtrain make-data {kind} {root}` writes synthetic records to try" if kind else ""
        raise ConfigError(f"{named}: folder not found: {root}{relative_to_cwd(root)}{try_one}")
    path = root / SPLIT_FILES[split]
    if not path.is_file():
        raise ConfigError(f"{named}: split file not found: {path}{relative_to_cwd(path)}{other_forms(root, split)}")
    return path


# Hugging Face's data forms, which --train-file / --validation-file name (data/sources.py reads them).
OTHER_FORMS = (".csv", ".tsv", ".json", ".parquet")


def other_forms(root: Path, split: str) -> str:
    """Where the folder holds the split in another form (a SageMaker channel with train.csv): how to name it."""
    # Under SageMaker the user sets hyperparameters, not flags: name them as the estimator spells them.
    sagemaker = in_sagemaker(os.environ)
    if (root / "dataset_dict.json").is_file() or (root / "state.json").is_file():
        # datasets' save_to_disk (a DatasetDict, or one Dataset): its .json files are metadata, not records.
        named = f"the hyperparameter dataset_name={root}" if sagemaker else f"--dataset-name {root}"
        return f"; the folder is a `datasets` save_to_disk folder: name it with {named}"
    flag = "--train-file" if split == "train" else "--validation-file"
    found = sorted(p.name for p in root.iterdir() if p.is_file() and p.suffix in OTHER_FORMS)
    if not found:
        return ""
    if sagemaker:
        named = f"the hyperparameter {flag[2:].replace('-', '_')}={root / found[0]}"
        columns = "the hyperparameters text_column_names / label_column_name"
    else:
        named, columns = flag, "--text-column-names / --label-column-name"
    return (
        f"; the folder holds {', '.join(found[:3])}{' ...' if len(found) > 3 else ''}: name it with {named} "
        f"(and {columns} for other column names), as docs/data.md shows"
    )


def relative_to_cwd(path: Path) -> str:
    """Which base a relative path was read from: the working directory, for a flag and a YAML key alike (as
    --data-dir and HF's run_classification.py read theirs), never the config file's folder."""
    return "" if path.is_absolute() else f" (relative paths are read from the working directory, {Path.cwd()})"


@dataclass
class Record:
    line: int  # 1-based line in the jsonl file, kept for messages raised later
    text: str
    label: int
    image: Optional[str] = None  # as written in the file: relative to the data folder (or absolute)
    text_pair: Optional[str] = None  # a sentence pair's second segment (a published layout's target)


def check_record(obj, kind: str, num_labels: int, root: Path) -> Optional[str]:
    """None if the parsed line is a valid record, else what is wrong with it (without the file:line prefix)."""
    if not isinstance(obj, dict):
        return f"expected a JSON object, got {type(obj).__name__}"
    fields = ("text", "label", "image") if has_images(kind) else ("text", "label")
    for name in fields:
        if name not in obj:
            return f"missing field '{name}'"
    text, label = obj["text"], obj["label"]
    if not isinstance(text, str):
        return f"field 'text' must be a string, got {type(text).__name__}"
    if not text.strip():
        return "empty text"
    # bool is an int subclass in Python; `true` as a label is a mistake, not class 1.
    if isinstance(label, bool) or not isinstance(label, int):
        return f"label {json.dumps(label)} is not an integer"
    if not 0 <= label < num_labels:
        return f"label {label} is outside 0..{num_labels - 1} (model.num_labels={num_labels})"
    if has_images(kind):
        image = obj["image"]
        if not isinstance(image, str) or not image:
            return f"field 'image' must be a non-empty path string, got {json.dumps(image)}"
        if not (root / image).is_file():
            return f"image not found: {image} (looked for {root / image})"
    return None


def iter_split(path: Path, kind: str, num_labels: int) -> Iterator[tuple[Optional[Record], Optional[str]]]:
    """Yield (record, None) for good lines and (None, 'file:line: message') for bad ones; blank lines are skipped."""
    root = path.parent
    with open(path, encoding="utf-8") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw.rstrip("\r\n"))  # a column in the line, not 'line 2, column 1'
            except json.JSONDecodeError as e:
                yield None, f"{path}:{lineno}: invalid JSON: {e.msg} at column {e.colno}"
                continue
            problem = check_record(obj, kind, num_labels, root)
            if problem:
                yield None, f"{path}:{lineno}: {problem}"
            else:
                yield (
                    Record(lineno, obj["text"], obj["label"], obj.get("image") if has_images(kind) else None),
                    None,
                )


def read_texts(path: Path) -> Iterator[str]:
    """Just the text of every line that has one (tokenizer training; validation happens in build_datasets)."""
    with open(path, encoding="utf-8") as f:
        for raw in f:
            try:
                obj = json.loads(raw.rstrip("\r\n"))
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict) and isinstance(obj.get("text"), str) and obj["text"].strip():
                yield obj["text"]
