"""docs/memory.md's table of `shardtrain plan` for the seed setups: roberta-base/large + resnet50/densenet121 on
3 x A100-40GB, and longformer-base/large at 4096 tokens on 4 x V100-16GB.

    python benchmarks/plan_seed_setups.py  -> benchmarks/results/plan_seed_setups.json and a markdown table
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from shardtrain.memory.planner import GIB, GPUS, plan  # noqa: E402

SETUPS = [  # (label, config, overrides, gpus, gpu)
    ("roberta-base + resnet50", "configs/multimodal_sentiment.yaml", {}, 3, "a100-40gb"),
    ("roberta-large + resnet50", "configs/multimodal_sentiment.yaml", {"text_model": "roberta-large"}, 3, "a100-40gb"),
    ("roberta-base + densenet121", "configs/multimodal_densenet.yaml", {}, 3, "a100-40gb"),
    (
        "roberta-large + densenet121",
        "configs/multimodal_densenet.yaml",
        {"text_model": "roberta-large"},
        3,
        "a100-40gb",
    ),
    ("longformer-base 4096", "configs/longformer_4096.yaml", {}, 4, "v100-16gb"),
    (
        "longformer-large 4096",
        "configs/longformer_4096.yaml",
        {"text_model": "allenai/longformer-large-4096"},
        4,
        "v100-16gb",
    ),
]


def config(path: str, overrides: dict):
    from shardtrain.config.settings import from_dict, load_yaml, replace_fields, validate

    cfg = from_dict(load_yaml(REPO / path))
    return validate(replace_fields(cfg, **overrides, output_dir="/tmp", resume="none"))


def main() -> int:
    out, lines = {}, []
    lines.append("| setup | GPUs | micro x accum, seq | ddp | zero2 | fsdp | zero3 | zero3_offload | recommendation |")
    lines.append("|---|---|---|---|---|---|---|---|---|")
    for label, path, overrides, n, gpu in SETUPS:
        cfg = config(path, overrides)
        g = GPUS[gpu]
        p = plan(cfg, n, g.memory_gib * GIB, bf16_ok=g.bf16)
        out[label] = p
        by = {
            (r["variant"], r["activation_checkpointing"]): r
            for r in p["rows"]
            if r["micro_batch_size"] == cfg.train.per_device_batch_size
        }

        def cell(v):
            off, on = by[(v, False)], by[(v, True)]  # noqa: B023 - called within this iteration
            return (
                f"{off['total_bytes'] / GIB:.1f}{'' if off['fits'] else '✗'} / "
                f"{on['total_bytes'] / GIB:.1f}{'' if on['fits'] else '✗'}"
            )

        rec = p["recommendation"]
        ac = rec and rec["activation_checkpointing"]
        ac_s = f"{rec['checkpointed_blocks']} of {rec['blocks']} blocks" if ac == "auto" else ("on" if ac else "off")
        rec_s = (
            f"{rec['variant']}, AC {ac_s}, {rec['micro_batch_size']} x {rec['grad_accum']}" if rec else "nothing fits"
        )
        lines.append(
            f"| {label} ({p['model_params'] / 1e6:.0f}M, {p['precision']}) | {n} x {g.name} | "
            f"{cfg.train.per_device_batch_size} x {cfg.train.grad_accum}, {cfg.data.max_length} | "
            + " | ".join(cell(v) for v in ("ddp", "zero2", "fsdp", "zero3", "zero3_offload"))
            + f" | {rec_s} |"
        )
        print(lines[-1], flush=True)
    lines.append("\nGiB per GPU predicted, activation checkpointing off / on; ✗ = does not fit (5% headroom).")
    (REPO / "benchmarks/results/plan_seed_setups.json").write_text(json.dumps(out, indent=1))
    (REPO / "benchmarks/results/plan_seed_setups.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
