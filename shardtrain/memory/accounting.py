"""Per-rank memory of a run: the bytes of the tensors each rank really holds, the bytes autograd saves for
backward per micro-batch, and (on CUDA) the allocator's view at four phases of a step.

What a rank holds is backend knowledge, so `strategy.memory_tensors()` yields (category, tensor) pairs; here
they are only deduplicated by storage and summed. A storage is counted once, whole (a ZeRO flat buffer of
which a parameter is a view counts as the buffer), under the first category that names it.

Walking every tensor costs a pass over the model, so it runs on the first two steps (the second is the one
with optimizer state: torch's AdamW creates it lazily) and then every `--memory-every` steps, never per
micro-step. The per-rank records are gathered to rank 0 on those steps only.

Record layout (metrics.jsonl `mem`, summary.json `memory.per_rank`): {rank: {key: bytes}} with keys
  params, grads, optimizer, buffers, comm      bytes held, by category (all devices)
  model_state                                  params + grads + optimizer
  device, host                                 all categories on the rank's device / in CPU RAM
  activations                                  bytes saved for backward by the first micro-batch
  batch                                        that micro-batch's [size, tokens] (padding is per batch)
  {phase}/allocated, {phase}/peak, {phase}/reserved   CUDA only; phase in PHASES, peak since the step began
"""

from __future__ import annotations

import contextlib
import resource
import sys

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from shardtrain.data.batches import top_tensor

CATEGORIES = ("params", "grads", "optimizer", "buffers", "comm")
MODEL_STATE = ("params", "grads", "optimizer")
PHASES = ("before_forward", "after_forward", "after_backward", "after_step")
MIB = 1024**2


def _local(t: torch.Tensor) -> torch.Tensor:
    # A DTensor's bytes on this rank are its local shard.
    return t.to_local() if hasattr(t, "to_local") else t


