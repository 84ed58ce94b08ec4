"""The report's figures (matplotlib, Agg: no display on cluster nodes). Each function takes one or more
RunLogs so that a single run and a comparison share the same figures."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from shardtrain.observability.metric_text import shown_as  # noqa: E402
from shardtrain.observability.runlog import MEMORY_PARTS, MIB, headline_metrics  # noqa: E402

COLORS = {"params": "#4c72b0", "grads": "#dd8452", "optimizer": "#55a868", "comm": "#8172b3", "activations": "#c44e52"}


def _save(fig, path: Path, rect=(0, 0, 1, 1)) -> Path:
    fig.tight_layout(rect=rect)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def curves(runs, path: Path) -> Path:
    """Training loss (left) and the evaluations' headline metrics (right: accuracy and macro-F1, or a workload's
    own first two) against the optimizer step."""
    fig, (ax_loss, ax_eval) = plt.subplots(1, 2, figsize=(11, 4))
    shown = headline_metrics(runs)
    numbers = {k: [e[k] for run in runs for e in run.evals if isinstance(e.get(k), (int, float))] for k in shown}
    if not all(0 <= v <= 1 for k in shown for v in numbers[k]):
        shown = shown[:1]  # a perplexity beside its log (nll): one axis would flatten the second
    for run in runs:
        ax_loss.plot([r["step"] for r in run.steps], [r["loss"] for r in run.steps], label=run.label)
        color = None
        for n, key in enumerate(shown):
            points = [(e["step"], e[key]) for e in run.evals if isinstance(e.get(key), (int, float))]
            if points:
                (line,) = ax_eval.plot(
                    *zip(*points),
                    marker="os"[n % 2],
                    linestyle="-" if n == 0 else "--",
                    color=color,
                    label=f"{run.label} {shown_as(key)}",
                )
                color = line.get_color()
    values = [v for k in shown for v in numbers[k]]
    ax_loss.set(title="training loss", xlabel="step", ylabel="loss")
    own = shown[:1] not in ([], ["accuracy"])  # a workload's own metric names its axis
    ax_eval.set(title="evaluation", xlabel="step", ylabel=shown_as(shown[0]) if own else "score")
    if values and all(0 <= v <= 1 for v in values):
        ax_eval.set_ylim(0, 1.05)
    ax_eval.set_xlim(ax_loss.get_xlim())  # one step axis for both panels, even with a single eval point
    if not values:
        ax_eval.text(0.5, 0.5, "no evaluation records", ha="center", va="center", transform=ax_eval.transAxes)
    for ax in (ax_loss, ax_eval):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    return _save(fig, path)


def throughput(runs, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(8, 3.5))
    for run in runs:
        ax.plot([r["step"] for r in run.steps], [r["samples_per_sec"] for r in run.steps], label=run.label)
    ax.set(title="throughput", xlabel="step", ylabel="samples/s (global)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def memory(runs, path: Path) -> Path:
    """One panel per run, side by side: a stacked bar per rank (params / grads / optimizer / comm / activations)."""
    fig, axes = plt.subplots(1, len(runs), figsize=(max(6, 3.2 * len(runs)), 4), squeeze=False, sharey=True)
    for ax, run in zip(axes[0], runs):
        ax.set_title(f"{run.label} ({run.strategy})", fontsize=9)
        if not run.memory:
            ax.text(
                0.5,
                0.5,
                "no memory records\n(run without the memory monitor)",
                ha="center",
                va="center",
                transform=ax.transAxes,
            )
            ax.set_xticks([])
            continue
        ranks = sorted(run.memory, key=int)
        bottom = [0.0] * len(ranks)
        for part in MEMORY_PARTS:
            values = [run.memory[r].get(part, 0) / MIB for r in ranks]
            ax.bar([f"rank {r}" for r in ranks], values, bottom=bottom, color=COLORS[part], label=part)
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("MiB per rank")
    handles, labels = [], []
    for ax in axes[0]:
        if ax.get_legend_handles_labels()[0]:
            handles, labels = ax.get_legend_handles_labels()
            break
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8)
    fig.suptitle("memory per rank (activations: one micro-batch)", fontsize=10)
    return _save(fig, path, rect=(0, 0.07, 1, 1))
