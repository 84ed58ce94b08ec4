"""Every place users keep data -> the canonical train/validation splits a run trains on.

    from shardtrain.data import load_splits
    splits = load_splits(cfg)        # splits.train, splits.validation: datasets.Dataset; splits.label_names

Sources (flag = YAML key under `data:`), the spellings of HF's run_classification.py:
- --dataset-name NAME_OR_PATH [--dataset-config-name]: load_dataset on a hub name or a local folder of data
  files, or load_from_disk on a folder that Dataset/DatasetDict.save_to_disk wrote;
- --train-file / --validation-file: one csv, json/jsonl or parquet file per split, by extension;
- --train-dir / --validation-dir: an image folder with metadata.jsonl / metadata.csv (datasets' imagefolder);
- none of those: the jsonl --data-dir layout (train.jsonl / validation.jsonl), read and checked by records.py.

The canonical split has the columns `text` (str), `label` (int class id), `image` (an absolute path string, or
an Image(decode=False) feature {"bytes", "path"}) when the source has images, and `row`: where the row came
from (its index in the source split; the line for jsonl), for messages; `text_pair` (str) when a reader of
canonical rows gives sentence pairs (tokenized as tokenizer(text, text_pair)). `label_names` is id2label's order:
ClassLabel names, or string/bool labels sorted; empty for integer labels (the class ids as given).

Bad rows (empty text, missing label, an integer label outside 0..num_labels-1, a missing image file) raise a
ConfigError naming the row, or are left out and counted with --skip-bad-samples. Labels -1 (unlabelled rows,
as in IMDB's `unsupervised` split) are always left out and counted. A wrong column, a validation label that
training does not have, and a num_labels that contradicts the data are configuration errors, never skipped.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from shardtrain.config.errors import BadRow
from shardtrain.config.labels import ClassLabels, run_config_dict
from shardtrain.config.settings import (
    FIELDS,
    Config,
    ConfigError,
    is_builtin_workload,
    located,
    reads_images,
    set_in_file,
    where,
)
from shardtrain.data.records import relative_to_cwd

# The flags that each name the training data; at most one of them, and none means the jsonl --data-dir layout.
SOURCE_FLAGS = ("dataset_name", "train_file", "train_dir")
FILE_BUILDERS = {".csv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
SPLITS = ("train", "validation")


# How many times the run's data source was asked for (source_of): a workload whose datasets() never asks
# trains on data of its own, and a source flag given to it would be ignored without a word (unread_source_flags).
_source_asks = 0


def source_asks() -> int:
    return _source_asks


def unread_source_flags(cfg: Config, asks_before: int) -> str | None:
    """A line to warn with when the config names training data that datasets() did not ask for: a source flag,
    a published layout, or a --data-dir other than the default folder (which nobody named) or that a YAML file
    names, the default included: a file that says `data_dir: data/multimodal` asked for that folder."""
    given = [name for name in (*SOURCE_FLAGS, "dataset_format") if getattr(cfg.data, name)]
    if cfg.data.data_dir != FIELDS["data_dir"][1].default or set_in_file(cfg, "data_dir"):
        given.append("data_dir")
    if not given:
        return None
    if _source_asks > asks_before:
        return _data_dir_beside_another_source(cfg)
    return (
        f"{located(cfg, given[0])} names training data, but the workload's datasets() did not read the run's data "
        f"source (shardtrain.data.load_splits(cfg), docs/data.md): it trains on what its own code reads"
    )


def _data_dir_beside_another_source(cfg: Config) -> str | None:
    """A --data-dir given beside the flag that names the training data (a trial's --data-dir over a config file's
    dataset_name) is not read: one source per run. Said, where it was ignored in silence. Not when a config file
    set it: the shipped configs name a data folder that --train-file and the others replace."""
    d = cfg.data
    other = next((name for name in SOURCE_FLAGS if getattr(d, name)), None)
    if other is None or d.data_dir == FIELDS["data_dir"][1].default or set_in_file(cfg, "data_dir"):
        return None
    return (
        f"{located(cfg, 'data_dir')} {d.data_dir} is not read: {located(cfg, other)} names the training data "
        f"(one source per run)"
    )


def source_of(cfg: Config) -> str:
    """The flag that names the training data ('data_dir' for the jsonl layout), or a ConfigError naming both
    when two do, or a validation flag without its train flag."""
    global _source_asks
    _source_asks += 1
    d = cfg.data
    given = [name for name in SOURCE_FLAGS if getattr(d, name)]
    if len(given) > 1:
        raise ConfigError(f"{where(given[0])} and {where(given[1])} both name the training data: keep one")
    if given and d.dataset_format:
        raise ConfigError(f"{where('dataset_format')} and {where(given[0])} both name the training data: keep one")
    for val, train in (("validation_file", "train_file"), ("validation_dir", "train_dir")):
        if getattr(d, val) and not getattr(d, train):
            raise ConfigError(f"{where(val)} needs {where(train)} beside it (the validation split of which data?)")
    pct = d.validation_split_percentage
    if pct is not None and not 0 < pct < 100:
        raise ConfigError(f"{where('validation_split_percentage')} must be in 1..99, got {pct}")
    if not d.text_column_names:
        raise ConfigError(
            f"{where('text_column_names')} is empty: name at least one column, e.g. --text-column-names text"
        )
    return given[0] if given else "data_dir"


@dataclass(frozen=True)
class RowNames:
    """How messages name a source's row (the canonical `row` column): by file and line where the lines are
    known, as check-data names them, else `<origin> row i`. A value, not a closure: the datasets that carry it
    go to DataLoader workers, which a non-fork start method reaches by pickling."""

    origin: str
    line_offset: Optional[int] = None  # row i is on line i + line_offset (0: the row column holds the line)
    lines: Optional[tuple[int, ...]] = None  # else each row's line, where blank lines come between records
    spans_lines: bool = False  # a CSV: a quoted field may span lines, so the line is only likely

    def __call__(self, row: int) -> str:
        if self.lines is not None:
            return f"{self.origin}:{self.lines[row]}"
        if self.line_offset is None:
            return f"{self.origin} row {row}"
        if self.spans_lines:
            return f"{self.origin} row {row} (line {row + self.line_offset} if no field spans lines)"
        return f"{self.origin}:{row + self.line_offset}"


@dataclass
class RawSplit:
    """One split as the source has it, before columns and labels are mapped."""

    ds: Any  # datasets.Dataset
    origin: str  # what it was read from, for messages: a file, a folder, "NAME split 'train'"
    root: Path  # the folder that relative image paths are resolved against
    row_names: Optional[RowNames] = None  # how messages name a row; None: "<origin> row i"
    # A reader of canonical rows (the jsonl layout, whose bad lines records.py has named file:line): its rows
    # have the canonical columns already, and these are the problems it found. None: columns still to map.
    problems: Optional[list[str]] = None

    def __post_init__(self):
        self.row_names = self.row_names or RowNames(self.origin)

    def name(self, row: int) -> str:
        return self.row_names(row)


@dataclass
class Splits:
    train: Any  # datasets.Dataset, canonical columns
    validation: Optional[Any]  # None: the source has no validation split and no percentage was set
    label_names: list[str]  # id2label order; []: integer class ids as given
    num_labels: int
    skipped: dict[str, list[str]] = field(default_factory=dict)  # bad rows left out (--skip-bad-samples)
    unlabelled: dict[str, int] = field(default_factory=dict)  # label -1 rows dropped, per split
    source: dict = field(default_factory=dict)  # for summary.json: where each split came from
    row_names: dict[str, RowNames] = field(default_factory=dict)  # how messages name each split's rows

    @property
    def id2label(self) -> dict[int, str]:
        return dict(enumerate(self.label_names))

    @property
    def label2id(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.label_names)}

    @property
    def labels(self) -> ClassLabels:
        """What the data decided of the classes: the run's state (config/labels.py), not the config's."""
        return ClassLabels(self.num_labels, tuple(self.label_names))


def load_splits(cfg: Config, check_images: Optional[bool] = None, report: Optional[list[str]] = None) -> Splits:
    """The canonical train and validation splits of whatever source the config names, validated.

    The classes the data decides are in the result (`labels`); cfg is read, never written. `check_images`:
    decode every image once, to find those that do not decode; None: with --skip-bad-samples, which must leave
    them out before training starts. `report` (check-data): a list that receives every row's problem, as
    --skip-bad-samples would skip them, and every empty split."""
    _quiet_datasets()
    kind = source_of(cfg)
    d = cfg.data
    raw = read_raw(cfg, kind)
    # A built-in needs an image per row or none, as its records do; a user's workload gets the image
    # column when the source has one.
    images = ("need" if reads_images(cfg) else "skip") if is_builtin_workload(cfg) else "if_present"
    check_images = d.skip_bad_samples if check_images is None else check_images
    skip = d.skip_bad_samples or report is not None
    columns = {split: _columns(r, cfg, images) for split, r in raw.items() if r is not None}
    names, int_labels = _label_scheme(cfg, raw["train"], columns["train"]["label"])
    num_labels = _num_labels(cfg, names, columns["train"]["label"], raw["train"])
    label2id = {name: i for i, name in enumerate(names)}
    out, skipped, unlabelled, source, row_names = {}, {}, {}, {}, {}
    for split, r in raw.items():
        if r is None:
            continue
        table, skipped[split], unlabelled[split] = _canonical(
            r,
            columns[split],
            cfg,
            label2id,
            names,
            int_labels,
            num_labels,
            check_images,
            split,
            skip,
            listing=report is not None,
        )
        if report is not None:
            report.extend(skipped[split])
        out[split] = table
        source[split] = r.origin
        row_names[split] = r.row_names
    held_out = raw["validation"] is None and d.validation_split_percentage is not None
    if held_out and len(out["train"]) > 1:  # fewer rows: the empty-split error below says what is wrong
        out["train"], out["validation"], source["validation"] = _percentage_split(cfg, out["train"])
        row_names["validation"] = row_names["train"]  # its rows are the train file's
        source["train"] = f"{raw['train'].origin}, the other {100 - d.validation_split_percentage}%"
    for split, limit in (("train", d.max_train_samples), ("validation", d.max_eval_samples)):
        if out.get(split) is not None and limit is not None and limit < len(out[split]):
            out[split] = out[split].select(range(limit))
    for split, table in out.items():
        if len(table) == 0:
            why = f" ({len(skipped.get(split, []))} bad rows skipped)" if skipped.get(split) else ""
            lost = f" ({unlabelled[split]} rows labelled -1 dropped)" if unlabelled.get(split) else ""
            flag = "validation_split_percentage" if split == "validation" and held_out else _flag_of(kind, split)
            empty = f"{where(flag)}: no usable rows in {source[split]}{why}{lost}"
            if report is None:
                raise ConfigError(empty)
            report.append(empty)
    return Splits(
        out["train"],
        out.get("validation"),
        list(names),
        num_labels,
        skipped,
        unlabelled,
        {
            "source": kind,
            **source,
            "rows": {s: len(t) for s, t in out.items()},
            "content_sha256": {s: content_sha256(t) for s, t in out.items()},
            **({"validation_split": _split_record(cfg, out)} if "validation" in out and held_out else {}),
        },
        row_names,
    )


def _quiet_datasets() -> None:
    # Progress bars and info lines from every rank would bury the run's own log (rank 0 only).
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()


def _flag_of(kind: str, split: str) -> str:
    """The flag that names a split's data, for messages."""
    return (
        kind.replace("train", "validation", 1)
        if split == "validation" and kind in ("train_file", "train_dir")
        else kind
    )


