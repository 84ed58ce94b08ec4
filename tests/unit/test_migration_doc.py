"""docs/migration.md promises that every row of its three tables works: this reads the tables and checks each."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from shardtrain import Workload
from shardtrain.config.settings import FIELDS, ConfigError, build_arg_parser, parse_cli

DOC = Path(__file__).resolve().parents[2] / "docs" / "migration.md"
FLAG = re.compile(r"--[a-z][a-z0-9_-]*")
CODE = re.compile(r"`([^`]+)`")


def _rows() -> list[tuple[str, str, str]]:
    rows = []
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == 3 and not set(cells[0]) <= {"-"} and cells[2] != "backed by":
            rows.append(tuple(cells))
    return rows


ROWS = _rows()


def _field(flag: str) -> str:
    return flag[2:].replace("-", "_")


def test_the_page_has_its_three_tables():
    assert len(ROWS) >= 40
    assert {r[2] for r in ROWS} >= {"same", "alias", "hint", "workload"}


@pytest.mark.parametrize("theirs,ours,backed", ROWS, ids=[r[0][:40] for r in ROWS])
def test_every_row(theirs, ours, backed):
    our_flags = FLAG.findall(" ".join(CODE.findall(ours)))
    for flag in our_flags:  # every shardtrain flag a row names exists (torchrun's own excepted)
        assert (
            _field(flag) in FIELDS
            or flag == "--num-processes"
            or flag in ("--nproc_per_node", "--nnodes", "--node_rank", "--master_addr")
        ), flag
    their_flag = (FLAG.findall(" ".join(CODE.findall(theirs)[:1])) or [None])[0]
    if backed == "same":
        assert _field(our_flags[0]) in FIELDS
    elif backed == "alias":
        args, unknown = build_arg_parser().parse_known_args([f"{their_flag.replace('_', '-')}=1"])
        assert not unknown and getattr(args, _field(our_flags[0])) == "1", f"{their_flag} is not {our_flags[0]}"
    elif backed == "hint":
        with pytest.raises(ConfigError, match=f"did you mean '{re.escape(our_flags[0])}'"):
            parse_cli([f"{their_flag}=1"])
    elif backed == "workload":
        names = [c for c in CODE.findall(ours) if re.fullmatch(r"[a-z_]+", c)]
        assert names and all(callable(getattr(Workload, n, None)) for n in names), names
    else:
        test_file = Path(__file__).resolve().parents[2] / CODE.findall(backed)[0]
        assert test_file.is_file(), backed
