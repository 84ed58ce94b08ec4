"""What freezing saves: per-rank model state (params, grads, optimizer state, as shardtrain's own accounting reports
them in summary.json `memory.per_rank`) with `freeze_layers: 6` against none, under ddp, fsdp, zero2 and zero3,
on 2 CPU processes.

    python benchmarks/freeze_memory.py                    -> benchmarks/results/freeze_memory.json ("after")
    python benchmarks/freeze_memory.py --code /tmp/main --label before --merge
        (the same measurement of another checkout, e.g. `git archive main | tar -x -C /tmp/main`)

The model is the multimodal tiny config with an 8-layer text encoder (hidden 64), so `freeze_layers: 6` freezes
the text embeddings, 6 of 8 text layers, the CNN stem and 3 of its 4 stages. ONE torchrun launch runs all eight
configurations (tests/dist/matrix_driver.py of the measured checkout: the same parse_cli -> train as
shardtrain/main.py), 2 optimizer steps each; the second step is the one measured (AdamW state exists from the
first). The table takes each category's largest rank: under ZeRO-2 a parameter that straddles two ranks'
partitions keeps its whole gradient alive on one of them, so ranks differ by up to a few MiB here (both are in
the JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

STRATEGIES = {
    "ddp": ["--strategy", "ddp"],
    "fsdp": ["--strategy", "fsdp", "--fsdp-policy", "fsdp_policies/default.yaml"],
    "zero2": ["--ds", "ds_configs/zero2.json"],
    "zero3": ["--ds", "ds_configs/zero3.json"],
}
FREEZE = (0, 6)
MODEL = [
    "--text-config",
    '{"hidden_size": 64, "num_hidden_layers": 8, "num_attention_heads": 2, "intermediate_size": 128}',
    "--max-steps",
    "2",
    "--memory-every",
    "0",
    "--max-eval-samples",
    "8",
    "--report",
    "false",
    "--log-every",
    "100",
    "--resume",
    "none",
    "--predict-memory",
    "false",
]
KEYS = ("params", "grads", "optimizer", "model_state")


def launch(code: Path, data: Path, root: Path) -> dict:
    plan = [
        {
            "name": f"{s}/freeze{n}",
            "args": [
                "--config",
                str(code / "configs/multimodal_tiny.yaml"),
                "--data-dir",
                str(data),
                "--output-dir",
                str(root / f"{s}-freeze{n}"),
                *MODEL,
                *[str(code / a) if a.endswith((".json", ".yaml")) else a for a in flags],
                *(["--freeze-layers", str(n)] if n else []),
            ],
        }
        for s, flags in STRATEGIES.items()
        for n in FREEZE
    ]
    (root / "plan.json").write_text(json.dumps(plan))
    env = dict(
        os.environ,
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        DS_ACCELERATOR="cpu",
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(code),
    )
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    from shardtrain.runtime.distributed import free_port

    cmd = [
        str(Path(sys.executable).parent / "torchrun"),
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        str(code / "tests/dist/matrix_driver.py"),
        str(root / "plan.json"),
        str(root / "out"),
    ]
    (root / "out").mkdir(exist_ok=True)
    proc = subprocess.run(cmd, env=env, cwd=code, capture_output=True, text=True)
    if proc.returncode != 0:
        print((proc.stdout + proc.stderr)[-4000:], file=sys.stderr)
        raise SystemExit(f"exit {proc.returncode}")
    return {
        p["name"]: json.loads((Path(p["args"][p["args"].index("--output-dir") + 1]) / "summary.json").read_text())
        for p in plan
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--code", default=str(REPO), help="the checkout whose shardtrain is measured")
    parser.add_argument("--label", default="after")
    parser.add_argument("--out", default=str(REPO / "benchmarks/results/freeze_memory.json"))
    parser.add_argument("--merge", action="store_true", help="add this label to the results already in --out")
    args = parser.parse_args()

    from shardtrain.data import make_data

    root = Path(tempfile.mkdtemp(prefix="freeze_memory-"))
    data = make_data("multimodal", root / "data", n_train=64, n_val=16, seed=0)
    summaries = launch(Path(args.code).resolve(), data, root)
    results = (
        json.loads(Path(args.out).read_text())
        if args.merge and Path(args.out).is_file()
        else {
            "model": "multimodal tiny, text encoder 8 x 64 (roberta arch) + resnet18 [1,1,1,1], fp32, 2 CPU ranks",
            "measured": "summary.json memory.per_rank at step 2, bytes; params/grads/optimizer/model_state: "
            "the largest rank",
            "runs": {},
        }
    )
    table = results["runs"].setdefault(args.label, {})
    for s in STRATEGIES:
        row = {}
        for n in FREEZE:
            summary = summaries[f"{s}/freeze{n}"]
            per_rank = summary["memory"]["per_rank"]
            row[f"freeze{n}"] = {
                **{k: max(rec[k] for rec in per_rank.values()) for k in KEYS},
                "per_rank": {r: {k: rec[k] for k in KEYS} for r, rec in per_rank.items()},
                "params_trainable": summary["params_trainable"],
                "params_total": summary["params_total"],
            }
        row["model_state_saved"] = 1 - row["freeze6"]["model_state"] / row["freeze0"]["model_state"]
        row["grads_and_optimizer_saved"] = 1 - (
            (row["freeze6"]["grads"] + row["freeze6"]["optimizer"])
            / (row["freeze0"]["grads"] + row["freeze0"]["optimizer"])
        )
        table[s] = row
        print(
            f"{args.label:<7} {s:<6} "
            + " | ".join(
                f"freeze {n}: " + " ".join(f"{k} {row[f'freeze{n}'][k] / 2**20:6.2f}" for k in KEYS) for n in FREEZE
            )
            + f" MiB | model state saved {row['model_state_saved']:.1%}",
            flush=True,
        )
    Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
