"""`shardtrain check-data`: every problem of a dataset at once (file:line or row), before a run finds the first.

A jsonl folder, the source that training flags name, a published layout, or a user's workload (its datasets()
and collate on a few samples).
"""

from __future__ import annotations

from shardtrain.config.errors import ConfigError


def main(argv: list[str]) -> int:
    import argparse

    from shardtrain.config.settings import add_workload_flags, record_kind_aliases, record_kinds
    from shardtrain.data.records import data_kind, guess_kind

    parser = argparse.ArgumentParser(
        prog="shardtrain check-data",
        # argparse's own usage lists only the flags below; the training flags a source is named by go through
        # train's parser (_check_source_main), so the usage names the four ways in.
        usage="shardtrain check-data DIR [--kind {}] [--num-labels N]\n"
        "       shardtrain check-data DIR --dataset-format FORMAT\n"
        "       shardtrain check-data [DIR] --config FILE | --dataset-name NAME | --train-file FILE | --train-dir DIR\n"
        "                             [train's data flags: --validation-file, --text-column-names, ...]\n"
        "       shardtrain check-data --workload MODULE:CLASS [--workload-args JSON] [--samples N|all]".format(
            "|".join(record_kinds())
        ),
        description="List every problem of a jsonl data folder (DIR), of the "
        "source that training flags name (--config, --dataset-name, --train-file, --train-dir, --dataset-format, "
        "column flags), or of a user's --workload (its datasets() and collate on a few samples).",
    )
    parser.add_argument("dir", nargs="?", default=None, help="a built-in dataset folder (not with a user's --workload)")
    parser.add_argument(
        "--kind",
        choices=[*record_kinds(), *record_kind_aliases()],  # `--kind longformer` is the longdoc records
        default=None,
        help="default: {} if records name images, else {}".format(*record_kinds()),
    )
    parser.add_argument(
        "--num-labels",
        type=int,
        default=None,
        help="labels must be in 0..N-1 (default: what make-data recorded, else 3)",
    )
    parser.add_argument(
        "--dataset-format",
        default=None,
        help="a published layout (mvsa-single, mvsa-multiple, twitter2015, twitter2017): what its "
        "reader keeps and drops, and every image decoded",
    )
    parser.add_argument("--config", default=None, help="a training config whose workload (and its args) to check")
    add_workload_flags(parser)
    parser.add_argument(
        "--samples",
        default="4",
        help="with a user's workload: samples read per split, or all (every one read; a few batched)",
    )
    parser.add_argument("--debug", action="store_true")
    own = (
        "--kind",
        "--num-labels",
        "--dataset-format",
        "--workload",
        "--workload-args",
        "--samples",
        "--debug",
        "-h",
        "--help",
    )
    # No argument at all is not "the default data_dir": a user who typed nothing is asked what to check.
    if argv and any(a.startswith("--") and a.split("=")[0] not in own for a in argv):
        # Training flags: a positional DIR may only come first (argparse would take a flag's value for it).
        folder = argv[0] if argv and not argv[0].startswith("-") else None
        return _check_source_main(folder, [a for a in argv[1 if folder else 0 :] if a != "--debug"])
    args = parser.parse_args(argv)

    from pathlib import Path

    from shardtrain.data import check_data
    from shardtrain.data.synthetic import DATASET_INFO, dataset_info

    chosen_by = "--kind"
    if args.config or args.workload:
        from shardtrain.config.settings import command_config, is_builtin_workload

        cfg = command_config(args.config, args.workload, args.workload_args)
        if not is_builtin_workload(cfg):
            return _check_workload(cfg, args)
        if args.kind is None:
            chosen_by = "--config" if args.config else "--workload"
        args.kind = args.kind or data_kind(cfg)
        args.dir = args.dir or cfg.data.data_dir
    if args.dir is None:
        raise ConfigError(
            "check-data: give a dataset folder (check-data DIR), a training config's data (--config FILE and its "
            "data flags), or a user's --workload my_pkg.tasks:MyTask"
        )
    if not Path(args.dir).is_dir():
        from shardtrain.data.records import relative_to_cwd

        raise ConfigError(f"check-data: folder not found: {args.dir}{relative_to_cwd(Path(args.dir))}")
    if args.dataset_format:
        return _check_layout(args.dir, args.dataset_format)
    recorded = dataset_info(args.dir)
    kind = args.kind or recorded.get("kind") or guess_kind(args.dir)
    num_labels = args.num_labels or recorded.get("num_labels") or 3
    counts: dict = {}
    problems = check_data(args.dir, kind, num_labels, chosen_by=chosen_by, counts=counts)
    for line in problems:
        print(line)
    if problems and args.num_labels is None and any("is outside 0.." in p for p in problems):
        source = f"as {DATASET_INFO} records" if recorded.get("num_labels") else "the default"
        print(f"(labels checked against {num_labels} classes, {source}; a model with more: check-data --num-labels N)")
    _print_counts(counts, "record")
    print(f"{len(problems)} problem(s) in {args.dir}" if problems else f"{args.dir}: no problems found")
    return 1 if problems else 0


def _print_counts(counts: dict, row: str) -> None:
    from shardtrain.data.check import count_lines

    for line in count_lines(counts, row):
        print(line)


def _kind_chosen_by(argv: list[str]) -> str:
    """A config file chose the workload unless --workload did (and no file contradicts it)."""
    flags = {a.split("=")[0] for a in argv}
    return "--workload" if "--workload" in flags and "--config" not in flags else "--config"


