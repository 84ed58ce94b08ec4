"""The startup banner: what is about to run, on which devices, at what batch size and memory.

Built once on rank 0 from the run-info dict train.py assembles (the same dict goes into
summary.json under `run`), so the log and the summary never disagree.
"""

from __future__ import annotations

import json

from shardtrain.memory.planner import recompute_time_share


def _size(key: str, value) -> str:
    if key.endswith("_gib") and isinstance(value, (int, float)):
        name = key[:-4]
        return f"{name} {value:.2f} GiB" if value >= 1 else f"{name} {value * 1024:.1f} MiB"
    return f"{key} {value:,}" if isinstance(value, int) else f"{key} {value}"


def _strategy_lines(info: dict) -> list[str]:
    skip = {"strategy", "ds_config"}
    settings = ", ".join(f"{k}={v}" for k, v in info.get("strategy_settings", {}).items() if k not in skip)
    lines = [f"  strategy    {info['strategy']} ({settings})" if settings else f"  strategy    {info['strategy']}"]
    ds = info.get("strategy_settings", {}).get("ds_config")
    if ds:
        lines.append("  ds config   " + json.dumps(ds, sort_keys=True, default=str))
    return lines


def _loggers(loggers: list[dict]) -> str:
    """--report-to's loggers: where each one's run is, or that it is off (its warning is above the banner)."""
    if not loggers:
        return "none besides metrics.jsonl (--report-to wandb,tensorboard,mlflow)"
    return " | ".join(
        f"{lg['name']} ({lg['where']})" if lg["on"] else f"{lg['name']} off (see its warning, on stderr)"
        for lg in loggers
    )


def format_banner(info: dict) -> str:
    ranks = info.get("ranks", [])
    lines = [
        "=" * 78,
        f"shardtrain run: {info['strategy']} on {info['world_size']} process{'es' if info['world_size'] != 1 else ''}",
    ]
    lines.append("  rank  host                      local  device       name")
    for r in ranks:
        lines.append(
            f"  {r['rank']:>4}  {r['host'][:24]:<24}  {r['local_rank']:>5}  {r['device']:<11}  "
            f"{r.get('device_name', '')}"
        )
    lines += _strategy_lines(info)
    lines.append(f"  precision   {info['precision']} | activation checkpointing {_recompute_text(info)}")
    math = info.get("cuda_math")
    if math:
        on = [name for key, name in (("tf32", "TF32 matmuls"), ("cudnn_benchmark", "cudnn.benchmark")) if math.get(key)]
        switch = (
            " (--deterministic: deterministic cuDNN)"
            if math.get("deterministic")
            else " (--deterministic true turns them off)"
        )
        lines.append(f"  cuda math   {', '.join(on) + ' on' if on else 'TF32 and cudnn.benchmark off'}{switch}")
    lines.append(
        f"  params      {info['params_total']:,} total | {info['params_trainable']:,} trainable | "
        f"{info['params_frozen']:,} frozen"
        + _named(info.get("frozen_parts") or [])
        + (f" | adapters: {info['adapters']}" if info.get("adapters") else "")
    )
    if info.get("max_tokens_per_batch"):  # the samples per micro-batch follow the texts' lengths
        lines.append(
            f"  batch       micro-batches of up to {info['max_tokens_per_batch']:,} tokens x accum "
            f"{info['grad_accum']} x world {info['world_size']} (samples per step vary; losses weighted by items)"
        )
    else:
        lines.append(
            f"  batch       micro {info['micro_batch_size']} x accum {info['grad_accum']} x world "
            f"{info['world_size']} = global {info['global_batch_size']}"
        )
    # None: a --streaming training split, whose length is unknown until read.
    train = "streamed" if info["train_examples"] is None else f"{info['train_examples']:,}"
    per_epoch = "?" if info["steps_per_epoch"] is None else f"{info['steps_per_epoch']:,}"
    per_epoch += " steps/epoch"
    examples, batch = info["train_examples"], info["global_batch_size"]
    if examples and not info.get("max_tokens_per_batch") and batch > examples:
        # "1 steps/epoch" hid that every step goes over the whole training set several times.
        per_epoch = f"1 step = {batch / examples:.1f} epochs (global batch {batch:,} > {examples:,} examples)"
    lines.append(
        f"  data        {train} train | {info['eval_examples']:,} eval | "
        f"{per_epoch} | {info.get('max_steps', '?')} steps"
        + (f" | images from cache {info['image_cache']}" if info.get("image_cache") else "")
    )
    dropped = info.get("unlabelled_dropped") or {}
    if any(dropped.values()):
        lines.append(
            f"  unlabelled  label -1 dropped: {dropped.get('train', 0):,} train | "
            f"{dropped.get('validation', 0):,} eval rows"
        )
    names = info.get("label_names") or []
    if names:
        lines.append(
            f"  labels      {len(names)}: "
            + ", ".join(f"{i}={n}" for i, n in enumerate(names[:8]))
            + (", ..." if len(names) > 8 else "")
        )
    if "loggers" in info:
        lines.append(f"  loggers     {_loggers(info['loggers'])}")
    mem = info.get("memory_prediction") or {}
    if "note" in mem and len(mem) == 1:
        lines.append(f"  memory      {mem['note']}")
    else:
        lines.append(
            "  memory      predicted per rank (shardtrain plan): " + ", ".join(_size(k, v) for k, v in mem.items())
        )
    lines.append("=" * 78)
    return "\n".join(lines)


def _recompute_text(info: dict) -> str:
    """on (12 blocks), off (0 blocks), every-2: 6 of 12 blocks (recompute ~...), or auto's choice and reasoning."""
    asked = info["activation_checkpointing"]
    settings = info.get("strategy_settings", {})
    done, blocks = settings.get("recompute_blocks", 0), settings.get("blocks")
    if isinstance(asked, bool):
        return f"{'on' if asked else 'off'} ({done} blocks)"
    if info.get("recompute_choice"):
        return f"{asked}: {info['recompute_choice']}"
    share = done / blocks if blocks else 0.0
    return f"{asked}: {done} of {blocks} blocks (recompute ~{100 * recompute_time_share(share):.0f}% of step time)"


def _named(parts: list[str], shown: int = 8) -> str:
    """` (image.conv1, image.layer1, text.embeddings)`: the frozen modules, the first `shown` of them."""
    if not parts:
        return ""
    more = f", +{len(parts) - shown} more" if len(parts) > shown else ""
    return f" ({', '.join(parts[:shown])}{more})"
