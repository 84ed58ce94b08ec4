"""Rank-0 progress: a tqdm bar on a terminal, plain periodic lines in a log file.

Slurm and nohup logs are not terminals; a bar there writes carriage returns and escape codes
into the file, so the bar is only used when stdout is a TTY.
"""

from __future__ import annotations

import resource
import sys
import time

import torch


def peak_memory_gb(device: torch.device) -> float:
    """Peak memory of this process: allocator peak on GPU, peak RSS on CPU. Neither call syncs."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def format_eta(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


class Progress:
    def __init__(self, total: int, initial: int, log_every: int, stream=None, tty: bool | None = None):
        self.total = total
        self.initial = initial
        self.log_every = log_every
        self.stream = stream or sys.stdout
        self.t0 = time.perf_counter()
        tty = self.stream.isatty() if tty is None else tty
        self.bar = None
        if tty:
            from tqdm import tqdm

            self.bar = tqdm(
                total=total, initial=initial, file=self.stream, dynamic_ncols=True, desc="train", unit="step"
            )

    def write(self, msg: str) -> None:
        if self.bar is not None:
            self.bar.write(msg, file=self.stream)
        else:
            print(msg, file=self.stream, flush=True)

    def update(self, record: dict, peak_gb: float) -> None:
        step = record["step"]
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix_str(
                f"loss {record['loss']:.4f} lr {record['lr']:.2e} "
                f"{record['samples_per_sec']:.1f} samples/s peak {peak_gb:.2f} GB",
                refresh=True,
            )
            return
        if step % self.log_every and step != self.total:
            return
        done = step - self.initial
        eta = (time.perf_counter() - self.t0) / done * (self.total - step) if done > 0 else 0.0
        self.write(
            f"step {step}/{self.total} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
            f"grad norm {record['grad_norm']:.3f} | {record['samples_per_sec']:.1f} samples/s | "
            f"peak mem {peak_gb:.2f} GB | ETA {format_eta(eta)}"
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
