"""The training loop. One file, top to bottom; the memory strategy hides behind `strategy`.

torchrun --nproc_per_node=3 shardtrain/main.py --config configs/multimodal_sentiment.yaml --strategy fsdp
torchrun --nproc_per_node=3 shardtrain/main.py --config configs/multimodal_sentiment.yaml --strategy ddp
torchrun --nproc_per_node=4 shardtrain/main.py --config configs/longformer_4096.yaml --strategy ddp
python -m shardtrain train --config configs/multimodal_tiny.yaml --device cpu --nproc 2
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from shardtrain.checkpointing import store as checkpoint
from shardtrain.checkpointing.final_model import export_final_model_if_missing, final_model_folder, write_final_model
from shardtrain.config.settings import Config, is_builtin_workload
from shardtrain.data import batch_to_device, build_loaders
from shardtrain.data.sources import check_resumed_labels
from shardtrain.loop.elastic import membership
from shardtrain.loop.oom import OOMRecovery
from shardtrain.loop.resume_changes import data_changes, resume_changes
from shardtrain.loop.saves import Saves
from shardtrain.loop.step_health import BadStepPolicy, agree
from shardtrain.memory.accounting import MemoryMonitor, construction_memory, format_table
from shardtrain.memory.autoplan import resolve_auto_strategy
from shardtrain.memory.planner import memory_prediction
from shardtrain.observability.tracking import Console, Throughput, Tracker, library_versions, now
from shardtrain.runtime import faults
from shardtrain.runtime.device_defaults import cuda_math
from shardtrain.runtime.distributed import DistInfo, all_reduce_sum, barrier, gather_rank_info, init_distributed
from shardtrain.runtime.gpu_guard import check_devices
from shardtrain.runtime.preemption import StopFlag, requeue_if_slurm
from shardtrain.runtime.shared_dir import require_shared_output_dir
from shardtrain.runtime.training_rng import aside, seed_training_stream
from shardtrain.strategies import make_strategy
from shardtrain.workloads.base import CheckedCollate, Workload, check_loss, load_workload


def train(cfg: Config, workload: Workload | None = None) -> dict:
    """`workload`: an instance to train (shardtrain.fit); None constructs the one the config names."""
    # Wall-clock stamps of the start-up phases, in summary.json `startup` (benchmarks/startup.py reads them).
    startup: dict[str, float] = {"train_entry": time.time()}
    dist_info = init_distributed(cfg.parallel.device, cfg.parallel.dist_timeout)
    math_on = cuda_math(dist_info.device.type, cfg.train.deterministic)  # before any model or kernel exists
    console = Console(dist_info.rank, cfg.log.verbose)
    rank_table = gather_rank_info(dist_info)  # the startup banner shows the same table
    check_devices(rank_table, dist_info.is_rank0, console.warn)
    out = Path(cfg.checkpoint.output_dir)
    require_shared_output_dir(out, dist_info.rank, [r["host"] for r in rank_table])  # across hosts: one folder
    if cfg.checkpoint.overwrite_output_dir and cfg.checkpoint.resume == "none" and dist_info.is_rank0:
        checkpoint.clear_previous_run(out)  # asked for by name; otherwise `train` refused (refuse_to_overwrite)
    barrier()
    startup["process_group"] = time.time()
    stop = StopFlag()
    t_start = now()

    # ---- where we resume from. This run's own checkpoint with nothing left to train: stop before any heavy
    # work, its files untouched. Another run's checkpoint at --max-steps is a conversion: it is loaded by this
    # strategy and saved into this output dir (the cross-strategy handover).
    resume_dir = checkpoint.find_resume_dir(cfg.checkpoint.resume, out)
    state = checkpoint.read_trainer_state(resume_dir) if resume_dir is not None else {}
    resumed_here = resume_dir is not None and resume_dir.parent.resolve() == checkpoint.checkpoints_root(out).resolve()
    if resumed_here and state["step"] >= cfg.train.max_steps:
        console.info(
            f"nothing to train: {resume_dir} is at step {state['step']} and --max-steps is "
            f"{cfg.train.max_steps}; summary.json and the checkpoints are left as they were "
            f"(a larger --max-steps trains on)"
        )
        export_final_model_if_missing(resume_dir, cfg, dist_info.is_rank0, console)
        return {"final_step": state["step"], "nothing_to_train": True}

    # ---- the batch geometry, before anything is built from it: what the flags change against the checkpoint's,
    # then the world size. An elastic job resumed at another world size keeps its global batch (loop/elastic.py).
    changed = resume_changes(state, cfg, dist_info.world_size) if state else None
    members = membership(state, cfg, dist_info.world_size, [r["host"] for r in rank_table])

    # ---- strategy first: a bad DeepSpeed JSON or FSDP policy fails before any data or model work.
    # `--strategy auto` becomes a concrete strategy, batch geometry and checkpointing choice here.
    auto_choice = resolve_auto_strategy(cfg, dist_info)
    if auto_choice:
        console.info(auto_choice)
    # The user's model, data, loss and metrics: the loop below calls only the Workload's methods for them.
    workload = workload if workload is not None else load_workload(cfg)
    task = type(workload).__name__  # errors name the workload method to look at
    strategy = make_strategy(cfg, dist_info, workload)

    # ---- data
    train_ds, eval_ds = workload.datasets()
    if state:
        check_resumed_labels(state.get("config") or {}, cfg)  # the checkpoint's class ids mean the data's classes
        changed.changes += data_changes(state, getattr(train_ds, "source", None))  # said in changed.line below
    loaders = build_loaders(
        cfg,
        None,
        train_ds,
        eval_ds,
        dist_info.rank,
        dist_info.world_size,
        dist_info.device.type,
        collate=CheckedCollate(workload),
    )
    startup["data"] = time.time()

    # ---- model, optimizer, schedule (built by the strategy: it decides where weights materialise)
    # The planner knows the built-ins' architectures from the config alone (with the vocabulary their tokenizer
    # was trained to); a user's model it has not seen.
    predictable = is_builtin_workload(cfg)
    vocab_size = len(workload.tokenizer) if predictable and not cfg.model.pretrained else None

    model_factory = make_model_factory(workload, cfg.train.seed, dist_info.device, startup)
    frozen = set(workload.freezable_parameter_names(cfg.model.freeze_layers)) if cfg.model.freeze_layers else set()
    with construction_memory(dist_info) as built:  # peak host RSS while the strategy materialises the model
        strategy.setup(model_factory, frozen)
    startup["strategy_setup"] = time.time()
    strategy.hold_frozen_norms(frozen)  # frozen BatchNorm keeps its running statistics until unfrozen

    # ---- resume: model, optimizer, schedule and data position, all or nothing (the RNG: right before the loop)
    step = 0
    unfreeze_at = cfg.model.unfreeze_at_step
    if resume_dir is not None:
        if frozen and unfreeze_at is not None and state["step"] > unfreeze_at:
            # Saved after the unfreeze: the formerly frozen parameters' optimizer state is in the checkpoint,
            # and a frozen parameter has none to load it into (DeepSpeed: not even a partition).
            strategy.set_frozen(frozen, False)
        strategy.load(resume_dir, state)  # a foreign strategy's checkpoint goes through the portable form
        loaders.train.load_state_dict(state["data"])
        step = state["step"]
        console.info(f"resumed from {resume_dir} at step {step}")
        if changed.schedule_changed:
            strategy.follow_configured_schedule()
        if changed.changes and dist_info.is_rank0:
            console.warn(changed.line(step))
        if members.line:
            console.info(members.line)
    if members.inexact and dist_info.is_rank0:
        console.warn(members.inexact)
    last_saved = step if resumed_here else None  # nothing new to save at a checkpoint of this output dir
    saves = Saves(strategy, out, cfg.checkpoint.keep_last, cfg.checkpoint.async_save, console)

    t, world = cfg.train, dist_info.world_size
    global_batch = t.per_device_batch_size * t.grad_accum * world
    run_info = {
        **strategy.describe(),
        "world_size": world,
        "precision": t.precision,
        "cuda_math": math_on,
        "micro_batch_size": t.per_device_batch_size,
        "grad_accum": t.grad_accum,
        "global_batch_size": global_batch,
        "train_examples": loaders.train_size,
        "eval_examples": loaders.eval_size,
        "steps_per_epoch": loaders.steps_per_epoch,
        "image_cache": cfg.data.image_cache,
        "activation_checkpointing": t.activation_checkpointing,
        **parameter_counts(strategy, frozen | strategy.user_frozen),
        "bad_samples_skipped": {"train": len(skipped(train_ds)), "validation": len(skipped(eval_ds))},
        # A published layout's posts kept and left out, by reason (--dataset-format, data/layouts.py).
        **({"data": train_ds.data_report} if getattr(train_ds, "data_report", None) else {}),
        "unlabelled_dropped": {
            "train": getattr(train_ds, "unlabelled", 0),
            "validation": getattr(eval_ds, "unlabelled", 0),
        },
        "data_source": getattr(train_ds, "source", None) or {"source": "workload" if not predictable else "data_dir"},
        "label_names": cfg.data.label_names,
        "max_steps": t.max_steps,
        "resumed_with_changes": changed.changes if changed else [],
        "ranks": rank_table,
        "strategy_settings": strategy.describe(),
        "memory_prediction": (
            memory_prediction(cfg, world, vocab_size)
            if predictable
            else {
                "note": f"not predicted: activations are measured for the built-in models, not {task} "
                f"(shardtrain plan --workload counts its model states)"
            }
        )
        if dist_info.is_rank0
        else {},
    }
    for line in getattr(train_ds, "data_report_lines", None) or []:
        console.info(line)
    for split, ds in (("train", train_ds), ("validation", eval_ds)):
        if skipped(ds):
            console.info(
                f"--skip-bad-samples: skipped {len(skipped(ds))} bad {split} records, "
                f"e.g. {skipped(ds)[0]} (shardtrain check-data lists them all)"
            )
    # Prints the banner, opens the W&B run (continuing the checkpoint's one), starts the progress display.
    tracker = Tracker(
        cfg, dist_info, console, out, step, run_info, state, model_factory, members.state(), members.change
    )
    startup["banner"] = time.time()  # the memory prediction (run_info), the banner, W&B

    # ---- the training stream (dropout): seeded, or the checkpoint's restored, after everything that builds or
    # measures a model (each does so aside, runtime/training_rng.py), so that only the steps below draw from it.
    seed_training_stream(cfg.train.seed, dist_info.device)
    if resume_dir is not None:
        checkpoint.load_rng(resume_dir / "rng", dist_info.rank)

    # ---- the loop
    throughput = Throughput()
    mem = MemoryMonitor(strategy, dist_info, every=t.memory_every)
    oom = OOMRecovery(cfg, strategy, loaders.train, dist_info, console)
    # A fresh run's first step follows no update: a non-finite loss there is the workload's, not training's.
    health = BadStepPolicy(
        t.nan_policy,
        t.max_bad_steps,
        console,
        dist_info.is_rank0,
        first_step=1 if step == 0 else None,
        loss_method=f"{task}.loss",
    )
    eval_result: dict = {}
    preempted = False
    batch = None
    strategy.train()
    while step < t.max_steps:
        if frozen and unfreeze_at is not None and step == unfreeze_at:
            # The last step's graph keeps the backend's hooks (and so a DeepSpeed engine about to be rebuilt) alive.
            outputs = loss = None
            strategy.set_frozen(frozen, False)
            console.info(f"step {step}: unfroze {len(frozen - strategy.user_frozen)} parameter tensors")
        t0 = now()
        loss_sum = torch.zeros((), device=dist_info.device)
        mem.begin_step(step + 1)
        oom.step_start(step + 1)
        for micro in range(t.grad_accum):
            batch = batch_to_device(loaders.train.next_batch(), dist_info.device)
            with oom.guard():  # an OOM is recovered or stops every rank at once: see loop/oom.py
                oom.enter("forward", micro)  # skips it on a rank that ran out of memory earlier in this step
                with strategy.micro_step(is_last=micro == t.grad_accum - 1):
                    with mem.forward(first_micro=micro == 0, batch=batch):
                        outputs = strategy.forward(batch)
                        with strategy.shard_read_guard(f"{task}.loss"):  # a loss reading a weight: no shard
                            loss = workload.loss(outputs, batch)
                        loss = check_loss(loss, task)
                    if micro == 0:  # test-only (train.inject_nan_at_steps); a no-op otherwise
                        loss = faults.maybe_nan(loss, step + 1, t.inject_nan_at_steps, dist_info.rank, world)
                    oom.enter("backward", micro)  # where needed, every rank learns here whether one ran out
                    strategy.backward(loss)
                    oom.after_backward(micro)  # test-only injection (train.inject_oom_above) there
                loss_sum += loss.detach()
            if oom.abandoned:
                outputs = loss = None  # the abandoned forward's graph, freed before the redo
                break  # every rank at once: some rank ran out of memory in this step
        mem.mark("after_backward")
        faults.mid_step(step + 1, dist_info.rank)  # test-only (SHARDTRAIN_FAULT): kill or stall; a no-op otherwise
        faults.hold(stop)  # test-only (SHARDTRAIN_FAULT_HOLD); a no-op otherwise

        # The one collective (and host sync) per optimizer step: the mean loss, the gradient norm (from each
        # rank's share; the strategy clips with it), and whether any rank saw a non-finite loss, ran out of
        # memory or was signalled to stop. Every rank then decides alike.
        # It also tells whether every rank's background checkpoint write (--async-save) is on disk: then it commits.
        agreed = agree(
            loss_sum,
            t.grad_accum,
            stop.raised,
            oom.hit,
            dist_info,
            strategy.grad_norm_share(),
            writing=saves.writing(),
            write_failed=saves.write_failed(),
        )
        saves.agreed(agreed.writing, agreed.write_failed)
        if oom.recover(agreed.oom_ranks, step + 1):
            continue  # the optimizer never stepped: redo the same samples at the smaller micro-batch
        with oom.optimizer_step():  # an OOM here stops every rank (shardtrain/loop/oom.py)
            result = strategy.step(skip=not agreed.finite, grad_norm=agreed.grad_norm)
        grad_norm = result.grad_norm
        step += 1
        mem_table = mem.end_step(step)  # on a few steps only: a tensor walk and a gather to rank 0
        health.update(step, result.applied, result.overflow, agreed, grad_norm)  # raises on --nan-policy

        seconds = now() - t0
        throughput.add(global_batch, seconds)
        record = {
            "step": step,
            "loss": agreed.loss_mean,
            "lr": strategy.optimizer.param_groups[0]["lr"],
            "grad_norm": grad_norm,
            "samples_per_sec": global_batch / seconds,
            "step_seconds": seconds,
            **health.counts(),
            "epoch": loaders.train.epoch,
            # Wall clock at the same point of every step: lets tools (benchmarks/overhead.py) time the
            # whole loop period, logging and metrics writes included, which step_seconds leaves out.
            "wall_time": time.time(),
        }
        if mem_table is not None:
            record["mem"] = mem_table
        tracker.step(record, batch)  # metrics.jsonl, progress bar / log line, W&B
        startup.setdefault("first_step", record["wall_time"])

        if t.eval_every and step % t.eval_every == 0 and step < t.max_steps:
            eval_result = evaluate(workload, strategy, loaders, dist_info, batch)
            tracker.evaluated(step, eval_result)
        preempted = agreed.stop
        if (cfg.checkpoint.save_every and step % cfg.checkpoint.save_every == 0) or preempted:
            saves.save(step, {**trainer_state(step, loaders, cfg), **tracker.checkpoint_state()})
            last_saved = step
        if preempted:
            saves.wait()  # the job is about to end: the checkpoint just started must be on disk and committed
            console.info(f"step {step}: stopped on {stop.reason}; resume with --resume auto")
            if dist_info.is_rank0 and stop.requeue:
                requeue_if_slurm(console.info)
            break
    if cfg.checkpoint.save_final and not preempted and last_saved != step:
        # Every finished run keeps the model it ended with: what `export` and a later --resume should see.
        saves.save(step, {**trainer_state(step, loaders, cfg), **tracker.checkpoint_state()})
        last_saved = step
    saves.wait()  # a background write still in flight is committed before the run reports itself done

    # ---- the end: evaluate, summarise
    if not preempted:
        eval_result = evaluate(workload, strategy, loaders, dist_info, batch)
        tracker.evaluated(step, eval_result, final=True)
    summary = {
        **run_info,
        "train_loss": tracker.metrics.losses() if dist_info.is_rank0 else [],
        "eval": eval_result,
        "samples_per_sec": throughput.samples_per_sec,
        "wall_seconds": now() - t_start,
        "final_step": step,
        **health.counts(),
        "preempted": preempted,
        "stopped_by": stop.reason if preempted else None,
        "checkpoint_save_seconds": saves.blocking_seconds,
        "checkpoint_write_seconds": saves.write_seconds,
        "versions": library_versions(),
        "config": cfg.to_dict(),
        "memory": {
            **mem.summary(),
            "construction": built.per_rank,
            "predicted": measured_shape_prediction(cfg, world, vocab_size, mem.last) if predictable else {},
        },
        "oom_recovery": oom.summary(),
        "membership": members.changes,
        "startup": startup,
    }
    if mem.last:
        console.info(format_table(mem.last, mem.last_step, summary["memory"]["predicted"]))
    final_model = None
    if final_model_folder(cfg) and not preempted:  # before W&B closes: --wandb-log-model uploads it
        final_model = write_final_model(strategy, trainer_state(step, loaders, cfg), cfg, console)
    tracker.finish(summary, final_model)  # summary.json (with `run`), W&B summary and model, report.html
    return summary


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
                        return workload.build_model()
                return workload.build_model()
        finally:
            workload.loads_weights = True
            if not on_meta:
                startup.setdefault("model_build_seconds", time.time() - t_build)

    return factory


def measured_shape_prediction(cfg: Config, world: int, vocab_size: int | None, per_rank: dict) -> dict:
    """The banner's prediction again, at the [micro-batch, tokens] each rank measured (rank 0; {} elsewhere):
    the banner's is for max_length, and a batch is only as long as its longest text."""
    if not cfg.log.predict_memory or not per_rank:
        return {}
    return {rank: memory_prediction(cfg, world, vocab_size, rec.get("batch")) for rank, rec in per_rank.items()}


