"""`python -m shardtrain <command>` and the `shardtrain` console script.

Commands are looked up lazily so that `shardtrain doctor` never pays for importing DeepSpeed.
Every command turns a ConfigError into one line on stderr and exit code 2 (a traceback with --debug).
"""
from __future__ import annotations

import importlib
import os
import sys

from shardtrain.config import ConfigError

COMMANDS = {
    "train": ("shardtrain.cli", "train_main", "train a model (the same entry torchrun/deepspeed run)"),
    "make-data": ("shardtrain.cli", "make_data_main", "write a small synthetic dataset"),
    "check-data": ("shardtrain.cli", "check_data_main", "scan a dataset folder and list every problem"),
    "cache-images": ("shardtrain.cli", "cache_images_main", "decode a dataset's images once, for --image-cache"),
    "plan": ("shardtrain.planner", "main", "predict per-GPU memory for every strategy"),
    "doctor": ("shardtrain.doctor", "main", "check GPUs, libraries and the launcher environment"),
    "export": ("shardtrain.export", "main", "write a consolidated safetensors model from a checkpoint"),
    "report": ("shardtrain.report", "main", "write OUT/report.html with plots"),
    "compare": ("shardtrain.report", "compare_main", "compare several runs in one table and plot"),
    "parity": ("shardtrain.parity", "main", "run the same steps under several strategies and compare"),
    "predict": ("shardtrain.commands.predict", "main", "predict with a checkpoint or export; write preds.jsonl"),
}


def main(argv: list[str] | None = None) -> int:
    from shardtrain.closed_output import survive_closed_output

    survive_closed_output()  # `shardtrain plan | head` ends quietly; training goes on (see closed_output.py)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: shardtrain <command> [options]\n\ncommands:")
        for name, (module, _, help_text) in COMMANDS.items():
            if _available(module):
                print(f"  {name:<11} {help_text}")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS or not _available(COMMANDS[name][0]):
        print(f"shardtrain: unknown command '{name}' (see shardtrain --help)", file=sys.stderr)
        return 2
    module, func, _ = COMMANDS[name]
    fn = getattr(importlib.import_module(module), func)
    # shardtrain/commands/ modules raise ConfigError and leave the one error guard to us.
    return run_guarded(fn, rest) if module.startswith("shardtrain.commands.") else fn(rest)


