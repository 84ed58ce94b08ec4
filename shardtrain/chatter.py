"""Keep library chatter (Hugging Face, DeepSpeed, torch) at warning level unless --verbose.

Users read rank-0 progress and our own warnings; INFO lines from every library on every rank
bury both. Each rule below silences one measured source of noise and nothing else.
"""
from __future__ import annotations

import logging
import os
import re
import sys
import warnings

# Messages that say nothing actionable on the machines we run on.
_NOISE = [
    # torch.distributed deprecation, raised by DeepSpeed's own all-gather on every step
    re.compile(r".*all_gather_into_tensor.* is deprecated"),
    # DeepSpeed on a CPU host, before it picks its CPU accelerator
    re.compile(r"Setting accelerator to CPU"),
    # torch's C++-extension loader when DeepSpeed JIT-loads a CPU op
    re.compile(r"No CUDA runtime is found"),
]
# DeepSpeed prints (not logs) this line each time it loads its shared-memory comm op.
_PRINTED_NOISE = re.compile(r"^DeepSpeed \S+ built successfully$")


class _DropNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return False
        msg = record.getMessage()
        return not any(p.match(msg) for p in _NOISE)


class _LineFilter:
    """A stdout wrapper that drops whole printed lines matching a pattern; everything else passes.
    print() writes the text and the newline separately, so the newline after a dropped line goes too."""

    def __init__(self, stream, pattern: re.Pattern):
        self._stream = stream
        self._pattern = pattern
        self._drop_newline = False

    def write(self, s: str) -> int:
        if self._drop_newline and s == "\n":
            self._drop_newline = False
            return len(s)
        self._drop_newline = False
        if self._pattern.match(s.rstrip("\n")):
            self._drop_newline = not s.endswith("\n")
            return len(s)
        return self._stream.write(s)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def quiet_libraries(verbose: bool) -> None:
    """Call before DeepSpeed / transformers are imported; filters survive their own setLevel calls."""
    if verbose:
        return
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "warning")
    os.environ.setdefault("DATASETS_VERBOSITY", "warning")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    for p in _NOISE:
        warnings.filterwarnings("ignore", message=p.pattern)
    # DeepSpeed's LoggerFactory resets its logger's level at import time; a filter is not reset.
    for name in ("DeepSpeed", "deepspeed", "torch.utils.cpp_extension", "torch.distributed",
                 "transformers", "datasets", "accelerate"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropNoise) for f in logger.filters):
            logger.addFilter(_DropNoise())
    if "transformers" in sys.modules:
        try:
            sys.modules["transformers"].logging.set_verbosity_warning()
        except AttributeError:
            pass
    if not isinstance(sys.stdout, _LineFilter):
        sys.stdout = _LineFilter(sys.stdout, _PRINTED_NOISE)