# ---------------------------------------------------------------- reading each source as it is


def read_raw(cfg: Config, kind: str) -> dict[str, Optional[RawSplit]]:
    """{"train": RawSplit, "validation": RawSplit or None} straight from the source."""
    d = cfg.data
    if d.dataset_format:
        return _read_published_layout(cfg)
    if kind == "data_dir":
        return _read_jsonl_layout(cfg)
    if kind == "dataset_name":
        return _read_dataset(d)
    reader = _read_file if kind == "train_file" else _read_image_folder
    flag = "file" if kind == "train_file" else "dir"
    return {
        "train": reader(getattr(d, f"train_{flag}"), f"train_{flag}"),
        "validation": (
            reader(getattr(d, f"validation_{flag}"), f"validation_{flag}") if getattr(d, f"validation_{flag}") else None
        ),
    }


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _read_dataset(d) -> dict[str, Optional[RawSplit]]:
    import datasets

    name, path = d.dataset_name, Path(d.dataset_name)
    saved = path.is_dir() and ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file())
    try:
        if saved:  # a save_to_disk folder: load_dataset would read its arrow files as plain data files
            loaded = datasets.load_from_disk(str(path))
        else:
            loaded = datasets.load_dataset(name, d.dataset_config_name)
    except Exception as e:  # noqa: BLE001 - FileNotFoundError, DatasetNotFoundError, ValueError (config name)...
        config = f" (config {d.dataset_config_name})" if d.dataset_config_name else ""
        raise ConfigError(f"{where('dataset_name')}: cannot load '{name}'{config}: {_first_line(e)}") from None
    if isinstance(loaded, datasets.Dataset):  # Dataset.save_to_disk: one split, training data
        loaded = datasets.DatasetDict({d.train_split_name: loaded})
    root = path if path.is_dir() else Path.cwd()
    have = ", ".join(loaded)
    out: dict[str, Optional[RawSplit]] = {}
    for split, key in (("train", "train_split_name"), ("validation", "validation_split_name")):
        want = getattr(d, key)
        if want in loaded:
            out[split] = RawSplit(loaded[want], f"{name} split '{want}'", root)
        elif split == "train" or d.validation_split_percentage is None:
            hint = "" if split == "train" else "; or hold out part of train with --validation-split-percentage"
            raise ConfigError(f"{where(key)}: '{name}' has no split '{want}' (splits: {have}){hint}")
        else:
            out[split] = None
    return out