def _available(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def run_guarded(fn, argv: list[str]) -> int:
    """One line for every failure: exit 2 for problems a user can fix (ConfigError), 1 for the rest
    (e.g. the FloatingPointError of --nan-policy abort); the traceback only with --debug."""
    debug = "--debug" in argv or os.environ.get("SHARDTRAIN_DEBUG") == "1"
    try:
        return fn(argv) or 0
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - the user gets one line; --debug shows the rest
        if debug:
            raise
        if isinstance(e, ConfigError):
            report_once(str(e), secondary=False)
            return 2
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        report_once(f"{type(e).__name__}: {first} (--debug shows the traceback)", secondary=_lost_peer(e))
        return 1


# How long a rank that is not the one to speak waits before it speaks anyway. torchrun (and the deepspeed
# launcher) stop every worker within ~0.1 s of the first failed one, so within this delay a rank is only
# still alive if it alone hit the error.
QUIET_SECONDS = 3.0


def report_once(msg: str, secondary: bool) -> None:
    """One line per failed job, not one per rank.

    Config and data errors, and the agreed --nan-policy abort, hit every rank at once: rank 0 says it and
    the launcher stops the others while they wait. An error that only one rank hit (a corrupt image in its
    shard) is still said, by that rank, after the wait. `secondary` errors (a collective failing because
    another rank died) are only ever consequences, so rank 0 waits before saying those too.
    """
    rank = int(os.environ.get("RANK", "0"))
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and (rank != 0 or secondary):
        import signal
        import time

        # The loop's preemption handler only sets a flag; the launcher's SIGTERM must end us here.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        time.sleep(QUIET_SECONDS)
    where_from = "" if rank == 0 else f" (rank {rank})"
    print(f"shardtrain: error{where_from}: {msg}", file=sys.stderr, flush=True)


def _lost_peer(e: BaseException) -> bool:
    names = {c.__name__ for c in type(e).__mro__}
    text = str(e).lower()
    return bool(names & {"DistError", "DistBackendError", "DistNetworkError"}) or any(
        s in text for s in ("closed by peer", "connection reset", "broken pipe", "connection refused"))


def train_main(argv: list[str]) -> int:
    from shardtrain.closed_output import survive_closed_output
    from shardtrain.config import parse_cli

    survive_closed_output()
    argv = [a for a in argv if not a.startswith(("--local_rank", "--local-rank"))]  # the deepspeed launcher adds it

    def run(args):
        cfg = parse_cli(args)
        # The files the strategy reads (DeepSpeed JSON, FSDP policy) are checked before any process starts.
        from shardtrain.strategies import check_strategy_config
        check_strategy_config(cfg)
        from shardtrain.config import is_builtin_workload
        builtin = is_builtin_workload(cfg)
        if builtin:
            # So are the data records: a typo on line 7 should not wait for N processes and a model.
            from shardtrain.data.precheck import check_splits
            check_splits(cfg)
        else:
            from shardtrain.workload import workload_class
            workload_class(cfg)  # --workload imports, and names a Workload, before any process starts
        from shardtrain.checkpoint import refuse_to_overwrite
        refuse_to_overwrite(cfg)
        if builtin:
            # Hub names last (the probe may wait seconds): reachable, cached (offline by itself), or one line now.
            from shardtrain.hub import check_hub_names
            note = check_hub_names(cfg)
            if note and os.environ.get("RANK", "0") == "0":
                print(f"shardtrain: {note}", flush=True)
        from shardtrain.launch import maybe_relaunch
        code = maybe_relaunch(cfg, args)
        if code is not None:
            return code
        from shardtrain.train import train
        summary = train(cfg)
        return 130 if summary.get("stopped_by") == "Ctrl-C" else 0  # a shell's code for a job ended by Ctrl-C

    code = run_guarded(run, argv)
    # Inside a process group: leave through the abort-free path (see distributed.teardown_and_exit).
    # Looked up, not imported: a config error must not pay seconds for importing torch just to exit.
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        from shardtrain.distributed import teardown_and_exit
        teardown_and_exit(code)
    return code


def make_data_main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="shardtrain make-data")
    parser.add_argument("kind", choices=["multimodal", "longdoc"])
    parser.add_argument("dir")
    parser.add_argument("--n-train", type=int, default=512)
    parser.add_argument("--n-val", type=int, default=128)
    parser.add_argument("--num-labels", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--debug", action="store_true")
    args = parser.parse_args(argv)

    def run(_):
        from shardtrain.data import make_data
        import json

        path = make_data(args.kind, args.dir, n_train=args.n_train, n_val=args.n_val, seed=args.seed,
                         num_labels=args.num_labels, overwrite=args.overwrite)
        (path / DATASET_INFO).write_text(json.dumps({"kind": args.kind, "num_labels": args.num_labels}) + "\n")
        print(f"wrote {args.n_train} train / {args.n_val} validation {args.kind} examples to {path}")
        return 0

    return run_guarded(run, argv)


def check_data_main(argv: list[str]) -> int:
    import argparse

    from shardtrain.config import add_workload_flags

    parser = argparse.ArgumentParser(
        prog="shardtrain check-data", description="List every problem of a jsonl data folder (DIR), of the "
        "source that training flags name (--config, --dataset-name, --train-file, --train-dir, --dataset-format, "
        "column flags), or of a user's --workload (its datasets() and collate on a few samples).")
    parser.add_argument("dir", nargs="?", default=None, help="a built-in dataset folder (not with a user's --workload)")
    parser.add_argument("--kind", choices=["multimodal", "longdoc"], default=None,
                        help="default: multimodal if records name images")
    parser.add_argument("--num-labels", type=int, default=None,
                        help="labels must be in 0..N-1 (default: what make-data recorded, else 3)")
    parser.add_argument("--dataset-format", default=None,
                        help="a published layout (mvsa-single, mvsa-multiple, twitter2015, twitter2017): what its "
                             "reader keeps and drops, and every image decoded")
    parser.add_argument("--config", default=None, help="a training config whose workload (and its args) to check")
    add_workload_flags(parser)
    parser.add_argument("--samples", type=int, default=4, help="with a user's workload: samples read per split")
    parser.add_argument("--debug", action="store_true")
    own = ("--kind", "--num-labels", "--dataset-format", "--workload", "--workload-args", "--samples", "--debug",
           "-h", "--help")
    if not argv or any(a.startswith("--") and a.split("=")[0] not in own for a in argv):
        # Training flags: a positional DIR may only come first (argparse would take a flag's value for it).
        folder = argv[0] if argv and not argv[0].startswith("-") else None
        return run_guarded(lambda _: _check_source_main(folder, [a for a in argv[1 if folder else 0:]
                                                                 if a != "--debug"]), argv)
    args = parser.parse_args(argv)

    def run(_):
        from pathlib import Path

        from shardtrain.data import check_data
        if args.config or args.workload:
            from shardtrain.config import command_config, is_builtin_workload
            cfg = command_config(args.config, args.workload, args.workload_args)
            if not is_builtin_workload(cfg):
                return _check_workload(cfg, args)
            args.kind = args.kind or {"longformer": "longdoc"}.get(cfg.model.name, "multimodal")
            args.dir = args.dir or cfg.data.data_dir
        if args.dir is None:
            raise ConfigError("check-data: give a dataset folder, or --workload my_pkg.tasks:MyTask for a user's data")
        if not Path(args.dir).is_dir():
            raise ConfigError(f"check-data: folder not found: {args.dir}")
        if args.dataset_format:
            return _check_layout(args.dir, args.dataset_format)
        recorded = _dataset_info(args.dir)
        kind = args.kind or recorded.get("kind") or _guess_kind(args.dir)
        num_labels = args.num_labels or recorded.get("num_labels") or 3
        problems = check_data(args.dir, kind, num_labels)
        for line in problems:
            print(line)
        if problems and args.num_labels is None and any("is outside 0.." in p for p in problems):
            print(f"(labels were checked against {num_labels} classes: pass --num-labels with the model's num_labels)")
        print(f"{len(problems)} problem(s) in {args.dir}" if problems else f"{args.dir}: no problems found")
        return 1 if problems else 0

    return run_guarded(run, argv)


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

    from shardtrain.config import is_builtin_workload, parse_cli
    from shardtrain.data.check import check_data, check_source
    from shardtrain.data.records import data_kind
    from shardtrain.data.sources import source_of

    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--samples", type=int, default=4)
    args, rest = own.parse_known_args(rest)
    cfg = parse_cli(rest + (["--data-dir", folder] if folder else []))
    if not is_builtin_workload(cfg):
        args.dir, args.kind = folder, None
        return _check_workload(cfg, args)
    if cfg.data.dataset_format:
        return _check_layout(cfg.data.data_dir, cfg.data.dataset_format)
    if source_of(cfg) == "data_dir":
        what = cfg.data.data_dir
        problems = check_data(what, data_kind(cfg.model.name), cfg.model.num_labels)
    else:
        what = next(getattr(cfg.data, n) for n in ("dataset_name", "train_file", "train_dir") if getattr(cfg.data, n))
        problems = check_source(cfg)
    for line in problems:
        print(line)
    print(f"{len(problems)} problem(s) in {what}" if problems else f"{what}: no problems found")
    return 1 if problems else 0


def _check_workload(cfg, args) -> int:
    """check-data for a user's workload: its datasets() and collate on a few samples (workload_check.py)."""
    from shardtrain.workload import workload_class
    from shardtrain.workload_check import check_workload_data

    if args.dir is not None or args.kind is not None:
        raise ConfigError(f"check-data: {cfg.workload.workload} reads its own data in datasets(); drop "
                          f"{'the folder ' + args.dir if args.dir else '--kind'} (pass its location in --workload-args)")
    if args.samples < 1:
        raise ConfigError(f"check-data: --samples must be positive, got {args.samples}")
    name = workload_class(cfg).__name__
    problems, notes = check_workload_data(cfg, args.samples)
    for line in notes + problems:
        print(line)
    print(f"{len(problems)} problem(s) in {name}'s data" if problems
          else f"{name}: datasets() and collate give batches its model takes; no problems found")
    return 1 if problems else 0


def cache_images_main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="shardtrain cache-images", description="Decode and resize every image of the training config's "
        "train and validation splits once, into --image-cache DIR; train with the same --image-cache DIR. "
        "Every other option is a training flag (--config, --data-dir, --image-size, ...).")
    parser.add_argument("--jobs", type=int, default=0, help="decoding processes (default: all cores)")
    parser.add_argument("--rebuild", action="store_true", help="decode again even when the cache is up to date")
    args, rest = parser.parse_known_args(argv)

    def run(_):
        from pathlib import Path

        from shardtrain.config import parse_cli, where
        from shardtrain.data.image_cache import ImageCache, build_image_cache
        from shardtrain.data.records import config_split_path, data_kind

        cfg = parse_cli(rest)
        d = cfg.data
        if d.image_cache is None:
            raise ConfigError(f"cache-images: {where('image_cache')} names the folder to write the cache to")
        if args.jobs < 0:
            raise ConfigError(f"cache-images: --jobs must be >= 0, got {args.jobs}")
        from shardtrain.data.sources import source_of
        if d.dataset_format:
            _cache_layout_images(cfg, args.rebuild, args.jobs)
            print(f"train with: --image-cache {d.image_cache}")
            return 0
        if source_of(cfg) != "data_dir":
            _cache_source_images(cfg, args.rebuild, args.jobs)
            print(f"train with: --image-cache {d.image_cache}")
            return 0
        kind = data_kind(cfg.model.name)
        for split in ("train", "validation"):
            path = config_split_path(cfg, split)
            if not args.rebuild:
                try:  # the same check training makes: split file, every image's size and mtime
                    cache = ImageCache(Path(d.image_cache), path, d.image_size)
                    print(f"{path.name}: up to date ({len(cache.rows)} images at {d.image_size}px; --rebuild "
                          f"decodes again)")
                    continue
                except ConfigError:
                    pass
            summary = build_image_cache(path, kind, cfg.model.num_labels, Path(d.image_cache), d.image_size,
                                        workers=args.jobs, progress=print)
            bad = f", {summary['bad']} did not decode (--skip-bad-samples skips them)" if summary["bad"] else ""
            print(f"{summary['split']}: {summary['images']} images at {d.image_size}px -> {summary['array']} "
                  f"({summary['bytes'] / 2**20:.1f} MiB){bad}")
        print(f"train with: --image-cache {d.image_cache}")
        return 0

    return run_guarded(run, rest)


