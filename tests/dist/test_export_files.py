"""What `shardtrain export` and --final-model-dir leave behind: files with the mode any other file gets, and no
library warnings unless --verbose. The INT8 copy (torchao) loads with torch's and torchao's own calls, and
`shardtrain predict` reads the fp32 export and the INT8 copy."""

from __future__ import annotations

import json
import os
import re

import pytest
from launch import cli, predicted_metrics, tiny_args, torchrun

WARNINGS = (
    "UserWarning",
    "FutureWarning",
    "assuming the intent is to load in a single process",
    "is an Enum subclass",
    "deprecated",
)


def test_exported_files_get_the_umask_mode_and_export_is_quiet(mm_data, tmp_path):
    out, final, export = tmp_path / "run", tmp_path / "final", tmp_path / "export"
    old = os.umask(0o022)  # inherited by the runs: their files should come out 0644
    try:
        torchrun(
            tiny_args(
                "multimodal",
                mm_data,
                out,
                "--strategy",
                "ddp",
                "--max-steps",
                "1",
                "--save-every",
                "1",
                "--max-eval-samples",
                "8",
                "--final-model-dir",
                str(final),
            ),
            nproc=1,
        )
        quiet = cli(["export", str(out), str(export), "--int8"])
        for path in (
            final / "model.safetensors",
            final / "config.json",
            export / "model.safetensors",
            export / "model_int8.pt",
            export / "config.json",
        ):
            assert oct(path.stat().st_mode & 0o777) == oct(0o644), path
        assert not [w for w in WARNINGS if w in quiet.output], quiet.output[-3000:]
        # Nor any other library line: a warning, one logged in torch's `W1201 06:00:00.000 ...` form, or a bar.
        noise = [line for line in quiet.output.splitlines() if re.search(r"warn|^[WE]\d{4} |it/s\]", line, re.I)]
        assert not noise, quiet.output[-3000:]
        loud = cli(["export", str(out), str(tmp_path / "export-verbose"), "--int8", "--verbose"])
        # predict from the fp32 export and from its INT8 copy; preds.jsonl gets the umask's mode too
        fp32 = cli(["predict", str(export), "--output", str(tmp_path / "fp32.jsonl")])
        int8 = cli(["predict", str(export), "--int8", "--output", str(tmp_path / "int8.jsonl")])
        assert oct((tmp_path / "int8.jsonl").stat().st_mode & 0o777) == oct(0o644)
    finally:
        os.umask(old)
    assert [w for w in WARNINGS if w in loud.output] == [
        "UserWarning",
        "assuming the intent is to load in a single process",
        "is an Enum subclass",
        "deprecated",
    ], loud.output[-3000:]
    assert not [w for w in WARNINGS if w in fp32.output + int8.output], (fp32.output + int8.output)[-3000:]
    run_eval = json.loads((out / "summary.json").read_text())["eval"]
    assert predicted_metrics(fp32) == pytest.approx(run_eval, rel=1e-9), fp32.tail()
    assert predicted_metrics(int8)["n_examples"] == 8 and len((tmp_path / "int8.jsonl").read_text().splitlines()) == 8
    meta = json.loads((export / "shardtrain_export.json").read_text())
    assert meta["bytes_int8"] == (export / "model_int8.pt").stat().st_size < meta["bytes_fp32"], meta

    # The README's lines, with the libraries' own calls: the architecture from config.json, then torch.load +
    # load_state_dict(assign=True) as torchao documents it. The same outputs as shardtrain's loader gives.
    import torch
    from torchao.quantization import Int8Tensor

    from shardtrain.builtin_workloads.networks import build_model_from_export
    from shardtrain.checkpointing.export import load_int8

    model = build_model_from_export(json.loads((export / "config.json").read_text()))
    model.load_state_dict(torch.load(export / "model_int8.pt", weights_only=True), assign=True)
    kinds = {name: type(p).__name__ for name, p in model.named_parameters()}
    assert kinds["text.embeddings.word_embeddings.weight"] == kinds["head.mlp.3.weight"] == Int8Tensor.__name__
    assert isinstance(model.text.encoder.layer[0].attention.self.query.weight, Int8Tensor)
    torch.manual_seed(0)
    batch = {
        "input_ids": torch.randint(3, 100, (2, 12)),
        "attention_mask": torch.ones(2, 12, dtype=torch.long),
        "pixel_values": torch.randn(2, 3, 32, 32),
    }
    with torch.no_grad():
        assert torch.equal(model.eval()(**batch), load_int8(export)(**batch))
