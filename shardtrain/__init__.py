"""shardtrain: one training loop, DDP / FSDP2 / DeepSpeed ZeRO behind a Strategy, any PyTorch model.

    from shardtrain import Workload, fit

Looked up lazily: `shardtrain doctor` and config errors must not pay for importing torch.

The composition root: the built-ins' settings and names go into the config's slot (config/shipped.py) here, on the
first import of anything in the package, so that every process (torchrun's, DeepSpeed's, a DataLoader worker's)
reads configs with them, and config/ itself names no model.
"""

from shardtrain.builtin_workloads.settings import BUILTINS as _BUILTINS
from shardtrain.config.settings import ship as _ship

_ship(_BUILTINS)


def __getattr__(name):
    if name == "Workload":
        from shardtrain.workloads.base import Workload

        return Workload
    if name == "fit":
        from shardtrain.api import fit

        return fit
    raise AttributeError(f"module 'shardtrain' has no attribute {name!r}")


__all__ = ["Workload", "fit"]
