"""Decode once: a split's images decoded and resized into one uint8 array that training memory-maps.

    shardtrain cache-images --config configs/multimodal_sentiment.yaml --image-cache /scratch/cache
    torchrun ... shardtrain/main.py --config configs/multimodal_sentiment.yaml --image-cache /scratch/cache

Decoding a JPEG costs milliseconds of CPU per image per epoch; a row of a memory map costs microseconds. The cache
holds exactly what `decode_image` returns, so a run trains on the same pixels with or without it.

Per split and image size, in the cache folder:
    train-224.npy    [N, 224, 224, 3] uint8 (150 KB per image; 100k images: 15 GB)
    train-224.json   the index, written last: image path -> row, the split file's sha256, and each image's
                     size and mtime, so that an edited split or image makes the cache stale, never silently wrong;
                     images that did not decode are listed with the reason (--skip-bad-samples reads it).

Other sources (shardtrain/data/sources.py: --dataset-name, --train-file, --train-dir) name their images by
absolute path, or hold them embedded (an Image feature's bytes, keyed by their sha256). Their split has no one
file to hash: the sha256 of the set of images it names stands in for it.
"""

from __future__ import annotations

import hashlib
import json
import os
from multiprocessing import get_context
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from shardtrain.config.settings import ConfigError, where
from shardtrain.data.records import iter_split

FORMAT = 1


def cache_files(cache_dir: Path, split: str, size: int) -> tuple[Path, Path]:
    stem = Path(cache_dir) / f"{split}-{size}"
    return stem.with_suffix(".npy"), stem.with_suffix(".json")


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _stamp(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns]


def _decode(job: tuple[int, "str | bytes", int]) -> tuple[int, Optional[np.ndarray], Optional[str]]:
    import io

    from shardtrain.data.images import decode_image  # torch and PIL: in the pool's workers only

    row, source, size = job  # a path, or an image's embedded bytes
    try:
        return row, decode_image(io.BytesIO(source) if isinstance(source, bytes) else Path(source), size), None
    except Exception as e:  # noqa: BLE001 - PIL raises many types; the index keeps the reason
        return row, None, f"{type(e).__name__}: {e}"


def build_image_cache(
    split_file: Path,
    kind: str,
    num_labels: int,
    cache_dir: Path,
    size: int,
    workers: int = 0,
    progress: Callable[[str], None] = lambda _: None,
) -> dict:
    """Decode every image the split's valid records name, in `workers` processes (0: all cores). Returns
    the index's summary. Records with other problems are left to the dataset, which reports them."""
    root = split_file.parent
    images: list[str] = []
    seen = set()
    for rec, _problem in iter_split(split_file, kind, num_labels):
        if rec is not None and rec.image not in seen:
            seen.add(rec.image)
            images.append(rec.image)
    if not images:
        raise ConfigError(f"{split_file}: no valid record names an image; nothing to cache (check-data says why)")
    # Stamped before decoding: an image edited while the cache is built then reads as stale, never as fresh.
    stamps = {image: _stamp(root / image) for image in images}
    jobs = [(row, str(root / image), size) for row, image in enumerate(images)]
    return _write_cache(
        images,
        jobs,
        stamps,
        file_sha256(split_file),
        split_file.stem,
        split_file.name,
        str(split_file.resolve()),
        cache_dir,
        size,
        workers,
        progress,
    )


def images_sha256(keys) -> str:
    """A source split's identity in the index: the set of images it names."""
    return hashlib.sha256("\n".join(sorted(set(keys))).encode()).hexdigest()


def build_source_image_cache(
    split: str,
    images: list,
    cache_dir: Path,
    size: int,
    workers: int = 0,
    progress: Callable[[str], None] = lambda _: None,
) -> dict:
    """The cache of a canonical split's `image` column (sources.py): absolute paths or {"bytes", "path"}."""
    from shardtrain.data.sources import image_key, image_source

    keys, jobs, stamps, seen = [], [], {}, set()
    for value in images:
        key = image_key(value)
        if key in seen:
            continue
        seen.add(key)
        source = image_source(value)
        jobs.append((len(keys), str(source) if isinstance(source, Path) else source.getvalue(), size))
        keys.append(key)
        if isinstance(source, Path):
            stamps[key] = _stamp(source)
    if not keys:
        raise ConfigError(f"{split} split: no row names an image; nothing to cache (check-data says why)")
    return _write_cache(
        keys,
        jobs,
        stamps,
        images_sha256(keys),
        split,
        f"{split} split",
        f"{split} split",
        cache_dir,
        size,
        workers,
        progress,
    )


