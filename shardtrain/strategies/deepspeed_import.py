"""DeepSpeed, imported without the MLflow client its autotuner would import.

`import deepspeed` always imports deepspeed/autotuning/autotuner.py, which imports mlflow at its top wherever
it is installed (to log autotuning experiments; a missing one is caught there, as any ImportError). shardtrain
pins the MLflow client for --report-to mlflow, so without this every DeepSpeed process paid for importing it,
in every rank of every ZeRO job and again at every restart. On the dev machine, alternated: `import deepspeed`
in a process that has imported what a rank has by then (torch, transformers' models, datasets, torchvision, DCP)
took 1.19 s of CPU against 0.21 s with mlflow kept out (medians of four rounds); `import torch, deepspeed` alone
3.4 s against 2.1 s. shardtrain never runs DeepSpeed's autotuner. Only this one import is affected: a later
`import mlflow` (--report-to mlflow) imports it as usual, and where mlflow was imported before DeepSpeed nothing
changes.
"""

from __future__ import annotations

import sys
from types import ModuleType


def import_deepspeed() -> ModuleType:
    """`import deepspeed`, the first time in a process with `mlflow` hidden from it."""
    if "deepspeed" in sys.modules:
        return sys.modules["deepspeed"]
    hide = "mlflow" not in sys.modules
    if hide:
        sys.modules["mlflow"] = None  # `import mlflow` raises ModuleNotFoundError (Python's import system)
    try:
        import deepspeed
    finally:
        if hide and sys.modules.get("mlflow", ...) is None:
            del sys.modules["mlflow"]
    return deepspeed
