"""The TensorBoard run of a job: event files in one folder of the run (OUT/tensorboard, or HF's
TENSORBOARD_LOGGING_DIR), written by rank 0 only through torch.utils.tensorboard, continued after a resume.

The folder is the run: a resumed or requeued job adds an event file beside the first one's. It starts with a
purge step, so TensorBoard hides what an earlier attempt logged past the checkpoint this one resumes from (those
steps are done again) and, for a start from scratch, everything an earlier attempt logged. TensorBoard is an
observer: its absence or a failure inside it is one warning, and training goes on.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from shardtrain.observability.loggers import failure_line

# Seconds between the writer thread's flushes to disk (torch's default, 120, leaves a live view 2 minutes behind).
FLUSH_SECS = 30


def log_dir(output_dir) -> Path:
    """TENSORBOARD_LOGGING_DIR (HF Trainer's variable; that folder is this run's), else OUT/tensorboard."""
    given = os.environ.get("TENSORBOARD_LOGGING_DIR")
    return Path(os.path.expanduser(given)) if given else Path(output_dir) / "tensorboard"


class TensorBoardRun:
    name = "tensorboard"
    run_id = None  # the folder is the run: nothing to keep in the checkpoint

    def __init__(self, warn, output_dir, resume_step: int, config: dict):
        self.warn = warn
        self.writer = None
        self.dir = log_dir(output_dir)
        self.last_step = resume_step
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            warn(
                "--report-to tensorboard: the tensorboard package is not installed (pip install tensorboard); "
                "continuing without TensorBoard"
            )
            return
        try:
            # Events at or past the purge step, from earlier event files in the folder, are hidden (0: all).
            purge_step = resume_step + 1 if resume_step > 0 else 0
            self.writer = SummaryWriter(log_dir=str(self.dir), purge_step=purge_step, flush_secs=FLUSH_SECS)
            if resume_step == 0:
                text = json.dumps(config, indent=2, default=str)
                self.writer.add_text("config", "    " + text.replace("\n", "\n    "), 0)  # markdown: a code block
        except Exception as e:  # noqa: BLE001 - TensorBoard must never take training down
            self._fail("init", e)

    @property
    def active(self) -> bool:
        return self.writer is not None

    def where(self) -> str:
        return str(self.dir)

    def log(self, step: int, values: dict) -> None:
        if self.writer is None:
            return
        self.last_step = max(self.last_step, step)
        try:
            for tag, value in values.items():
                self.writer.add_scalar(tag, value, step)
        except Exception as e:  # noqa: BLE001
            self._fail("log", e)

    def finish(self, summary: dict) -> None:
        """The totals as summary/{name} scalars at the last step logged, then the files closed."""
        if self.writer is None:
            return
        try:
            for key, value in summary.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                    self.writer.add_scalar(f"summary/{key}", value, self.last_step)
            self.writer.close()
        except Exception as e:  # noqa: BLE001
            self._fail("finish", e)
        self.writer = None

    def _fail(self, what: str, e: Exception) -> None:
        self.warn(failure_line(f"TensorBoard {what}", e) + "; continuing without TensorBoard")
        if self.writer is not None:
            try:
                self.writer.close()
            except Exception:  # noqa: BLE001
                pass
        self.writer = None
