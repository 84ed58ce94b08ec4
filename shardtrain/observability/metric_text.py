"""A workload's metrics as one line of text, the same in the run's eval lines and in `export --eval`."""

from __future__ import annotations

# The default metrics (workloads/base.py classification_metrics) by the names people read them by.
SHOWN_AS = {"macro_f1": "macro-F1"}


def shown_as(key: str) -> str:
    """A class's F1 (`f1_negative`) reads `F1 negative`."""
    return SHOWN_AS.get(key) or (f"F1 {key[3:]}" if key.startswith("f1_") else key)


def _with_its_f1(key: str, result: dict) -> bool:
    """A class's precision or recall beside its F1 (the default metrics): the line shows the F1, eval.jsonl and
    the loggers all three. A workload's own `precision_macro` has no `f1_macro` beside it, and is shown."""
    metric, _, name = key.partition("_")
    return metric in ("precision", "recall") and f"f1_{name}" in result


def metrics_line(result: dict, sep: str = ", ", before: dict | None = None) -> str:
    """`accuracy 0.9375, macro-F1 0.9370, 128 examples`; a workload's own keys as it names them. `before`: each
    number's change from that result, as `export --int8 --eval` shows INT8 against fp32."""
    parts = []
    for key, value in result.items():
        if _with_its_f1(key, result):
            continue
        if key == "n_examples":
            parts.append(f"{value} examples")
        elif isinstance(value, float):
            change = before.get(key) if before else None
            parts.append(f"{shown_as(key)} {value:.4f}" + (f" ({value - change:+.4f})" if change is not None else ""))
        else:
            parts.append(f"{shown_as(key)} {value}")
    return sep.join(parts)