def _plain(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors that hold `t`'s bytes. A wrapper subclass has no storage of its own (reading it raises
    "invalid python storage"): torchao's 8-bit optimizer state is codes + scales (seen on an H200 with
    --optim adamw_8bit, benchmarks/results/gpu_suite.json)."""
    t = _local(t)
    if not is_traceable_wrapper_subclass(t):
        return [t]
    names, _ = t.__tensor_flatten__()
    return [inner for n in names for inner in _plain(getattr(t, n))]


def _storage_key(t: torch.Tensor):
    s = t.untyped_storage()
    return (t.device.type, t.device.index, s.data_ptr()), s.nbytes()


def count_bytes(items, device: torch.device) -> dict:
    """Sum unique storages of (category, tensor) pairs by category and by device/host."""
    out = {c: 0 for c in CATEGORIES}
    out["device"] = out["host"] = 0
    seen = set()
    for category, t in items:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        for plain in _plain(t):
            if plain.device.type == "meta":
                continue
            key, nbytes = _storage_key(plain)
            if nbytes == 0 or key in seen:
                continue
            seen.add(key)
            out[category] += nbytes
            out["device" if plain.device == device or device.type == "cpu" else "host"] += nbytes
    out["model_state"] = sum(out[c] for c in MODEL_STATE)
    return out


class SavedActivations:
    """Bytes autograd keeps for backward while active: unique storages of saved tensors, parameters excluded
    (a saved weight, or a transposed view of one, is model state, not an activation).

    With non-reentrant activation checkpointing the checkpointed block's inputs are saved through these hooks
    and its inner tensors are not saved at all, so the count is what checkpointing really keeps.

    `backward=False` is for a forward that nothing will differentiate (the planner's measurement): the graph
    then keeps no saved tensor, this object holds them until exit, and dropping the outputs frees it all. The
    graph itself would keep them in C++, each saved output in a cycle with its grad_fn that only a backward
    breaks, and a backward costs about twice the forward."""

    def __init__(self, backward: bool = True):
        self.bytes = 0
        self._seen: set = set()
        self._hooks = None
        self._held: list | None = None if backward else []

    def _pack(self, t):
        self._count(t)
        if self._held is None:
            return t
        self._held.append(t)  # alive until exit, as in the graph: a freed storage's address could be reused
        return None

    def _count(self, t) -> None:
        base = t._base if t._base is not None else t
        if not isinstance(base, nn.Parameter) and t.device.type != "meta":
            try:
                key, nbytes = _storage_key(t)
            except (RuntimeError, NotImplementedError):  # tensor subclasses without a plain storage
                return
            if key not in self._seen:
                self._seen.add(key)
                self.bytes += nbytes

    @staticmethod
    def _unpack(t):
        return t

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        self._seen.clear()  # the keys only matter while the graph they describe is alive
        if self._held is not None:
            self._held.clear()
        return False


def rss_bytes() -> int:
    """Current resident set size of this process."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        return peak_rss_bytes()


def peak_rss_bytes() -> int:
    """High-water mark of this process's resident set size (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


class MemoryMonitor:
    """The loop calls begin_step / forward / mark / end_step; everything is a no-op off measured steps."""

    def __init__(self, strategy, dist_info, every: int):
        self.strategy, self.dist, self.every = strategy, dist_info, every
        self.cuda = dist_info.device.type == "cuda"
        self.measuring = False
        self.local: dict = {}
        self.last: dict = {}  # {rank: {...}} of the latest measured step, on rank 0
        self.last_step = 0

    def wants(self, step: int) -> bool:
        return step <= 2 or (self.every > 0 and step % self.every == 0)

    def begin_step(self, step: int) -> None:
        self.measuring = self.wants(step)
        self.local = {}
        if self.measuring and self.cuda:
            torch.cuda.reset_peak_memory_stats(self.dist.device)

    def mark(self, phase: str) -> None:
        if not self.measuring:
            return
        if self.cuda:
            dev = self.dist.device
            self.local[f"{phase}/allocated"] = torch.cuda.memory_allocated(dev)
            self.local[f"{phase}/peak"] = torch.cuda.max_memory_allocated(dev)
            self.local[f"{phase}/reserved"] = torch.cuda.memory_reserved(dev)
        if phase == "after_backward":
            # Gradients exist only between the last backward and the step: the moment model state peaks.
            self.local.update(count_bytes(self.strategy.memory_tensors(), self.dist.device))

    @contextlib.contextmanager
    def forward(self, first_micro: bool, batch=None):
        """Wraps one micro-batch's forward (and loss): counts saved activations on the first one."""
        if not (self.measuring and first_micro):
            yield
            return
        self.mark("before_forward")
        with SavedActivations() as saved:
            yield
        self.local["activations"] = saved.bytes
        input_ids = top_tensor(batch, "input_ids")  # a batch of any shape (data/batches.py)
        if input_ids is not None:
            # The planner predicts activations for a shape; padding to the longest text makes each batch's its own.
            self.local["batch"] = list(input_ids.shape)
        self.mark("after_forward")

    def end_step(self, step: int) -> dict | None:
        """On measured steps, every rank's record, gathered (a collective: all ranks measure the same steps)."""
        if not self.measuring:
            return None
        self.mark("after_step")
        table = gather_to_rank0(self.local, self.dist)
        self.measuring = False
        if table is not None:
            self.last, self.last_step = table, step
        return table

    def summary(self) -> dict:
        return {"step": self.last_step, "per_rank": self.last}


def gather_to_rank0(obj: dict, dist_info) -> dict | None:
    from shardtrain.runtime.distributed import gather_object

    table = gather_object(obj, dst=0)
    return {str(r): rec for r, rec in enumerate(table)} if table is not None else None


def format_table(per_rank: dict, step: int, predicted: dict | None = None) -> str:
    """The end-of-run table: one row per rank, MiB, so a reader sees each rank hold its share; under it, per
    rank, `shardtrain plan`'s prediction ({rank: predict_run's dict}) for the batch that rank measured."""
    cols = ["params", "grads", "optimizer", "model_state", "buffers", "comm", "activations", "host"]
    head = f"memory per rank at step {step} (MiB; activations per micro-batch):"
    lines = [head, "  rank " + "".join(f"{c:>13}" for c in cols)]
    for rank in sorted(per_rank, key=int):
        rec = per_rank[rank]
        lines.append(f"  {rank:>4} " + "".join(f"{rec.get(c, 0) / MIB:13.2f}" for c in cols))
    for rank in sorted(predicted or {}, key=int):
        pred = predicted[rank]
        if f"{cols[0]}_gib" not in pred:
            lines.append(f"{'plan ' + rank:>6} {pred.get('note', 'no prediction')}")
            continue
        lines.append(
            f"{'plan ' + rank:>6} "
            + "".join(f"{pred[f'{c}_gib'] * 1024:13.2f}" if f"{c}_gib" in pred else f"{'-':>13}" for c in cols)
            + f"  (the plan at the measured {pred['batch']}; the banner's was at full length)"
        )
    cuda = [p for p in PHASES if f"{p}/peak" in next(iter(per_rank.values()), {})]
    if cuda:
        lines.append(
            "  CUDA peak since step start (MiB): "
            + " | ".join(
                f"rank {r}: " + ", ".join(f"{p} {per_rank[r][f'{p}/peak'] / MIB:.0f}" for p in cuda)
                for r in sorted(per_rank, key=int)
            )
        )
    return "\n".join(lines)


class construction_memory:
    """Host RSS of each rank around model construction (strategy.setup): before, after, and the process's
    high-water mark after (ru_maxrss, which construction usually sets: nothing before it is as large).
    `per_rank` is filled on rank 0 after the block ({rank: {...}}); gathering is a collective."""

    def __init__(self, dist_info):
        self.dist = dist_info
        self.per_rank: dict = {}

    def __enter__(self):
        self.before = rss_bytes()
        return self

    def __exit__(self, exc_type, *exc):
        if exc_type is not None:
            return False
        own = {"rss_before": self.before, "rss_after": rss_bytes(), "peak_rss": peak_rss_bytes()}
        own["peak_rss_increase"] = own["peak_rss"] - self.before
        self.per_rank = gather_to_rank0(own, self.dist) or {}
        return False
