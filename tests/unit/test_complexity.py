"""Cyclomatic complexity (radon) under a limit per part of the package: a function that grows past its part's
limit fails here, named with its score, so that it is split while it grows rather than in a redesign.

A limit is a row of LIMITS: a glob of files, relative to the repository, and the highest complexity a function
there may have (methods and nested functions each count on their own, as radon scores them; a class is not
scored as a whole). A file that several rows match must keep to each.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest
from radon.complexity import cc_visit
from radon.visitors import Class, Function

REPO = Path(__file__).resolve().parents[2]

LIMITS = [
    ("shardtrain/config/**/*.py", 25),  # the config stays simple: no function in config/ above 25
    ("shardtrain/loop/train.py", 15),  # the Trainer: train() reads in a screen, and so does each of its steps
]


def functions(blocks, prefix: str = "") -> Iterator[tuple[str, Function]]:
    """(qualified name, block) of every function in radon's blocks: methods, and the functions nested in
    functions (radon scores each closure apart from the function around it), at any depth."""
    for block in blocks:
        name = f"{prefix}{block.name}"
        if isinstance(block, Class):
            yield from functions([*block.methods, *block.inner_classes], f"{name}.")
        else:
            yield name, block
            yield from functions(block.closures, f"{name}.")


def scores(source: str) -> list[tuple[str, int, int]]:
    """(qualified name, line, complexity) of each function in a module's source, in the order of their lines."""
    # cc_visit lists each class's methods beside the class too; they are reached through their class instead.
    top = [b for b in cc_visit(source) if not (isinstance(b, Function) and b.is_method)]
    return sorted(((name, block.lineno, block.complexity) for name, block in functions(top)), key=lambda s: s[1])


def over_limit(files: list[Path], limit: int, root: Path = REPO) -> list[str]:
    return [
        f"{path.relative_to(root)}:{line} {name} has complexity {score} (limit {limit})"
        for path in files
        for name, line, score in scores(path.read_text())
        if score > limit
    ]


@pytest.mark.parametrize(("pattern", "limit"), LIMITS, ids=[pattern for pattern, _ in LIMITS])
def test_no_function_above_its_limit(pattern, limit):
    files = sorted(REPO.glob(pattern))
    assert files, f"{pattern} matches no file: fix the row of LIMITS"
    over = over_limit(files, limit)
    assert not over, "split these functions (radon cc -s shows the branches):\n" + "\n".join(over)


def test_methods_and_nested_functions_are_scored_too(tmp_path):
    def branches(indent: str) -> str:  # complexity 1 + 30
        return "".join(f"{indent}if x == {i}:\n{indent}    return {i}\n" for i in range(30))

    source = (
        "class Outer:\n"
        "    class Inner:\n"
        "        def method(self, x):\n" + branches(" " * 12) + "def outer():\n"
        "    def inner(x):\n" + branches(" " * 8) + "    return inner\n"
    )
    (tmp_path / "m.py").write_text(source)
    assert over_limit([tmp_path / "m.py"], 25, root=tmp_path) == [
        "m.py:3 Outer.Inner.method has complexity 31 (limit 25)",
        "m.py:65 outer.inner has complexity 31 (limit 25)",
    ]
