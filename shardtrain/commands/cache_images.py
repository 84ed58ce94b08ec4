"""`shardtrain cache-images`: decode and resize a run's images once, into the memory-mapped cache that
`--image-cache DIR` trains from (data/image_cache.py)."""

from __future__ import annotations

from shardtrain.config.errors import ConfigError


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="shardtrain cache-images",
        description="Decode and resize every image of the training config's "
        "train and validation splits once, into --image-cache DIR; train with the same --image-cache DIR. "
        "Every other option is a training flag (--config, --data-dir, --image-size, ...).",
    )
    parser.add_argument("--jobs", type=int, default=0, help="decoding processes (default: all cores)")
    parser.add_argument("--rebuild", action="store_true", help="decode again even when the cache is up to date")
    args, rest = parser.parse_known_args(argv)

    from pathlib import Path

    from shardtrain.config.settings import parse_cli, reads_images, where
    from shardtrain.data.image_cache import ImageCache, build_image_cache
    from shardtrain.data.records import config_split_path, data_kind

    cfg = parse_cli(rest)
    d = cfg.data
    if not reads_images(cfg):  # before asking for a folder that could not be used
        # The name the user gave (`longformer`, my_pkg.tasks:MyTask), not the module path it resolves to.
        named = cfg.workload.workload or cfg.model.name
        raise ConfigError(f"cache-images: {named} reads no images: there is nothing to cache")
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
    kind = data_kind(cfg)
    for split in ("train", "validation"):
        path = config_split_path(cfg, split)
        if not args.rebuild:
            try:  # the same check training makes: split file, every image's size and mtime
                cache = ImageCache(Path(d.image_cache), path, d.image_size)
                print(
                    f"{path.name}: up to date ({len(cache.rows)} images at {d.image_size}px; --rebuild decodes again)"
                )
                continue
            except ConfigError:
                pass
        summary = build_image_cache(
            path, kind, cfg.model.num_labels, Path(d.image_cache), d.image_size, workers=args.jobs, progress=print
        )
        bad = f", {summary['bad']} did not decode (--skip-bad-samples skips them)" if summary["bad"] else ""
        print(
            f"{summary['split']}: {summary['images']} images at {d.image_size}px -> {summary['array']} "
            f"({summary['bytes'] / 2**20:.1f} MiB){bad}"
        )
    print(f"train with: --image-cache {d.image_cache}")
    return 0


def _cache_source_images(cfg, rebuild: bool, jobs: int) -> None:
    """cache-images for --dataset-name / --train-file / --train-dir: the images of the rows training will read
    (rows with other problems are left to the run, which reports them; check-data lists them)."""
    from pathlib import Path

    from shardtrain.config.settings import reads_images
    from shardtrain.data.image_cache import build_source_image_cache, open_source_image_cache
    from shardtrain.data.sources import column_values, image_key, load_splits

    d = cfg.data
    if not reads_images(cfg):
        raise ConfigError(f"cache-images: model.name {cfg.model.name} reads no images, so there are none to cache")
    splits = load_splits(cfg, check_images=False, report=[])
    for split, table in (("train", splits.train), ("validation", splits.validation)):
        if table is None:
            continue
        images = column_values(table, "image")
        if not rebuild:
            try:
                cache = open_source_image_cache(cfg, split, [image_key(v) for v in images])
                print(
                    f"{split} split: up to date ({len(cache.rows)} images at {d.image_size}px; --rebuild decodes again)"
                )
                continue
            except ConfigError:
                pass
        summary = build_source_image_cache(
            split, images, Path(d.image_cache), d.image_size, workers=jobs, progress=print
        )
        bad = f", {summary['bad']} did not decode (--skip-bad-samples skips them)" if summary["bad"] else ""
        print(
            f"{summary['split']}: {summary['images']} images at {d.image_size}px -> {summary['array']} "
            f"({summary['bytes'] / 2**20:.1f} MiB){bad}"
        )


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
            print(
                f"{d.dataset_format}: up to date ({len(cache.rows)} images at {d.image_size}px; --rebuild "
                f"decodes again)"
            )
            return
        except ConfigError:
            pass
    summary = build_source_image_cache(
        d.dataset_format, layout_images(layout), Path(d.image_cache), d.image_size, workers=jobs, progress=print
    )
    bad = f", {summary['bad']} did not decode (--skip-bad-samples skips them)" if summary["bad"] else ""
    print(
        f"{summary['split']}: {summary['images']} images at {d.image_size}px -> {summary['array']} "
        f"({summary['bytes'] / 2**20:.1f} MiB){bad}"
    )
