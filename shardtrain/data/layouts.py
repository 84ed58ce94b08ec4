"""The reports' datasets, read in their published layouts: `--dataset-format FORMAT --data-dir FOLDER`.

FOLDER is the dataset's own top folder, as unpacked. What each reader expects, and the rules it applies
(docs/datasets.md says the same for users):

**mvsa-single** (MCRLab's MVSA-Single, unpacked as `MVSA_Single/`):
    labelResultAll.txt   header `ID<TAB>text,image`, then `12<TAB>positive,neutral`: one annotator's text
                         label and image label per post
    data/<ID>.txt        the tweet (often not UTF-8), data/<ID>.jpg its image
  A post is kept when its text and image labels agree, or when one of them is neutral: it then takes the other's
  label (neutral,neutral stays neutral). positive against negative is dropped (`labels_disagree`).

**mvsa-multiple** (MVSA-Multiple, unpacked as `MVSA/`): the same files, with three annotators' `text,image`
  pairs per line. The text label is the majority of the three text labels, the image label the majority of the
  three image labels; then the MVSA-Single rule. Tie rule: with three annotators and three classes a majority
  (2 of 3) is only missing when all three differ; such a post is dropped (`no_majority`), never broken by order.

**twitter2015 / twitter2017** (TomBERT's target-oriented multimodal sentiment release, unpacked as
  `IJCAI2019_data/` holding `twitter2015/`, `twitter2015_images/`, `twitter2017/`, `twitter2017_images/`):
    twitter2015/{train,dev,test}.tsv   header `index  #1 Label  #2 ImageID  #3 String  #3 String`, then index,
                                       label (0 negative, 1 neutral, 2 positive), image file name, the tweet with
                                       `$T$` where the target was, the target
    twitter2015_images/<ImageID>       the images, in a sibling folder of the TSVs' folder
  FOLDER may be the unpacked top folder (`IJCAI2019_data/`) or the TSVs' own folder (`twitter2015/`, as
  TomBERT's --data_dir); the images are looked for beside the TSVs' folder. train/dev/test become
  train/validation/test. The text is the tweet with the target put back, and the target is its pair
  (`tokenizer(text, text_pair)`). One tweet with several targets gives several rows, as in the files.

Messy files: text is decoded as UTF-8, and a byte that is not UTF-8 is read as Windows-1252 (what the MVSA texts
that are not UTF-8 are written in), so `caf\\xe9` reads `café`; the few bytes Windows-1252 leaves undefined become
U+FFFD. Both are counted. A post with a missing half (a text but no image, or the other way round) is skipped
and counted, as is a malformed line; each reason keeps one example (`file:line: ...`) to look at. Checks run in
this order, the first that fails names the reason: malformed line, label rule, missing half, empty text.

A layout has no validation split of its own for MVSA: validation comes from the caller (data/splits.py).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from shardtrain.config.settings import ConfigError, where

FORMATS = ("mvsa-single", "mvsa-multiple", "twitter2015", "twitter2017")
# Sorted names, and the order of Twitter's 0/1/2 ids: the same id2label for all four layouts.
LABELS = ("negative", "neutral", "positive")
MVSA_LABEL_FILE = "labelResultAll.txt"
MVSA_ANNOTATORS = {"mvsa-single": 1, "mvsa-multiple": 3}
TWITTER_SPLITS = {"train": "train.tsv", "validation": "dev.tsv", "test": "test.tsv"}
TARGET = "$T$"


@dataclass
class Row:
    """One canonical row: the columns every source gives (text, optional text_pair, image, label)."""

    line: int  # 1-based line of the label file or TSV, for messages raised later
    text: str
    image: str  # absolute path
    label: str  # a name from LABELS
    text_pair: Optional[str] = None


@dataclass
class Layout:
    """What a reader found: rows per split, the label names, and what it left out and why."""

    fmt: str
    root: Path  # the folder the files were found in
    files: dict = field(default_factory=dict)  # split -> the file its rows' lines number
    splits: dict = field(default_factory=dict)  # split -> list[Row]
    labels: tuple = LABELS
    dropped: Counter = field(default_factory=Counter)  # reason -> posts (or rows) left out
    examples: dict = field(default_factory=dict)  # reason -> the first one, `file:line: why`
    non_utf8_bytes: int = 0  # read as Windows-1252
    replaced_bytes: int = 0  # undecodable even so: U+FFFD

    def drop(self, reason: str, example: str) -> None:
        self.dropped[reason] += 1
        self.examples.setdefault(reason, example)

    def read_text(self, path: Path) -> str:
        text, non_utf8, replaced = decode_leniently(path.read_bytes())
        self.non_utf8_bytes += non_utf8
        self.replaced_bytes += replaced
        return text

    def report(self) -> dict:
        """For summary.json and check-data: counts kept per split, dropped per reason (with one example each)."""
        return {
            "dataset_format": self.fmt,
            "folder": str(self.root),
            "labels": list(self.labels),
            "kept": {split: len(rows) for split, rows in self.splits.items()},
            "dropped": dict(sorted(self.dropped.items())),
            "dropped_examples": dict(sorted(self.examples.items())),
            "non_utf8_bytes": self.non_utf8_bytes,
            "replaced_bytes": self.replaced_bytes,
        }

    def report_lines(self) -> list[str]:
        kept = ", ".join(f"{len(rows)} {split}" for split, rows in self.splits.items())
        lines = [f"--dataset-format {self.fmt} {self.root}: kept {kept}"]
        lines += [
            f"--dataset-format {self.fmt}: dropped {n} ({reason}), e.g. {self.examples[reason]}"
            for reason, n in sorted(self.dropped.items())
        ]
        if self.non_utf8_bytes or self.replaced_bytes:
            lines.append(
                f"--dataset-format {self.fmt}: {self.non_utf8_bytes} byte(s) were not UTF-8 and were read "
                f"as Windows-1252; {self.replaced_bytes} undecodable byte(s) became U+FFFD"
            )
        return lines

    def to_dataset(self, split: str):
        """The canonical `datasets.Dataset` of a split: text, text_pair (Twitter), image (a path) and label as a
        ClassLabel whose names are self.labels, so `features['label'].names` is id2label."""
        import datasets

        rows = self.splits[split]
        columns = {
            "text": [r.text for r in rows],
            "image": [r.image for r in rows],
            "label": [self.labels.index(r.label) for r in rows],
        }
        features = {
            "text": datasets.Value("string"),
            "image": datasets.Value("string"),
            "label": datasets.ClassLabel(names=list(self.labels)),
        }
        if any(r.text_pair is not None for r in rows):
            columns["text_pair"] = [r.text_pair for r in rows]
            features["text_pair"] = datasets.Value("string")
        return datasets.Dataset.from_dict(columns, features=datasets.Features(features))


def decode_leniently(raw: bytes) -> tuple[str, int, int]:
    """(text, bytes read as Windows-1252, bytes replaced by U+FFFD). Valid UTF-8 stays as it is, so a mostly
    UTF-8 file with one stray Latin-1 byte keeps its emoji; a UTF-8 byte-order mark is dropped."""
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    parts, non_utf8, replaced, pos = [], 0, 0, 0
    while True:
        try:
            parts.append(raw[pos:].decode("utf-8"))
            return "".join(parts), non_utf8, replaced
        except UnicodeDecodeError as e:
            parts.append(raw[pos : pos + e.start].decode("utf-8"))
            for byte in raw[pos + e.start : pos + e.end]:
                try:
                    parts.append(bytes([byte]).decode("cp1252"))
                    non_utf8 += 1
                except UnicodeDecodeError:  # 0x81, 0x8d, 0x8f, 0x90, 0x9d: undefined in Windows-1252
                    parts.append("\ufffd")
                    replaced += 1
            pos += e.end


def file_lines(text: str):
    """(1-based line number, line) split at newlines only: str.splitlines would also split at the U+2028, U+0085
    and other separators a tweet may hold, making two bad rows of one good one and shifting every line number."""
    for lineno, line in enumerate(text.split("\n"), start=1):
        yield lineno, line.rstrip("\r")


def read_layout(fmt: str, data_dir) -> Layout:
    """Every split of the layout, or a ConfigError naming --dataset-format and the file or folder missing."""
    if fmt not in FORMATS:
        raise ConfigError(f"{where('dataset_format')}: '{fmt}' is not one of {', '.join(FORMATS)}")
    reader = read_mvsa if fmt.startswith("mvsa") else read_twitter
    return reader(fmt, Path(data_dir))


def layout_files(fmt: str, data_dir) -> dict:
    """split -> the file a layout reads for it, found but not read (MVSA: only its first post's line, for the
    number of annotators): what start-up checks, cheaply."""
    root = Path(data_dir)
    if not root.is_dir():
        raise ConfigError(f"--dataset-format {fmt}: {where('data_dir')} folder not found: {root}")
    if fmt.startswith("mvsa"):
        label_file = _mvsa_folder(fmt, root) / MVSA_LABEL_FILE
        with open(label_file, "rb") as f:  # the first post's width: the other MVSA is named before any launch
            for lineno, raw in enumerate(f, start=1):
                fields = decode_leniently(raw)[0].strip().split("\t")
                if fields[0] and (lineno > 1 or fields[0].upper() != "ID"):
                    _check_annotators(fmt, f"{label_file}:{lineno}", fields)
                    break
        return {"train": label_file}
    tsv_dir, _ = _twitter_folders(fmt, root)
    return {split: tsv_dir / name for split, name in TWITTER_SPLITS.items() if (tsv_dir / name).is_file()}


# ---- MVSA


def _mvsa_folder(fmt: str, root: Path) -> Path:
    """root, once its label file and posts' folder are there."""
    if not (root / MVSA_LABEL_FILE).is_file():
        raise ConfigError(
            f"--dataset-format {fmt}: {MVSA_LABEL_FILE} not found in {root} (--data-dir is the "
            f"folder the dataset unpacked to, e.g. {'MVSA_Single' if fmt == 'mvsa-single' else 'MVSA'}/)"
        )
    if not (root / "data").is_dir():
        raise ConfigError(f"--dataset-format {fmt}: the posts' folder data/ not found in {root}")
    return root


