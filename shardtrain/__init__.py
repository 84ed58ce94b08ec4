"""shardtrain: one training loop, DDP / FSDP2 / DeepSpeed ZeRO behind a Strategy, any PyTorch model.

    from shardtrain import Workload, fit

Looked up lazily: `shardtrain doctor` and config errors must not pay for importing torch.
"""


def __getattr__(name):
    if name == "Workload":
        from shardtrain.workloads.base import Workload

        return Workload
    if name == "fit":
        from shardtrain.api import fit

        return fit
    raise AttributeError(f"module 'shardtrain' has no attribute {name!r}")


__all__ = ["Workload", "fit"]
