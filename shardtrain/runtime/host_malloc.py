"""glibc's malloc, told to keep the large blocks it frees, for `shardtrain plan`.

The planner measures activations by running the model's forward at the config's lengths on this machine's CPU
(memory/planner.py). Longformer-base at 1,536 tokens allocates tensors of 40 MB and more, many times per forward,
and glibc serves every block above its mmap threshold (which grows with the blocks freed, but never past 32 MiB)
with a fresh mmap that it unmaps on free. Each forward then faults all of its memory in again, page by page, and
the kernel zeroes every page: a third of `plan`'s CPU was system time. With the threshold and the heap's trim
threshold at 1 GiB, freed blocks are reused instead. benchmarks/plan_malloc.py measures it
(benchmarks/results/plan_malloc.json).

Only `plan` asks for this: it is a process of its own that ends when it has printed. A training process keeps
glibc's defaults, which hand freed memory back to the system (CPU offload and the data workers share the host).
"""

from __future__ import annotations

import ctypes
import sys

# mallopt's parameters, from glibc's <malloc.h>
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
KEEP_UP_TO = 1 << 30  # mallopt takes an int


def keep_freed_blocks(limit: int = KEEP_UP_TO) -> bool:
    """Blocks up to `limit` bytes come from the heap, and the heap keeps up to `limit` freed bytes at its top.
    False (and nothing changed) where the C library is not glibc (musl, macOS): they have no mallopt."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library this process already runs on
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, limit)) and bool(mallopt(M_TRIM_THRESHOLD, limit))
