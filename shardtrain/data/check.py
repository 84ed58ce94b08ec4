"""`check-data`: every problem in a data folder or source, not just the first, so one pass fixes them all."""

from __future__ import annotations

from pathlib import Path

from shardtrain.config.settings import ConfigError, reads_images, record_kinds
from shardtrain.data.images import image_problem
from shardtrain.data.layouts import read_layout
from shardtrain.data.records import (
    all_lack_images,
    all_name_their_labels,
    has_images,
    iter_split,
    named_labels_hint,
    normalize_kind,
    split_path,
    workload_reading,
)


def check_data(
    data_dir, kind: str, num_labels: int = 3, chosen_by: str = "--kind", counts: dict | None = None
) -> list[str]:
    """Scan both splits: each record, and each image fully decoded. Returns `file:line: message` strings.
    `chosen_by`: the flag that chose the kind. Records of the other kind are pointed to what reads them in its
    terms: `--kind`, `--workload`, or (for a config, whose model.name another --workload would contradict) the
    workload alone. `counts`: receives each split file's usable records by label ({path: {label: n}}, in label
    order)."""
    from collections import Counter

    kind = normalize_kind(kind)
    problems = []
    for split in ("train", "validation"):
        try:
            path = split_path(data_dir, split)
        except ConfigError as e:
            if str(e) not in problems:  # a missing folder is one problem, not one per split
                problems.append(str(e))
            continue
        found, labels = [], Counter()
        for rec, problem in iter_split(path, kind, num_labels):
            if rec is not None and has_images(kind):
                err = image_problem(path.parent / rec.image)
                if err:
                    problem = f"{path}:{rec.line}: cannot decode image {rec.image}: {err}"
            if problem:
                found.append(problem)
            else:
                labels[rec.label] += 1
        if counts is not None:
            counts[str(path)] = dict(sorted(labels.items()))
        if not labels and all_lack_images(found):
            # Text records checked as image records: one line, not one per record.
            text_only = record_kinds()[1]
            reader = workload_reading(text_only)
            fix = {"--kind": f" (--kind {text_only})", "--workload": f" (--workload {reader})"}.get(
                chosen_by, f", which the {reader} workload reads"
            )
            found = [f"{path}: no record names an image: these are {text_only} records{fix}"]
        elif not labels and all_name_their_labels(found):
            found = [f"{path}: no usable records: {named_labels_hint(path)}"]  # one line, not one per record
        elif not labels:
            found.append(f"{path}: no usable records")
        problems += found
    return problems


def check_layout(data_dir, fmt: str) -> tuple[list[str], list[str]]:
    """A published layout (--dataset-format): (the reader's report, problems). What the reader drops by its
    documented rules (disagreeing labels, missing halves) is reported, not a problem: training skips it too.
    Problems are what would stop a run: an image that does not decode, a split with nothing left."""
    layout = read_layout(fmt, data_dir)  # a missing file or folder: the ConfigError training would raise
    problems = []
    for split, rows in layout.splits.items():
        for row in rows:
            err = image_problem(Path(row.image))
            if err:
                problems.append(f"{layout.files[split]}:{row.line}: cannot decode image {row.image}: {err}")
        if not rows:
            problems.append(f"{layout.files[split]}: no usable posts")
    return layout.report_lines(), problems


def check_source(cfg, counts: dict | None = None) -> list[str]:
    """Every problem of the source a training config names (--dataset-name, --train-file, --train-dir): each bad
    row by file:line or row index (images fully decoded), each empty split; or the one problem that stops the
    source being read at all (a missing file or column, mixed label types, a num_labels the data contradicts).
    `counts`: receives each split's usable rows by class ({split: {name: n}}, in class-id order)."""
    from collections import Counter

    from shardtrain.data.sources import load_splits

    problems: list[str] = []
    try:
        splits = load_splits(cfg, check_images=reads_images(cfg), report=problems)
    except ConfigError as e:
        problems.append(str(e))
        return problems
    if counts is not None:
        names = dict(enumerate(splits.label_names))
        for split in ("train", "validation"):
            table = getattr(splits, split)
            if table is not None:
                ids = Counter(table["label"])
                counts[split] = {names.get(i, i): ids[i] for i in sorted(ids)}
    return problems


def count_lines(counts: dict, row: str = "row") -> list[str]:
    """One line per split: what a run would train or evaluate on, and each class's share, so that an imbalance
    (or a class missing from one split) shows before a run does."""
    lines = []
    for split, by_label in counts.items():
        total = sum(by_label.values())
        if total:
            shares = ", ".join(f"{label} {n} ({100 * n / total:.0f}%)" for label, n in by_label.items())
            lines.append(f"{split}: {total} usable {row}{'s' if total != 1 else ''}; by label: {shares}")
    return lines