def trainer_state(step: int, loaders, cfg: Config) -> dict:
    return {"step": step, "data": loaders.train.checkpoint_state(), "config": cfg.to_dict()}


def parameter_counts(strategy, frozen: set[str]) -> dict:
    """Counts of the full (unsharded) model; DTensor shards report their global shape. `frozen`: --freeze-layers'
    parameters (frozen at the start, even if unfreeze_at_step comes later) and those build_model froze."""
    total = trainable = 0
    for name, p in strategy.named_parameters():
        n = getattr(p, "ds_numel", None) or p.numel()
        total += n
        if name not in frozen:
            trainable += n
    return {"params_total": total, "params_trainable": trainable, "params_frozen": total - trainable}


def skipped(ds) -> list:
    """Bad records a dataset left out (the built-ins' --skip-bad-samples); a user's dataset has none."""
    return getattr(ds, "skipped", None) or []


@torch.no_grad()
def evaluate(workload: Workload, strategy, loaders, dist_info: DistInfo, spare_batch: dict) -> dict:
    """The workload's metrics over every validation example exactly once across ranks.

    Sharded strategies gather parameters collectively in each forward, so every rank runs the same number of
    forwards; a rank whose shard ran out repeats its last batch and counts nothing from it (its sums are
    multiplied by 0: the same keys and shapes on every rank, so the one all-reduce per key matches).
    """
    if loaders.eval is None:
        return {}
    strategy.eval()
    sums: dict[str, torch.Tensor] = {}
    batches = iter(loaders.eval)
    last = spare_batch  # a rank with no validation example at all still joins every forward
    for _ in range(loaders.eval_batches):
        batch = next(batches, None)
        real = batch is not None
        batch = batch if real else last
        last = batch
        batch = batch_to_device(batch, dist_info.device)
        with strategy.autocast():
            outputs = strategy.forward(batch)
        with strategy.shard_read_guard(f"{type(workload).__name__}.metric_sums"):
            metric_sums = workload.metric_sums(outputs, batch)
        for key, value in metric_sums.items():
            value = value.detach().double() * (1.0 if real else 0.0)
            sums[key] = sums[key] + value if key in sums else value
    sums = {key: all_reduce_sum(sums[key], dist_info.device).cpu() for key in sorted(sums)}
    strategy.train()
    if dist_info.device.type == "cuda":
        torch.cuda.empty_cache()  # eval activations are a different shape: give their blocks back
    return workload.metrics(sums)