def _cache_source_images(cfg, rebuild: bool, jobs: int) -> None:
    """cache-images for --dataset-name / --train-file / --train-dir: the images of the rows training will read
    (rows with other problems are left to the run, which reports them; check-data lists them)."""
    import copy
    from pathlib import Path

    from shardtrain.data.image_cache import build_source_image_cache, open_source_image_cache
    from shardtrain.data.sources import column_values, image_key, load_splits

    d = cfg.data
    if cfg.model.name != "multimodal":
        raise ConfigError(f"cache-images: only the multimodal model reads images; model.name is {cfg.model.name}")
    splits = load_splits(copy.deepcopy(cfg), check_images=False, report=[])
    for split, table in (("train", splits.train), ("validation", splits.validation)):
        if table is None:
            continue
        images = column_values(table, "image")
        if not rebuild:
            try:
                cache = open_source_image_cache(cfg, split, [image_key(v) for v in images])
                print(f"{split} split: up to date ({len(cache.rows)} images at {d.image_size}px; --rebuild decodes again)")
                continue
            except ConfigError:
                pass
        summary = build_source_image_cache(split, images, Path(d.image_cache), d.image_size, workers=jobs,
                                           progress=print)
        bad = f", {summary['bad']} did not decode (--skip-bad-samples skips them)" if summary["bad"] else ""
        print(f"{summary['split']}: {summary['images']} images at {d.image_size}px -> {summary['array']} "
              f"({summary['bytes'] / 2**20:.1f} MiB){bad}")