def _named(flag: str) -> str:
    """A setting's flag and key for messages; predict's own flags (`--file`) as they are spelled."""
    return where(flag) if flag in FIELDS else f"--{flag.replace('_', '-')}"


def _read_file(file: str, flag: str) -> RawSplit:
    import datasets

    path = Path(file)
    builder = FILE_BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise ConfigError(f"{_named(flag)}: {file}: unknown extension '{path.suffix}' (csv, json, jsonl or parquet)")
    if not path.is_file():
        raise ConfigError(f"{_named(flag)}: file not found: {file}{relative_to_cwd(path)}")
    try:
        # Its json reader logs the parse error before raising it: the one line below says it, with the line.
        datasets.logging.set_verbosity(datasets.logging.CRITICAL)
        ds = datasets.load_dataset(builder, data_files={"data": str(path.resolve())}, split="data")
    except Exception as e:  # noqa: BLE001 - pyarrow's parse errors: a broken line, a ragged csv row
        if _no_rows(path, builder):
            raise ConfigError(f"{_named(flag)}: {file} has no rows") from None
        bad_line = _first_bad_json_line(path) if builder == "json" else None
        raise ConfigError(
            bad_line or f"{_named(flag)}: cannot read {file} as {builder}: {_first_line(_root_cause(e))}"
        ) from None
    finally:
        datasets.logging.set_verbosity_error()
    # Rows of a jsonl file are its lines (blank lines aside); a csv's are after its header line.
    names = None
    if path.suffix.lower() == ".jsonl":
        lines = _nonblank_lines(path)
        if len(lines) == len(ds):
            contiguous = lines == list(range(1, len(lines) + 1))
            names = RowNames(file, line_offset=1) if contiguous else RowNames(file, lines=tuple(lines))
    elif builder == "csv":
        names = RowNames(file, line_offset=2, spans_lines=True)
    return RawSplit(ds, file, path.resolve().parent, names)


