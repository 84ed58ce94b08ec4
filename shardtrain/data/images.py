"""Image decoding: PIL load -> RGB -> square resize -> float tensor normalized with ImageNet statistics."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np
import torch
from PIL import Image

# The torchvision backbones (ResNet, DenseNet) were trained with these; random-init models do not mind them.
IMAGENET_MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
IMAGENET_STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)


def load_image(path: Path, size: int) -> torch.Tensor:
    """[3, size, size] float32. Raises whatever PIL raises on a corrupt file; callers add file:line."""
    with Image.open(path) as img:
        img = img.convert("RGB").resize((size, size), Image.BILINEAR)
        arr = np.asarray(img, dtype=np.float32) / 255.0
    x = torch.from_numpy(arr).permute(2, 0, 1)
    return (x - IMAGENET_MEAN) / IMAGENET_STD


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
