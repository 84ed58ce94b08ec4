"""ZeRO checkpoints that scale: what one save and one load cost per rank under ZeRO-2 and ZeRO-3 against
FSDP, at 1, 2 and 4 processes, on a 67M-parameter MLP (16 x Linear(2048, 2048), fp32, AdamW).

    ~/.cache/shardtrain/venv/bin/python benchmarks/zero_checkpoint.py   -> benchmarks/results/zero_checkpoint.json
    ~/.cache/shardtrain/venv/bin/python benchmarks/zero_checkpoint.py --worlds 2 --rounds 1   # quick

Per world size ONE torchrun launch (tests/launch.py) of this file with --worker: every strategy is set up through
shardtrain's own Strategy interface (make_strategy -> setup -> one optimizer step, so Adam's moments exist), then
saved with `strategy.save` and loaded with `strategy.load` (what the loop's checkpoints call), round by round with
the strategies interleaved (fsdp, zero2, zero3, and `zero3_gathered`: the save as it was before this issue, the
full gather of every tensor on every rank plus DeepSpeed's engine files, kept as the baseline), so that drift on
the shared machine hits all alike. Per save and rank:
  - extra peak RSS: a sampling thread reads /proc/self/statm every 2 ms during the save; the peak minus the RSS
    just before it (the save's own host memory; the page cache is not RSS);
  - bytes written: the files of the step folder (every rank's, once);
  - save and load seconds: wall time of the call, the slowest rank (every rank waits for it).
Targets: extra RSS <= 1.25 x model state / N (model state = fp32 weights + two Adam moments, 12 bytes per
parameter), bytes <= 1.05 x model state, save and load time <= 1.2 x FSDP's (paired per round, median).
The machine is a loaded 2-core VM shared with other engineers: the load average is recorded per launch; at 4
processes the ranks share 2 cores, so times there say more about the machine than about the formats.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

STRATEGIES = {
    "fsdp": ["--strategy", "fsdp"],
    "zero2": ["--ds", str(REPO / "ds_configs" / "zero2.json")],
    "zero3": ["--ds", str(REPO / "ds_configs" / "zero3.json")],
    "zero3_gathered": ["--ds", str(REPO / "ds_configs" / "zero3.json")],
}
LAYERS, WIDTH = 16, 2048
TARGETS = {"extra_rss_over_state_per_rank": 1.25, "bytes_over_state": 1.05, "time_over_fsdp": 1.2}


# ---- the worker: one process of the torchrun launch ----------------------------------------------------------
class RssPeak:
    """Peak resident set size of this process while the block runs (sampled every 2 ms from /proc)."""

    def __init__(self):
        self.page = os.sysconf("SC_PAGE_SIZE")

    def rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def __enter__(self):
        self.before = self.peak = self.rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            self._stop.wait(0.002)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())
        self.extra = self.peak - self.before


def mlp_workload(cfg):
    import torch
    from torch import nn

    from shardtrain.workloads.base import Workload

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(WIDTH, WIDTH)

        def forward(self, x):
            return torch.relu(self.lin(x))

    class Mlp(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    class MlpTask(Workload):
        def build_model(self):
            return Mlp()

        def datasets(self):
            return [], []

        def block_classes(self):
            return (Block,)

        def forward(self, model, batch):  # the batch is one tensor, the model's one positional input
            return model(batch)

    return MlpTask(cfg)


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def worker(a) -> int:
    import gc

    import torch
    import torch.distributed as dist

    from shardtrain.checkpointing.dcp_state import save_portable
    from shardtrain.config.settings import parse_cli
    from shardtrain.runtime.distributed import init_distributed
    from shardtrain.strategies import make_strategy

    work = Path(a.work)
    results = []
    info = None
    for rnd in range(a.rounds):
        for name in a.strategies.split(","):
            cfg = parse_cli(
                [
                    "--device",
                    "cpu",
                    "--output-dir",
                    str(work / "out"),
                    "--precision",
                    "fp32",
                    "--lr",
                    "1e-3",
                    "--warmup-steps",
                    "0",
                    *STRATEGIES[name],
                ]
            )
            info = info or init_distributed("cpu")
            workload = mlp_workload(cfg)
            strategy = make_strategy(cfg, info, workload)

            def build(on_meta=False, load_weights=True, workload=workload):
                torch.manual_seed(0)
                return workload.build_model()

            strategy.setup(build, set())
            strategy.train()
            x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(info.rank))
            with strategy.micro_step(True):
                loss = strategy.model(x).float().pow(2).mean()
                strategy.backward(loss)
            share = strategy.grad_norm_share()
            norm = None
            if share is not None:
                dist.all_reduce(share)
                norm = float(share.sqrt())
            strategy.step(grad_norm=norm)
            ckpt = work / "ckpt" / f"step-{rnd:06d}"
            if info.is_rank0 and ckpt.exists():
                shutil.rmtree(ckpt)
            dist.barrier()
            if info.is_rank0:
                ckpt.mkdir(parents=True)
            dist.barrier()
            gc.collect()
            with RssPeak() as mem:
                t0 = time.perf_counter()
                if name == "zero3_gathered":  # the old save: engine files + the gathered form
                    strategy.engine.save_checkpoint(str(ckpt), tag="engine", save_latest=False)
                    model_sd, optim_state = strategy._portable_state()
                    save_portable(ckpt, model_sd, optim_state, strategy._extra(), info.is_rank0)
                    del model_sd, optim_state
                else:
                    strategy.save(ckpt)
                save_s = time.perf_counter() - t0
            dist.barrier()
            written = folder_bytes(ckpt) if info.is_rank0 else 0
            gc.collect()
            with RssPeak() as load_mem:
                t0 = time.perf_counter()
                strategy.load(ckpt, {"strategy": {"strategy": strategy.name}, "world_size": info.world_size})
                load_s = time.perf_counter() - t0
            dist.barrier()
            row = torch.tensor([save_s, load_s, float(mem.extra), float(load_mem.extra)], dtype=torch.float64)
            rows = [torch.zeros_like(row) for _ in range(info.world_size)]
            dist.all_gather(rows, row)
            params = LAYERS * (WIDTH * WIDTH + WIDTH)
            if info.is_rank0:
                results.append(
                    {
                        "round": rnd,
                        "strategy": name,
                        "nproc": info.world_size,
                        "parameters": params,
                        "save_seconds": max(float(r[0]) for r in rows),
                        "load_seconds": max(float(r[1]) for r in rows),
                        "save_extra_rss_bytes_per_rank": [int(r[2]) for r in rows],
                        "load_extra_rss_bytes_per_rank": [int(r[3]) for r in rows],
                        "bytes_written": written,
                        "load_average_1min": round(os.getloadavg()[0], 2),
                    }
                )
                print(
                    f"[zero_checkpoint] N={info.world_size} round {rnd} {name}: "
                    f"save {results[-1]['save_seconds']:.2f}s "
                    f"load {results[-1]['load_seconds']:.2f}s extra RSS {max(int(r[2]) for r in rows) / 2**20:.0f} MiB "
                    f"written {written / 2**20:.0f} MiB",
                    flush=True,
                )
                (work / "results.json").write_text(json.dumps(results, indent=1))
            if hasattr(strategy, "engine"):
                strategy.engine.destroy()
            del strategy
            gc.collect()
            dist.barrier()
    return 0


# ---- the driver ----------------------------------------------------------------------------------------------
def summarize(rows: list[dict], strategies: list[str]) -> dict:
    out = {}
    for n in sorted({r["nproc"] for r in rows}):
        at = [r for r in rows if r["nproc"] == n]
        params = at[0]["parameters"]
        state = 12 * params  # fp32 weights + Adam m, v
        fsdp = {r["round"]: r for r in at if r["strategy"] == "fsdp"}
        cells = {}
        for s in strategies:
            mine = [r for r in at if r["strategy"] == s]
            if not mine:
                continue
            extra = statistics.median(max(r["save_extra_rss_bytes_per_rank"]) for r in mine)
            written = statistics.median(r["bytes_written"] for r in mine)
            cell = {
                "model_state_bytes": state,
                "save_extra_rss_bytes_per_rank_max": extra,
                "extra_rss_over_state_per_rank": extra / (state / n),
                "bytes_written": written,
                "bytes_over_state": written / state,
                "save_seconds": statistics.median(r["save_seconds"] for r in mine),
                "load_seconds": statistics.median(r["load_seconds"] for r in mine),
                "load_extra_rss_bytes_per_rank_max": statistics.median(
                    max(r["load_extra_rss_bytes_per_rank"]) for r in mine
                ),
            }
            if s != "fsdp" and fsdp:
                paired = [(r, fsdp[r["round"]]) for r in mine if r["round"] in fsdp]
                cell["save_over_fsdp"] = statistics.median(r["save_seconds"] / f["save_seconds"] for r, f in paired)
                cell["load_over_fsdp"] = statistics.median(r["load_seconds"] / f["load_seconds"] for r, f in paired)
                cell["meets_targets"] = {
                    "extra_rss": cell["extra_rss_over_state_per_rank"] <= TARGETS["extra_rss_over_state_per_rank"],
                    "bytes": cell["bytes_over_state"] <= TARGETS["bytes_over_state"],
                    "save_time": cell["save_over_fsdp"] <= TARGETS["time_over_fsdp"],
                    "load_time": cell["load_over_fsdp"] <= TARGETS["time_over_fsdp"],
                }
            cells[s] = cell
        out[str(n)] = cells
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--strategies", default="fsdp,zero2,zero3,zero3_gathered")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--work", default="/tmp/shardtrain-bench/zero_checkpoint", help="checkpoints (not committed)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "zero_checkpoint.json"))
    ap.add_argument("--merge", action="store_true", help="keep the other world sizes' runs already in --out")
    a = ap.parse_args(argv)
    if a.worker:
        return worker(a)

    import launch  # tests/launch.py: the one way this repo starts torchrun jobs

    from shardtrain.observability.tracking import library_versions

    rows, loads, t_start, earlier = [], {}, time.time(), {}
    if a.merge and Path(a.out).exists():
        earlier = json.loads(Path(a.out).read_text())
        worlds = {int(x) for x in a.worlds.split(",")}
        rows = [r for r in earlier["runs"] if r["nproc"] not in worlds]
        loads = {n: v for n, v in earlier["load_average_1min"].items() if int(n) not in worlds}
    for n in (int(x) for x in a.worlds.split(",")):
        work = Path(a.work) / f"n{n}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        cmd = [
            str(launch.BIN / "torchrun"),
            f"--nproc_per_node={n}",
            "--master_addr=127.0.0.1",
            f"--master_port={launch.free_port()}",
            str(Path(__file__).resolve()),
            "--worker",
            "--rounds",
            str(a.rounds),
            "--strategies",
            a.strategies,
            "--work",
            str(work),
        ]
        before = os.getloadavg()[0]
        launch.run(cmd, timeout=1800, env=launch.test_env())
        loads[str(n)] = [round(before, 2), round(os.getloadavg()[0], 2)]
        rows += json.loads((work / "results.json").read_text())
    strategies = list(dict.fromkeys([*a.strategies.split(","), *(r["strategy"] for r in rows)]))
    result = {
        "benchmark": "zero_checkpoint",
        "issue": 28,
        "model": f"{LAYERS} x Linear({WIDTH}, {WIDTH}) MLP, fp32, AdamW",
        "device": "cpu (gloo)",
        "host": {"cpus": os.cpu_count(), "machine": platform.machine()},
        "rounds": {str(n): max(r["round"] for r in rows if r["nproc"] == n) + 1 for n in {r["nproc"] for r in rows}},
        "method": "per world size one torchrun launch; per round every strategy in turn (interleaved): setup, "
        "one optimizer step, strategy.save (extra peak RSS sampled every 2 ms from /proc/self/statm "
        "minus the RSS just before; wall time of the slowest rank), bytes of the step folder, "
        "strategy.load (wall time). Medians over rounds; time ratios paired per round against fsdp. "
        "zero3_gathered: the save before issue 28 (full gather on every rank + engine files)",
        "targets": TARGETS,
        "machine_load": "a 2-core VM shared with other engineers' jobs; 1-min load average before/after each "
        "launch in load_average_1min, and per save in runs",
        "load_average_1min": loads,
        "summary": summarize(rows, strategies),
        "runs": rows,
        "wall_seconds": round(time.time() - t_start + earlier.get("wall_seconds", 0.0), 1),
        "versions": library_versions(),
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"\n{'N':>2} {'strategy':15s} {'extraRSS/(S/N)':>14s} {'bytes/S':>8s} {'save s':>7s} {'load s':>7s} "
        f"{'save/fsdp':>9s} {'load/fsdp':>9s}"
    )
    for n, cells in result["summary"].items():
        for s, c in cells.items():
            print(
                f"{n:>2} {s:15s} {c['extra_rss_over_state_per_rank']:14.3f} {c['bytes_over_state']:8.3f} "
                f"{c['save_seconds']:7.2f} {c['load_seconds']:7.2f} {c.get('save_over_fsdp', 1.0):9.2f} "
                f"{c.get('load_over_fsdp', 1.0):9.2f}"
            )
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
