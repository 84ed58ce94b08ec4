"""What a run tells people: rank-0 console lines, metrics.jsonl, summary.json.

Only rank 0 writes; other ranks print warnings and errors, prefixed with their rank.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path


class Console:
    def __init__(self, rank: int, verbose: bool = False):
        self.rank = rank
        self.verbose = verbose

    def info(self, msg: str) -> None:
        if self.rank == 0:
            print(msg, flush=True)

    def warn(self, msg: str) -> None:
        prefix = "[shardtrain] warning: " if self.rank == 0 else f"[rank {self.rank}] warning: "
        print(prefix + msg, file=sys.stderr, flush=True)


class MetricsLog:
    """One JSON line per optimizer step, appended so a resumed run continues the same file."""

    def __init__(self, output_dir: Path, rank: int, resume_step: int):
        self.enabled = rank == 0
        self.path = output_dir / "metrics.jsonl"
        if self.enabled:
            output_dir.mkdir(parents=True, exist_ok=True)
            self._truncate_after(resume_step)
            self.file = open(self.path, "a")

    def _truncate_after(self, step: int) -> None:
        # Steps after the checkpoint we resume from were never committed: they will be redone.
        if not self.path.exists():
            return
        kept = [line for line in self.path.read_text().splitlines()
                if line.strip() and json.loads(line).get("step", 0) <= step]
        self.path.write_text("".join(line + "\n" for line in kept))

    def write(self, record: dict) -> None:
        if self.enabled:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def losses(self) -> list[float]:
        if not self.path.exists():
            return []
        return [json.loads(line)["loss"] for line in self.path.read_text().splitlines() if line.strip()]

    def close(self) -> None:
        if self.enabled:
            self.file.close()


class Throughput:
    """Samples/s over the steps of this process's life, excluding the first (warm-up) step."""

    def __init__(self):
        self.samples = 0
        self.seconds = 0.0
        self.steps = 0

    def add(self, samples: int, seconds: float) -> None:
        self.steps += 1
        if self.steps > 1:
            self.samples += samples
            self.seconds += seconds

    @property
    def samples_per_sec(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0


def write_summary(output_dir: Path, summary: dict) -> None:
    path = output_dir / "summary.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(summary, indent=2, default=str))
    tmp.replace(path)


def library_versions() -> dict:
    import platform

    import torch

    versions = {"python": platform.python_version(), "torch": torch.__version__,
                "cuda": torch.version.cuda, "shardtrain": _own_version()}
    for name in ("deepspeed", "transformers", "datasets", "tokenizers", "torchvision", "wandb"):
        try:
            from importlib.metadata import version
            versions[name] = version(name)
        except Exception:  # noqa: BLE001 - an absent optional library is simply not listed
            pass
    return versions


def _own_version() -> str:
    try:
        from importlib.metadata import version
        return version("shardtrain")
    except Exception:  # noqa: BLE001
        return "dev"


def now() -> float:
    return time.perf_counter()