def _read_saved_split(folder: str) -> RawSplit:
    """`predict --file` on a folder that `Dataset.save_to_disk` wrote: one split, its rows in order (a user's
    data was in that form, and --file took files only). A DatasetDict's folder holds one such folder per split."""
    import json

    import datasets

    path = Path(folder)
    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits") or []
        example = path / (splits[-1] if splits else "validation")
        raise ConfigError(
            f"predict --file {folder}: a DatasetDict's save_to_disk folder (splits: {', '.join(splits)}): name one "
            f"split's folder, e.g. --file {example}"
        )
    if not (path / "state.json").is_file():
        raise ConfigError(
            f"predict --file {folder}: a folder, and not one that datasets' save_to_disk wrote (no state.json): "
            f"name a csv, json, jsonl or parquet file, or such a folder"
        )
    return RawSplit(datasets.load_from_disk(str(path)), folder, path.resolve(), RowNames(folder))


def _root_cause(e: BaseException) -> BaseException:
    # datasets wraps the parser's error in DatasetGenerationError("An error occurred while generating...").
    while e.__cause__ is not None:
        e = e.__cause__
    return e


def _no_rows(path: Path, builder: str) -> bool:
    """An empty file, or a csv with its header line only: datasets cannot read it ('corresponds to no data')."""
    if builder == "parquet":
        return False
    return len(_nonblank_lines(path)) <= (1 if builder == "csv" else 0)


def _first_bad_json_line(path: Path) -> Optional[str]:
    """`file:line: invalid JSON: ...` for the first line of a jsonl file that does not parse (pyarrow only says
    'in row N' of a block), or None for a .json file holding one document."""
    import json

    if path.suffix.lower() != ".jsonl":
        return None
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, raw in enumerate(f, start=1):
            if raw.strip():
                try:
                    json.loads(raw.rstrip("\r\n"))  # a column in the line, not "line 2, column 1"
                except json.JSONDecodeError as e:
                    return f"{path}:{n}: invalid JSON: {e.msg} at column {e.colno}"
    return None


def _nonblank_lines(path: Path) -> list[int]:
    with open(path, "rb") as f:
        return [n for n, raw in enumerate(f, start=1) if raw.strip()]


def _read_image_folder(folder: str, flag: str) -> RawSplit:
    import datasets

    path = Path(folder)
    if not path.is_dir():
        raise ConfigError(f"{where(flag)}: folder not found: {folder}{relative_to_cwd(path)}")
    if not any((path / m).is_file() for m in ("metadata.jsonl", "metadata.csv")):
        raise ConfigError(
            f"{where(flag)}: {folder} has no metadata.jsonl or metadata.csv (file_name, text, label "
            f"per image, as datasets' imagefolder reads it)"
        )
    try:
        ds = datasets.load_dataset("imagefolder", data_dir=str(path.resolve()), split="train")
    except Exception as e:  # noqa: BLE001
        raise ConfigError(
            f"{where(flag)}: cannot read {folder} as an image folder: {_first_line(_root_cause(e))}"
        ) from None
    return RawSplit(ds, f"{folder}/metadata", path.resolve())


def _read_jsonl_layout(cfg: Config) -> dict[str, Optional[RawSplit]]:
    """train.jsonl / validation.jsonl as records.py reads them: its file:line checks, row = the line."""
    import datasets

    from shardtrain.data.records import config_split_path, data_kind, has_images, iter_split

    kind = data_kind(cfg)
    out = {}
    for split in SPLITS:
        path = config_split_path(cfg, split)
        rows: dict[str, list] = {"row": [], "text": [], "label": []}
        if has_images(kind):
            rows["image"] = []
        problems = []
        for rec, problem in iter_split(path, kind, cfg.model.num_labels):
            if problem:
                if not cfg.data.skip_bad_samples:
                    raise ConfigError(problem)
                problems.append(problem)
                continue
            rows["row"].append(rec.line)
            rows["text"].append(rec.text)
            rows["label"].append(rec.label)
            if has_images(kind):
                rows["image"].append(rec.image)
        out[split] = RawSplit(
            datasets.Dataset.from_dict(rows), str(path), path.parent, RowNames(str(path), line_offset=0), problems
        )
    return out


