"""The one error type a user can fix, and the one line any other error is told in; a leaf, so that every layer
can raise and tell them."""

from __future__ import annotations

import re
import sys
import traceback
from pathlib import Path


class ConfigError(ValueError):
    """A usage, config or data problem: one line, exit code 2, no traceback."""


class BadRow(ConfigError):
    """A row of the data that training cannot use (it names the row first): --skip-bad-samples leaves such rows
    out, check-data lists them all, and predict --file predicts them where it can."""


def with_where_raised(e: BaseException) -> str:
    """`Type: message (raised in MyTask.loss, my_tasks.py:42; --debug shows the traceback)`: where the user's own
    code (a workload method, their model, their Dataset) raised, when it did, so that a bare `KeyError: 'label'`
    points at the method to fix rather than at the data. A DataLoader worker's error arrives wrapped by torch
    (`Caught FileNotFoundError in DataLoader worker process 0.`, the original traceback as text): its own
    last line is the message, and its frames say where. A file or hub error inside a `from_pretrained` also
    names what it was loading: transformers' offline message ("We couldn't connect to 'https://huggingface.co'
    ...") does not say which model."""
    text = str(e)
    worker = re.match(r"Caught \w+ (in DataLoader worker process \d+)\.", text)
    loading = None
    if worker and "Traceback" in text:
        message = next(line for line in reversed(text.strip().splitlines()) if line.strip()).strip()
        frames = [(f, int(n), name) for f, n, name in re.findall(r'File "([^"]+)", line (\d+), in (\S+)', text)]
        where = _users_frame(frames)
        where = f"{where}, {worker.group(1)}" if where else worker.group(1)
    else:
        message = f"{type(e).__name__}: {text.strip().splitlines()[0] if text.strip() else ''}"
        frames = []
        for frame, line in traceback.walk_tb(e.__traceback__):
            owner = frame.f_locals.get("self", frame.f_locals.get("cls"))
            owner = owner if isinstance(owner, type) else type(owner) if owner is not None else None
            name = f"{owner.__name__}.{frame.f_code.co_name}" if owner else frame.f_code.co_name
            frames.append((frame.f_code.co_filename, line, name))
            # the outermost from_pretrained's documented argument: the name the user passed
            name_or_path = frame.f_locals.get("pretrained_model_name_or_path")
            if loading is None and isinstance(e, OSError) and isinstance(name_or_path, (str, Path)):
                loading = f"loading '{name_or_path}'"
        where = _users_frame(frames)
    said = "; ".join(part for part in (loading, f"raised in {where}" if where else None) if part)
    return f"{message} ({said}; --debug shows the traceback)" if said else f"{message} (--debug shows the traceback)"


def _users_frame(frames: list[tuple[str, int, str]]) -> str | None:
    """`name, file:line` of the deepest frame in the user's own code: not shardtrain's, not the standard
    library's or an installed package's."""
    ours = Path(__file__).resolve().parents[1]
    installed = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)}
    for filename, line, name in reversed(frames):
        if filename.startswith("<"):
            continue
        path = Path(filename).resolve()
        if (
            ours in path.parents
            or installed & set(path.parents)
            or {"site-packages", "dist-packages"} & set(path.parts)
        ):
            continue
        return f"{name}, {as_seen_from_cwd(path)}:{line}"
    return None


def as_seen_from_cwd(path: Path) -> str:
    """An absolute path as a user in this working directory can type it: relative under it, else whole (from an
    example's folder, `shardtrain/main.py` named a file that is not there)."""
    return str(path.relative_to(Path.cwd())) if Path.cwd() in path.parents else str(path)
