"""The checkpoint settings of per-rank ZeRO saves: DeepSpeed's engine files only when asked, and the planner's host
memory of a save per rank (shown in the banner)."""

from __future__ import annotations

import pytest

from shardtrain.config.settings import ConfigError, parse_cli
from shardtrain.memory.planner import ModelCount, save_host_bytes


def test_engine_files_default_off_and_refused_where_there_are_none():
    assert parse_cli(["--ds", "ds_configs/zero3.json"]).checkpoint.engine_files is False
    assert parse_cli(["--ds", "ds_configs/zero3.json", "--engine-files"]).checkpoint.engine_files is True
    with pytest.raises(
        ConfigError,
        match=r"^--engine-files \(checkpoint\.engine_files\) asks for DeepSpeed's own "
        r"checkpoint files; --strategy fsdp writes only the portable form",
    ):
        parse_cli(["--strategy", "fsdp", "--engine-files"])


def test_a_save_holds_a_ranks_share_of_the_model_state_on_the_host():
    m = ModelCount(params=7_000_000_000, largest_unit=200_000_000, small_params=0, buffer_bytes=0, layers=32)
    state = 12 * m.params  # fp32 weights + Adam m, v
    for variant in ("zero2", "zero3", "fsdp"):
        assert save_host_bytes(variant, m, 64, async_save=True) == state / 64
        assert save_host_bytes(variant, m, 64, async_save=False) == 4 * m.largest_unit / 64
    assert save_host_bytes("ddp", m, 64, async_save=True) == state  # every DDP rank holds all of it