def _read_published_layout(cfg: Config) -> dict[str, Optional[RawSplit]]:
    """--dataset-format: a research dataset as it unpacks (data/layouts.py), whose reader gives canonical rows
    (a ClassLabel label, an absolute image path, Twitter's text_pair) and has counted what its rules drop."""
    from shardtrain.data.layouts import read_layout

    layout = read_layout(cfg.data.dataset_format, cfg.data.data_dir)
    out: dict[str, Optional[RawSplit]] = {}
    for split in SPLITS:
        if split not in layout.splits:  # MVSA: validation from --validation-split-percentage
            out[split] = None
            continue
        path = layout.files[split]
        ds = layout.to_dataset(split).add_column("row", [row.line for row in layout.splits[split]])
        out[split] = RawSplit(ds, str(path), layout.root, RowNames(str(path), line_offset=0), problems=[])
    return out


# ---------------------------------------------------------------- columns and labels


def _columns(r: RawSplit, cfg: Config, images: str) -> dict[str, Any]:
    """{"text": [column names], "label": name, "image": name or None}, each checked to exist in the split."""
    d = cfg.data
    have = list(r.ds.column_names)
    if r.problems is not None:  # a reader of canonical rows (the jsonl layout)
        return {
            "text": ["text"],
            "label": "label",
            "image": "image" if "image" in have else None,
            "text_pair": "text_pair" if "text_pair" in have else None,
        }

    def need(column: str, flag: str) -> str:
        if column not in have:
            raise ConfigError(f"{where(flag)}: no column '{column}' in {r.origin} (columns: {', '.join(have)})")
        return column

    text = [need(c, "text_column_names") for c in d.text_column_names]
    label = need(d.label_column_name, "label_column_name")
    image = (
        need(d.image_column_name, "image_column_name")
        if images == "need"
        else d.image_column_name
        if images == "if_present" and d.image_column_name in have
        else None
    )
    return {"text": text, "label": label, "image": image, "text_pair": None}


def _label_scheme(cfg: Config, r: RawSplit, column: str) -> tuple[list[str], bool]:
    """(class names in id order, whether labels are integer class ids). From a ClassLabel feature's names, else
    the training split's string or bool values sorted; integer labels keep their ids and have no names (but
    --label-names)."""
    import datasets

    feature = r.ds.features[column]
    given = list(cfg.data.label_names)
    if isinstance(feature, datasets.ClassLabel):
        names = list(feature.names)
        if given and given != names:
            raise ConfigError(
                f"{where('label_names')} {given} differs from the ClassLabel names {names} of "
                f"column '{column}' in {r.origin}: drop --label-names, or relabel the data"
            )
        return names, False
    values = column_values(r.ds, column)
    kinds: dict[str, int] = {}
    for i, v in enumerate(values):
        if _missing(v) or _unlabelled(v):
            continue
        kinds.setdefault(_label_type(v), i)
    if len(kinds) > 1:
        firsts = ", ".join(f"{t} at {r.name(i)}" for t, i in sorted(kinds.items(), key=lambda kv: kv[1]))
        raise ConfigError(
            f"{r.origin}: column '{column}' mixes label types ({firsts}): use one type, class names or integer ids"
        )
    kind = next(iter(kinds), "int")
    if kind == "float":
        i = kinds["float"]
        raise ConfigError(
            f"{r.name(i)}: label {values[i]!r} in column '{column}' is a number, not a class: labels "
            f"are class names (str, bool), integer ids or a ClassLabel"
        )
    if kind == "int":
        return given, True
    found = sorted({_label_text(v) for v in values if not (_missing(v) or _unlabelled(v))})
    if given:
        unknown = [name for name in found if name not in given]
        if unknown:
            raise ConfigError(f"{r.origin}: labels {unknown[:5]} are not in {where('label_names')} {given}")
        return given, False
    _refuse_one_class_spelt_two_ways(r, column, values, found)
    return found, False


def _refuse_one_class_spelt_two_ways(r: RawSplit, column: str, values: list, found: list[str]) -> None:
    """`Pos` beside `pos` (or `pos `) became a class of its own in silence, with its one row. Names that differ only
    in case or surrounding spaces are one class spelt two ways far more often than two classes; --label-names
    that lists them both keeps them apart."""
    spellings: dict[str, list[str]] = {}
    for name in found:
        spellings.setdefault(name.strip().casefold(), []).append(name)
    clash = next((names for names in spellings.values() if len(names) > 1), None)
    if clash is None:
        _refuse_a_rare_near_spelling(r, column, values, found)
        return
    counts = {name: 0 for name in clash}
    for v in values:
        if not (_missing(v) or _unlabelled(v)) and _label_text(v) in counts:
            counts[_label_text(v)] += 1
    shown = " and ".join(f"{name!r} ({n} row{'s' if n != 1 else ''})" for name, n in counts.items())
    raise ConfigError(
        f"{r.origin}: column '{column}' has labels {shown}, which differ only in case or spaces: fix the data, "
        f"or list every class in {where('label_names')} to keep them apart"
    )