def _cache_layout_images(cfg, rebuild: bool, jobs: int) -> None:
    """cache-images for --dataset-format: every image the layout's kept posts name, in one cache."""
    from pathlib import Path

    from shardtrain.data.image_cache import build_source_image_cache
    from shardtrain.data.layouts import read_layout
    from shardtrain.data.splits import layout_images, open_layout_image_cache

    d = cfg.data
    layout = read_layout(d.dataset_format, d.data_dir)
    if not rebuild:
        try:
            cache = open_layout_image_cache(cfg, layout)
            print(f"{d.dataset_format}: up to date ({len(cache.rows)} images at {d.image_size}px; --rebuild "
                  f"decodes again)")
            return
        except ConfigError:
            pass
    summary = build_source_image_cache(d.dataset_format, layout_images(layout), Path(d.image_cache), d.image_size,
                                       workers=jobs, progress=print)
    bad = f", {summary['bad']} did not decode (--skip-bad-samples skips them)" if summary["bad"] else ""
    print(f"{summary['split']}: {summary['images']} images at {d.image_size}px -> {summary['array']} "
          f"({summary['bytes'] / 2**20:.1f} MiB){bad}")


DATASET_INFO = "shardtrain_dataset.json"  # written by make-data: its kind and number of labels


def _dataset_info(data_dir: str) -> dict:
    import json
    from pathlib import Path

    try:
        return json.loads((Path(data_dir) / DATASET_INFO).read_text())
    except (OSError, ValueError):
        return {}


def _guess_kind(data_dir: str) -> str:
    import json
    from pathlib import Path

    first = Path(data_dir) / "train.jsonl"
    try:
        with open(first) as f:
            return "multimodal" if "image" in json.loads(f.readline() or "{}") else "longdoc"
    except (OSError, ValueError):
        return "multimodal"


if __name__ == "__main__":
    sys.exit(main())
