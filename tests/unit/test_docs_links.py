"""The README is a front door of at most 250 lines, and the pages it leads to are all reachable: every relative
link in README.md and docs/*.md names a file of the repository, and every `#anchor` a heading of its page."""
from __future__ import annotations

import re
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
