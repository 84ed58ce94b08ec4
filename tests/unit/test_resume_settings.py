"""A resume names every setting that differs from its checkpoint's (shardtrain/loop/resume_changes.py), not only
the schedule and the batch geometry: another --weight-decay, --dropout or --max-length trained on without a word,
and summary.json then recorded a --tokenizer-vocab-size the run never used."""

from __future__ import annotations

from launch import REPO

from shardtrain.config.settings import parse_cli
from shardtrain.loop.resume_changes import resume_changes, setting_changes

TINY = str(REPO / "configs/multimodal_tiny.yaml")


def saved_state(tmp_path, *flags) -> dict:
    cfg = parse_cli(["--config", TINY, "--output-dir", str(tmp_path), *flags])
    return {"step": 40, "world_size": 2, "config": cfg.to_dict()}


def test_every_changed_setting_is_named_with_what_a_resume_makes_of_it(tmp_path):
    saved = saved_state(tmp_path, "--max-steps", "40")
    cfg = parse_cli(
        ["--config", TINY, "--output-dir", str(tmp_path), "--max-steps", "40", "--weight-decay", "0.1",
         "--dropout", "0.2", "--seed", "7", "--max-grad-norm", "0.5", "--max-length", "32",
         "--tokenizer-vocab-size", "500", "--early-stopping-patience", "4", "--eval-every", "10"]
    )  # fmt: skip
    assert resume_changes(saved, cfg, 2).changes == [
        "--dropout 0.0 -> 0.2",
        "--tokenizer-vocab-size 1000 -> 500: not applied: the run's trained tokenizer is kept (a new one would "
        "renumber the vocabulary under the checkpoint)",
        "--max-length 64 -> 32",
        "--weight-decay 0.01 -> 0.1",
        "--max-grad-norm 1.0 -> 0.5",
        "--seed 42 -> 7",
        "--eval-every 0 -> 10",
        "--early-stopping-patience unset -> 4",
    ]


def test_settings_said_with_their_effect_or_of_no_effect_on_training_are_not_repeated(tmp_path):
    saved = saved_state(tmp_path, "--max-steps", "40")
    cfg = parse_cli(
        ["--config", TINY, "--output-dir", str(tmp_path / "elsewhere"), "--max-steps", "60", "--log-every", "1",
         "--data-dir", str(tmp_path / "moved"), "--per-device-batch-size", "8", "--report", "false"]
    )  # fmt: skip
    changes = resume_changes(saved, cfg, 2).changes
    assert [c.split(" ")[0] for c in changes] == ["--max-steps", "the", "--per-device-batch-size"], changes


def test_a_dict_setting_names_the_keys_that_differ(tmp_path):
    saved = saved_state(tmp_path)
    bigger = tmp_path / "bigger.yaml"
    bigger.write_text(
        open(TINY)
        .read()
        .replace("fusion_hidden: 64", "fusion_hidden: 32")
        .replace("hidden_size: 64", "hidden_size: 96")
    )
    cfg = parse_cli(["--config", str(bigger), "--output-dir", str(tmp_path)])
    assert setting_changes(saved["config"], cfg, sections=("model",)) == [
        "--text-config hidden_size 64 -> 96",
        "--fusion-hidden 64 -> 32",
    ]
