"""The training loop: a Trainer whose `__init__` starts the run (or resumes it), whose `train_step` is one optimizer
step, and whose `train` is the loop. The memory strategy hides behind `strategy`.

torchrun --nproc_per_node=3 shardtrain/main.py --config configs/multimodal_sentiment.yaml --strategy fsdp
torchrun --nproc_per_node=3 shardtrain/main.py --config configs/multimodal_sentiment.yaml --strategy ddp
torchrun --nproc_per_node=4 shardtrain/main.py --config configs/longformer_4096.yaml --strategy ddp
python -m shardtrain train --config configs/multimodal_tiny.yaml --device cpu --nproc 2
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from shardtrain.checkpointing import store as checkpoint
from shardtrain.checkpointing.dcp_state import ModelMismatch
from shardtrain.checkpointing.final_model import export_final_model_if_missing, final_model_folder, write_final_model
from shardtrain.checkpointing.output_lock import hold_output_dir
from shardtrain.config.settings import Config, ConfigError, profile_range
from shardtrain.data import batch_to_device, build_loaders
from shardtrain.data.sources import check_resumed_labels, source_asks, unread_source_flags
from shardtrain.data.split_dataset import write_label_file
from shardtrain.loop.best import BestCheckpoint, stopped_early
from shardtrain.loop.elastic import membership
from shardtrain.loop.evaluate import evaluate
from shardtrain.loop.oom import OOMRecovery
from shardtrain.loop.resume_changes import data_changes, resume_changes, setting_changes
from shardtrain.loop.run_info import describe_run, measured_shape_prediction, predicted_memory, skipped
from shardtrain.loop.saves import Saves
from shardtrain.loop.step_health import BadStepPolicy, agree
from shardtrain.memory.accounting import MemoryMonitor, construction_memory, format_table
from shardtrain.memory.autoplan import resolve_auto_strategy
from shardtrain.memory.recompute_choice import resolve_recompute
from shardtrain.observability.step_profile import StepProfiler
from shardtrain.observability.tracking import Console, Throughput, Tracker, library_versions, now
from shardtrain.runtime import faults
from shardtrain.runtime.device_defaults import cuda_math
from shardtrain.runtime.distributed import barrier, broadcast_object, gather_rank_info, init_distributed
from shardtrain.runtime.gpu_guard import check_devices
from shardtrain.runtime.preemption import StopFlag, requeue_if_slurm
from shardtrain.runtime.shared_dir import require_shared_output_dir
from shardtrain.runtime.startup_gc import freeze_start_up, restore_collections
from shardtrain.runtime.training_rng import aside, seed_training_stream
from shardtrain.strategies import make_strategy
from shardtrain.strategies.optim import base_lr
from shardtrain.workloads.adapters import apply_lora, base_fingerprint, check_same_base, untrained_head_warning
from shardtrain.workloads.base import (
    CheckedCollate,
    Workload,
    check_class_metric,
    check_head_fits_classes,
    check_loss,
    declared_outputs,
    import_root,
    load_workload,
    model_of,
    splits_of,
)


def train(cfg: Config, workload: Workload | None = None) -> dict:
    """`workload`: an instance to train (shardtrain.fit); None constructs the one the config names."""
    return Trainer(cfg, workload).train()


@dataclass
class StepOutcome:
    """What one call of Trainer.train_step did."""

    redo: bool  # some rank ran out of memory: nothing was updated, the same samples come again smaller
    loss: float = float("nan")  # the mean over every rank's micro-batches
    grad_norm: float | None = None
    applied: bool = False  # the optimizer updated the weights (not skipped as non-finite or overflowed)
    stop: bool = False  # a preemption signal reached some rank: save and stop after this step
    samples: int = 0  # in the step over every rank (under a token budget they vary from step to step)
    lr: float = float("nan")  # the base learning rate the step applied (the scheduler has moved on since)


class Trainer:
    def __init__(self, cfg: Config, workload: Workload | None = None):
        """Start-up: the process group, where to resume from, the batch geometry, the strategy, data, model and
        optimizer, the checkpoint's state, and the trackers. A run with nothing left to train stops here
        (`finished` holds its summary), its files untouched."""
        # Wall-clock stamps of the start-up phases, in summary.json `startup` (benchmarks/startup.py reads them).
        self.startup: dict[str, float] = {"train_entry": time.time()}
        self._start_processes(cfg)
        dist_info, console = self.dist, self.console
        # ---- where we resume from. This run's own checkpoint with nothing left to train: stop before any heavy
        # work, its files untouched.
        self.finished = None
        if self._find_resume(cfg):
            self.finished = self._nothing_to_train(cfg)
            return
        state = self.state

        # ---- the batch geometry, before anything is built from it: what the flags change against the
        # checkpoint's, then the world size. An elastic job resumed at another world size keeps its global batch
        # (loop/elastic.py). `--strategy auto` resolves to a config with a concrete strategy, and a geometry.
        self.changed = resume_changes(state, cfg, dist_info.world_size) if state else None
        self.members = membership(state, cfg, dist_info.world_size, [r["host"] for r in self.rank_table])
        cfg, auto_geometry, auto_line = resolve_auto_strategy(cfg, dist_info)
        if auto_line:
            console.info(auto_line)
        self.cfg = cfg
        self.geometry = auto_geometry or self.members.geometry
        # Which blocks recompute their activations: --activation-checkpointing auto's choice is made here, for
        # this strategy and geometry, on rank 0 for every rank (memory/recompute_choice.py).
        self.recompute = resolve_recompute(cfg, dist_info, self.geometry)

        # ---- strategy first: a bad DeepSpeed JSON or FSDP policy fails before any data or model work.
        # The user's model, data, loss and metrics: the loop calls only the Workload's methods for them.
        self.workload = workload = workload if workload is not None else load_workload(cfg)
        apply_lora(workload, cfg.peft)  # a workload given as an object (shardtrain.fit) too
        self.task = type(workload).__name__  # errors name the workload method to look at
        self.strategy = strategy = make_strategy(cfg, dist_info, workload, self.geometry, self.recompute)
        self._build_data()
        self._build_model()
        self.step, self.unfrozen = 0, False
        if self.resume_dir is not None:
            self._resume()
        self.last_saved = self.step if self.resumed_here else None  # nothing new to save at this dir's checkpoint
        # The best checkpoint and early stopping: the checkpoint's record (best step, value, patience count)
        # restored, so that a kill -9, a requeue or an elastic resize goes on counting where it was.
        self.best = BestCheckpoint(cfg.train, self.state.get("best"), self.task, console)
        if self.resumed_here:
            self.best.repair_pointer(checkpoint.checkpoints_root(self.out), dist_info.is_rank0)
        self.saves = Saves(strategy, self.out, cfg.checkpoint.keep_last, cfg.checkpoint.async_save, console)
        self._describe_run()

        # ---- the training stream (dropout): seeded, or the checkpoint's restored, after everything that builds
        # or measures a model (each does so aside, runtime/training_rng.py), so that only the steps draw from it.
        seed_training_stream(cfg.train.seed, dist_info.device)
        if self.resume_dir is not None:
            checkpoint.load_rng(self.resume_dir / "rng", dist_info.rank)

        # ---- what watches the steps
        t = cfg.train
        self.throughput = Throughput()
        self.mem = MemoryMonitor(strategy, dist_info, every=t.memory_every)
        self.profiler = StepProfiler(
            profile_range(cfg.log.profile_steps, t.max_steps), dist_info.rank, dist_info.device.type, self.out, console
        )
        self.oom = OOMRecovery(cfg, strategy, self.loaders.train, dist_info, console, self.geometry)
        # A fresh run's first step follows no update: a non-finite loss there is the workload's, not training's.
        self.health = BadStepPolicy(
            t.nan_policy,
            t.max_bad_steps,
            console,
            dist_info.is_rank0,
            first_step=1 if self.step == 0 else None,
            loss_method=f"{self.task}.loss",
        )
        self.eval_result: dict = {}
        self.evaluated_at: int | None = None
        self.preempted = self.stopped_early = False
        self.last_batch = None

    # ---- the loop -----------------------------------------------------------------------------------------
    def train(self) -> dict:
        if self.finished is not None:
            return self.finished
        restore_collections()  # start-up ran with rare collections (runtime/startup_gc.py)
        self.strategy.train()
        try:
            while self.step < self.cfg.train.max_steps:
                t0 = now()
                with self.profiler.step(self.step + 1):  # --profile-steps: nothing outside its range
                    outcome = self.train_step()
                if outcome.redo:
                    continue  # the optimizer never stepped: redo the same samples at the smaller micro-batch
                self._log_step(outcome, now() - t0)
                self.preempted = outcome.stop
                if self._saves_before_final_eval():
                    self._save_final()  # an evaluation that fails must not take the trained model with it
                if self._eval_due():  # also decides the best checkpoint and early stopping, every rank alike
                    self.evaluate(final=self.step >= self.cfg.train.max_steps)
                if self._save_due():
                    self.save()
                if self.preempted:
                    self._stop_for_preemption()
                    break
                # --early-stopping-patience ends the run as a finished one ends; at max_steps it has finished anyway
                if self.best.stop and self.step < self.cfg.train.max_steps:
                    self.stopped_early = True
                    self.console.info(self.best.stop_line(self.step))
                    break
            self._end()
            # No batch is read after this: the DataLoader workers end here, not whenever their loader is freed. A
            # preempted job has seconds left (Slurm's KillWait) and its step ends only once they are gone.
            self.loaders.close()
            return self._summarise()
        finally:
            self.strategy.close()  # a later run in this process starts as it would in a process of its own

    def train_step(self) -> StepOutcome:
        """One optimizer step over `geometry.accum` micro-batches, then the step's one all-reduce, after which
        every rank decides alike: update, skip a non-finite step, or redo it smaller after an OOM."""
        step = self.step + 1
        self._unfreeze_if_due()
        loss_sum = torch.zeros((), device=self.device)
        self.mem.begin_step(step)
        self.oom.step_start(step)
        # Under --max-tokens-per-batch, each micro-batch's loss weight (data/token_budget.py); else all alike.
        share = self.loaders.train.step_share(self.geometry.accum)
        for micro in range(self.geometry.accum):
            with self.profiler.phase("data"):
                batch = batch_to_device(self.loaders.train.next_batch(), self.device)
            with self.oom.guard():  # an OOM is recovered or stops every rank at once: see loop/oom.py
                loss_sum += self._micro_step(batch, micro, step, share.weights[micro] if share else None)
            self.last_batch = batch
            if self.oom.abandoned:
                break  # every rank at once: some rank ran out of memory in this step
        self.mem.mark("after_backward")
        faults.after_backward(step, self.dist.rank, self.stop)  # test-only (SHARDTRAIN_FAULT); a no-op otherwise

        # The one collective (and host sync) per optimizer step: the mean loss, the gradient norm (from each
        # rank's share; the strategy clips with it), and whether any rank saw a non-finite loss, ran out of
        # memory or was signalled to stop, and whether every rank's background checkpoint write is on disk.
        with self.profiler.phase("optimizer"):
            norm_share = self.strategy.grad_norm_share()
        with self.profiler.phase("step_sync"):
            agreed = agree(
                loss_sum,
                self.geometry.accum,
                self.stop.raised,
                self.oom.hit,
                self.dist,
                norm_share,
                writing=self.saves.writing(),
                write_failed=self.saves.write_failed(),
            )
        self.saves.agreed(agreed.writing, agreed.write_failed)
        smaller = self.oom.recover(agreed.oom_ranks, step)
        if smaller is not None:
            self.geometry = smaller
            return StepOutcome(redo=True)
        lr = base_lr(self.strategy.optimizer)  # this step's rate: the scheduler moves on inside step()
        with self.oom.optimizer_step(), self.profiler.phase("optimizer"):  # an OOM here stops every rank (loop/oom.py)
            result = self.strategy.step(skip=not agreed.finite, grad_norm=agreed.grad_norm)
        self.step = step
        self.mem_table = self.mem.end_step(step)  # on a few steps only: a tensor walk and a gather to rank 0
        self.health.update(step, result.applied, result.overflow, agreed, result.grad_norm)  # raises per policy
        samples = share.samples if share else self.geometry.global_batch
        return StepOutcome(False, agreed.loss_mean, result.grad_norm, result.applied, agreed.stop, samples, lr)

    def _micro_step(self, batch, micro: int, step: int, weight: float | None) -> torch.Tensor:
        """Forward, loss and backward of one micro-batch; its loss (times `weight`, where micro-batches differ in
        size), detached. Each phase is announced to OOM recovery first: a rank that ran out of memory earlier in
        the step skips the rest there."""
        self.oom.enter("forward", micro)
        with self.strategy.micro_step(is_last=micro == self.geometry.accum - 1):
            with self.mem.forward(first_micro=micro == 0, batch=batch), self.profiler.phase("forward"):
                outputs = self.strategy.model(batch)  # the root's forward is Workload.forward (strategies/root.py)
                with self.strategy.shard_read_guard(f"{self.task}.loss"):  # a loss reading a weight: no shard
                    loss = check_loss(self.workload.loss(outputs, batch), self.task)
            if micro == 0:  # test-only (train.inject_nan_at_steps); a no-op otherwise
                loss = faults.maybe_nan(
                    loss, step, self.cfg.train.inject_nan_at_steps, self.dist.rank, self.dist.world_size
                )
            if weight is not None:
                loss = loss * weight
            with self.profiler.phase("step_sync"):  # where needed, every rank learns here whether one ran out
                self.oom.enter("backward", micro)
            with self.profiler.phase("backward"):
                self.strategy.backward(loss)
            self.oom.enter("gap", micro)
        return loss.detach()

    # ---- what the loop calls ----------------------------------------------------------------------------------
    def evaluate(self, final: bool = False) -> None:
        self.eval_result = evaluate(self.workload, self.strategy, self.loaders, self.dist, self.last_batch)
        self.evaluated_at = self.step
        self.tracker.evaluated(self.step, self.eval_result, final=final)
        # The metrics are the same on every rank (all-reduced sums, loop/best.py), so every rank reaches the same
        # decision here: to save this step as the best, and to stop.
        self.best.observe(self.step, self.eval_result)

    def _eval_due(self) -> bool:
        """--eval-every N, and at the last step the final evaluation (not when a preemption stops the run there);
        with a best checkpoint tracked, before that step's checkpoint, which holds the best record of every
        evaluation up to it (_saves_before_final_eval)."""
        every, step = self.cfg.train.eval_every, self.step
        if step >= self.cfg.train.max_steps:
            return not self.preempted
        return bool(every) and step % every == 0

    def _save_due(self) -> bool:
        """--save-every N, a preemption, or a new best evaluation (which checkpoints/best is to name); never a
        step saved already."""
        if self.last_saved == self.step:
            return False
        every = self.cfg.checkpoint.save_every
        return bool(every and self.step % every == 0) or self.preempted or self.best.saves_at(self.step)

    def _saves_before_final_eval(self) -> bool:
        """The last step's checkpoint comes before its evaluation when no best checkpoint is tracked: nothing of
        the evaluation goes into it then. With --metric-for-best-model or early stopping the checkpoint holds the
        best record, this evaluation's included, so it waits (a failure in that evaluation loses the steps since
        the last save; --eval-every meets it sooner)."""
        return self.step >= self.cfg.train.max_steps and not self.preempted and not self.best.on

    def save(self) -> None:
        self.saves.save(self.step, {**self._trainer_state(), **self.tracker.checkpoint_state()})
        self.last_saved = self.step

    def _end(self) -> None:
        """The model the run ended with: evaluated (the loop did that at its last step, and at an early stop; a
        conversion of another run's checkpoint trains no step; a preemption does not evaluate), then committed."""
        self.profiler.close()  # a run that stopped inside --profile-steps' range keeps what it profiled
        if not self.preempted and self.evaluated_at != self.step:
            self.evaluate(final=True)
        self._save_final()
        self.saves.wait()  # a background write still in flight is committed before the run reports itself done

    def _save_final(self) -> None:
        wanted = self.cfg.checkpoint.save_final or self.best.saves_at(self.step)  # the best is always kept
        if wanted and not self.preempted and self.last_saved != self.step:
            self.save()  # every finished run keeps the model it ended with: what `export` and --resume see

    def _log_step(self, outcome: StepOutcome, seconds: float) -> None:
        self.throughput.add(outcome.samples, seconds)
        record = {
            "step": self.step,
            "loss": outcome.loss,
            "lr": outcome.lr,
            "grad_norm": outcome.grad_norm,
            "samples": outcome.samples,
            "samples_per_sec": outcome.samples / seconds,
            "step_seconds": seconds,
            **self.health.counts(),
            "epoch": self.loaders.train.epoch,
            # Wall clock at the same point of every step: lets tools (benchmarks/overhead.py) time the
            # whole loop period, logging and metrics writes included, which step_seconds leaves out.
            "wall_time": time.time(),
        }
        if self.mem_table is not None:
            record["mem"] = self.mem_table
        self.tracker.step(record, self.last_batch)  # metrics.jsonl, progress bar / log line, W&B
        self.startup.setdefault("first_step", record["wall_time"])

    def _unfreeze_if_due(self) -> None:
        """At unfreeze_at_step (once: a step redone after an OOM does not unfreeze again)."""
        at = self.cfg.model.unfreeze_at_step
        if self.frozen and at is not None and self.step == at and not self.unfrozen:
            self.unfrozen = True
            self.strategy.set_frozen(self.frozen, False)
            self.console.info(
                f"step {self.step}: unfroze {len(self.frozen - self.strategy.user_frozen)} parameter tensors"
            )

    def _stop_for_preemption(self) -> None:
        self.saves.wait()  # the job is about to end: the checkpoint just started must be on disk and committed
        self.console.info(f"step {self.step}: stopped on {self.stop.reason}; resume with --resume auto")
        if self.dist.is_rank0 and self.stop.requeue:
            requeue_if_slurm(self.console.info)

    # ---- start-up ---------------------------------------------------------------------------------------------
    def _start_processes(self, cfg: Config) -> None:
        """The process group, this rank's device and CUDA math, the console, and one output dir for every host."""
        self.dist = dist_info = init_distributed(cfg.parallel.device, cfg.parallel.dist_timeout)
        self.device = dist_info.device
        self.cuda_math = cuda_math(dist_info.device.type, cfg.train.deterministic)  # before any model or kernel
        self.console = Console(dist_info.rank, cfg.log.verbose)
        self.rank_table = gather_rank_info(dist_info)  # the startup banner shows the same table
        check_devices(self.rank_table, dist_info.is_rank0, self.console.warn)
        self.out = out = Path(cfg.checkpoint.output_dir)
        require_shared_output_dir(out, dist_info.rank, [r["host"] for r in self.rank_table])  # across hosts: one
        self.output_lock = self._hold_output_dir(out)  # before anything in it is read or cleared
        if cfg.checkpoint.overwrite_output_dir and cfg.checkpoint.resume == "none" and dist_info.is_rank0:
            checkpoint.clear_previous_run(out)  # asked for by name; otherwise `train` refused (refuse_to_overwrite)
        barrier()
        self.startup["process_group"] = time.time()
        self.stop = StopFlag()
        self.t_start = now()

    def _hold_output_dir(self, out: Path):
        """Rank 0 holds the folder for this run (checkpointing/output_lock.py); a refusal reaches every rank."""
        lock, refused = None, None
        if self.dist.is_rank0:
            try:
                lock = hold_output_dir(out)
            except ConfigError as e:
                refused = str(e)
        refused = broadcast_object(refused)
        if refused:
            raise ConfigError(refused)
        return lock

    def _find_resume(self, cfg: Config) -> bool:
        """The checkpoint to resume from and its trainer state; True when it is this run's own with nothing left
        to train. Another run's checkpoint at --max-steps is a conversion: it is loaded by this strategy and
        saved into this output dir (the cross-strategy handover)."""
        self.resume_dir = checkpoint.find_resume_dir(cfg.checkpoint.resume, self.out)
        self.state = checkpoint.read_trainer_state(self.resume_dir) if self.resume_dir is not None else {}
        self.resumed_here = self.resume_dir is not None and (
            self.resume_dir.parent.resolve() == checkpoint.checkpoints_root(self.out).resolve()
        )
        torn = checkpoint.cut_short(checkpoint.checkpoints_root(self.out), self.resume_dir)
        if torn and cfg.checkpoint.resume == "auto" and self.dist.is_rank0:
            self.console.info(
                f"{', '.join(p.name for p in torn)}: no {checkpoint.COMMIT_MARKER} (a save cut short), passed over"
                + (f": resuming from {self.resume_dir.name}" if self.resume_dir is not None else ": starting afresh")
            )
        return self.resumed_here and (self.state["step"] >= cfg.train.max_steps or stopped_early(self.state, cfg.train))

    def _another_model(self, e: ModelMismatch) -> str:
        """The checkpoint's tensors are not this model's: a config changed the model's sizes (the same workload,
        so refuse_another_workloads_checkpoint let it through). Which checkpoint (the user may never have named
        one), the settings that differ from its run's, and the way out."""
        cfg = self.cfg
        found = (
            f"the checkpoint --resume auto found, {self.resume_dir},"
            if cfg.checkpoint.resume == "auto"
            else f"--resume {self.resume_dir}:"
        )
        differ = setting_changes(self.state.get("config") or {}, cfg, sections=("workload", "model", "peft", "data"))
        since = f"; changed since its run: {', '.join(differ)}" if differ else ""
        way_out = (
            "train into another --output-dir, or start over in it with --resume none --overwrite-output-dir"
            if self.resumed_here
            else "name a checkpoint of this model, or start afresh with --resume none"
        )
        return f"{found} is from another model: {e.detail}{since}: {way_out}"

    def _nothing_to_train(self, cfg: Config) -> dict:
        step, patience = self.state["step"], cfg.train.early_stopping_patience
        why, more = (
            (f"--max-steps is {cfg.train.max_steps}", "--max-steps")
            if step >= cfg.train.max_steps
            else (f"its patience ran out there (--early-stopping-patience {patience})", "--early-stopping-patience")
        )
        self.console.info(
            f"nothing to train: {self.resume_dir} is at step {step} and {why}; summary.json and the checkpoints "
            f"are left as they were (a larger {more} trains on)"
        )
        export_final_model_if_missing(self.resume_dir, cfg, self.dist.is_rank0, self.console)
        self._release_output_dir()
        return {"final_step": self.state["step"], "nothing_to_train": True}

    def _build_data(self) -> None:
        asks = source_asks()
        self.datasets = train_ds, eval_ds = splits_of(self.workload)
        unread = unread_source_flags(self.cfg, asks)
        if unread and self.dist.is_rank0:
            self.console.warn(unread)
        self.labels = self.workload.labels()  # what the data decided of the classes: the run's state
        check_class_metric(self.cfg, self.workload, self.labels)
        # What the planner and the banner describe: the user's config with the data's classes in it.
        self.model_cfg = self.labels.applied_to(self.cfg) if self.labels else self.cfg
        if self.state:
            check_resumed_labels(self.state, self.labels)  # class ids mean the data's classes
            self.changed.changes += data_changes(self.state, getattr(train_ds, "source", None))  # said at resume
        # Once a resume has been checked: a refused one left its checkpoints' folder naming the refused classes.
        if self.labels and self.labels.names and self.dist.is_rank0:
            write_label_file(self.cfg, list(self.labels.names))  # any workload's, for the export and its readers
        d = self.dist
        self.loaders = build_loaders(
            self.cfg,
            None,
            train_ds,
            eval_ds,
            d.rank,
            d.world_size,
            d.device.type,
            collate=CheckedCollate(self.workload),
            geometry=self.geometry,
            workload=self.workload,
        )
        self.startup["data"] = time.time()

    def _build_model(self) -> None:
        """Model, optimizer and schedule, built by the strategy: it decides where weights materialise."""
        cfg = self.cfg
        # The planner predicts activations for a workload that says how to measure them, with its vocabulary.
        memory_model = self.workload.memory_model()
        self.predictable = memory_model is not None
        self.vocab_size = memory_model.vocab()[0] if self.predictable else None
        self.model_factory = make_model_factory(self.workload, cfg.train.seed, self.device, self.startup)
        freeze = cfg.model.freeze_layers
        self.frozen = set(self.workload.freezable_parameter_names(freeze)) if freeze else set()
        freeze_start_up()  # the set-up's full collections skip the imported heap (runtime/startup_gc.py)
        with construction_memory(self.dist) as self.built:  # peak host RSS while the strategy materialises it
            self.strategy.setup(self.model_factory, self.frozen)
        # A LoRA model's checkpoints leave its frozen base out and name it instead; rank 0 built it whole.
        self.base = broadcast_object(self.model_factory.base) if self.strategy.base_not_saved else None
        self.startup["strategy_setup"] = time.time()
        self.strategy.hold_frozen_norms(self.frozen)  # frozen BatchNorm keeps its running statistics until unfrozen

    def _resume(self) -> None:
        """Model, optimizer, schedule and data position, all or nothing (the RNG: right before the loop)."""
        state, unfreeze_at = self.state, self.cfg.model.unfreeze_at_step
        if self.frozen and unfreeze_at is not None and state["step"] > unfreeze_at:
            # Saved after the unfreeze: the formerly frozen parameters' optimizer state is in the checkpoint,
            # and a frozen parameter has none to load it into (DeepSpeed: not even a partition).
            self.unfrozen = True
            self.strategy.set_frozen(self.frozen, False)
        # Adapters only (a LoRA run's checkpoint): they fit the base they were trained on, which build_model rebuilt.
        check_same_base(state.get("base"), self.base, f"--resume {self.resume_dir}", self.task)
        try:
            self.strategy.load(self.resume_dir, state)  # a foreign strategy's: through the portable form
        except ModelMismatch as e:
            raise ConfigError(self._another_model(e)) from None
        self.loaders.train.load_state_dict(state["data"])
        self.step = state["step"]
        self.console.info(f"resumed from {self.resume_dir} at step {self.step}")
        written_under = (state.get("strategy") or {}).get("strategy")
        if written_under and written_under != self.strategy.name and self.dist.is_rank0:
            # A handover is allowed, and is also what a wrong STRATEGY on a Slurm requeue looks like: say it.
            self.console.warn(
                f"the checkpoint was written under {written_under} and training goes on under {self.strategy.name}: "
                f"each rank read its own part of it"
            )
        if self.changed.schedule_changed:
            self.strategy.follow_configured_schedule()
        if self.changed.changes and self.dist.is_rank0:
            self.console.warn(self.changed.line(self.step))
        if self.members.line:
            self.console.info(self.members.line)
        if self.members.inexact and self.dist.is_rank0:
            self.console.warn(self.members.inexact)

    def _describe_run(self) -> None:
        """The banner's facts (summary.json `run`), the data's report lines, and the tracker that prints them."""
        cfg, d = self.cfg, self.dist
        on_cuda = d.device.type == "cuda"  # CUDA's dropout and attention kernels save less than the CPU's
        prediction = predicted_memory(
            self.model_cfg,
            self.geometry,
            self.vocab_size,
            self.predictable,
            self.task,
            d.is_rank0,
            self.recompute,
            on_cuda,
        )
        self.run_info = describe_run(
            self.model_cfg,
            self.geometry,
            self.strategy,
            self.loaders,
            self.datasets,
            self.frozen | self.strategy.user_frozen,
            self.rank_table,
            self.changed.changes if self.changed else [],
            self.cuda_math,
            self.predictable,
            prediction,
            self.recompute,
        )
        for line in getattr(self.datasets[0], "data_report_lines", None) or []:
            self.console.info(line)
        for split, ds in zip(("train", "validation"), self.datasets):
            if skipped(ds):
                self.console.info(
                    f"--skip-bad-samples: skipped {len(skipped(ds))} bad {split} records, "
                    f"e.g. {skipped(ds)[0]} (shardtrain check-data lists them all)"
                )
        # Prints the banner, opens the W&B run (continuing the checkpoint's one), starts the progress display.
        self.tracker = Tracker(
            cfg, d, self.console, self.out, self.step, self.run_info, self.state, self.model_factory,
            self.members.state(), self.members.change,
        )  # fmt: skip
        self.startup["banner"] = time.time()  # the memory prediction (run_info), the banner, W&B
        head = untrained_head_warning(self.strategy.unwrapped)
        if head and d.is_rank0:
            self.console.warn(head)

    # ---- the end ----------------------------------------------------------------------------------------------
    def _trainer_state(self) -> dict:
        """What a checkpoint keeps of the run besides the strategy's state: the config the user gave (as
        validated) and, apart from it, what the run decided."""
        return {
            "step": self.step,
            "data": self.loaders.train.checkpoint_state(),
            "config": self.cfg.to_dict(),
            "resolved": self._resolved(),
            **self.best.checkpoint_state(),  # best step, value and patience count (loop/best.py)
            **({"base": self.base} if self.base else {}),  # a LoRA run's base, left out of the checkpoint
        }

    def _predicted_at_measured_shapes(self, per_rank: dict) -> dict:
        if not self.predictable:
            return {}
        on_cuda = self.dist.device.type == "cuda"
        return measured_shape_prediction(
            self.model_cfg, self.geometry, self.vocab_size, per_rank, self.recompute, on_cuda
        )

    def _resolved(self) -> dict:
        """What the run decided, kept apart from the user's config: the batch geometry, the data's classes."""
        labels = {"labels": self.labels.as_record()} if self.labels else {}
        # Where the workload's module was imported from: export and predict find it from any folder.
        root = import_root(type(self.workload))
        return {
            "batch_geometry": self.geometry.as_record(),
            "recompute": self.recompute.as_record(self.strategy.recompute_count, self.strategy.block_count),
            **labels,
            **({"workload_import_root": root} if root else {}),
        }

    def _summarise(self) -> dict:
        d, mem = self.dist, self.mem
        summary = {
            **self.run_info,
            "train_loss": self.tracker.metrics.losses() if d.is_rank0 else [],
            "eval": self.eval_result,
            "samples_per_sec": self.throughput.samples_per_sec,
            "wall_seconds": now() - self.t_start,
            "final_step": self.step,
            **self.health.counts(),
            "preempted": self.preempted,
            "stopped_by": self.stop.reason if self.preempted else "early_stopping" if self.stopped_early else None,
            "best": self.best.summary(),
            "checkpoint_save_seconds": self.saves.blocking_seconds,
            "checkpoint_write_seconds": self.saves.write_seconds,
            "versions": library_versions(),
            "config": self.cfg.to_dict(),
            "resolved": self._resolved(),
            "memory": {
                **mem.summary(),
                "construction": self.built.per_rank,
                "predicted": self._predicted_at_measured_shapes(mem.last),
            },
            "oom_recovery": self.oom.summary(),
            "profile": self.profiler.summary(),
            "membership": self.members.changes,
            "startup": self.startup,
        }
        if mem.last:
            self.console.info(format_table(mem.last, mem.last_step, summary["memory"]["predicted"]))
        final_model = None
        if final_model_folder(self.cfg) and not self.preempted:  # before W&B closes: --wandb-log-model uploads it
            final_model = write_final_model(self.strategy, self._trainer_state(), self.cfg, self.console)
        self.tracker.finish(summary, final_model)  # summary.json (with `run`), W&B summary and model, report.html
        self._release_output_dir()
        return summary

    def _release_output_dir(self) -> None:
        """The next run in this folder may start now (a later run in the same process, as shardtrain.fit's)."""
        if self.output_lock is not None:
            self.output_lock.release()


def make_model_factory(workload: Workload, seed: int, device: torch.device, startup: dict):
    """What the strategies build the model with: `factory(on_meta=False, load_weights=True)`. Each build starts
    from `seed` (identical initial weights on every rank and strategy, however often a strategy builds) and
    runs aside, so no build, before the run or during it (DeepSpeed's rebuild at unfreeze_at_step, the FLOP
    count's meta copy), moves the training stream."""

    def factory(on_meta: bool = False, load_weights: bool = True):
        workload.loads_weights = load_weights and not on_meta
        t_build = time.time()
        try:
            with aside(seed=seed, device=device):
                if on_meta:
                    with torch.device("meta"):
                        model = model_of(workload)
                else:
                    model = model_of(workload)
            # Before a forward that fails on it; on every rank alike (FSDP's other ranks build on meta).
            check_head_fits_classes(workload, declared_outputs(model))
            if on_meta:
                return model
            if load_weights and factory.base is None:  # the first full build with its weights: rank 0's at least
                factory.base = base_fingerprint(model)
            return model
        finally:
            workload.loads_weights = True
            if not on_meta:
                startup.setdefault("model_build_seconds", time.time() - t_build)

    # A LoRA model's frozen base, as built (workloads/adapters.py): what its adapter-only checkpoints name.
    factory.base = None
    return factory
