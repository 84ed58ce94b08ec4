"""The README is a front door of at most 250 lines, and the pages it leads to are all reachable: every relative
link in README.md and docs/*.md names a file of the repository, and every `#anchor` a heading of its page."""

from __future__ import annotations

import ast
import functools
import io
import re
import tokenize
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
README_MAX_LINES = 250
# [text](target): the target has no spaces; code spans are removed first, so `[--flag x](y)` in code is no link.
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`[^`]*`")


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """The lines outside fenced code blocks, numbered from 1."""
    out, fenced = [], False
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            out.append((n, line))
    return out


def anchors(path: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to hyphens, repeats numbered -1, -2..."""
    seen: dict[str, int] = {}
    for _, line in prose_lines(path):
        m = re.match(r"#{1,6} (.*)", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            seen[slug] = seen.get(slug, -1) + 1
            if seen[slug]:
                seen[f"{slug}-{seen[slug]}"] = 0
    return set(seen)


def links(path: Path) -> list[tuple[int, str]]:
    return [(n, target) for n, line in prose_lines(path) for target in LINK.findall(CODE_SPAN.sub("", line))]


def test_the_readme_is_a_front_door():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; at most {README_MAX_LINES}"
    # Its table of links leads to every docs page: a page nobody links to is a page nobody finds.
    linked = {(REPO / target.split("#")[0]).resolve() for _, target in links(REPO / "README.md")}
    assert [p.name for p in PAGES[1:] if p.resolve() not in linked] == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_reaches_a_file_and_heading(page):
    broken = []
    for n, target in links(page):
        if re.match(r"[a-z]+:", target):  # https:, mailto: ... leave this machine
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists() or REPO not in (dest, *dest.parents):
            broken.append(f"{page.relative_to(REPO)}:{n}: {target}: no such file in the repository")
        elif anchor and anchor not in anchors(dest):
            broken.append(f"{page.relative_to(REPO)}:{n}: {target}: no heading '#{anchor}' in {dest.name}")
    assert broken == []


# The pages a user reads. The project's tracker is not among them: an issue's number tells a reader nothing.
USER_PAGES = [*PAGES, *sorted((REPO / "examples").glob("*/README.md"))]
# And the user trials the issues were written from, named by a letter: a reader has no list of them either.
TRACKER_REFERENCE = re.compile(r"\b[Ii]ssues? #?\d+|\b[Tt]rials? [A-Z]\b")


def test_user_pages_say_what_happened_not_which_issue():
    named = [
        f"{page.relative_to(REPO)}:{n}: {m.group(0)}"
        for page in USER_PAGES
        for n, line in enumerate(page.read_text().splitlines(), 1)
        for m in TRACKER_REFERENCE.finditer(line)
    ]
    assert named == [], "pages name tracker issues instead of saying what they mean:\n" + "\n".join(named)


# ---- repository paths named in comments and docstrings ---------------------------------------------------------
# A comment that names a file the re-layout moved sends its reader nowhere. Every path-looking word in a comment or
# docstring of the Python and shell files below must name a file or folder of the repository, from the repository's
# root or from shardtrain/ (the package's modules name each other as `loop/oom.py`).
CODE_FOLDERS = ("shardtrain", "tests", "benchmarks", "examples", "slurm")
CODE_SUFFIXES = {".py", ".sh", ".sbatch"}
EXTRA_CODE_FILES = (".ci/run",)  # a shell script without a suffix
# A word is path-looking when it has a slash and either starts with one of the repository's top-level folders or
# ends in one of these suffixes. Written out rather than listed from the disk, so that a local, untracked `runs/`
# or venv beside the checkout does not turn the words `runs/x` into paths.
TOP_FOLDERS = {
    "shardtrain",
    "tests",
    "benchmarks",
    "examples",
    "slurm",
    "docs",
    "configs",
    "ds_configs",
    "fsdp_policies",
    ".ci",
}
PATH_SUFFIXES = {".py", ".sh", ".sbatch", ".md", ".yaml", ".yml", ".json", ".toml", ".txt", ".cfg"}
# Words that look like paths and are no paths of the repository, each for its reason:
NOT_REPO_PREFIXES = (
    # files of the installed libraries, as they lie in site-packages (`deepspeed/comm/torch.py`)
    "torch/",
    "deepspeed/",
    "transformers/",
    "datasets/",
    "peft/",
    "sagemaker/",
    "accelerate/",
    "lightning/",
    "torchao/",
    "safetensors/",
    "huggingface_hub/",
)
NOT_REPO_PATHS = {
    "benchmarks/results/gpu_suite.json",  # written by benchmarks/gpu_suite.py on a GPU machine; absent until then
    "configs/x.yaml",  # the made-up file of the error-message examples in config/settings.py
}
# Skipped words, not listed above because a rule covers them: an absolute path (`/opt/ml/...` in the container,
# `/tmp/...`), one from a variable or the home directory (`$OUT/...`, `${WT}/...`, `~/.cache/...`), a URL or other
# `scheme:` name (`https://...`, `s3://...`, `arn:aws:...`), a template (`data/<ID>.jpg`, `mem/rank{r}/{key}`), and
# an upper-case placeholder of a usage line (`STATE_DIR/env.sh`, `OUT_DIR/results.json`).
# The words with a slash, between spaces, quotes, backticks, brackets, commas, semicolons and pipes.
WORD = re.compile(r"(?<![^\s`'\"()\[\],;|])[^\s`'\"()\[\],;|/]*/[^\s`'\"()\[\],;|]*")
PLACEHOLDER = re.compile(r"[A-Z][A-Z0-9_]*")


