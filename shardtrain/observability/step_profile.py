"""--profile-steps A-B: where the time of a step goes, on every rank.

torch.profiler records optimizer steps A to B on each rank; each rank writes its trace (Chrome / Perfetto JSON,
chrome://tracing or ui.perfetto.dev) to OUT/profile/rank-NNNNN.json. The loop marks the parts of a step with
record_function ranges (`shardtrain::data`, `::forward`, `::backward`, `::step_sync`, `::optimizer`, around all of
them `::step`; activation checkpointing marks `::recompute` inside the backward, strategies/recompute.py), and
the summary splits each rank's step time into parts that add up to it:

    data           waiting for the next batch (the DataLoader) and moving it to the device
    compute        forward and backward while no collective is in flight, less the recomputation
    communication  forward and backward while a collective is in flight on any thread (DDP's bucket
                   all-reduce, FSDP's all-gathers and reduce-scatters, ZeRO's reductions): where these overlap
                   computation, as DDP's do, that time counts here and not as compute
    recompute      the forward of checkpointed blocks run again in the backward
    host_sync      the step's one all-reduce (loss, gradient norm, flags) and the host sync that reads it, and
                   OOM recovery's meeting before a backward (loop/oom.py): waiting there is waiting for the
                   slowest rank
    optimizer      the gradient norm, clipping and the optimizer step
    other          the rest of the step (unmarked)

The slowest rank is named: in a synchronous job the others wait for it inside their collectives, so its own
largest part is what to look at. CUDA kernels run asynchronously, so on a GPU the host-side parts show where the
host waits; the trace's device rows show the kernels themselves.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from shardtrain.runtime.distributed import gather_object

MARK = "shardtrain::"
PHASES = ("data", "forward", "backward", "step_sync", "optimizer")
PARTS = ("data", "compute", "communication", "recompute", "host_sync", "optimizer", "other")
# Collectives as the profiler names them: torch.distributed's c10d ops, their backends' own, DeepSpeed's comm.
COMM_PREFIXES = ("c10d::", "c10d_functional::", "_c10d_functional::", "gloo:", "nccl:", "record_param_comms")
COMM_NAMES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "allreduce", "allgather", "_reduce_scatter")


def is_communication(name: str) -> bool:
    low = name.lower()
    return low.startswith(COMM_PREFIXES) or low.startswith("deepspeed.comm") or low in COMM_NAMES


class StepProfiler:
    """Every rank: step(n) around each optimizer step, phase(name) around its parts. Inactive (no range, or
    outside it) these cost nothing."""

    def __init__(self, steps: tuple[int, int] | None, rank: int, device_type: str, out: Path, console):
        self.steps, self.rank, self.device_type, self.out, self.console = steps, rank, device_type, out, console
        self._prof = None
        self._done = False
        self._last = None  # the last step profiled so far
        self.summaries: list[dict] = []  # rank 0, once the range is done: every rank's summary

    @property
    def active(self) -> bool:
        return self._prof is not None

    def phase(self, name: str):
        return torch.profiler.record_function(MARK + name) if self._prof is not None else contextlib.nullcontext()

    @contextlib.contextmanager
    def step(self, n: int):
        """Around optimizer step n (a step redone after an OOM is profiled again, as it ran again)."""
        if self.steps is not None and self._prof is None and not self._done and n == self.steps[0]:
            self._start()
        with self.phase("step"):
            yield
        if self._prof is not None:
            self._last = n
            if n >= self.steps[1]:
                self._finish()

    def close(self) -> None:
        """Every rank, at the end of training: a run that stopped inside the range (a preemption, early stopping,
        both every rank alike at the same step) still writes what it profiled."""
        if self._prof is not None:
            self._finish()

    def _start(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device_type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(activities=activities)
        self._prof.start()

    def _finish(self) -> None:
        """Every rank at the same step: its trace written, the summaries gathered to rank 0."""
        prof, self._prof = self._prof, None
        if self.device_type == "cuda":
            torch.cuda.synchronize()
        prof.stop()
        folder = self.out / "profile"
        folder.mkdir(parents=True, exist_ok=True)
        trace = folder / f"rank-{self.rank:05d}.json"
        prof.export_chrome_trace(str(trace))
        mine = {"rank": self.rank, "trace": str(trace), **summarise(prof.events())}
        gathered = gather_object(mine)
        self.summaries, self._done = gathered or [], True
        for line in format_profile(self.summary()):
            self.console.info(line)

    def summary(self) -> dict:
        """summary.json's `profile` (rank 0): steps, every rank's parts, the slowest rank."""
        if not self.summaries:
            return {}
        slowest = max(self.summaries, key=lambda s: s["step_ms"])
        return {"steps": [self.steps[0], self._last], "ranks": self.summaries, "slowest_rank": slowest["rank"]}


def summarise(events) -> dict:
    """Mean ms per step of each part (PARTS), from the profiler's events of one rank. Intervals of the same
    name nested in each other (a record_function inside itself) count once."""
    spans: dict[str, list[tuple[float, float]]] = {}
    comm: list[tuple[float, float]] = []
    for e in events:
        start, end = e.time_range.start, e.time_range.end
        if e.name.startswith(MARK):
            spans.setdefault(e.name[len(MARK) :], []).append((start, end))
        elif is_communication(e.name):
            comm.append((start, end))
    steps = _merged(spans.get("step", []))
    n = max(len(steps), 1)
    total = {name: _length(_merged(spans.get(name, []))) for name in (*PHASES, "recompute")}
    passes = _merged(spans.get("forward", []) + spans.get("backward", []))
    communication = _length(_intersection(_merged(comm), passes))
    recompute = _length(_intersection(_merged(spans.get("recompute", [])), passes))
    step_us = _length(steps)
    parts = {
        "data": total["data"],
        "compute": max(total["forward"] + total["backward"] - communication - recompute, 0.0),
        "communication": communication,
        "recompute": recompute,
        "host_sync": total["step_sync"],
        "optimizer": total["optimizer"],
    }
    parts["other"] = max(step_us - sum(parts.values()), 0.0)
    return {
        "profiled_steps": len(steps),
        "step_ms": step_us / n / 1000,
        "parts_ms": {k: v / n / 1000 for k, v in parts.items()},
    }


def _merged(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def _intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Of two merged, sorted interval lists."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in spans)


def profile_rows(summary: dict) -> list[list[str]]:
    """A row per rank: rank, ms per step, each part's ms and share, and "slowest" on the slowest of several."""
    rows = []
    for r in sorted(summary["ranks"], key=lambda r: r["rank"]):
        step = r["step_ms"] or float("nan")
        shares = [f"{r['parts_ms'][p]:.1f} ({100 * r['parts_ms'][p] / step:.0f}%)" for p in PARTS]
        slowest = "slowest" if r["rank"] == summary["slowest_rank"] and len(summary["ranks"]) > 1 else ""
        rows.append([str(r["rank"]), f"{r['step_ms']:.1f}", *shares, slowest])
    return rows


def format_profile(summary: dict) -> list[str]:
    """The console's table (rank 0), the slowest rank marked."""
    if not summary:
        return []
    a, b = summary["steps"]
    folder = Path(summary["ranks"][0]["trace"]).parent
    rows = [["rank", "step", *PARTS, ""], *profile_rows(summary)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [f"profile of steps {a}-{b}, ms per step (traces: {folder}/rank-*.json)"] + [
        "  ".join(c.rjust(w) for c, w in zip(r, widths)).rstrip() for r in rows
    ]
