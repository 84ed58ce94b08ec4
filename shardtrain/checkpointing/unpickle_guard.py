"""Refuse checkpoint files that would run code when unpickled, before anything reads them for real.

Our own files are JSON and safetensors. Two formats we read are pickles by design: the `.metadata` of a
torch.distributed.checkpoint folder (read with a plain `pickle.load` inside torch) and DeepSpeed's engine
files (read by DeepSpeed with `torch.load(weights_only=False)`). Each is checked here first with an
unpickler that only rebuilds plain data, so a crafted file fails with one line and executes nothing.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import pickle
import sys
from pathlib import Path

from shardtrain.config.settings import ConfigError

# DeepSpeed's checkpoints hold these plain-data classes next to tensors (measured on 0.19.8 ZeRO-2/3).
DEEPSPEED_GLOBALS = (
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
)
_BUILTINS = {"set", "frozenset", "tuple", "list", "dict", "slice"}


class UnsafeCheckpoint(ConfigError):
    pass


def _refuse(path: Path, what: str) -> UnsafeCheckpoint:
    return UnsafeCheckpoint(
        f"checkpoint file {path} contains a pickled {what}, which loading would execute; "
        f"refusing to load it (only plain tensors and checkpoint metadata are accepted)"
    )


class _MetadataUnpickler(pickle.Unpickler):
    """Rebuilds DCP metadata: its dataclasses/enums, torch dtypes/sizes and builtin containers. Nothing else,
    and no module outside torch.distributed.checkpoint is imported to find out."""

    def __init__(self, file, path: Path):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str):
        if module == "builtins" and name in _BUILTINS:
            return getattr(__import__("builtins"), name)
        if module == "collections" and name == "OrderedDict":
            from collections import OrderedDict

            return OrderedDict
        if module == "pathlib" and name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"):
            import pathlib

            return getattr(pathlib, name)  # a path object: building one does no I/O
        if module == "torch.serialization" and name == "_get_layout":
            import torch.serialization

            return torch.serialization._get_layout  # a lookup of torch.strided & co. by name
        if module == "torch":
            import torch

            obj = getattr(torch, name, None)
            if obj is torch.Size or isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
                return obj
        elif module.startswith("torch.distributed.checkpoint.") and "." not in name:
            obj = getattr(importlib.import_module(module), name, None)
            if isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)):
                return obj
        raise _refuse(self.path, f"object '{module}.{name}'")


def check_dcp_metadata(dcp_dir: Path) -> None:
    path = Path(dcp_dir) / ".metadata"
    if not path.is_file():
        raise ConfigError(f"checkpoint {dcp_dir}: missing {path.name}: the checkpoint is incomplete or corrupt")
    try:
        with open(path, "rb") as f:
            _MetadataUnpickler(f, path).load()
    except UnsafeCheckpoint:
        raise
    except Exception as e:  # noqa: BLE001 - truncated or garbage bytes: a corrupt file, said in one line
        raise ConfigError(f"checkpoint file {path} is corrupt ({type(e).__name__}: {e})") from None


def check_torch_file(path: Path, allowed: tuple[str, ...] = DEEPSPEED_GLOBALS) -> None:
    """torch.load(weights_only=True) with `allowed` classes as a dry run: mmap keeps it from reading the
    tensor data, so the cost is the pickle itself."""
    import torch

    globs = []
    for dotted in allowed:
        module, _, name = dotted.rpartition(".")
        mod = sys.modules.get(module)
        if mod is None:
            try:
                mod = importlib.import_module(module)
            except ImportError:
                continue
        globs.append(getattr(mod, name))
    try:
        with torch.serialization.safe_globals(globs):
            torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        what = first.split("Unsupported global: GLOBAL ", 1)[-1].split(" ")[0] if "GLOBAL" in first else "object"
        raise _refuse(path, f"object '{what}'") from None
    except Exception as e:  # noqa: BLE001
        raise ConfigError(
            f"checkpoint file {path} is corrupt ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
        ) from None
