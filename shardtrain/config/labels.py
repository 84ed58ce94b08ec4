"""The classes a run trains on: how many, and their names in id order (id2label).

The user may give them (`--num-labels`, `--label-names`); otherwise the data decides (a ClassLabel or string
column's names, the largest integer id, a published layout's classes). What the data decided is the run's
state, like its batch geometry (config/geometry.py): the Trainer holds it, a checkpoint records it apart from
the user's config (`resolved.labels` beside `config`), and whoever rebuilds the run's model reads both
(`run_config_dict`).
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class ClassLabels:
    count: int
    names: tuple[str, ...] = ()  # empty: the data's integer ids are the classes, nameless

    @classmethod
    def from_record(cls, record: dict) -> ClassLabels:
        return cls(int(record["num_labels"]), tuple(record.get("label_names") or ()))

    def as_record(self) -> dict:
        return {"num_labels": self.count, "label_names": list(self.names)}

    def applied_to(self, cfg):
        """`cfg` with these classes in `model.num_labels` and `data.label_names`: for the code that builds the
        run's model and exports it (its head has `count` outputs, its HF config the names)."""
        from shardtrain.config.settings import replace_fields

        return replace_fields(cfg, num_labels=self.count, label_names=list(self.names))


def run_config_dict(state: dict) -> dict:
    """The config a run's model was built from, as a dict: the user's `config` of a checkpoint's (or summary's)
    state with the run's `resolved.labels` in it. A checkpoint from before the split keeps the labels in
    `config` itself, and comes back as it is."""
    config = copy.deepcopy(state.get("config") or {})
    labels = (state.get("resolved") or {}).get("labels")
    if labels:
        config.setdefault("model", {})["num_labels"] = labels["num_labels"]
        config.setdefault("data", {})["label_names"] = list(labels.get("label_names") or [])
    return config


# Each class's own numbers among the default metrics: `f1_negative`, `precision_negative`, `recall_negative`.
CLASS_METRICS = ("f1", "precision", "recall")


def class_metric_key(metric: str, name: str) -> str:
    """`<metric>_<class name>`, in characters every logger takes as a metric name (MLflow's are the fewest)."""
    return f"{metric}_" + re.sub(r"[^\w.\- /]", "_", str(name))


def check_class_metric(cfg, labels: ClassLabels | None) -> None:
    """--metric-for-best-model f1_<class> (or precision_, recall_) against the classes `labels` holds (the names,
    else the ids), as soon as they are known: before any process starts where the data is read there (the
    built-ins' pre-launch check), else before the first step; never at the first evaluation. Only for the
    default metrics (the caller's to know)."""
    from shardtrain.config.settings import ConfigError, where

    asked = cfg.train.metric_for_best_model or ""
    metric = asked.removeprefix("eval_").split("_", 1)[0]
    if labels is None or metric not in CLASS_METRICS or "_" not in asked.removeprefix("eval_"):
        return
    keys = [class_metric_key(metric, c) for c in (labels.names or [str(i) for i in range(labels.count)])]
    if asked.removeprefix("eval_") not in keys:
        raise ConfigError(
            f"{where('metric_for_best_model')} {asked}: no such class; the data's classes give {', '.join(keys)}"
        )
