"""FSDP2 (`fully_shard`): parameters, gradients and optimizer state sharded across ranks.

The wrap policy is data (`fsdp_policies/*.yaml`). Rank 0 alone materialises the model; the other ranks
build it on the meta device, and the weights reach them shard by shard from rank 0, so host RAM holds one
full copy per job rather than one per rank.
"""

from __future__ import annotations

import difflib
import functools

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor, distribute_tensor

from shardtrain.config.settings import ConfigError, where
from shardtrain.runtime.distributed import broadcast_
from shardtrain.strategies.base import DTYPES
from shardtrain.strategies.fsdp_policy import FSDPPolicy, load_policy, shipped_class_names
from shardtrain.strategies.native import NativeStrategy
from shardtrain.strategies.root import workload_root


def _classes_by_name(model: nn.Module, names: list[str], what: str, policy: FSDPPolicy) -> tuple[type, ...]:
    present = {type(m).__name__: type(m) for m in model.modules()}
    known = shipped_class_names() if any(n not in present for n in names) else set()
    for name in names:
        if name not in present and name not in known:
            close = difflib.get_close_matches(name, list(present), n=1)
            raise ConfigError(
                f"{where('fsdp_policy')} {policy.path}: {what} names unknown class '{name}'"
                + (f"; did you mean '{close[0]}'?" if close else "")
            )
    return tuple(present[n] for n in names if n in present)


def _units(
    model: nn.Module, policy: FSDPPolicy, blocks: tuple[type, ...], blocks_from: str = "Workload.block_classes()"
) -> list[nn.Module]:
    """Modules to shard as their own units, innermost first (fully_shard must go bottom-up). The policy's
    wrap_classes where the model has some of them (the shipped policies name the built-ins' blocks), else the
    workload's block classes; a size-only policy (no wrap_classes) stays size-only."""
    classes = _classes_by_name(model, policy.wrap_classes, "wrap_classes", policy)
    if policy.wrap_classes and not classes:
        classes = blocks
    units, covered = [], set()
    for module in reversed(list(model.modules())):
        if module is model:
            continue
        own = [p for p in module.parameters() if id(p) not in covered]
        by_class = classes and isinstance(module, classes)
        by_size = policy.min_params and sum(p.numel() for p in own) >= policy.min_params
        if (by_class or by_size) and own:
            units.append(module)
            covered.update(id(p) for p in module.parameters())
    if not units:
        model_classes = sorted({type(m).__name__ for m in model.modules()})
        if policy.wrap_classes and not blocks:
            raise ConfigError(
                f"FSDP found no blocks to shard: {blocks_from} is empty and the model has no Hugging Face "
                f"_no_split_modules; return its repeated block classes (the model has "
                f"{', '.join(model_classes)}), or use --fsdp-policy fsdp_policies/size_based.yaml"
            )
        looked = policy.wrap_classes or [f"modules with >= {policy.min_params} parameters"]
        raise ConfigError(
            f"{where('fsdp_policy')} {policy.path} wraps nothing in this model: looked for "
            f"{', '.join(map(str, looked))}; the model has {', '.join(model_classes)}"
        )
    return units


def mixed_precision_policy(policy: FSDPPolicy, precision: str) -> MixedPrecisionPolicy | None:
    """Under bf16/fp16 (the policy's mixed_precision, on by default): parameters all-gathered in 16 bits, where
    autocast would recast every fp32 weight per op anyway, and gradients reduce-scattered in fp32, so the sum
    over ranks loses nothing. The BatchNorms share an fp32 unit (setup)."""
    if not policy.mixed_precision or precision == "fp32":
        return None
    return MixedPrecisionPolicy(param_dtype=DTYPES[precision], reduce_dtype=torch.float32)


def wire_dtypes(policy: FSDPPolicy, precision: str) -> dict:
    """What the banner and summary.json say travels over the wire (and why, when it is fp32 under bf16/fp16)."""
    if precision == "fp32":
        return {"mixed_precision_params": False, "param_dtype": "fp32", "reduce_dtype": "fp32"}
    if not policy.mixed_precision:
        return {
            "mixed_precision_params": False,
            "param_dtype": "fp32",
            "reduce_dtype": "fp32",
            "why_fp32_params": "the policy's mixed_precision is false",
        }
    return {"mixed_precision_params": True, "param_dtype": precision, "reduce_dtype": "fp32"}


def materialise(model: nn.Module, device: torch.device, cpu_offload: bool) -> None:
    """Real storage for the sharded model. Under CPU offload the parameters' shards live on the CPU (FSDP2
    moves them to `device` per unit for compute), but buffers are not sharded and never moved: BatchNorm
    statistics and position ids left on the CPU mix with CUDA activations in forward, and a CPU buffer in an
    NCCL broadcast (setup, sync_buffers) raises. They belong on the compute device, as torchtitan places them."""
    model.to_empty(device="cpu" if cpu_offload else device)
    if cpu_offload:
        for module in model.modules():
            for name, buf in module._buffers.items():
                if buf is not None and buf.device != device:
                    module._buffers[name] = buf.to(device)


def _fp32_inputs(module, args):
    return tuple(a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)


def _output_in(dtype, module, args, output):
    return output.to(dtype) if isinstance(output, torch.Tensor) and output.is_floating_point() else output