def _refuse_a_rare_near_spelling(r: RawSplit, column: str, values: list, found: list[str]) -> None:
    """`postive` in one row beside `positive` in 239 became a fourth class in silence: a label of at
    most 1% of the rows (at least 2) spelt within a letter or two of one ten times as frequent is a typo far more
    often than a class. Names that differ only in their digits (`label_1`, `label_2`) are classes."""
    import difflib
    import re
    from collections import Counter

    counts = Counter(_label_text(v) for v in values if not (_missing(v) or _unlabelled(v)))
    rare_at_most = max(2, sum(counts.values()) // 100)
    for rare in found:
        if counts[rare] > rare_at_most:
            continue
        for common in found:
            if counts[common] < 10 * counts[rare] or re.sub(r"\d", "", rare) == re.sub(r"\d", "", common):
                continue
            if difflib.SequenceMatcher(None, rare.casefold(), common.casefold()).ratio() >= 0.8:
                first = next(i for i, v in enumerate(values) if not _missing(v) and _label_text(v) == rare)
                rows = f"{counts[rare]} row{'s' if counts[rare] != 1 else ''} of column '{column}'"
                raise ConfigError(
                    f"{r.name(first)}: label {rare!r} ({rows}) beside {common!r} ({counts[common]} rows): a typo "
                    f"would train a class of its own; fix the row, or list every class in {where('label_names')} "
                    f"to keep them apart"
                )


def _missing(v) -> bool:
    return v is None or (isinstance(v, float) and v != v)  # NaN: a blank cell in a csv column of numbers


def _unlabelled(v) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and v == -1


def _label_type(v) -> str:
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer()):  # a csv column with a blank is float
        return "int"
    return "float" if isinstance(v, float) else "str"


def _label_text(v) -> str:
    """The class name of a label value: JSON's spelling for bools, so `false` < `true` and ids 0, 1."""
    return ("true" if v else "false") if isinstance(v, bool) else str(v)


def _num_labels(cfg: Config, names: list[str], values_column: str, r: RawSplit) -> int:
    """The number of classes: the names' (ClassLabel, string/bool labels, --label-names), which an explicit
    --num-labels must agree with; for integer ids without names --num-labels, else the largest id + 1."""
    explicit = cfg.model.num_labels
    if names:
        if explicit is not None and explicit != len(names):
            shown = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
            raise ConfigError(
                f"{where('num_labels')}={explicit}, but the data has {len(names)} classes ({shown}) "
                f"in {r.origin}: drop --num-labels (it is taken from the data) or fix the data"
            )
        return len(names)
    if explicit is not None:
        return explicit
    ids = [int(v) for v in column_values(r.ds, values_column) if _label_type(v) == "int" and not _missing(v) and v >= 0]
    return max(ids) + 1 if ids else 1


def _canonical(
    r: RawSplit,
    cols: dict,
    cfg: Config,
    label2id: dict,
    names: list[str],
    int_labels: bool,
    num_labels: int,
    check_images: bool,
    split: str,
    skip: bool,
    listing: bool,
):
    """(canonical Dataset, skipped messages, rows labelled -1). Raises on the first bad row unless `skip`;
    a validation label training does not have is a bad row only when every problem is listed (check-data)."""
    import datasets

    ds = r.ds
    problems = list(r.problems or [])
    feature = ds.features[cols["label"]]
    source_names = feature.names if isinstance(feature, datasets.ClassLabel) else None
    texts = [column_values(ds, c) for c in cols["text"]]
    labels = column_values(ds, cols["label"])
    rows = column_values(ds, "row") if r.problems is not None else range(len(ds))
    image_col, image_is_feature, images = cols["image"], False, None
    if image_col is not None:
        image_is_feature = isinstance(ds.features[image_col], datasets.Image)
        images = column_values(
            ds.cast_column(image_col, datasets.Image(decode=False)) if image_is_feature else ds, image_col
        )
    out: dict[str, list] = {"row": [], "text": [], "label": []}
    pairs = column_values(ds, cols["text_pair"]) if cols["text_pair"] else None  # a sentence pair's second text
    if pairs is not None:
        out["text_pair"] = []
    if image_col is not None:
        out["image"] = []
    unlabelled = 0
    for i in range(len(ds)):
        value = labels[i]
        if _unlabelled(value):
            unlabelled += 1
            continue
        problem, label_id = None, None
        parts = [t[i] for t in texts]
        if any(p is not None and not isinstance(p, str) for p in parts):
            parts = [p if isinstance(p, str) or p is None else str(p) for p in parts]
        text = cfg.data.text_column_delimiter.join(p for p in parts if p is not None)
        if not text.strip():
            problem = "empty text" + (f" (columns {', '.join(cols['text'])})" if len(cols["text"]) > 1 else "")
        elif _missing(value):
            problem = f"no label (column '{cols['label']}' is empty)"
        else:
            label_id, problem = _label_id(value, source_names, label2id, names, int_labels, num_labels, split)
            if problem and label_id == UNSEEN and not listing:
                raise ConfigError(f"{r.name(rows[i])}: {problem}")  # the data, not one row, is wrong: never skipped
        image = None
        if problem is None and image_col is not None:
            image, problem = _image_value(images[i], image_is_feature, r.root, check_images, image_col)
        if problem is not None:
            message = f"{r.name(rows[i])}: {problem}"
            if not skip:
                raise BadRow(message)
            problems.append(message)
            continue
        out["row"].append(rows[i])
        out["text"].append(text)
        if pairs is not None:
            out["text_pair"].append(pairs[i] or "")
        out["label"].append(label_id)
        if image_col is not None:
            out["image"].append(image)
    features = {"row": datasets.Value("int64"), "text": datasets.Value("string"), "label": datasets.Value("int64")}
    if pairs is not None:
        features["text_pair"] = datasets.Value("string")
    if image_col is not None:
        features["image"] = datasets.Image(decode=False) if image_is_feature else datasets.Value("string")
    table = datasets.Dataset.from_dict(out, features=datasets.Features(features))
    return table, problems, unlabelled


