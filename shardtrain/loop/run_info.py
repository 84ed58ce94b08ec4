"""What a run says about itself: the banner's table, summary.json's `run`, W&B's config. Built once at start-up."""

from __future__ import annotations

from collections import Counter

from shardtrain.config.geometry import BatchGeometry
from shardtrain.config.recompute import RecomputePlan
from shardtrain.config.settings import Config
from shardtrain.memory.planner import memory_prediction
from shardtrain.workloads.adapters import describe_adapters


def describe_run(
    cfg: Config,
    geometry: BatchGeometry,
    strategy,
    loaders,
    datasets: tuple,
    frozen: set[str],
    rank_table: list[dict],
    changes: list[str],
    cuda_math: dict,
    predictable: bool,
    prediction: dict,
    recompute: RecomputePlan,
) -> dict:
    """`predictable`: the planner knows the model (a built-in); `prediction`: its banner prediction (rank 0)."""
    train_ds, eval_ds = datasets
    t = cfg.train
    return {
        **strategy.describe(),
        "world_size": geometry.world,
        "precision": t.precision,
        "cuda_math": cuda_math,
        "micro_batch_size": geometry.micro,
        "grad_accum": geometry.accum,
        "global_batch_size": geometry.global_batch,
        "max_tokens_per_batch": cfg.data.max_tokens_per_batch,
        "train_examples": loaders.train_size,
        "eval_examples": loaders.eval_size,
        "steps_per_epoch": loaders.steps_per_epoch,
        "image_cache": cfg.data.image_cache,
        "activation_checkpointing": t.activation_checkpointing,
        **({"recompute_choice": recompute.why} if recompute.why else {}),
        **parameter_counts(strategy, frozen),
        "bad_samples_skipped": {"train": len(skipped(train_ds)), "validation": len(skipped(eval_ds))},
        # Texts longer than max_length, cut to it: known where the workload tokenised its splits ahead (None: not).
        "texts_truncated": {
            "train": getattr(train_ds, "truncated", None),
            "validation": getattr(eval_ds, "truncated", None),
        },
        # A published layout's posts kept and left out, by reason (--dataset-format, data/layouts.py).
        **({"data": train_ds.data_report} if getattr(train_ds, "data_report", None) else {}),
        "unlabelled_dropped": {
            "train": getattr(train_ds, "unlabelled", 0),
            "validation": getattr(eval_ds, "unlabelled", 0),
        },
        "data_source": getattr(train_ds, "source", None) or {"source": "data_dir" if predictable else "workload"},
        "label_names": cfg.data.label_names,
        "max_steps": t.max_steps,
        "resumed_with_changes": changes,
        "ranks": rank_table,
        "strategy_settings": strategy.describe(),
        "memory_prediction": prediction,
    }


def predicted_memory(
    cfg: Config,
    geometry: BatchGeometry,
    vocab_size: int | None,
    predictable: bool,
    task: str,
    is_rank0: bool,
    recompute: RecomputePlan,
    cuda: bool = False,
) -> dict:
    """The banner's memory prediction (rank 0; {} elsewhere). The planner knows the built-ins' architectures from
    the config alone (`vocab_size`: their tokenizer's, None for a pretrained model); a user's model it has not
    seen."""
    if not is_rank0:
        return {}
    if not predictable:
        return {
            "note": f"not predicted: {task} has no memory_model() to measure its activations "
            f"(docs/your-own-model.md; shardtrain plan --workload counts its model states)"
        }
    geometry = geometry.at_token_budget(cfg)
    return memory_prediction(geometry.applied_to(cfg), geometry.world, vocab_size, recompute=recompute, cuda=cuda)


def measured_shape_prediction(
    cfg: Config, geometry: BatchGeometry, vocab_size, per_rank: dict, recompute: RecomputePlan, cuda: bool = False
) -> dict:
    """The banner's prediction again, at the [micro-batch, tokens] each rank measured (rank 0; {} elsewhere):
    the banner's is for max_length, and a batch is only as long as its longest text."""
    if not cfg.log.predict_memory or not per_rank:
        return {}
    c = geometry.applied_to(cfg)
    return {
        rank: memory_prediction(c, geometry.world, vocab_size, rec.get("batch"), recompute, cuda)
        for rank, rec in per_rank.items()
    }


def parameter_counts(strategy, frozen: set[str]) -> dict:
    """Counts of the full (unsharded) model; DTensor shards report their global shape. `frozen`: --freeze-layers'
    parameters (frozen at the start, even if unfreeze_at_step comes later) and those build_model froze."""
    total = trainable = 0
    names = []
    for name, p in strategy.named_parameters():
        n = strategy.full_numel(p)
        total += n
        names.append(name)
        if name not in frozen:
            trainable += n
    adapters = describe_adapters(strategy.unwrapped)
    counts = {"params_total": total, "params_trainable": trainable, "params_frozen": total - trainable}
    # A PEFT model's base is frozen whole by design, and the adapters line says what trains instead.
    parts = frozen_parts(names, frozen) if not adapters else []
    return {**counts, **({"frozen_parts": parts} if parts else {}), **({"adapters": adapters} if adapters else {})}


def frozen_parts(names: list[str], frozen: set[str]) -> list[str]:
    """The frozen parameters as the fewest modules that hold only frozen ones, in model order, a run of numbered
    siblings as one range: `image.conv1, image.bn1, image.layer1, text.encoder.layer.0-3`. What the user's
    build_model() or --freeze-layers froze, said by name in the banner (a count alone could not be checked)."""

    def prefixes(name: str) -> list[str]:
        pieces = name.split(".")
        return [".".join(pieces[:i]) for i in range(1, len(pieces) + 1)]

    held, held_frozen = Counter(), Counter()  # parameters under each prefix, and how many of them are frozen
    for name in names:
        for prefix in prefixes(name):
            held[prefix] += 1
            held_frozen[prefix] += name in frozen
    parts: list[str] = []
    for name in names:
        if name in frozen:
            # the shortest prefix (a module, or the parameter itself) under which everything is frozen
            part = next(p for p in prefixes(name) if held_frozen[p] == held[p])
            if part not in parts:
                parts.append(part)
    return _ranges(parts)


def _ranges(parts: list[str]) -> list[str]:
    """`a.layer.0, a.layer.1, a.layer.2` -> `a.layer.0-2`: consecutive numbered siblings as one range."""
    out: list[str] = []
    for part in parts:
        head, _, last = part.rpartition(".")
        previous = out[-1] if out else ""
        prev_head, _, prev_last = previous.rpartition(".")
        first, _, end = prev_last.partition("-")
        if (
            head
            and head == prev_head
            and last.isdigit()
            and (end or first).isdigit()
            and int(last) == int(end or first) + 1
        ):
            out[-1] = f"{head}.{first}-{last}"
        else:
            out.append(part)
    return out


def skipped(ds) -> list:
    """Bad records a dataset left out (the built-ins' --skip-bad-samples); a user's dataset has none."""
    return getattr(ds, "skipped", None) or []
