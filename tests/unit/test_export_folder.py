"""Where an export writes (shardtrain/checkpointing/export.py, export_folder): a previous export in OUT is replaced
whole, never mixed with the new one (a stale adapter_config.json beside merged weights makes plain transformers
apply old adapters without an error); other files are refused before any work; a failed export leaves OUT as it
was."""

from __future__ import annotations

import pytest

from shardtrain.checkpointing.export import EXPORT_META, export_folder
from shardtrain.config.settings import ConfigError


def previous_export(out):
    out.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors", EXPORT_META):
        (out / name).write_text("old")
    return out


def test_a_merged_export_over_an_adapter_export_leaves_no_adapter_file(tmp_path):
    out = previous_export(tmp_path / "export")
    with export_folder(out) as staging:
        for name in ("model.safetensors", "config.json", EXPORT_META):
            (staging / name).write_text("new")
    assert sorted(p.name for p in out.iterdir()) == sorted(["model.safetensors", "config.json", EXPORT_META])
    assert (out / EXPORT_META).read_text() == "new"


def test_a_folder_of_other_files_is_refused_and_left_alone(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep")
    with pytest.raises(ConfigError) as e:
        with export_folder(out):
            raise AssertionError("no work may start")
    assert str(e.value) == (
        f"export: {out} holds files that are no shardtrain export (notes.txt): give a new or empty folder "
        f"(a previous export there is replaced)"
    )
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    with export_folder(out, keep_others=True) as staging:  # --final-model-dir: a folder the platform made
        (staging / "model.safetensors").write_text("new")
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors", "notes.txt"]


def test_a_failed_export_keeps_the_previous_one_and_makes_no_folder(tmp_path):
    out = previous_export(tmp_path / "export")
    with pytest.raises(ConfigError):
        with export_folder(out) as staging:
            (staging / "model.safetensors").write_text("half")
            raise ConfigError("the checkpoint does not fit")
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["adapter_config.json", "adapter_model.safetensors", EXPORT_META]
    )
    new = tmp_path / "new"
    with pytest.raises(ConfigError):
        with export_folder(new):
            raise ConfigError("the checkpoint does not fit")
    assert not new.exists()