def _check_annotators(fmt: str, at: str, fields: list[str]) -> None:
    """The first post decides: a whole file of the other MVSA is a wrong flag, not a thousand bad lines."""
    annotators, pairs = MVSA_ANNOTATORS[fmt], len([f for f in fields[1:] if f.strip()])
    if pairs != annotators:
        other = "mvsa-multiple" if annotators == 1 else "mvsa-single"
        raise ConfigError(
            f"--dataset-format {fmt}: {at} has {pairs} text,image label pair(s), "
            f"{fmt} has {annotators} (is this {other}?)"
        )


def _majority(labels: list[str]) -> Optional[str]:
    """The label at least two of three annotators gave; None when all three differ (the tie rule)."""
    label, n = Counter(labels).most_common(1)[0]
    return label if n * 2 > len(labels) else None


def _agree(text_label: str, image_label: str) -> Optional[str]:
    """MVSA's usual rule: equal labels, or one neutral and the other's label; None for positive vs negative."""
    if text_label == image_label or image_label == "neutral":
        return text_label
    if text_label == "neutral":
        return image_label
    return None


def read_mvsa(fmt: str, data_dir: Path) -> Layout:
    root = _mvsa_folder(fmt, data_dir)
    label_file = root / MVSA_LABEL_FILE
    layout = Layout(fmt, root, files={"train": label_file})
    annotators = MVSA_ANNOTATORS[fmt]
    rows, checked_width = [], False
    for lineno, line in file_lines(layout.read_text(label_file)):
        fields = [f.strip() for f in line.split("\t")]
        if not line.strip() or (lineno == 1 and fields[0].upper() == "ID"):
            continue
        at = f"{label_file}:{lineno}"
        pairs = [f.lower().split(",") for f in fields[1:] if f]
        if not checked_width:
            _check_annotators(fmt, at, fields)
            checked_width = True
        if (
            not fields[0].isdigit()
            or len(pairs) != annotators
            or any(len(p) != 2 or p[0] not in LABELS or p[1] not in LABELS for p in pairs)
        ):
            layout.drop(
                "malformed_line",
                f"{at}: expected ID then {annotators} text,image pair(s) of {'/'.join(LABELS)}, got {line.strip()!r}",
            )
            continue
        post = fields[0]
        text_label, image_label = (_majority([p[i] for p in pairs]) for i in (0, 1))
        if text_label is None or image_label is None:
            layout.drop(
                "no_majority",
                f"{at}: post {post}: the three annotators' "
                f"{'text' if text_label is None else 'image'} labels all differ",
            )
            continue
        label = _agree(text_label, image_label)
        if label is None:
            layout.drop("labels_disagree", f"{at}: post {post}: text {text_label}, image {image_label}")
            continue
        text_path, image_path = root / "data" / f"{post}.txt", root / "data" / f"{post}.jpg"
        missing = [p.name for p in (text_path, image_path) if not p.is_file()]
        if missing:
            reason = "missing_image" if missing == [image_path.name] else "missing_text"
            layout.drop(reason, f"{at}: post {post}: data/{' and data/'.join(missing)} not found")
            continue
        text = layout.read_text(text_path).strip()
        if not text:
            layout.drop("empty_text", f"{at}: post {post}: data/{text_path.name} is empty")
            continue
        rows.append(Row(lineno, text, str(image_path.resolve()), label))
    layout.splits["train"] = rows
    return layout


