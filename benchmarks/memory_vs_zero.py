"""Per-rank model-state bytes of a real-size model (roberta-base + resnet50, random init, fp32), measured by
shardtrain's own accounting (summary.json `memory.per_rank`, a walk over the tensors each rank holds), against
the planner's formula for what shardtrain allocates, at 2 and 4 CPU processes; and ZeRO-3 / FSDP per-rank
state at N = 1, 2, 4 against the ideal 1/N.

    python benchmarks/memory_vs_zero.py --worlds 1,2          -> benchmarks/results/memory_vs_zero.json
    python benchmarks/memory_vs_zero.py --worlds 4 --strategies fsdp,zero2,zero3 --merge

Each world size is ONE torchrun launch running every strategy in turn (tests/dist/matrix_driver.py: the same
parse_cli -> train as shardtrain/main.py), 2 optimizer steps each (the second is the one measured: AdamW
state exists from the first step on). Tiny inputs (16 tokens, 32x32 images, micro-batch 2) keep it to a few
minutes; model states do not depend on them. Check host memory first: DDP at N=4 holds 4 x 16 B x 150 M.
Targets: |measured/formula - 1| <= 5%; per-rank state at N >= 0.95 of the ideal (state at 1)/N.
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
    "fsdp": ["--strategy", "fsdp", "--fsdp-policy", str(REPO / "fsdp_policies/default.yaml")],
    "zero2": ["--ds", str(REPO / "ds_configs/zero2.json")],
    "zero3": ["--ds", str(REPO / "ds_configs/zero3.json")],
}
MODEL = [
    "--text-model",
    "roberta-base",
    "--pretrained",
    "false",
    "--text-config",
    "{}",
    "--image-model",
    "resnet50",
    "--image-config",
    "{}",
    "--fusion-hidden",
    "512",
    "--max-length",
    "16",
    "--image-size",
    "32",
    "--per-device-batch-size",
    "2",
    "--grad-accum",
    "1",
    "--max-steps",
    "2",
    "--max-eval-samples",
    "8",
    "--report",
    "false",
    "--log-every",
    "100",
    "--resume",
    "none",
    "--memory-every",
    "0",
]


def env() -> dict:
    e = dict(os.environ)
    e.update(
        {
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1",
            "DS_ACCELERATOR": "cpu",
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(REPO),
        }
    )
    e.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    return e


def launch(world: int, strategies: list[str], data: Path, root: Path) -> dict:
    plan = [
        {
            "name": s,
            "args": [
                "--config",
                str(REPO / "configs/multimodal_tiny.yaml"),
                "--data-dir",
                str(data),
                "--output-dir",
                str(root / f"{s}-n{world}"),
                *MODEL,
                *STRATEGIES[s],
            ],
        }
        for s in strategies
    ]
    (root / f"plan-n{world}.json").write_text(json.dumps(plan))
    torchrun = Path(sys.executable).parent / "torchrun"
    from shardtrain.runtime.distributed import free_port

    cmd = [
        str(torchrun),
        f"--nproc_per_node={world}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        str(REPO / "tests/dist/matrix_driver.py"),
        str(root / f"plan-n{world}.json"),
        str(root / f"n{world}"),
    ]
    (root / f"n{world}").mkdir(exist_ok=True)
    proc = subprocess.run(cmd, env=env(), capture_output=True, text=True)
    if proc.returncode != 0:
        print((proc.stdout + proc.stderr)[-4000:], file=sys.stderr)
        raise SystemExit(f"world {world}: exit {proc.returncode}")
    return {s: json.loads((root / f"{s}-n{world}" / "summary.json").read_text()) for s in strategies}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worlds", default="1,2,4")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--out", default=str(REPO / "benchmarks/results/memory_vs_zero.json"))
    parser.add_argument(
        "--merge",
        action="store_true",
        help="add to the results already in --out (e.g. N=4 "
        "for the sharded strategies only, where DDP's 4 full copies would not fit in host RAM)",
    )
    args = parser.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    strategies = args.strategies.split(",")

    from shardtrain.config.settings import parse_cli
    from shardtrain.data import make_data
    from shardtrain.memory.planner import count_model, model_states, paper_formula

    root = Path(tempfile.mkdtemp(prefix="memory_vs_zero-"))
    data = make_data("multimodal", root / "data", n_train=64, n_val=16, seed=0)
    results: dict = {"model": "roberta-base + resnet50 (random init, fp32)", "per_strategy": {}}
    if args.merge and Path(args.out).is_file():
        results = json.loads(Path(args.out).read_text())
    for world in worlds:
        summaries = launch(world, strategies, data, root)
        for s, summary in summaries.items():
            cfg = parse_cli(
                [
                    "--config",
                    str(REPO / "configs/multimodal_tiny.yaml"),
                    "--data-dir",
                    str(data),
                    "--output-dir",
                    str(root / "plan"),
                    *MODEL,
                    *STRATEGIES[s],
                ]
            )
            m = count_model(cfg)
            pred = model_states(s, m, world, "fp32")["gpu"]
            formula = pred["params"] + pred["grads"] + pred["optimizer"]
            per_rank = summary["memory"]["per_rank"]
            measured = [rec["model_state"] for _, rec in sorted(per_rank.items(), key=lambda kv: int(kv[0]))]
            worst = max(measured, key=lambda b: abs(b / formula - 1))
            results["per_strategy"].setdefault(s, {})[str(world)] = {
                "params_counted": m.params,
                "params_run": summary["params_total"],
                "measured_bytes_per_rank": measured,
                "formula_bytes_per_rank": formula,
                "rel_error": worst / formula - 1,
                "zero_paper_bytes_per_rank": paper_formula(s, m.params, world).get("zero_paper"),
                "construction_peak_rss_per_rank": [
                    r["peak_rss"] for _, r in sorted(summary["memory"]["construction"].items())
                ],
                "comm_bytes_per_rank": [rec["comm"] for rec in per_rank.values()],
            }
            print(
                f"n={world} {s:<6} measured {max(measured) / 2**20:9.1f} MiB/rank, formula {formula / 2**20:9.1f} "
                f"MiB, error {worst / formula - 1:+.3%}",
                flush=True,
            )
    if any("1" in by for by in results["per_strategy"].values()):
        results["scaling_vs_ideal"] = {}
        for s in ("fsdp", "zero3"):
            by = results["per_strategy"].get(s, {})
            if "1" not in by:
                continue
            one = max(by["1"]["measured_bytes_per_rank"])
            results["scaling_vs_ideal"][s] = {
                w: (one / int(w)) / max(v["measured_bytes_per_rank"]) for w, v in by.items() if w != "1"
            }
    results["targets"] = {"rel_error_max": 0.05, "scaling_min": 0.95}
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(json.dumps(results.get("scaling_vs_ideal", {}), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
