"""The loop's checkpoints, synchronous or (--async-save) written in the background; one in flight at most.

A background save goes through three points, every rank at the same step:
    start    the strategy copies its state to host memory (what the loop waits for) and a thread writes it;
             the trainer state and RNG are this step's
    agreed   the loop's one all-reduce per step (step_health.agree) carries "still writing" from every rank; the
             first step at which no rank is, rank 0 commits (trainer_state.json, COMMITTED, `latest`)
    wait     a new save, the end of the run or a preemption waits for the write still in flight and commits it
An error leaves it uncommitted: the thread dies with the process, and the step folder has no COMMITTED.
"""

from __future__ import annotations

from pathlib import Path

from shardtrain.checkpointing import store as checkpoint
from shardtrain.observability.tracking import now


class Saves:
    def __init__(self, strategy, output_dir: Path, keep_last: int, background: bool, console):
        self.strategy, self.output_dir, self.keep_last = strategy, output_dir, keep_last
        self.background, self.console = background, console
        self.pending: checkpoint.PendingSave | None = None
        self._started = self._blocked = 0.0  # when the pending save started; what the loop waited for it so far
        # Per save, in order: what the loop waited for it (staging, plus any wait for its write), and the seconds
        # from its start until it was on disk. Synchronous saves: the same number twice.
        self.blocking_seconds: list[float] = []
        self.write_seconds: list[float] = []

    def save(self, step: int, trainer_state: dict) -> None:
        """A checkpoint of this step: committed before returning, or (--async-save) started."""
        self.wait()  # one in flight: the previous background write is committed first
        t0 = now()
        pending = checkpoint.start_save(
            self.strategy, trainer_state, self.output_dir, self.keep_last, background=self.background
        )
        if not self.background:
            path = checkpoint.finish_save(self.strategy, pending)
            self._record(now() - t0, now() - t0)
            self.console.info(f"step {step}: saved {path} in {self.blocking_seconds[-1]:.2f}s")
            return
        self.pending, self._started, self._blocked = pending, t0, now() - t0
        self.console.info(
            f"step {step}: saving {pending.path} in the background (training waited {self._blocked:.2f}s for the copy)"
        )

    def writing(self) -> bool:
        """This rank's background write is still running (for the loop's agreement)."""
        return self.pending is not None and not self.pending.write_done()

    def write_failed(self) -> bool:
        return self.pending is not None and self.pending.write_done() and self.pending.write_failed()

    def agreed(self, writing_ranks: int, any_failed: bool) -> None:
        """After the loop's agreement: no rank writing any more -> commit (or every rank raises the one error)."""
        if self.pending is not None and writing_ranks == 0:
            pending, self.pending = self.pending, None
            checkpoint.commit_agreed(self.strategy, pending, any_failed)
            self._committed(pending)

    def wait(self) -> None:
        """Every rank: wait for the write in flight, if any, and commit it (or raise its error)."""
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        t0 = now()
        checkpoint.finish_save(self.strategy, pending)
        self._blocked += now() - t0
        self._committed(pending)

    def _committed(self, pending: checkpoint.PendingSave) -> None:
        self._record(self._blocked, (pending.write.finished or now()) - self._started)
        self.console.info(
            f"step {pending.step}: committed {pending.path} (written in "
            f"{self.write_seconds[-1]:.2f}s, training waited {self.blocking_seconds[-1]:.2f}s)"
        )

    def _record(self, blocked: float, written: float) -> None:
        self.blocking_seconds.append(round(blocked, 3))
        self.write_seconds.append(round(written, 3))