@torch.no_grad()
def load_full_weights(model: nn.Module, full: dict[str, torch.Tensor], rank0: bool) -> None:
    """Rank 0's full weights (`full`: names as the model's) into every rank's shards and buffers, one tensor at a
    time. Not set_model_state_dict(broadcast_from_rank0=True): it refuses a model whose state lives on two
    devices ("Multiple devices found"), which CPU offload makes on a GPU (parameter shards on the CPU, buffers on
    the GPU; seen on an H200, benchmarks/results/gpu_suite.json)."""
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        whole = full[name].to(t.dtype) if rank0 else torch.empty(t.shape, dtype=t.dtype)
        broadcast_(whole, src=0)  # through the process group's device, wherever `whole` lives
        if isinstance(t, DTensor):  # this rank's slice of it, cut locally (src_data_rank=None: no collective)
            t.to_local().copy_(distribute_tensor(whole, t.device_mesh, t.placements, src_data_rank=None).to_local())
        else:
            t.copy_(whole)


class FSDPStrategy(NativeStrategy):
    name = "fsdp"
    refused_optimizers = {
        "adafactor": "transformers' Adafactor keeps its factored moments as plain tensors beside FSDP2's sharded "
        "parameters (DTensors), and torch refuses to mix the two in its update; use it under --strategy ddp",
    }
    grads_sharded = True  # each rank's share of the gradient norm is its shards'
    shards_outside_forward = True

    def is_shard(self, p):
        # A unit's parameters are DTensor shards again after its forward (the root's stay gathered for backward).
        return isinstance(p, DTensor)

    def __init__(self, cfg, dist_info, workload=None, geometry=None, recompute=None):
        super().__init__(cfg, dist_info, workload, geometry, recompute)
        self.policy = load_policy(cfg.parallel.fsdp_policy)

    def _make_scaler(self):
        return ShardedGradScaler(self.device.type)

    def setup(self, build_model, frozen_names):
        rank0 = self.dist.is_rank0
        model = build_model(on_meta=not rank0)
        full_sd = {k: v.detach().cpu() for k, v in model.state_dict().items()} if rank0 else {}
        buffers = {n: b.detach().clone().cpu() for n, b in model.named_buffers()} if rank0 else {}
        self._freeze(model, frozen_names)  # before sharding: a unit may hold frozen and trainable parameters

        # The policy's classes where the model has some of them; else the workload's blocks.
        ac_classes = _classes_by_name(
            model, self.policy.activation_checkpointing, "activation_checkpointing", self.policy
        ) or self.block_classes(model)
        self.recompute_count = self._apply_recompute(model, ac_classes)

        mesh = init_device_mesh(self.device.type, (self.dist.world_size,))
        common = {"mesh": mesh, "reshard_after_forward": self.policy.reshard_after_forward}
        if self.policy.cpu_offload:
            # CPUOffloadPolicy(pin_memory=False) works on CPU (measured); pinning needs CUDA.
            common["offload_policy"] = CPUOffloadPolicy(pin_memory=self.device.type == "cuda")
        low = DTYPES[self.precision]
        mp = mixed_precision_policy(self.policy, self.precision)
        units = _units(model, self.policy, self.block_classes(model), f"{type(self.workload).__name__}.block_classes()")
        norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        if mp and norms:
            # BatchNorm must see fp32 weights: one unit of them all keeps them so and hands back low precision.
            # One unit, not one each: a unit costs hooks, copies and a collective per pass, and ResNet-50's 53
            # units of a few KB each made FSDP's step 3.5x DDP's on an H200 (benchmarks/results/gpu_suite.json).
            bn_mp = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, output_dtype=low)
            fully_shard(norms, mp_policy=bn_mp, **common)
            # torch 2.14.1 applies the unit's input and output casts at every norm of the group; FSDP2 releases
            # whose group hooks fire only at the group's first forward and its last apply them there alone
            # (read from their source). These make every norm see fp32 and hand back 16 bits on any release.
            for m in norms:
                m.register_forward_pre_hook(_fp32_inputs)
                m.register_forward_hook(functools.partial(_output_in, low))
        self.norm_units = int(bool(mp and norms))
        if self.cfg.train.compile != "none":
            # Per block, before sharding (torchtitan's order): FSDP2's all-gather / reduce-scatter hooks stay
            # outside the compiled regions and are scheduled as in eager mode.
            for unit in units:
                unit.compile(backend=self.cfg.train.compile)
        for unit in units:
            fully_shard(unit, **({"mp_policy": mp} if mp else {}), **common)
        # The root unit is the workload's forward (a ModuleDict has none to shard around); same names as the model.
        model = workload_root(model, self.workload)
        fully_shard(model, **({"mp_policy": mp} if mp else {}), **common)
        self.unit_count = len(units)

        materialise(model, self.device, self.policy.cpu_offload)
        # Non-persistent buffers (e.g. position ids) are not in the state dict: every buffer comes from `buffers`.
        load_full_weights(model, {**full_sd, **buffers}, rank0)
        del full_sd, buffers
        self.model = model
        return self._finish_setup(frozen_names)

    def micro_step(self, is_last):
        self.model.set_requires_gradient_sync(is_last)
        return super().micro_step(is_last)

    def describe(self):
        return {
            "strategy": "fsdp",
            "offload": self.policy.cpu_offload,
            "policy": self.policy.path,
            "sharding": self.policy.sharding,
            "units": self.unit_count,
            "norm_units": self.norm_units,  # the fp32 unit all BatchNorms share under 16-bit parameters
            **wire_dtypes(self.policy, self.precision),
            "recompute_blocks": self.recompute_count,
            "blocks": self.block_count,
        }