# ---- Twitter-2015/2017


def _twitter_folders(fmt: str, root: Path) -> tuple[Path, Path]:
    """(the TSVs' folder, the images' folder): FOLDER is the unpacked top folder or the TSVs' own folder."""
    images = f"{fmt}_images"
    candidates = ((root / fmt, root / images), (root, root.parent / images), (root, root / images))
    for tsv_dir, image_dir in candidates:  # noqa: B007 (the pair the loop stops at is the answer)
        if (tsv_dir / TWITTER_SPLITS["train"]).is_file():
            break
    else:
        raise ConfigError(
            f"--dataset-format {fmt}: train.tsv not found in {root} or {root / fmt} (--data-dir is "
            f"the unpacked top folder holding {fmt}/ and {images}/, or {fmt}/ itself)"
        )
    if not (tsv_dir / TWITTER_SPLITS["validation"]).is_file():
        raise ConfigError(f"--dataset-format {fmt}: dev.tsv not found in {tsv_dir}")
    if not image_dir.is_dir():
        raise ConfigError(
            f"--dataset-format {fmt}: the images' folder {images}/ not found beside {tsv_dir} (looked for {image_dir})"
        )
    return tsv_dir, image_dir


def read_twitter(fmt: str, data_dir: Path) -> Layout:
    tsv_dir, image_dir = _twitter_folders(fmt, data_dir)
    layout = Layout(fmt, tsv_dir)
    for split, name in TWITTER_SPLITS.items():
        path = tsv_dir / name
        if not path.is_file():  # test.tsv: not needed to train
            continue
        layout.files[split] = path
        layout.splits[split] = _twitter_rows(layout, path, image_dir)
    return layout


