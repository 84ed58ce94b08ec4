"""`make-data`: small synthetic datasets in exactly the user formats, learnable but not trivially.

Signal: each class has its own words (positive / negative / neutral for the first three) mixed into filler
text, with words from other classes as distractors; multimodal images carry a class-dependent stripe
orientation and tint under pixel noise. About `label_noise` of the labels are then replaced by another class,
so no model can reach 100% and accuracy well above chance shows that learning happened.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

import numpy as np
from PIL import Image

from shardtrain.config.settings import ConfigError
from shardtrain.data.records import SPLIT_FILES, has_images, normalize_kind

DATASET_INFO = "shardtrain_dataset.json"  # written by make-data: its kind and number of labels, for check-data
# The images make-data writes: images/<split>/000000.png, ...
_MADE_IMAGE = re.compile(r"\d{6}\.png")

CLASS_WORDS = [
    ["excellent", "wonderful", "delightful", "superb", "brilliant", "lovely", "great", "enjoyable", "charming"],
    ["terrible", "awful", "boring", "dreadful", "horrible", "disappointing", "poor", "tedious", "messy"],
    ["average", "ordinary", "adequate", "typical", "moderate", "standard", "usual", "plain", "fair"],
]
FILLER = (
    "the a of and to in it was is this that with for on as at by from story film product day "
    "place time people thing way year work city room book music food service color house "
    "street morning evening window table paper water light sound road tree"
).split()


def class_words(label: int) -> list[str]:
    if label < len(CLASS_WORDS):
        return CLASS_WORDS[label]
    # Beyond three classes: made-up but pronounceable words, distinct per class.
    syll = ["ka", "lo", "mi", "tu", "ze", "ro", "pa", "ni", "vo"]
    return [f"{syll[label % 9]}{syll[(label // 9 + j) % 9]}{syll[j]}" for j in range(9)]


def make_text(rng: np.random.Generator, label: int, num_labels: int, n_words: int, signal_every: int) -> str:
    """Filler with about one signal word per `signal_every` words; a quarter of them from another class."""
    words = list(rng.choice(FILLER, size=n_words))
    n_signal = max(2, n_words // signal_every)
    for pos in rng.choice(n_words, size=min(n_signal, n_words), replace=False):
        src = label if rng.random() < 0.75 or num_labels == 1 else int(rng.integers(num_labels))
        words[pos] = str(rng.choice(class_words(src)))
    return " ".join(words)


def make_image(rng: np.random.Generator, label: int, size: int) -> np.ndarray:
    """Stripes whose orientation and tint depend on the class, with random phase, contrast and noise."""
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    angle = np.pi * (label % 4) / 4 + rng.normal(0, 0.15)  # 0, 45, 90, 135 degrees, jittered
    period = size / (3 + (label // 4) % 3)  # more classes: different frequencies too
    wave = np.sin(2 * np.pi * (xx * np.cos(angle) + yy * np.sin(angle)) / period + rng.uniform(0, 2 * np.pi))
    tint = np.array([[0.9, 0.4, 0.4], [0.4, 0.4, 0.9], [0.4, 0.9, 0.4]][label % 3], dtype=np.float32)
    contrast = rng.uniform(0.15, 0.35)
    img = 0.5 + contrast * wave[..., None] * tint + rng.normal(0, 0.12, size=(size, size, 3))
    return (np.clip(img, 0, 1) * 255).astype(np.uint8)


def doc_words(rng: np.random.Generator, low: int, high: int, lengths: str) -> int:
    if lengths == "uniform":
        return int(rng.integers(low, high + 1))
    # Median at a sixth of the range's top, one sigma a factor of 2.7: most documents short, a few near the top.
    return int(np.clip(rng.lognormal(np.log(max(low, high / 6)), 1.0), low, high))


def make_data(
    kind: str,
    out_dir,
    n_train: int = 512,
    n_val: int = 128,
    seed: int = 0,
    num_labels: int = 3,
    overwrite: bool = False,
    image_size: int = 32,
    label_noise: float = 0.07,
    min_words: int = 200,
    max_words: int = 1000,
    lengths: str = "uniform",
) -> Path:
    """Write train.jsonl / validation.jsonl (+ images/<split>/*.png for multimodal). Returns the folder.

    Longdoc documents have min_words..max_words words with signal words sparse (~1 in 40): still present in
    the first few hundred tokens, so a short max_length can learn them. `lengths`: "uniform" over that range,
    or "lognormal", a real corpus's shape (many short posts, a long tail of reports), clipped to it.
    """
    if lengths not in ("uniform", "lognormal"):
        raise ConfigError(f"make-data --lengths: uniform or lognormal, got {lengths!r}")
    kind = normalize_kind(kind)
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise ConfigError(f"make-data: {out} is not empty; refusing to overwrite it (use --overwrite)")
        _remove_earlier_output(out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for split, n in (("train", n_train), ("validation", n_val)):
        lines = []
        for i in range(n):
            true = int(rng.integers(num_labels))
            if has_images(kind):
                text = make_text(rng, true, num_labels, int(rng.integers(8, 20)), signal_every=6)
            else:
                text = make_text(rng, true, num_labels, doc_words(rng, min_words, max_words, lengths), signal_every=40)
            label = true
            if num_labels > 1 and rng.random() < label_noise:
                label = int((true + rng.integers(1, num_labels)) % num_labels)
            rec = {"text": text}
            if has_images(kind):
                rel = f"images/{split}/{i:06d}.png"
                (out / rel).parent.mkdir(parents=True, exist_ok=True)
                Image.fromarray(make_image(rng, true, image_size)).save(out / rel)
                rec["image"] = rel
            rec["label"] = label
            lines.append(json.dumps(rec))
        (out / SPLIT_FILES[split]).write_text("\n".join(lines) + "\n", encoding="utf-8")
    (out / DATASET_INFO).write_text(json.dumps({"kind": kind, "num_labels": num_labels}) + "\n")
    return out


def _remove_earlier_output(out: Path) -> None:
    """--overwrite: what an earlier make-data wrote goes (its images, so that a smaller dataset leaves none
    behind); a folder whose splits or images make-data did not write is refused, --overwrite or not: they may be
    the only copy of a user's data."""
    theirs = [p.name for p in (out / f for f in (*SPLIT_FILES.values(), "images")) if p.exists()]
    if theirs and not (out / DATASET_INFO).is_file():
        raise ConfigError(
            f"make-data: {out} holds {', '.join(theirs)} that make-data did not write (no {DATASET_INFO}); "
            f"refusing to overwrite them, --overwrite or not: choose a new folder"
        )
    for split in SPLIT_FILES:
        folder = out / "images" / split
        for made in folder.glob("*.png"):
            if _MADE_IMAGE.fullmatch(made.name):
                made.unlink()
        with contextlib.suppress(OSError):  # not empty: something of the user's is in it, and stays
            folder.rmdir()


def dataset_info(data_dir: str) -> dict:
    """What make-data recorded about the folder ({} for a folder it did not write)."""
    import json

    try:
        return json.loads((Path(data_dir) / DATASET_INFO).read_text())
    except (OSError, ValueError):
        return {}