UNSEEN = -2  # _label_id: a class that training does not have


def _label_id(
    value, source_names, label2id: dict, names: list[str], int_labels: bool, num_labels: int, split: str
) -> tuple[Optional[int], Optional[str]]:
    """(class id, None) or (None or UNSEEN, what is wrong)."""
    if int_labels and source_names is None:
        if _label_type(value) != "int":
            return None, f"label {value!r} is not an integer class id like the others"
        value = int(value)
        if not 0 <= value < num_labels:
            return None, f"label {value} is outside 0..{num_labels - 1} (model.num_labels={num_labels})"
        return value, None
    name = source_names[value] if source_names is not None else _label_text(value)
    if name in label2id:
        return label2id[name], None
    return UNSEEN, f"{split} label '{name}' is not a class of the training split (its labels: {', '.join(names)})"


def _image_value(value, is_feature: bool, root: Path, decode: bool, column: str):
    """(canonical image, None) or (None, what is wrong): a path string made absolute (relative to the data
    file's folder, not the working directory), or the Image feature's {"bytes", "path"}."""
    from shardtrain.data.images import image_problem

    if is_feature:
        if value is None or (value.get("bytes") is None and not value.get("path")):
            return None, f"no image in column '{column}'"
        if value.get("bytes") is None and not Path(value["path"]).is_file():
            return None, f"image not found: {value['path']}"
        if decode:
            err = image_problem(image_source(value))
            if err:
                return None, f"cannot decode image {value.get('path') or '(embedded)'}: {err}"
        return value, None
    if not isinstance(value, str) or not value:
        return None, f"column '{column}' must hold an image path, got {value!r}"
    path = root / value
    if not path.is_file():
        return None, f"image not found: {value} (looked for {path})"
    if decode:
        err = image_problem(path)
        if err:
            return None, f"cannot decode image {value}: {err}"
    return str(path), None


def image_source(value):
    """What PIL opens for a canonical image value: a path, or the embedded bytes."""
    import io

    if isinstance(value, str):
        return Path(value)
    return io.BytesIO(value["bytes"]) if value.get("bytes") is not None else Path(value["path"])


def column_values(ds, column: str) -> list:
    """One column as a Python list, in one read (ds[column] is a lazy Column that reads per index)."""
    return ds.select_columns([column])[:][column] if len(ds) else []


def image_key(value) -> str:
    """A canonical image's name in the image cache: its path, else a digest of its embedded bytes."""
    if isinstance(value, str):
        return value
    if value.get("bytes") is not None:
        return "sha256:" + hashlib.sha256(value["bytes"]).hexdigest()
    return value["path"]


# ---------------------------------------------------------------- held-out validation


def _percentage_split(cfg: Config, train):
    """(train, validation, description): datasets' train_test_split seeded with train.seed, so the same seed
    holds out the same rows."""
    pct = cfg.data.validation_split_percentage
    parts = train.train_test_split(test_size=pct / 100, seed=cfg.train.seed, shuffle=True)
    return parts["train"], parts["test"], f"{pct}% of train held out (seed {cfg.train.seed})"


def _split_record(cfg: Config, out: dict) -> dict:
    """What summary.json records of a percentage split: enough to see that two runs held out the same rows."""
    rows = sorted(column_values(out["validation"], "row"))
    return {
        "percentage": cfg.data.validation_split_percentage,
        "seed": cfg.train.seed,
        "validation_rows": len(rows),
        "first_rows": rows[:10],
        "rows_sha256": hashlib.sha256(",".join(map(str, rows)).encode()).hexdigest(),
    }


def check_resumed_labels(saved_state: dict, labels: ClassLabels | None) -> None:
    """A checkpoint's output ids stand for its run's classes: resuming on data whose classes differ (another
    file, a class added) would train and report under the wrong names. `labels`: the data's now."""
    saved = (run_config_dict(saved_state).get("data") or {}).get("label_names") or []
    now = list(labels.names) if labels else []
    if saved and now and saved != now:
        raise ConfigError(
            f"the checkpoint was trained on the classes {saved}, but the data now has {now}: resume "
            f"on the same classes (or pass --label-names {','.join(saved)} to keep its order), or "
            f"start over with --resume none"
        )


# ---------------------------------------------------------------- what a run read, by content


