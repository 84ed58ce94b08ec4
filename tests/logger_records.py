"""Read back what the TensorBoard and MLflow loggers wrote, with each tool's own reader."""

from __future__ import annotations

from pathlib import Path


def tensorboard_scalars(folder: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value} as TensorBoard shows the folder: its EventAccumulator, which applies the purge steps
    a resumed run writes. A step shown twice for one tag fails."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    out = {}
    for tag in acc.Tags()["scalars"]:
        events = acc.Scalars(tag)
        assert len({e.step for e in events}) == len(events), f"{tag}: a step shown twice"
        out[tag] = {e.step: e.value for e in events}
    return out


def mlflow_history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    """(step, value) of every value a run logged for one metric, sorted, values to 6 decimals."""
    return sorted((m.step, round(m.value, 6)) for m in client.get_metric_history(run_id, key))
