"""Out-of-memory errors in a training step: recovered where every rank can stay in step, else every rank stops.

`--oom-recovery` (on by default) recovers an OOM by halving the micro-batch and doubling accumulation (the same
global batch), then redoing the optimizer step from its first sample with the RNG as it was (dropout included):
the same losses as a run started at the smaller micro-batch.

What decides it is where the OOM is raised. A micro-step is three phases: the forward (with the loss), the
backward (with any recomputation of checkpointed activations), and the gap after it. The strategy says which
phases can run a collective once user code is inside them (`Resizing.collectives_in`, strategies/capabilities.py):

    strategy   forward   backward                   so an OOM here is recovered
    ddp        none      the last micro-step's      forward; backward of all but the last micro-step
    zero2      none      every micro-step's         forward
    fsdp       gathers   gathers, reduce-scatters   none inside a pass
    zero3      gathers   gathers, reductions        none inside a pass
(and, for every strategy, an OOM in the gap after the step's last backward: nothing is in flight there).

An OOM in a phase without collectives is recovered: the rank skips the rest of the step's work up to the next
point where every rank meets. Those points are placed by `_plan`, only where such a phase is followed by one with
collectives: one all-reduce of an OOM flag, over a gloo group of its own (a CPU tensor: no device sync), before
DDP's last backward (once per step) and before each ZeRO-2 backward (once per micro-step); none for FSDP and
ZeRO-3. At that point, or at the loop's own all-reduce at the end of the step (loop/step_health.py), every rank
learns it together, drops the step's gradients (strategy.discard_gradients) and redoes the step at the smaller
micro-batch (strategy.set_batch_geometry). BatchNorm running statistics keep what the failed attempt added.

An OOM inside a phase with collectives, in the optimizer step (one that fails part-way may have updated some
weights already, and its memory does not shrink with the micro-batch: Adam allocates its state at step 1), or
with --oom-recovery off, stops the job: the rank says one line and every rank exits 1 within about a second
(shardtrain/runtime/job_stop.py), instead of waiting in a collective for --dist-timeout. Committed checkpoints are
untouched. On one rank it is one MemoryError line. An OOM outside these (an eval, a save) is not handled here.

What counts as out of memory: torch.OutOfMemoryError (CUDA, and other accelerators), and the CPU allocator's own
failure, which torch raises as a RuntimeError ("DefaultCPUAllocator: can't allocate memory"): host memory runs
out too, on --device cpu and under CPU offload.

Fault injection for tests:
- `--inject-oom-above N` alone: rank 0 raises a real torch.OutOfMemoryError at the end of each micro-step's
  backward while the micro-batch is above N (the gap: after the backward's collectives);
- `--inject-oom POINT@STEP:RANK,...`: rank RANK, in optimizer step STEP (its redo included), while the
  micro-batch is above --inject-oom-above if that is set. POINT: `forward` (a forward pre-hook on the model's
  middle block raises torch.OutOfMemoryError: under FSDP and ZeRO-3 between two units' gathers), `alloc` (the same
  hook allocates 2**50 bytes on the rank's device, which really fails: torch.OutOfMemoryError on CUDA, the CPU
  allocator's RuntimeError on CPU), `backward` (a hook on that block's output gradient: mid-backward),
  `recompute` (a pre-hook inside that block that fires only while the backward recomputes it: needs
  --activation-checkpointing), `step` (a pre-hook on the torch optimizer's step).
"""

from __future__ import annotations

import contextlib
import gc
import traceback
import weakref

import torch

from shardtrain.config.geometry import BatchGeometry
from shardtrain.config.settings import where
from shardtrain.runtime import job_stop
from shardtrain.runtime.distributed import any_rank_on_host

PHASES = ("forward", "backward", "gap")
WHAT = {"forward": "forward", "backward": "backward", "gap": "end of the backward", "step": "optimizer step"}


def largest_divisor_at_most(n: int, limit: int) -> int | None:
    """The largest micro-batch up to `limit` that splits `n` samples into whole micro-batches."""
    for d in range(min(n, limit), 0, -1):
        if n % d == 0:
            return d
    return None