def content_sha256(table) -> str:
    """sha256 of a canonical split's content, in order: its text (and text_pair), labels and images (a path, or
    the digest of embedded bytes), not where the rows came from. Two runs that read the same rows from another
    path, or from another source flag, get the same hash; one row more, fewer or relabelled changes it."""
    import json

    h = hashlib.sha256()
    columns = [c for c in ("text", "text_pair", "label") if c in table.column_names]
    values = [column_values(table, c) for c in columns]
    images = [image_key(v) for v in column_values(table, "image")] if "image" in table.column_names else None
    for i in range(len(table)):
        row = [v[i] for v in values] + ([images[i]] if images is not None else [])
        h.update(json.dumps(row, ensure_ascii=False).encode() + b"\n")
    return h.hexdigest()


# ---------------------------------------------------------------- a file to predict on


@dataclass
class PredictionRows:
    table: Any  # datasets.Dataset: row, text, label (-1: no label), [image], [text_pair]
    ids: Optional[list]  # the id column's values, row by row; None: the file has no id column
    origin: str
    labelled: int  # rows with a label (metrics are over these)
    row_names: RowNames  # how messages name its rows (file:line for jsonl)
    empty: list[int] = field(default_factory=list)  # rows with no text (training refuses them; predicted here)


def prediction_rows(cfg: Config, file: str, id_column: Optional[str]) -> PredictionRows:
    """Every row of `file` (csv, json/jsonl or parquet), in its order, read with the run's columns: the text and
    image columns must be there; the label column and each label are optional (unlabelled data is what a model is
    for). Nothing is left out: a row that cannot be predicted (no image) is an error naming it. `id_column`
    None: the column `id` where the file has one."""
    _quiet_datasets()
    d = cfg.data
    raw = _read_saved_split(file) if Path(file).is_dir() else _read_file(file, "file")
    have = list(raw.ds.column_names)
    images = "need" if is_builtin_workload(cfg) and reads_images(cfg) else "skip"
    for column in d.text_column_names + ([d.image_column_name] if images == "need" else []):
        if column not in have:
            raise ConfigError(
                f"predict --file {file}: no column '{column}' (the run read its text from "
                f"{', '.join(d.text_column_names)}"
                + (f" and its image from {d.image_column_name}" if images == "need" else "")
                + f"; the file's columns: {', '.join(have)})"
            )
    if id_column is not None and id_column not in have:
        raise ConfigError(
            f"predict --id-column {id_column}: no column '{id_column}' in {file} (columns: {', '.join(have)})"
        )
    id_column = id_column or ("id" if "id" in have else None)
    label_col = d.label_column_name if d.label_column_name in have else None
    names = list(d.label_names)
    label2id = {name: i for i, name in enumerate(names)}
    texts = [column_values(raw.ds, c) for c in d.text_column_names]
    labels = column_values(raw.ds, label_col) if label_col else [None] * len(raw.ds)
    source_names = None
    if label_col:
        import datasets

        feature = raw.ds.features[label_col]
        source_names = feature.names if isinstance(feature, datasets.ClassLabel) else None
    image_values, image_is_feature = None, False
    if images == "need":
        import datasets

        image_is_feature = isinstance(raw.ds.features[d.image_column_name], datasets.Image)
        ds = raw.ds.cast_column(d.image_column_name, datasets.Image(decode=False)) if image_is_feature else raw.ds
        image_values = column_values(ds, d.image_column_name)
    out: dict[str, list] = {"row": [], "text": [], "label": []}
    if image_values is not None:
        out["image"] = []
    labelled, empty = 0, []
    for i in range(len(raw.ds)):
        parts = [t[i] if t[i] is None or isinstance(t[i], str) else str(t[i]) for t in texts]
        out["row"].append(i)
        out["text"].append(d.text_column_delimiter.join(p for p in parts if p is not None))
        if not out["text"][-1].strip():
            empty.append(i)
        value, label = labels[i], -1
        if not (_missing(value) or _unlabelled(value) or value == ""):
            label, problem = _label_id(
                value, source_names, label2id, names, not names, cfg.model.num_labels, "the file's"
            )
            if problem:
                raise ConfigError(
                    f"{raw.name(i)}: {problem.replace(' of the training split', ' the run trained')}"
                    f" (drop the column '{label_col}', or empty the cell, to predict it unlabelled)"
                )
            labelled += 1
        out["label"].append(label)
        if image_values is not None:
            image, problem = _image_value(image_values[i], image_is_feature, raw.root, False, d.image_column_name)
            if problem:
                raise ConfigError(f"{raw.name(i)}: {problem}")
            out["image"].append(image)
    import datasets

    features = {"row": datasets.Value("int64"), "text": datasets.Value("string"), "label": datasets.Value("int64")}
    if image_values is not None:
        features["image"] = datasets.Image(decode=False) if image_is_feature else datasets.Value("string")
    table = datasets.Dataset.from_dict(out, features=datasets.Features(features))
    ids = column_values(raw.ds, id_column) if id_column else None
    return PredictionRows(table, ids, file, labelled, raw.row_names, empty)