def _twitter_rows(layout: Layout, path: Path, image_dir: Path) -> list[Row]:
    rows = []
    for lineno, line in file_lines(layout.read_text(path)):
        if not line.strip() or (lineno == 1 and line.lower().startswith("index\t")):
            continue
        at = f"{path}:{lineno}"
        fields = line.split("\t")
        if len(fields) != 5 or fields[1].strip() not in ("0", "1", "2") or not fields[4].strip():
            layout.drop(
                "malformed_line",
                f"{at}: expected index, label 0/1/2, image id, tweet, target "
                f"(5 tab-separated fields), got {len(fields)} field(s)",
            )
            continue
        _, label, image_id, tweet, target = (f.strip() for f in fields)
        if TARGET not in tweet:
            layout.drop("no_target_marker", f"{at}: the tweet has no {TARGET} for the target {target!r}")
            continue
        image = image_dir / image_id
        if not image.is_file():
            layout.drop("missing_image", f"{at}: image {image_id} not found in {image_dir}")
            continue
        rows.append(Row(lineno, tweet.replace(TARGET, target), str(image.resolve()), LABELS[int(label)], target))
    return rows


def check_num_labels(fmt: str, num_labels: int) -> None:
    """The layouts' labels are the data's, so a different model.num_labels is a mistake, not a choice."""
    if num_labels != len(LABELS):
        raise ConfigError(
            f"--dataset-format {fmt} has {len(LABELS)} labels ({', '.join(LABELS)}), but "
            f"{where('num_labels')} is {num_labels}: set it to {len(LABELS)}"
        )
