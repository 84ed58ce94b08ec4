"""--peft lora on a built-in workload (the tiny Longformer) under ZeRO-3: only the adapters and the head train, and
its export is the merged plain model (the built-ins' export format), which scores what the run scored."""

from __future__ import annotations

import json

from launch import cli, tiny_args, torchrun


def test_a_builtin_trains_adapters_and_exports_them_merged(ld_data, tmp_path):
    run = torchrun(
        tiny_args(
            "longformer",
            ld_data,
            tmp_path / "run",
            *("--strategy", "zero3", "--max-steps", "3", "--per-device-batch-size", "4"),
            *("--peft", "lora", "--target-modules", "query,value"),
        )
    )
    summary = json.loads((run.output_dir / "summary.json").read_text())
    assert 0 < summary["params_trainable"] < summary["params_frozen"] / 10, summary
    exported = cli(["export", str(run.output_dir), str(tmp_path / "export"), "--eval"])
    meta = json.loads((tmp_path / "export" / "shardtrain_export.json").read_text())
    assert (
        meta["export_config"]["text_config"]["model_type"] == "longformer"
        and (tmp_path / "export" / "model.safetensors").is_file()
    )
    assert not (tmp_path / "export" / "adapter_config.json").exists()
    accuracy = summary["eval"]["accuracy"]
    assert f"fp32 validation: accuracy {accuracy:.4f}" in exported.output, (summary["eval"], exported.tail())