def comment_texts(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment, and of every line of a docstring of a module, class or function, in a Python
    file; of every `#` comment (a whole line, or after code and a space; not the `#!` line) in a shell file."""
    src = path.read_text()
    if path.suffix != ".py":
        return [
            (n, m.group(1))
            for n, line in enumerate(src.splitlines(), 1)
            for m in [re.search(r"(?:^|\s)(#(?!!).*)", line)]
            if m
        ]
    out = [
        (tok.start[0], tok.string)
        for tok in tokenize.generate_tokens(io.StringIO(src).readline)
        if tok.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                out += [(first.lineno + i, line) for i, line in enumerate(first.value.value.splitlines())]
    return out


def repo_paths(text: str) -> list[str]:
    """The words of `text` that name a path of the repository, by the rule above."""
    found = []
    for word in WORD.findall(text):
        word = word.rstrip(".:").split("=")[-1]  # the end of a sentence; `--out=a.json`
        if "/" not in word or word.startswith(("/", "~", "$")) or re.search(r"[$<>{}]|^[\w+.-]+:", word):
            continue
        word = re.sub(r":[^/]*$", "", word)  # `a.py:12`, `a.py:Name`
        parts = word.rstrip("/").split("/")
        if PLACEHOLDER.fullmatch(parts[0]) or word.startswith(NOT_REPO_PREFIXES) or word in NOT_REPO_PATHS:
            continue
        if parts[0] in TOP_FOLDERS or Path(parts[-1]).suffix in PATH_SUFFIXES:
            found.append(word)
    return found


@functools.lru_cache(maxsize=None)
def exists_in_repo(word: str) -> bool:
    return any(any(base.glob(word)) if "*" in word else (base / word).exists() for base in (REPO, REPO / "shardtrain"))


def code_files() -> list[Path]:
    files = [
        p
        for folder in CODE_FOLDERS
        for p in (REPO / folder).rglob("*")
        if p.suffix in CODE_SUFFIXES and "__pycache__" not in p.parts
    ]
    return sorted(files) + [REPO / f for f in EXTRA_CODE_FILES if (REPO / f).exists()]


def test_the_rule_finds_repository_paths_and_nothing_else():
    """One word of each kind the comments hold: the paths it must check, and the look-alikes it must skip."""
    text = (
        "see shardtrain/oom.py, `strategies/dcp_state.py:83`. and tests/nowhere/ --out=benchmarks/x.json; "
        "torch/distributed and deepspeed/comm/torch.py, https://example.com/a/b.py, s3://bucket/k.json, "
        "/opt/ml/input/config/hyperparameters.json, $OUT/metrics.json, ${WT}/a.py, ~/.cache/shardtrain/venv, "
        "/tmp/x/y.py, data/<ID>.txt, OUT_DIR/results.json, ZeRO-2/3, I/O, configs/x.yaml:12, fsdp_policies/*.yaml "
        "(tests/launch.py:torchrun)"
    )
    assert repo_paths(text) == [
        "shardtrain/oom.py",
        "strategies/dcp_state.py",
        "tests/nowhere/",
        "benchmarks/x.json",
        "fsdp_policies/*.yaml",
        "tests/launch.py",
    ]
    assert [w for w in repo_paths(text) if not exists_in_repo(w)] == [
        "shardtrain/oom.py",
        "strategies/dcp_state.py",
        "tests/nowhere/",
        "benchmarks/x.json",
    ]
    assert exists_in_repo("loop/oom.py") and exists_in_repo("shardtrain/loop/oom.py")


def test_comments_and_docstrings_name_only_paths_that_exist():
    # Parsing every file costs seconds; reading it costs milliseconds. A file whose text, code included, names no
    # missing path cannot have one in a comment, so only the few others are parsed.
    suspects = [path for path in code_files() if any(not exists_in_repo(word) for word in repo_paths(path.read_text()))]
    broken = [
        f"{path.relative_to(REPO)}:{n}: {word}"
        for path in suspects
        for n, text in comment_texts(path)
        for word in repo_paths(text)
        if not exists_in_repo(word)
    ]
    assert not broken, "comments and docstrings name paths that do not exist:\n" + "\n".join(broken)


def test_comments_and_docstrings_say_what_happened_not_which_issue():
    # As for the user pages: the tracker is not part of the repository, and a clone's reader cannot open its issues.
    suspects = [path for path in code_files() if TRACKER_REFERENCE.search(path.read_text())]
    named = [
        f"{path.relative_to(REPO)}:{n}: {m.group(0)}"
        for path in suspects
        for n, text in comment_texts(path)
        for m in TRACKER_REFERENCE.finditer(text)
    ]
    assert named == [], "comments and docstrings name tracker issues instead of saying what they mean:\n" + "\n".join(
        named
    )
