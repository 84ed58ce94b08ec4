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
    # torch.distributed deprecations, raised by DeepSpeed's own collectives on every step and rank: ZeRO's
    # all-gather of parameters, and ZeRO-3's reduce-scatter of gradients (deepspeed/comm/torch.py)
    re.compile(r".*(all_gather_into_tensor|reduce_scatter_tensor).* is deprecated"),
    # torch.distributed.checkpoint read in one process (export, portable.py) with no_dist=True: what we ask for
    re.compile(r"torch\.distributed is (disabled, )?unavailable or uninitialized, assuming the intent is to"),
    # DeepSpeed on a CPU host, before it picks its CPU accelerator
    re.compile(r"Setting accelerator to CPU"),
    # torch's C++-extension loader when DeepSpeed JIT-loads a CPU op
    re.compile(r"No CUDA runtime is found"),
    # torchao 0.18 registers two Enums as pytree constants at import, which torch 2.14 deprecates; transformers
    # imports torchao whenever it is installed (export --int8 needs it), so every model build would say it
    re.compile(r".* is an Enum subclass and is now natively supported by torch\.compile"),
    # peft 0.x reads transformers' is_gradient_checkpointing as it wraps a model (peft_model.py), which
    # transformers 5 deprecates: every --peft lora command would say it
    re.compile(r"`is_gradient_checkpointing` is deprecated"),
]
# transformers' table of the keys a pretrained load skipped or initialised, once per rank and per load.
_LOAD_REPORT = re.compile(r".*LOAD REPORT")
# A row is one line: a key that could run on over the line before (the table's `---+---` rule) was not the key.
_LOAD_ROW = re.compile(r"^([^\s|][^|\n]*?)[ \t]*\|[ \t]*(UNEXPECTED|MISSING|MISMATCH|CONVERSION)\b", re.M)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _routine_load_report(msg: str) -> bool:
    """Routine: it lists only UNEXPECTED keys (checkpoint weights the model does not use: the RoBERTa pooler
    we leave out, a masked-LM head) and a MISSING new classifier head. Weights the model needs that were not
    loaded (MISSING elsewhere, MISMATCH, CONVERSION, after which transformers raises pointing at "the above
    report") keep it on screen."""
    rows = _LOAD_ROW.findall(_ANSI.sub("", msg))
    return bool(rows) and all(
        status == "UNEXPECTED" or (status == "MISSING" and key.startswith("classifier.")) for key, status in rows
    )


# DeepSpeed prints (not logs) this line each time it loads its shared-memory comm op.
_PRINTED_NOISE = re.compile(r"^DeepSpeed \S+ built successfully$")


class _DropNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return False
        msg = record.getMessage()
        if _LOAD_REPORT.match(msg):
            return not _routine_load_report(msg)
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


_quiet = False  # quiet_libraries ran without --verbose


def quiet_libraries(verbose: bool) -> None:
    """Call before DeepSpeed / transformers are imported; filters survive their own setLevel calls."""
    if verbose:
        return
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "warning")
    os.environ.setdefault("DATASETS_VERBOSITY", "warning")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")  # read when --report-to mlflow imports it
    for p in _NOISE:
        warnings.filterwarnings("ignore", message=p.pattern)
    # DeepSpeed's LoggerFactory resets its logger's level at import time; a filter is not reset.
    # A logger's filter sees only records logged to it, not its children's: transformers logs the load report
    # to transformers.modeling_utils.
    for name in (
        "DeepSpeed",
        "deepspeed",
        "torch.utils.cpp_extension",
        "torch.distributed",
        "torch.utils._pytree",
        "transformers",
        "transformers.modeling_utils",
        "datasets",
        "accelerate",
    ):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropNoise) for f in logger.filters):
            logger.addFilter(_DropNoise())
    global _quiet
    _quiet = True
    quiet_late_imports()
    if not isinstance(sys.stdout, _LineFilter):
        sys.stdout = _LineFilter(sys.stdout, _PRINTED_NOISE)


def quiet_late_imports() -> None:
    """What quiet_libraries does to transformers, once more where it may have been imported since: a user's
    workload module imports it at its top, after the command quieted the libraries. transformers reads its
    progress-bar setting at import time, so the environment alone does not hide the "Loading weights" bar."""
    if not _quiet or "transformers" not in sys.modules:
        return
    try:
        sys.modules["transformers"].logging.set_verbosity_warning()
        # The "Loading weights" bar of a pretrained load, one per rank.
        sys.modules["transformers"].logging.disable_progress_bar()
    except AttributeError:
        pass
