"""What `shardtrain export` and --final-model-dir leave behind: files with the mode any other file gets, and no
library warnings unless --verbose."""
from __future__ import annotations

import os
import re

from launch import cli, tiny_args, torchrun

WARNINGS = ("UserWarning", "FutureWarning", "assuming the intent is to load in a single process",
            "quantize_per_tensor")


def test_exported_files_get_the_umask_mode_and_export_is_quiet(mm_data, tmp_path):
    out, final, export = tmp_path / "run", tmp_path / "final", tmp_path / "export"
    old = os.umask(0o022)  # inherited by the runs: their files should come out 0644
    try:
        torchrun(tiny_args("multimodal", mm_data, out, "--strategy", "ddp", "--max-steps", "1", "--save-every", "1",
                           "--max-eval-samples", "8", "--final-model-dir", str(final)), nproc=1)
        quiet = cli(["export", str(out), str(export), "--int8"])
        for path in (final / "model.safetensors", final / "config.json", export / "model.safetensors",
                     export / "model_int8.safetensors", export / "config.json"):
            assert oct(path.stat().st_mode & 0o777) == oct(0o644), path
        assert not [w for w in WARNINGS if w in quiet.output], quiet.output[-3000:]
        # Nor any other library line: a warning, one logged in torch's `W1201 06:00:00.000 ...` form, or a bar.
        noise = [line for line in quiet.output.splitlines() if re.search(r"warn|^[WE]\d{4} |it/s\]", line, re.I)]
        assert not noise, quiet.output[-3000:]
        loud = cli(["export", str(out), str(tmp_path / "export-verbose"), "--int8", "--verbose"])
    finally:
        os.umask(old)
    assert [w for w in WARNINGS if w in loud.output] == ["UserWarning", "assuming the intent is to load in a single "
                                                         "process", "quantize_per_tensor"], loud.output[-3000:]
