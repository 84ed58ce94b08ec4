"""Images: decode -> RGB -> square resize -> uint8 [3, S, S]; normalisation happens on the training device.

Workers hand over uint8, not float: a quarter of the bytes through worker shared memory, pinned memory and the
host-to-device copy, and no per-pixel float arithmetic on the CPU cores that decode. `normalize_pixels` turns
them into ImageNet-normalised floats on the device (`batch_to_device` does it for every batch). The result is
bit-identical to normalising on the host: the same float32 operations in the same order.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np
import torch
from PIL import Image

from shardtrain.data.batches import move_batch, top_tensor

# The torchvision backbones (ResNet, DenseNet) were trained with these; random-init models do not mind them.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def decode_image(path: Path, size: int) -> np.ndarray:
    """[size, size, 3] uint8. Raises whatever PIL raises on a corrupt file; callers add file:line."""
    with Image.open(path) as img:
        # JPEG only, a no-op elsewhere: libjpeg decodes at 1/2, 1/4 or 1/8 scale while the result stays at
        # least size x size. A 1600x1200 photo for a 224 model decodes ~10x faster, and is resized from there.
        img.draft("RGB", (size, size))
        if img.mode != "RGB":
            img = img.convert("RGB")
        # reducing_gap: an integer box reduction first, then bilinear over the last factor of <= 3.
        img = img.resize((size, size), Image.BILINEAR, reducing_gap=3.0)
        return np.array(img, dtype=np.uint8)  # a writable copy: torch.from_numpy warns on PIL's read-only view


def load_image(path: Path, size: int) -> torch.Tensor:
    """[3, size, size] uint8 (a channels-first view; the collator's stack makes the batch contiguous)."""
    return torch.from_numpy(decode_image(path, size)).permute(2, 0, 1)


def normalize_pixels(pixels: torch.Tensor) -> torch.Tensor:
    """uint8 [B, 3, S, S] -> float32 ImageNet-normalised, on whatever device `pixels` is on."""
    mean = torch.tensor(IMAGENET_MEAN, device=pixels.device).view(3, 1, 1)
    std = torch.tensor(IMAGENET_STD, device=pixels.device).view(3, 1, 1)
    return (pixels.float() / 255.0 - mean) / std


def batch_to_device(batch, device: torch.device):
    """Move a collated batch, of any nesting (shardtrain/data/batches.py), to `device` (asynchronously from pinned
    memory), and normalise uint8 images there: a uint8 `pixel_values` at the top of a dict batch (the built-ins')."""
    out = move_batch(batch, device)
    pixels = top_tensor(out, "pixel_values")
    if pixels is not None and pixels.dtype == torch.uint8:
        out["pixel_values"] = normalize_pixels(pixels)
    return out


def image_problem(path: Path) -> Optional[str]:
    """None if the image decodes, else why not. verify() alone misses truncated pixel data, so load() too."""
    try:
        with Image.open(path) as img:
            img.verify()
        with Image.open(path) as img:  # verify() leaves the object unusable: reopen to decode
            img.load()
    except Exception as e:  # PIL raises many types (UnidentifiedImageError, OSError, SyntaxError...)
        return f"{type(e).__name__}: {e}"
    return None


# What a run that meets an undecodable image mid-training says after the image's file:line.
BAD_IMAGE_HINT = "; shardtrain check-data lists every such image before a run, --skip-bad-samples leaves them out"
