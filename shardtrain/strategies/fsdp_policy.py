"""The FSDP policy file (fsdp_policies/*.yaml): read and checked without torch, so that the parent process of
`train --nproc N` checks it before any process starts without paying for torch (strategies/fsdp.py applies it).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields
from pathlib import Path

from shardtrain.config.settings import ConfigError, where

SHIPPED_POLICIES = Path(__file__).resolve().parents[2] / "fsdp_policies"


def shipped_class_names() -> set[str]:
    """The classes the shipped policies list (one policy serves several models): a model may lack some of them.
    Read from the policy files, so the strategy itself names no model."""
    import yaml

    names: set[str] = set()
    for path in SHIPPED_POLICIES.glob("*.yaml"):
        data = yaml.safe_load(path.read_text()) or {}
        for key in ("wrap_classes", "activation_checkpointing"):
            names.update(data.get(key) or [])
    return names


@dataclass
class FSDPPolicy:
    wrap_classes: list = field(default_factory=list)
    min_params: int | None = None
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    # Under --precision bf16/fp16: all-gather in 16 bits, reduce-scatter in fp32 (fsdp.py); fp32 runs ignore it.
    mixed_precision: bool = True
    activation_checkpointing: list = field(default_factory=list)
    path: str = ""

    @property
    def sharding(self) -> str:
        return "FULL_SHARD" if self.reshard_after_forward else "SHARD_GRAD_OP"


def load_policy(path: str) -> FSDPPolicy:
    import yaml

    p = Path(path)
    shipped = Path(__file__).resolve().parents[2] / p
    if not p.is_file() and not p.is_absolute() and shipped.is_file():
        # The default policy is implied, not typed: a run started outside the checkout (a Slurm or
        # SageMaker working dir) still finds the shipped fsdp_policies/ beside the package.
        p = shipped
    if not p.is_file():
        raise ConfigError(f"{where('fsdp_policy')}: file not found: {p}")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        loc = f" line {mark.line + 1}, column {mark.column + 1}:" if mark else ""
        raise ConfigError(f"{where('fsdp_policy')} {p}:{loc} invalid YAML: {getattr(e, 'problem', e)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where('fsdp_policy')} {p}: expected a mapping of policy keys")
    known = {f.name for f in fields(FSDPPolicy)} - {"path"}
    for key in data:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            raise ConfigError(
                f"{where('fsdp_policy')} {p}: unknown key '{key}'"
                + (f"; did you mean '{close[0]}'?" if close else f" (keys: {', '.join(sorted(known))})")
            )
    policy = FSDPPolicy(**data, path=str(p))
    for key in ("wrap_classes", "activation_checkpointing"):
        if not isinstance(getattr(policy, key), list):
            raise ConfigError(f"{where('fsdp_policy')} {p}: '{key}' must be a list of class names")
    if not policy.wrap_classes and not policy.min_params:
        raise ConfigError(
            f"{where('fsdp_policy')} {p}: names neither wrap_classes nor min_params: "
            f"the whole model would be one giant unit"
        )
    return policy
