"""What the OOM handling of shardtrain/loop/oom.py costs per step: this tree against the commit before it, both
with --oom-recovery on (the default), same everything else.

    ~/.cache/shardtrain/venv/bin/python benchmarks/oom_guard.py [--base a4e8e27] [--rounds 2] \
        [--cells tiny:ddp,tiny:zero2,tiny:fsdp,mid:ddp,mid:zero2]   -> benchmarks/results/oom_guard.json

What differs per step: DDP meets once per step before its syncing backward (a 1-float gloo all-reduce on a group
of its own), ZeRO-2 once per micro-step, FSDP and ZeRO-3 never; every strategy saves the RNG state at the step's
start (for an exact redo), and every rank runs a thread that looks up one store key twice a second. The base
commit is exported with `git archive` into a scratch folder and run through its own shardtrain/main.py.
Each cell runs the two as real 2-process torchrun jobs on CPU (gloo), interleaved base, new, base, new, ... so
that drift on the shared machine hits both alike; step times are the median period between metrics.jsonl
`wall_time` stamps after the warm-up steps (benchmarks/overhead.py's steady_rate).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from overhead import CONFIGS, STRATEGY_ARGS, global_batch_of, parse_steps, run_one, steady_rate, write  # noqa: E402


def export(commit: str, into: Path) -> Path:
    into.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", commit], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into / "shardtrain" / "main.py"


MEETING = """
import time, torch, torch.distributed as dist
dist.init_process_group("gloo")
group = dist.new_group(backend="gloo")
flag = torch.zeros(1)
for _ in range(50):
    dist.all_reduce(flag, group=group)
times = []
for _ in range(__N__):
    t0 = time.perf_counter(); dist.all_reduce(flag, group=group); flag.item(); times.append(time.perf_counter() - t0)
rng = []
for _ in range(__N__):
    t0 = time.perf_counter(); torch.get_rng_state(); rng.append(time.perf_counter() - t0)
if dist.get_rank() == 0:
    times.sort(); rng.sort()
    print("MEETING", 1e6 * times[len(times) // 2], 1e6 * rng[len(rng) // 2], flush=True)
dist.destroy_process_group()
"""


def meeting_cost(work: Path, n: int = 2000) -> dict:
    """The meeting point alone (oom.py's _meet: a 1-float all-reduce on its own gloo group, read on the host) and
    the RNG snapshot, medians over `n` calls on 2 ranks: what a step pays, without the noise of whole steps."""
    script = work / "meeting.py"
    script.write_text(MEETING.replace("__N__", str(n)))
    import launch

    run = launch.torchrun([], script=script, timeout=600)
    line = next(x for x in run.output.splitlines() if x.startswith("MEETING"))
    meet_us, rng_us = map(float, line.split()[1:])
    return {"meeting_us_median": meet_us, "rng_snapshot_us_median": rng_us, "calls": n}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="a4e8e27", help="the commit before the change")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cells", default="tiny:ddp,tiny:zero2,tiny:fsdp,mid:ddp,mid:zero2")
    ap.add_argument("--steps", default=None, help="as benchmarks/overhead.py: 40 or tiny=40:8,mid=12:4")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "oom_guard.json"))
    a = ap.parse_args(argv)
    t_start = time.time()
    step_plan = parse_steps(a.steps)
    from shardtrain.data import make_data

    work = Path(tempfile.mkdtemp(prefix="oom_guard_"))
    data = make_data("multimodal", work / "data", n_train=512, n_val=16, seed=0)
    scripts = {"base": export(a.base, work / "base"), "new": REPO / "shardtrain" / "main.py"}
    result = {
        "method": "2 CPU ranks (gloo), the base commit and this tree interleaved per round; median step "
        "period after warm-up, from metrics.jsonl wall_time",
        "base": a.base,
        "rounds": a.rounds,
        "steps": {c: step_plan[c.split(":")[0]] for c in a.cells.split(",")},
        "cells": {},
    }
    result["meeting"] = meeting_cost(work)
    print(f"[oom_guard] meeting {result['meeting']}", flush=True)
    write(result, a.out, t_start)
    for cell in a.cells.split(","):
        cname, strategy = cell.split(":")
        steps, warmup = step_plan[cname]
        gb = global_batch_of(CONFIGS[cname], 2)
        runs = {"base": [], "new": []}
        for r in range(a.rounds):
            for who in ("base", "new"):
                run = run_one(
                    scripts[who],
                    STRATEGY_ARGS[strategy]
                    + ["--report", "false", "--save-final", "false", "--max-eval-samples", "16"],
                    CONFIGS[cname],
                    data,
                    work / f"{cname}-{strategy}-{who}-{r}",
                    steps,
                    2,
                )
                if run.returncode != 0:
                    raise RuntimeError(f"{cell} {who}: exit {run.returncode}\n{run.tail(30)}")
                rate = steady_rate(run.output_dir / "metrics.jsonl", gb, warmup)
                runs[who].append(rate["median_step_ms"])
                print(f"[oom_guard] {cell} round {r} {who}: {rate['median_step_ms']:.1f} ms/step", flush=True)
        base, new = statistics.median(runs["base"]), statistics.median(runs["new"])
        result["cells"][cell] = {
            "base_step_ms": runs["base"],
            "new_step_ms": runs["new"],
            "median_base_ms": base,
            "median_new_ms": new,
            "new_over_base": new / base,
            "per_round_ratio": [n / b for b, n in zip(runs["base"], runs["new"])],
        }
        write(result, a.out, t_start)
    write(result, a.out, t_start)
    for cell, c in result["cells"].items():
        print(
            f"{cell:12s} base {c['median_base_ms']:8.1f} ms  new {c['median_new_ms']:8.1f} ms  "
            f"ratio {c['new_over_base']:.3f}  per round {[round(x, 3) for x in c['per_round_ratio']]}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