def _check_layout(data_dir: str, fmt: str) -> int:
    from shardtrain.data.check import check_layout

    report, problems = check_layout(data_dir, fmt)
    for line in report + problems:
        print(line)
    print(f"{len(problems)} problem(s) in {data_dir}" if problems else f"{data_dir}: no problems found")
    return 1 if problems else 0


def _check_source_main(folder: str | None, rest: list[str]) -> int:
    """check-data with training flags: the run's own source, read as the run reads it, or a user's workload."""
    import argparse
    from pathlib import Path

    from shardtrain.config.settings import is_builtin_workload, parse_cli
    from shardtrain.data.check import check_data, check_source
    from shardtrain.data.records import data_kind
    from shardtrain.data.sources import source_of

    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--samples", default="4")
    args, rest = own.parse_known_args(rest)
    if any(a.split("=")[0] == "--kind" for a in rest):
        raise ConfigError(
            "check-data --kind is for a folder on its own (check-data DIR --kind KIND); with training flags the "
            "config's workload decides which records it reads"
        )
    try:
        cfg = parse_cli(rest + (["--data-dir", folder] if folder else []))
    except ConfigError as e:
        stray = next((a for a in rest if not a.startswith("-") and f"unknown argument '{a}'" in str(e)), None)
        if stray is not None and Path(stray).is_dir():
            raise ConfigError(
                f"check-data: a folder goes first (check-data {stray} --config ...) or as --data-dir {stray}"
            ) from None
        raise
    if not is_builtin_workload(cfg):
        args.dir, args.kind = folder, None
        return _check_workload(cfg, args)
    if cfg.data.dataset_format:
        return _check_layout(cfg.data.data_dir, cfg.data.dataset_format)
    counts: dict = {}
    if source_of(cfg) == "data_dir":
        what = cfg.data.data_dir
        problems = check_data(
            what, data_kind(cfg), cfg.model.num_labels, chosen_by=_kind_chosen_by(rest), counts=counts
        )
    else:
        problems = check_source(cfg, counts=counts)
        what = ", ".join(_source_names(cfg))
        for line in problems:
            print(line)
        _print_counts(counts, "row")
        print(
            f"{len(problems)} problem(s): {_where_problems_are(problems, _source_names(cfg))}"
            if problems
            else f"{what}: no problems found"
        )
        return 1 if problems else 0
    for line in problems:
        print(line)
    _print_counts(counts, "record")
    print(f"{len(problems)} problem(s) in {what}" if problems else f"{what}: no problems found")
    return 1 if problems else 0


def _source_names(cfg) -> list[str]:
    """What a source's messages name its rows by: each file, folder or dataset the flags name."""
    names = ("dataset_name", "train_file", "validation_file", "train_dir", "validation_dir")
    return [str(getattr(cfg.data, n)) for n in names if getattr(cfg.data, n)]


def _where_problems_are(problems: list[str], names: list[str]) -> str:
    """`2 in data/validation.csv`: counted by the file each message names, not the training file's name for all
    (a source's messages start with the file, folder or dataset the row is in)."""
    counts: dict[str, int] = {}
    for line in problems:
        # The longest name that starts the line: `a.csv` must not take the lines of `a.csv.bak`.
        name = max((n for n in names if line.startswith(n)), key=len, default=None) or max(
            (n for n in names if n in line), key=len, default=None
        )  # `no usable rows in FILE`
        counts[name or "the data as a whole"] = counts.get(name or "the data as a whole", 0) + 1
    return ", ".join(f"{n} in {name}" for name, n in counts.items())


def _check_workload(cfg, args) -> int:
    """check-data for a user's workload: its datasets() and collate on a few samples (workloads/check.py)."""
    from shardtrain.config.settings import BUILTIN_WORKLOADS, record_kinds, where
    from shardtrain.workloads.base import workload_class
    from shardtrain.workloads.check import check_workload_data

    # The records' kinds and the workloads differ by one name.
    if cfg.workload.workload in set(record_kinds()) - set(BUILTIN_WORKLOADS):
        raise ConfigError(
            f"{where('workload')}: {cfg.workload.workload} is a kind of records, not a workload: check-data DIR "
            f"--kind {cfg.workload.workload} (the built-in workloads: {', '.join(BUILTIN_WORKLOADS)})"
        )
    cls = workload_class(cfg)  # a name that is no workload (a typo) is said as such before the folder is
    if args.dir is not None or args.kind is not None:
        raise ConfigError(
            f"check-data: {cfg.workload.workload} reads its own data in datasets(); drop "
            f"{'the folder ' + args.dir if args.dir else '--kind'} (pass its location in --workload-args)"
        )
    samples = None if args.samples == "all" else int(args.samples) if args.samples.isdigit() else 0
    if samples is not None and samples < 1:
        raise ConfigError(f"check-data: --samples must be a positive number or all, got {args.samples}")
    name = cls.__name__
    problems, notes, read = check_workload_data(cfg, samples)
    for line in notes + problems:
        print(line)
    if problems:
        print(f"{len(problems)} problem(s) in {name}'s data")
        return 1
    if any(got < n for got, n in read.values()):  # a clean few is not a clean split: say how few
        counts = [f"{got} of {n} {split}" for split, (got, n) in read.items()]
        counts[0] = counts[0].replace(" train", " train samples", 1)
        print(f"read {' and '.join(counts)}: --samples all reads every one")
    print(f"{name}: datasets() and collate give batches its model takes; no problems found")
    return 0
