"""Start-up: time from launch to the end of the first optimizer step, shardtrain against the same contenders
as benchmarks/overhead.py, per strategy, warm and cold.

    ~/.cache/shardtrain/venv/bin/python benchmarks/startup.py            # -> benchmarks/results/startup.json
    ~/.cache/shardtrain/venv/bin/python benchmarks/startup.py --dry-run  # one round, DDP, no warm-up run first

Every contender is launched the way its users launch it (torchrun; shardtrain also as `shardtrain train
--nproc 2`, whose parent process relaunches torchrun) on the tiny Longformer config (HF Trainer's cell) with
the default flags, so shardtrain's pre-launch checks and the banner's memory prediction are included. The clock
starts just before the launch command is started and stops at the wall-clock stamp of step 1 in rank 0's
metrics.jsonl (written after that step's host sync, as in overhead.py). Contenders are interleaved per round.

warm: DeepSpeed's JIT-op cache (TORCH_EXTENSIONS_DIR) and shardtrain's tokenised-data cache (HF_DATASETS_CACHE)
already filled by an earlier run; cold: both empty, fresh folders for that one run. Every run has a fresh output
folder, so every contender trains its BPE tokenizer each time (as a first run does); the OS page cache is not
dropped (a shared machine), so "cold" is cold for these caches, not for the disk.

shardtrain's phases come from the wall-clock stamps its loop writes to summary.json `startup`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import overhead  # noqa: E402  the contenders, their strategy flags and the peers' known refusals
from overhead import REPO, launch  # noqa: E402

CONFIG = REPO / "configs" / "longformer_tiny.yaml"
CONTENDERS = ["shardtrain", "shardtrain_cli", "handwritten", "accelerate", "fabric", "hf_trainer"]
PHASES = ["imports", "process_group", "data", "model_build", "strategy_setup", "banner_and_prediction", "first_step"]


def command(contender: str, strategy: str, args: list[str], nproc: int) -> list[str]:
    if contender == "shardtrain_cli":  # what a user types; the parent process starts torchrun itself
        return [
            sys.executable,
            "-m",
            "shardtrain",
            "train",
            "--nproc",
            str(nproc),
            *args,
            *overhead.STRATEGY_ARGS[strategy],
        ]
    return [
        str(launch.BIN / "torchrun"),
        f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={launch.free_port()}",
        str(overhead.SCRIPTS[contender](strategy)),
        *args,
        *overhead.STRATEGY_ARGS[strategy],
    ]


def phases(launched: float, stamps: dict) -> dict:
    """Seconds per phase from the loop's wall-clock stamps (imports: launch to train(), the launcher, the
    interpreter, the imports, the config and the pre-launch checks included)."""
    built = stamps["model_build_seconds"]
    return {
        "imports": stamps["train_entry"] - launched,
        "process_group": stamps["process_group"] - stamps["train_entry"],
        "data": stamps["data"] - stamps["process_group"],
        "model_build": built,
        "strategy_setup": stamps["strategy_setup"] - stamps["data"] - built,
        "banner_and_prediction": stamps["banner"] - stamps["strategy_setup"],
        "first_step": stamps["first_step"] - stamps["banner"],
    }


def run_once(contender: str, strategy: str, data: Path, work: Path, cold: bool, nproc: int, warm_env: dict):
    out = work / "runs" / f"{strategy}-{contender}"
    if out.exists():
        shutil.rmtree(out)
    env = dict(warm_env)
    fresh = None
    if cold:
        fresh = Path(tempfile.mkdtemp(prefix="cold-", dir=work))
        env.update(TORCH_EXTENSIONS_DIR=str(fresh / "torch_extensions"), HF_DATASETS_CACHE=str(fresh / "datasets"))
    args = [
        "--config",
        str(CONFIG),
        "--data-dir",
        str(data),
        "--output-dir",
        str(out),
        "--resume",
        "none",
        "--max-steps",
        "2",
        "--eval-every",
        "0",
        "--save-every",
        "0",
    ]
    launched = time.time()
    run = launch.run(command(contender, strategy, args, nproc), timeout=900, env=env, check=False)
    if fresh is not None:
        shutil.rmtree(fresh, ignore_errors=True)
    why = overhead.refusal(contender.removesuffix("_cli"), strategy, run)
    if why is not None:
        return {"skipped": f"{contender} cannot run {strategy} on CPU / gloo: {why}"}
    run.check()
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 1, first
    r = {"seconds": first["wall_time"] - launched}
    if contender.startswith("shardtrain"):
        r["phases"] = phases(launched, json.loads((out / "summary.json").read_text())["startup"])
    return r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--strategies", default=",".join(overhead.STRATEGY_ARGS))
    ap.add_argument("--contenders", default=",".join(CONTENDERS))
    ap.add_argument("--rounds", type=int, default=3, help="warm rounds (every contender once per round)")
    ap.add_argument("--cold-rounds", type=int, default=2)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--work", default="/tmp/shardtrain-bench/startup", help="data, caches and runs (not committed)")
    ap.add_argument("--out", default=str(BENCH / "results" / "startup.json"))
    ap.add_argument("--dry-run", action="store_true", help="DDP, one round, no cold one, no warm-up run first")
    a = ap.parse_args(argv)
    strategies, contenders = a.strategies.split(","), a.contenders.split(",")
    unknown = set(contenders) - set(CONTENDERS)
    if unknown:
        raise SystemExit(f"--contenders: unknown {sorted(unknown)}; known: {', '.join(CONTENDERS)}")
    if a.dry_run:
        strategies, a.rounds, a.cold_rounds = (
            ["ddp"] if a.strategies == ap.get_default("strategies") else strategies,
            1,
            0,
        )

    from shardtrain.data import make_data

    work = Path(a.work)
    data = work / "data"
    if not (data / "train.jsonl").exists():
        make_data("longdoc", data, n_train=512, n_val=64, seed=0, overwrite=True)
    warm_env = launch.test_env(HF_DATASETS_CACHE=str(work / "hf_datasets"))
    warm_env.pop("WANDB_MODE", None)  # W&B stays off, as it is without --report-to

    result = {
        "benchmark": "startup",
        "dry_run": a.dry_run,
        "nproc": a.nproc,
        "device": "cpu (gloo)",
        "config": str(CONFIG.relative_to(REPO)),
        "host": {"cpus": os.cpu_count(), "machine": platform.machine()},
        "measures": "seconds from starting the launch command to the wall-clock stamp of step 1 in rank 0's "
        "metrics.jsonl; medians over rounds",
        "warm": "TORCH_EXTENSIONS_DIR (DeepSpeed's JIT ops) and HF_DATASETS_CACHE (shardtrain's tokenised "
        "splits) filled by an earlier run of the same command",
        "cold": "TORCH_EXTENSIONS_DIR and HF_DATASETS_CACHE empty (fresh folders for the one run): DeepSpeed "
        "builds its ops, shardtrain tokenises; the OS page cache is not dropped (shared machine)",
        "every_run": "fresh output folder: every contender trains its BPE tokenizer, as a first run does",
        "command": " ".join(["benchmarks/startup.py", *(argv if argv is not None else sys.argv[1:])]),
        "rounds": {"warm": a.rounds, "cold": a.cold_rounds},
        "entries": [],
    }
    t_start = time.time()
    # One unmeasured run fills the warm tokenised-data cache; the warm JIT-op cache is the venv's (tests fill it).
    # Not in a dry run, which checks that every contender starts and the JSON is whole, and times nothing (a
    # launch is ~13 CPU-s of the test suite's).
    if not a.dry_run:
        run_once("shardtrain", "ddp", data, work, False, a.nproc, warm_env)
    load_before = os.getloadavg()
    for strategy in strategies:
        runs = {c: {"warm": [], "cold": []} for c in contenders}
        skipped = {}
        plan = [("cold", i) for i in range(a.cold_rounds)] + [("warm", i) for i in range(a.rounds)]
        for kind, _i in plan:
            for c in contenders:
                if c in skipped:
                    continue
                r = run_once(c, strategy, data, work, kind == "cold", a.nproc, warm_env)
                if "skipped" in r:
                    skipped[c] = r["skipped"]
                    print(f"{strategy:6s} {c:15s} skipped: {r['skipped']}", flush=True)
                    continue
                runs[c][kind].append(r)
                print(f"{strategy:6s} {kind:4s} {c:15s} {r['seconds']:6.1f} s", flush=True)
        for c in contenders:
            entry = {"strategy": strategy, "contender": c}
            if c in skipped:
                entry["skipped"] = skipped[c]
            else:
                for kind in ("warm", "cold"):
                    secs = [r["seconds"] for r in runs[c][kind]]
                    entry[f"{kind}_seconds"] = statistics.median(secs) if secs else None
                    entry[f"{kind}_runs"] = secs
                    if c.startswith("shardtrain") and runs[c][kind]:
                        entry[f"{kind}_phases_median"] = {
                            p: statistics.median(r["phases"][p] for r in runs[c][kind]) for p in PHASES
                        }
            result["entries"].append(entry)
        hand = next(
            (
                e.get("warm_seconds")
                for e in result["entries"]
                if e["strategy"] == strategy and e["contender"] == "handwritten"
            ),
            None,
        )
        for e in result["entries"]:
            if e["strategy"] == strategy and hand and e.get("warm_seconds"):
                e["warm_ratio_vs_handwritten"] = e["warm_seconds"] / hand
        result["machine_load"] = {"loadavg_before": list(load_before), "loadavg_after": list(os.getloadavg())}
        result["wall_seconds"] = time.time() - t_start
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=2) + "\n")  # after every strategy
    print(f"\n{'strategy':8s} {'contender':15s} {'warm s':>7s} {'cold s':>7s} {'vs hand':>8s}")
    for e in result["entries"]:
        f = lambda v: f"{v:7.1f}" if v else f"{'-':>7s}"  # noqa: E731
        print(
            f"{e['strategy']:8s} {e['contender']:15s} {f(e.get('warm_seconds'))} {f(e.get('cold_seconds'))} "
            f"{e.get('warm_ratio_vs_handwritten') or 0:8.2f}" + (f"  {e['skipped'][:60]}" if "skipped" in e else "")
        )
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
