"""Training goes on when whoever reads its console output has gone (`| head`, a log collector or `tee`
that died).

A write into a closed pipe raises BrokenPipeError. Left alone it ends rank 0 alone, whose exit then waits in
a barrier that the other ranks, still training, never reach: a hang that burns GPU hours. Instead the stream
turns into /dev/null at the file-descriptor level, so every holder of the descriptor (tqdm, logging handlers,
DeepSpeed's prints, C++ code) writes into nothing from then on. metrics.jsonl, W&B and checkpoints are files
of their own and carry on unaffected.
"""

from __future__ import annotations

import os
import sys


class _DropWhenClosed:
    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._drop()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._drop()

    def _drop(self) -> None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, self._stream.fileno())
        os.close(devnull)

    def __getattr__(self, name):  # isatty, fileno, encoding...: the real stream's
        return getattr(self._stream, name)


def survive_closed_output() -> None:
    """Wrap stdout and stderr, once per process, before anything prints."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _DropWhenClosed):
            setattr(sys, name, _DropWhenClosed(stream))
