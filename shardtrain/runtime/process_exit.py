"""A command's process ends when the command is done, without the interpreter's teardown.

At exit CPython clears every module and runs full collections over what is left. In a process that imported
torch and transformers (close to a million objects) that is ~2 s of CPU spent after the command has finished:
`shardtrain export` of the tiny Longformer took 6.9 CPU-s with it and 4.8 without (dev machine, medians of three
alternated pairs). The ranks already end without it (runtime/distributed.py's teardown_and_exit).

So the entry points (`python -m shardtrain`, the `shardtrain` console script, shardtrain/main.py) register
`_end_without_teardown` before the command's imports (libraries register theirs as they are imported). Exit
handlers run in the reverse order of registration, so it runs last: after Python has joined the non-daemon
threads and run every other exit handler (logging's, multiprocessing's, the loggers' clients', weakref
finalizers such as TemporaryDirectory's). It then flushes stdout and stderr and ends the process with the
command's exit code. What it skips is only the teardown. An exception that escapes the command leaves the code
unset, and Python's own exit prints it as usual. A command called from Python (cli.main) never comes here: that
process goes on as before.
"""

from __future__ import annotations

import atexit
import os
import sys
from typing import NoReturn

_exit_code: int | None = None


def end_without_teardown_at_exit() -> None:
    """First thing in an entry point: later exit handlers (libraries') run before this one."""
    atexit.register(_end_without_teardown)


def exit_with(code: int) -> NoReturn:
    """sys.exit(code), remembering the code for the last exit handler."""
    global _exit_code
    _exit_code = code
    sys.exit(code)


def _end_without_teardown() -> None:
    if _exit_code is None:
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`shardtrain plan | head`): nothing left to say
            pass
    os._exit(_exit_code)