def smaller_micro_batch(micro: int) -> int | None:
    """The largest micro-batch below `micro` that divides it (half, when even): the global batch stays whole."""
    return largest_divisor_at_most(micro, micro // 2)


def geometry_for(samples_per_rank: int, max_micro: int) -> tuple[int, int]:
    """(micro-batch, accumulation) taking `samples_per_rank` per optimizer step with a micro-batch no larger than
    `max_micro` (what is known to fit): the largest one that divides it, as OOM recovery picks (elastic resumes)."""
    micro = largest_divisor_at_most(samples_per_rank, max_micro)
    return micro, samples_per_rank // micro


def is_out_of_memory(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(e)
    )


def plan(collectives: list[bool]) -> tuple[list[bool], list[bool]]:
    """For a step's phases in order (PHASES per micro-step), whether each can run a collective: (meet, safe).
    meet[i]: every rank all-reduces the OOM flag before phase i; safe[i]: an OOM in phase i is recovered.
    A meeting point goes before a phase with collectives when a forward or backward without any precedes it since
    the last one (a gap alone is no reason to pay for one: an OOM there is then not safe). A phase is safe when it
    has no collectives and neither has any phase after it before the next meeting point or the step's end (the
    loop's all-reduce)."""
    n = len(collectives)
    meet, pending = [False] * n, False
    for i, has in enumerate(collectives):
        if has and pending:
            meet[i], pending = True, False
        if not has and PHASES[i % len(PHASES)] != "gap":
            pending = True
    safe, clear = [False] * n, True  # clear: from the end of phase i on, no collective before the next meeting
    for i in reversed(range(n)):
        safe[i] = not collectives[i] and clear
        clear = meet[i] or safe[i]
    return meet, safe


class _Skip(Exception):
    """This rank skips the rest of the micro-step: it ran out of memory earlier in the step, or every rank just
    learnt that some rank did."""


class OOMRecovery:
    def __init__(self, cfg, strategy, stream, dist_info, console, geometry: BatchGeometry):
        """`geometry`: the run's batch geometry at the start; recover() returns each new one."""
        self.cfg, self.strategy, self.stream, self.dist, self.console = cfg, strategy, stream, dist_info, console
        self.geometry = geometry  # this step's
        self.enabled = cfg.train.oom_recovery
        self.events: list[dict] = []
        self.hit = False  # this rank ran out of memory in this step
        self.abandoned = False  # every rank knows some rank did (at a meeting point): leave the micro-step loop
        self.step = 0
        self._position: dict = {}
        self._rng = None
        self._plans: dict[int, tuple[list[bool], list[bool]]] = {}
        self._current = 0
        job_stop.watch()  # every rank: a rank that must stop the job reaches the others through it
        # A proxy, not a reference: the injection's hooks live on the model, and a cycle through them would keep
        # the model, the optimizer and the data stream (its DataLoader workers) alive until the next gc pass.
        self._injection = Injection(cfg, strategy, dist_info, weakref.proxy(self))

    # ---- the step's phases -------------------------------------------------------------------------------
    def step_start(self, step: int) -> None:
        """`step`: the optimizer step about to run (1-based; a redone step keeps its number)."""
        self.step, self.hit, self.abandoned, self._current = step, False, False, 0
        if self.enabled:
            self._position = self.stream.state_dict()  # a few ints: where this step's first sample is
            self._rng = (
                torch.get_rng_state(),
                torch.cuda.get_rng_state(self.dist.device) if self.dist.device.type == "cuda" else None,
            )
        accum = self.geometry.accum
        if accum not in self._plans:
            multi = self.dist.world_size > 1 and self.enabled
            collectives = [
                multi and kind != "gap" and self.strategy.collectives_in(kind, m == accum - 1)
                for m in range(accum)
                for kind in PHASES
            ]
            self._plans[accum] = plan(collectives)

    def enter(self, kind: str, micro: int) -> None:
        """At the start of each phase of a micro-step (PHASES); raises _Skip (caught by guard) when this rank
        skips it."""
        i = micro * len(PHASES) + PHASES.index(kind)
        self._current = i
        if self._plans[self.geometry.accum][0][i] and self._meet():
            raise _Skip
        if self.hit:
            raise _Skip
        if kind == "gap":
            self._injection.at_backward_end()

    @contextlib.contextmanager
    def guard(self):
        """Wraps one micro-step (its first statement is enter("forward", micro)). An OOM is recovered or stops
        the job (see the module's docstring); either way nothing after it in the micro-step runs on this rank."""
        try:
            yield
        except _Skip:
            pass
        except Exception as e:  # noqa: BLE001 - anything but an OOM goes on up
            if not is_out_of_memory(e):
                raise
            # The failed attempt's activations are the locals of the frames in this error's traceback. Whatever
            # keeps the error alive (a frame that stored it, which makes a cycle only the collector frees; a
            # logger; a retry helper) would keep them through the redo, and each smaller redo would then run
            # out too: on an H200 every redo failed down to micro-batch 1 (benchmarks/results/gpu_suite.json).
            traceback.clear_frames(e.__traceback__)
            self._ran_out(e, PHASES[self._current % len(PHASES)])
        if self.hit and not self.abandoned:
            # The meeting points of the phases this rank skipped in this micro-step: its partners stop at them.
            meet = self._plans[self.geometry.accum][0]
            end = (self._current // len(PHASES) + 1) * len(PHASES)
            for i in range(self._current + 1, end):
                if meet[i] and self._meet():
                    break

    @contextlib.contextmanager
    def optimizer_step(self):
        try:
            yield
        except Exception as e:  # noqa: BLE001
            if not is_out_of_memory(e):
                raise
            self._stop(
                e,
                "step",
                "an optimizer step that fails part-way may have updated some weights already, "
                "and what it allocates (Adam's state at step 1) does not shrink with the "
                "micro-batch; use a sharded strategy or optimizer offload (`shardtrain plan` "
                "compares them)",
            )

    def _meet(self) -> bool:
        """Every rank: the OOM flag, all-reduced. True (and the step abandoned) when any rank ran out."""
        self.abandoned = any_rank_on_host(self.hit)
        return self.abandoned

    def _ran_out(self, e: BaseException, kind: str) -> None:
        if not self.enabled:
            self._stop(e, kind, f"{where('oom_recovery')} is off")
        if not self._plans[self.geometry.accum][1][self._current]:
            self._stop(
                e,
                kind,
                f"the other ranks wait for this one in {self.strategy.name}'s collectives inside the "
                f"{WHAT[kind]}, so the step cannot be redone",
            )
        self.hit = True

    def _stop(self, e: BaseException, kind: str, why: str) -> None:
        g = self.geometry
        first = (str(e).strip().splitlines() or [""])[0][:160]
        job_stop.stop_job(
            f"step {self.step}: out of memory in the {WHAT[kind]} on rank {self.dist.rank} at micro-batch "
            f"{g.micro} x accum {g.accum} ({type(e).__name__}: {first}); {why}. Every rank "
            f"stops now; the last committed checkpoint is as it was: --resume auto with a smaller "
            f"--per-device-batch-size (and a larger --grad-accum for the same global batch) or "
            f"--activation-checkpointing",
            self.dist.rank,
            self.dist.world_size,
        )

    # ---- after the step's all-reduce ----------------------------------------------------------------------
    def recover(self, ranks_hit: float, step: int) -> BatchGeometry | None:
        """Called by every rank with the all-reduced count of ranks that hit an OOM in this step.
        Returns the batch geometry to redo the step at; None when no rank ran out (the step stands)."""
        if ranks_hit <= 0:
            return None
        micro, accum = self.geometry.micro, self.geometry.accum
        new = smaller_micro_batch(micro)
        if new is None:
            raise MemoryError(
                f"step {step}: out of memory on {int(ranks_hit)} rank(s) at micro-batch 1; "
                f"--oom-recovery cannot go lower: use a sharded strategy or offload "
                f"(`shardtrain plan` compares them), activation checkpointing, or a shorter "
                f"{where('max_length')}"
            )
        self.geometry = self.geometry.at_micro(new)
        new_accum = self.geometry.accum
        self.strategy.discard_gradients()
        # Here no error is alive any more: a cycle through the failed attempt is garbage the collector can free,
        # and the allocator then gives its blocks back before the redo allocates at the new shapes.
        gc.collect()
        if self.dist.device.type == "cuda":
            torch.cuda.empty_cache()
        self.strategy.set_batch_geometry(self.geometry)
        self.stream.load_state_dict(self._position)
        self.stream.set_micro_batch_size(new)
        torch.set_rng_state(self._rng[0])  # the redo draws the dropout masks a run at `new` would draw
        if self._rng[1] is not None:
            torch.cuda.set_rng_state(self._rng[1], self.dist.device)
        self.events.append({"step": step, "ranks": int(ranks_hit), "from": [micro, accum], "to": [new, new_accum]})
        self.console.info(
            f"step {step}: out of memory on {int(ranks_hit)} rank(s) at micro-batch {micro} x accum "
            f"{accum}; redoing the step at micro-batch {new} x accum {new_accum} (global batch "
            f"{self.geometry.global_batch} unchanged)"
        )
        return self.geometry

    def summary(self) -> dict:
        return {"events": self.events, "micro_batch_size": self.geometry.micro, "grad_accum": self.geometry.accum}


class Injection:
    """Test-only (train.inject_oom, train.inject_oom_above): see the module's docstring. A no-op otherwise."""

    def __init__(self, cfg, strategy, dist_info, recovery: OOMRecovery):
        self.train, self.dist, self.recovery = cfg.train, dist_info, recovery
        self.points: set[tuple[str, int]] = set()
        for spec in cfg.train.inject_oom:
            point, _, at = spec.partition("@")
            step, _, rank = at.partition(":")
            if int(rank) == dist_info.rank:
                self.points.add((point, int(step)))
        if not self.points:
            return
        model = strategy.unwrapped
        classes = strategy.block_classes(model)
        blocks = [m for m in model.modules() if isinstance(m, classes)]
        block = blocks[len(blocks) // 2]
        block.register_forward_pre_hook(self._before_block)
        block.register_forward_hook(self._after_block)
        # Inside the block: recomputation calls the block's own forward, not the module, so its hooks do not run.
        inner = next((m for m in block.modules() if m is not block and any(True for _ in m.parameters())), block)
        inner.register_forward_pre_hook(self._inside_block)
        optimizer = strategy.optimizer
        # DeepSpeed's ZeRO optimizers hold the torch optimizer they step (what Adam's state is allocated in).
        torch_optimizer = optimizer if isinstance(optimizer, torch.optim.Optimizer) else optimizer.optimizer
        torch_optimizer.register_step_pre_hook(self._before_step)

    def _armed(self, point: str) -> bool:
        above = self.train.inject_oom_above
        return (point, self.recovery.step) in self.points and (above is None or self.micro > above)

    @property
    def micro(self) -> int:
        return self.recovery.geometry.micro

    def _raise(self, point: str):
        raise torch.OutOfMemoryError(
            f"injected by {where('inject_oom')} at {point}@{self.recovery.step}:"
            f"{self.dist.rank}, micro-batch {self.micro}"
        )

    @staticmethod
    def _in_backward() -> bool:
        return torch._C._current_graph_task_id() != -1

    def _before_block(self, module, args):
        if self._in_backward():
            return
        if self._armed("forward"):
            self._raise("forward")
        if self._armed("alloc"):
            torch.empty(2**50, dtype=torch.uint8, device=self.dist.device)  # 1 PiB: no machine has it

    def _after_block(self, module, args, output):
        if self._in_backward() or not self._armed("backward"):
            return
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        grad_out = next((t for t in outputs if isinstance(t, torch.Tensor) and t.requires_grad), None)
        if grad_out is not None:
            grad_out.register_hook(lambda grad: self._raise("backward"))

    def _inside_block(self, module, args):
        if self._in_backward() and self._armed("recompute"):
            self._raise("recompute")

    def _before_step(self, optimizer, args, kwargs):
        if self._armed("step"):
            self._raise("step")

    def at_backward_end(self) -> None:
        above = self.train.inject_oom_above
        if above is not None and not self.train.inject_oom and self.dist.is_rank0 and self.micro > above:
            raise torch.OutOfMemoryError(f"injected by {where('inject_oom_above')}={above} at micro-batch {self.micro}")