def _write_cache(
    images: list[str],
    jobs: list,
    stamps: dict,
    split_sha: str,
    stem: str,
    label: str,
    split_file: str,
    cache_dir: Path,
    size: int,
    workers: int,
    progress: Callable[[str], None],
) -> dict:
    cache_dir.mkdir(parents=True, exist_ok=True)
    array_path, index_path = cache_files(cache_dir, stem, size)
    index_path.unlink(missing_ok=True)  # from here until the new index exists, the cache is incomplete
    tmp = array_path.with_name(array_path.stem + ".partial.npy")
    pixels = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.uint8, shape=(len(images), size, size, 3))
    bad: dict[str, str] = {}
    workers = workers or os.cpu_count() or 1
    with get_context("spawn").Pool(workers) as pool:  # spawn: no fork of a process holding torch threads
        for done, (row, array, error) in enumerate(pool.imap_unordered(_decode, jobs, chunksize=16), start=1):
            if error is None:
                pixels[row] = array
            else:
                bad[images[row]] = error
            if done % 1000 == 0 or done == len(jobs):
                progress(f"{label}: {done}/{len(jobs)} images")
    pixels.flush()
    del pixels
    os.replace(tmp, array_path)
    index = {
        "format": FORMAT,
        "image_size": size,
        "split_file": split_file,
        "split_sha256": split_sha,
        # embedded images (no file) have no size and mtime: their key is their content's sha256
        "images": {image: [row, *stamps.get(image, [None, None])] for row, image in enumerate(images)},
        "bad": bad,
    }
    tmp_index = index_path.with_name(index_path.name + ".partial")
    tmp_index.write_text(json.dumps(index))
    os.replace(tmp_index, index_path)  # the commit: only now is the cache used
    return {
        "split": label,
        "images": len(images),
        "bad": len(bad),
        "array": str(array_path),
        "bytes": array_path.stat().st_size,
    }


def open_image_cache(cfg, split_file: Path) -> Optional["ImageCache"]:
    """The split's cache (checked against the split file and its images), or None when none is configured."""
    if cfg.data.image_cache is None:
        return None
    return ImageCache(Path(cfg.data.image_cache), split_file, cfg.data.image_size)


def open_source_image_cache(cfg, split: str, keys) -> Optional["ImageCache"]:
    """A source split's cache (sources.py), checked against the images it names; None when none is configured."""
    if cfg.data.image_cache is None:
        return None
    return ImageCache(Path(cfg.data.image_cache), Path(split), cfg.data.image_size, identity=images_sha256(keys))


class UndecodableImage(ValueError):
    """An image the cache build could not decode; the message is PIL's reason, as recorded then."""


class ImageCache:
    """The cache of one split, checked against the split file and its images when opened. Pickles small
    (DataLoader workers): the memory map opens lazily in whichever process reads first."""

    def __init__(self, cache_dir: Path, split_file: Path, size: int, identity: Optional[str] = None):
        """`identity`: a source split's images_sha256; its `split_file` is then just the split's name."""
        self.array_path, index_path = cache_files(cache_dir, split_file.stem, size)
        rebuild = (
            f"build it with: shardtrain cache-images <this run's --config and --data-dir flags> "
            f"--image-size {size} --image-cache {cache_dir}"
        )
        if not index_path.is_file() or not self.array_path.is_file():
            other = sorted(p.stem.rsplit("-", 1)[-1] + "px" for p in Path(cache_dir).glob(f"{split_file.stem}-*.json"))
            has = f" (it has {', '.join(other)}: --image-size differs?)" if other else ""
            raise ConfigError(
                f"{where('image_cache')}: no complete cache of {split_file} at {size}px in {cache_dir}{has}; {rebuild}"
            )
        index = json.loads(index_path.read_text())
        if index.get("format") != FORMAT:
            raise ConfigError(f"{where('image_cache')}: {index_path} is from another shardtrain version; {rebuild}")
        if index["split_sha256"] != (identity or file_sha256(split_file)):
            what = f"the images of the {split_file} split" if identity else split_file
            raise ConfigError(f"{where('image_cache')}: {what} changed since {index_path} was built; {rebuild}")
        root = split_file.parent  # a source's images are absolute paths, which `root /` leaves alone
        for image, (_, nbytes, mtime) in index["images"].items():
            if nbytes is None:  # embedded: keyed by its content
                continue
            path = root / image
            if not path.is_file() or _stamp(path) != [nbytes, mtime]:
                raise ConfigError(f"{where('image_cache')}: {path} changed since {index_path} was built; {rebuild}")
        self.rows = {image: entry[0] for image, entry in index["images"].items()}
        self.bad: dict[str, str] = index["bad"]
        self._pixels: Optional[np.ndarray] = None

    def problem(self, image: str) -> Optional[str]:
        """Why the image did not decode when the cache was built, or None."""
        return self.bad.get(image)

    def load(self, image: str):
        """[3, S, S] uint8 torch tensor, as images.load_image returns it."""
        import torch

        if image in self.bad:
            raise UndecodableImage(self.bad[image])
        if self._pixels is None:
            self._pixels = np.load(self.array_path, mmap_mode="r")
        return torch.from_numpy(np.array(self._pixels[self.rows[image]])).permute(2, 0, 1)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_pixels": None}
