"""ZeRO checkpoints written once, each rank its own partition (docs/checkpoints.md "ZeRO checkpoints").

ONE launch of tests/dist/matrix_driver.py (2 CPU ranks, the tiny multimodal model, dropout 0.1 as shipped): ZeRO-2
and ZeRO-3 with DeepSpeed's engine files asked for (`--engine-files`), and ZeRO-3 as it runs by default.
- by default a step folder holds the portable form alone (no engine/), and each rank wrote its own ranges of the
  parameters: a weight's chunks in the DCP metadata come from both ranks, and none is the whole tensor;
- with --engine-files, DeepSpeed's zero_to_fp32 reads engine/ into exactly the weights the portable form holds
  (what `shardtrain export` and every resume read).
Exact resume of the partitioned form after kill -9 (sync, async) is in test_checkpoints.py and
test_async_checkpoints.py; the gathered form of older checkpoints in test_old_checkpoints.py.
"""

from __future__ import annotations

import torch
from launch import run_plan, tiny_args

from shardtrain.checkpointing.dcp_state import MODEL_DIR, read_metadata
from shardtrain.checkpointing.portable import read_portable

FLAGS = {"zero2": ["--ds", "ds_configs/zero2.json"], "zero3": ["--ds", "ds_configs/zero3.json"]}


def test_zero_writes_its_partitions_once_and_engine_files_only_when_asked(mm_data, tmp_path):
    runs = {
        "zero2-engine": ("zero2", ["--engine-files"]),
        "zero3-engine": ("zero3", ["--engine-files"]),
        "zero3": ("zero3", []),
    }
    plan = [
        {
            "name": name,
            "args": tiny_args(
                "multimodal",
                mm_data,
                tmp_path / name,
                *FLAGS[s],
                *extra,
                "--per-device-batch-size",
                "8",
                "--max-steps",
                "2",
                "--save-every",
                "2",
                "--eval-every",
                "0",
            ),
        }
        for name, (s, extra) in runs.items()
    ]
    (tmp_path / "plan").mkdir()
    run_plan(plan, tmp_path / "plan", timeout=600)
    ckpt = {name: tmp_path / name / "checkpoints" / "step-000002" for name in runs}

    assert not (ckpt["zero3"] / "engine").exists() and (ckpt["zero3-engine"] / "engine").is_dir()
    metadata = read_metadata(ckpt["zero3"]).state_dict_metadata
    chunked = {
        k: m
        for k, m in metadata.items()
        if k.startswith(("model.", "optim.state.")) and len(m.size) == 2 and m.size.numel() >= 1000
    }
    assert chunked, sorted(metadata)[:10]
    for key, meta in chunked.items():
        assert len(meta.chunks) >= 2 and all(tuple(c.sizes) != tuple(meta.size) for c in meta.chunks), (key, meta)
    files = [f.name for f in (ckpt["zero3"] / MODEL_DIR).iterdir()]
    assert sorted(f for f in files if f.endswith(".distcp")) == ["__0_0.distcp", "__1_0.distcp"], files
    # The same training, the same bytes: the default's step folder is the portable form of the engine-files run.
    portable = {n: read_portable(ckpt[n], optimizer=True) for n in ckpt}
    for part in ("model", "optim"):
        a, b = portable["zero3"][part], portable["zero3-engine"][part]
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a), part

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    for name in ("zero2-engine", "zero3-engine"):
        # No tag, as `python zero_to_fp32.py . OUT` in the step folder reads it: from the folder's `latest` (a
        # trial's run of the script DeepSpeed copies there failed: "Unable to find 'latest' file").
        assert (ckpt[name] / "zero_to_fp32.py").is_file() and (ckpt[name] / "latest").read_text() == "engine"
        theirs = get_fp32_state_dict_from_zero_checkpoint(str(ckpt[name]))
        ours = portable[name]["model"]
        assert set(theirs) <= set(ours) and len(theirs) > 10, (name, sorted(set(theirs) ^ set(ours))[:5])
        different = [k for k in theirs if not torch.equal(theirs[k].float(), ours[k])]
        assert not different, (name, different[:5])
