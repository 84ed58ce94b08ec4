"""`shardtrain plan`: predict per-GPU memory for every strategy before a job starts, and pick one.

    shardtrain plan --config configs/longformer_4096.yaml --gpus 4 --gpu v100-16gb [--per-device-batch-size 8
                    --max-length 4096] [--json]

Model states are counted on the meta device (nothing allocated) and priced the way shardtrain really holds
them, which is what `shardtrain.memory.accounting` measures on a run (Ψ = parameter count, N = ranks):
  - every strategy keeps fp32 master weights (DDP/FSDP and DeepSpeed bf16 run under torch.autocast);
    DeepSpeed fp16 keeps 16-bit weights in the model and the fp32 master copy in the optimizer;
  - DeepSpeed always keeps its own fp32 master partition, also when the weights are already fp32 (its
    ZeRO-3 "no copy" test compares a torch.device with a string, which is never equal: measured here);
  - ZeRO-3 keeps parameters under stage3_param_persistence_threshold whole on every rank, and a reduce bucket
    (reduce_bucket_size elements) allocated for the whole run.
The ZeRO paper's formulas (Rajbhandari et al. 2020; fp16 weights and grads, K=12 for mixed-precision Adam) are
printed beside ours: baseline (2+2+K)Ψ, stage 2 2Ψ+(2+K)Ψ/N, stage 3 (4+K)Ψ/N; DeepSpeed's own stage-2
estimator uses 2Ψ+18Ψ/N.

Activations come from a measurement: the real architecture with 1 and 2 encoder layers, forward + loss on CPU
under saved-tensor hooks (shardtrain.memory.accounting.SavedActivations), batch 2 at three sequence lengths and
batch 4 at the shortest. What is saved is a part per sample plus a part per forward that no batch size changes: under
autocast the low-precision copy of every weight a matmul or convolution used (autocast casts each weight once
per forward and backward needs it: 2 bytes per such parameter, ~10 MiB of the tiny multimodal model's ~12 at
bf16 micro-batch 8), and per-channel BatchNorm statistics. Batch 2 against batch 4 separates the two (the
per-forward part does not depend on the length: measured at 4..256 tokens); scaling all of batch 2's bytes
with the batch counted the weight copies micro-batch/2 times over.
Per layer and per length the per-sample bytes are fitted in the length: a quadratic through three lengths for
full attention (it may grow as L²); Longformer's sliding window is linear in L (x window) from two windows on,
so a line through 2 and 3 windows (one window is a special case, and a quadratic through it bent the
extrapolation to 16 windows 21% low). Then they are scaled to the layer count and the batch.
With activation checkpointing the same measurement runs with the blocks checkpointed; backward then also
needs one block's activations again while it is recomputed, which goes into overhead.
DeepSpeed fp16 keeps 16-bit weights, so there are no weight copies to save; it is measured as autocast all
the same (an upper bound by those copies).
ZeRO-3 trains with DeepSpeed's own linear: zero.Init swaps it in for torch.nn.functional.linear, until the run
ends ("mem_efficient_linear", on by default; strategies/zero.py gives torch's back). It saves its input as it
is, where torch's linear on a non-contiguous input (Longformer's transposed hidden states) saves the contiguous
copy it makes: 15% fewer activations on a 4-layer Longformer. ZeRO-3 rows are measured with a linear that
saves what it saves.
For a GPU, dropout and attention are measured as CUDA's fused kernels save them (_kernels_of): the CPU's own keep
more (a mask in the input's dtype; attention's L x L weights under dropout).

The model is counted with the vocabulary the run's tokenizer will have (shardtrain.data.tokenizer.
planned_vocab_size); the banner passes the run's own tokenizer length.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

from shardtrain.config.geometry import BatchGeometry
from shardtrain.config.recompute import checkpointed_text

GIB = 1024**3
REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gib: float
    bf16: bool


GPUS = {
    "a100-40gb": GPU("A100 40GB", 40.0, True),
    "a100-80gb": GPU("A100 80GB", 80.0, True),
    "v100-16gb": GPU("V100 16GB", 16.0, False),
    "v100-32gb": GPU("V100 32GB", 32.0, False),
    "h100-80gb": GPU("H100 80GB", 80.0, True),
    "h200-141gb": GPU("H200 141GB", 141.0, True),
    # The 16-48 GB cards of cloud instances (SageMaker's g4dn, g5, g6 and g6e) and workstations.
    "t4-16gb": GPU("T4 16GB", 16.0, False),
    "a10g-24gb": GPU("A10G 24GB", 24.0, True),
    "a10-24gb": GPU("A10 24GB", 24.0, True),
    "l4-24gb": GPU("L4 24GB", 24.0, True),
    "rtx3090-24gb": GPU("RTX 3090 24GB", 24.0, True),
    "rtx4090-24gb": GPU("RTX 4090 24GB", 24.0, True),
    "l40s-48gb": GPU("L40S 48GB", 48.0, True),
    "a6000-48gb": GPU("RTX A6000 48GB", 48.0, True),
}
GPU_ALIASES = {
    "a100": "a100-40gb",
    "a100-40": "a100-40gb",
    "a100-80": "a100-80gb",
    "v100": "v100-16gb",
    "v100-16": "v100-16gb",
    "v100-32": "v100-32gb",
    "h100": "h100-80gb",
    "h200": "h200-141gb",
    "t4": "t4-16gb",
    "a10g": "a10g-24gb",
    "a10": "a10-24gb",
    "l4": "l4-24gb",
    "rtx3090": "rtx3090-24gb",
    "rtx4090": "rtx4090-24gb",
    "l40s": "l40s-48gb",
    "a6000": "a6000-48gb",
}
# Resident outside the allocator's view: the CUDA context and kernels (~0.3-0.5 GiB on A100/H100).
CUDA_CONTEXT = 0.5 * GIB
# Below this much free memory a run fits on paper but fragments into an OOM.
HEADROOM = 0.05

# Variant -> (strategy, fsdp policy or ds config, relative cost, communication per step in Ψ-sized payloads).
# The cost is a heuristic for ranking, not a measurement: sharding adds collectives (FSDP/ZeRO-3 gather
# parameters again for backward), offload moves state over PCIe and runs Adam on the CPU.
VARIANTS = {
    "ddp": ("ddp", None, 1.00, "all-reduce grads (2Ψ)"),
    "zero2": ("deepspeed", "ds_configs/zero2.json", 1.05, "reduce-scatter grads + all-gather params (2Ψ)"),
    "fsdp_sgo": ("fsdp", "fsdp_policies/shard_grad_op.yaml", 1.05, "all-gather once + reduce-scatter (2Ψ)"),
    "fsdp": ("fsdp", "fsdp_policies/default.yaml", 1.12, "all-gather twice + reduce-scatter (3Ψ)"),
    "zero3": ("deepspeed", "ds_configs/zero3.json", 1.15, "all-gather twice + reduce-scatter (3Ψ)"),
    "zero2_offload": ("deepspeed", "ds_configs/zero2_offload.json", 1.6, "2Ψ + grads/params over PCIe, CPU Adam"),
    "fsdp_offload": ("fsdp", "fsdp_policies/offload.yaml", 2.0, "3Ψ, all state over PCIe, CPU Adam"),
    "zero3_offload": ("deepspeed", "ds_configs/zero3_offload.json", 2.2, "3Ψ, all state over PCIe, CPU Adam"),
}
RECOMPUTE_COST = 1.33  # one more forward per step: ~1/3 of forward + backward


# ---- the model, counted without allocating it ---------------------------------------------------------------
@dataclass
class ModelCount:
    params: int
    largest_unit: int  # parameters of the biggest wrapped block / layer (gathered whole at a time)
    small_params: int  # parameters in tensors below ZeRO-3's persistence threshold (kept whole)
    buffer_bytes: int
    layers: int  # repeated text encoder layers
    blocks: int = 0  # instances of the block classes (what activation checkpointing wraps)
    # Parameters frozen for the whole run (freeze_layers without unfreeze_at_step, and whatever the model is built
    # frozen with): no gradient and no optimizer state under any strategy. freeze_layers' with unfreeze_at_step
    # get both before the end, so they count in full.
    frozen: int = 0
    # The optimizer's state for the trainable parameters, whole (strategies/optim.py optim_state_bytes for
    # --optim); None: AdamW's two fp32 moments.
    optimizer_state: int | None = None

    @property
    def optim_bytes(self) -> float:
        return 8 * (self.params - self.frozen) if self.optimizer_state is None else self.optimizer_state


def memory_model_of(cfg):
    """The workload's answer to what the planner measures (Workload.memory_model()); None: it gives none, and
    only its model states are planned (plan_workload)."""
    from shardtrain.workloads.base import load_workload

    return load_workload(cfg).memory_model()


def _measured(cfg):
    model = memory_model_of(cfg)
    if model is None:
        from shardtrain.config.settings import ConfigError, where, workload_target

        raise ConfigError(
            f"{where('workload')}: {workload_target(cfg)} has no memory_model(), so its activations cannot be "
            f"measured; `shardtrain plan` plans its model states alone"
        )
    return model


def run_vocab(cfg) -> tuple[int | None, str]:
    """(vocab size, source) of the model the run builds: the checkpoint's own when pretrained (None), else
    its tokenizer's length, which for a trained tokenizer can be well under tokenizer_vocab_size."""
    return _measured(cfg).vocab()


def count_model(cfg, persistence_threshold: int = 100_000, vocab_size: int | None = None) -> ModelCount:
    """`vocab_size`: the run's tokenizer length when known (the banner); otherwise planned (run_vocab)."""
    model = _measured(cfg)
    if vocab_size is None:
        vocab_size, _ = model.vocab()
    return model.count(persistence_threshold, vocab_size)


def _optimizer_state(cfg, model, freeze_layers_names: set[str]) -> int:
    """--optim's state bytes for what trains (the frozen parameters have none)."""
    from shardtrain.strategies.optim import optim_state_bytes

    trained = [
        tuple(p.shape) for name, p in model.named_parameters() if p.requires_grad and name not in freeze_layers_names
    ]
    return optim_state_bytes(cfg.train.optim, trained)


def _frozen_count(model, freeze_layers_names: set[str]) -> int:
    """Parameters frozen for the whole run: those of freeze_layers (when nothing unfreezes them) and those
    the model is built frozen with (requires_grad False), which no strategy trains (strategies/base.py)."""
    return sum(p.numel() for name, p in model.named_parameters() if name in freeze_layers_names or not p.requires_grad)


def count_built(cfg, model, blocks: tuple, freezable, persistence_threshold: int, layers: int) -> ModelCount:
    """A model built on the meta device, counted: `blocks` (classes: FSDP units, gathered whole at a time),
    `freezable(n)`: the parameter names freeze_layers: n freezes, `layers`: its repeated layers, which the
    activation measurement scales by (0: none measured)."""
    units = [sum(p.numel() for p in m.parameters()) for m in model.modules() if blocks and isinstance(m, blocks)]
    params = [p.numel() for p in model.parameters()]
    m = cfg.model
    frozen = set(freezable(m.freeze_layers)) if m.freeze_layers and m.unfreeze_at_step is None else set()
    return ModelCount(
        params=sum(params),
        largest_unit=max(units, default=max(params, default=0)),
        small_params=sum(n for n in params if n < persistence_threshold),
        buffer_bytes=sum(b.numel() * b.element_size() for b in model.buffers()),
        layers=layers,
        blocks=len(units),
        frozen=_frozen_count(model, frozen),
        optimizer_state=_optimizer_state(cfg, model, frozen),
    )


# ---- activations, measured at small shapes -------------------------------------------------------------------
def _saved_bytes(
    cfg,
    seq_len: int,
    recompute: bool,
    precision: str,
    batch: int = 2,
    gathered_16bit: bool = False,
    ds_linear: bool = False,
    layers: int | None = None,
    cuda: bool = False,
) -> int:
    """Bytes saved for backward by one forward + loss at this batch and length (batch >= 2: BatchNorm in
    train mode rejects one value per channel, which a small image pooled to 1x1 would give).
    `gathered_16bit`: FSDP's 16-bit all-gathers (strategies/fsdp.py mixed_precision_policy): the weights arrive
    in 16 bits, so autocast saves no cast copy of them, and each BatchNorm, in the norms' fp32 unit, casts its input up
    to fp32 (saving that) and hands back 16 bits; emulated here on the plain model.
    `cuda`: dropout and attention save what CUDA's kernels save (_kernels_of)."""
    from shardtrain.runtime.training_rng import aside

    # Seeded, so a measurement is the same every time, and aside: the model and inputs it draws must not move
    # the training stream of the run whose banner this is (runtime/training_rng.py).
    with aside(seed=0), _linear_of(ds_linear), _kernels_of(cuda):
        return _measured(cfg).saved_bytes(layers, seq_len, recompute, precision, batch, gathered_16bit)


@contextlib.contextmanager
def _kernels_of(cuda: bool):
    """Dropout and attention as a CUDA run's kernels save them, where the plan is for a GPU: the measurement runs
    on CPU, whose kernels keep more for backward.
    - Dropout: CPU's at::dropout keeps its random mask in the input's dtype (2 or 4 bytes an element); CUDA's fused
      kernel, torch.native_dropout, a bool mask (1 byte). native_dropout runs on CPU too, so it is called here.
    - Attention (scaled_dot_product_attention) with dropout: CPU has no fused kernel for it and falls back to the
      math path, which keeps the L x L weights, their mask and fp32 copies of q, k, v; CUDA's flash and memory-
      efficient kernels keep q, k, v, the output, the mask and an fp32 row statistic, and draw the dropout mask
      again from a seed in backward. CPU's flash kernel, which it takes without dropout, keeps exactly those.
    The GPU runs of benchmarks/results/gpu_suite.json (H200, transformers 5.24) saw what this leaves out: the
    CPU-measured plan was 32% over the fusion model's peak at 128 tokens and 10% over Longformer's at 4096."""
    import torch
    import torch.nn.functional as F

    if not cuda:
        yield
        return
    own_dropout, own_attention = F.dropout, F.scaled_dot_product_attention

    def fused_dropout(input, p=0.5, training=True, inplace=False):
        if training and 0 < p < 1 and not inplace and input.numel() > 0:  # at::dropout's test for the fused kernel
            return torch.native_dropout(input, p, True)[0]
        return own_dropout(input, p, training, inplace)

    def fused_attention(query, key, value, attn_mask=None, dropout_p=0.0, *args, **kwargs):
        return own_attention(query, key, value, attn_mask, 0.0, *args, **kwargs)

    F.dropout, F.scaled_dot_product_attention = fused_dropout, fused_attention
    try:
        yield
    finally:
        F.dropout, F.scaled_dot_product_attention = own_dropout, own_attention


@contextlib.contextmanager
def _linear_of(ds_linear: bool):
    """torch.nn.functional.linear as the run will have it: DeepSpeed's for ZeRO-3 (see the module docstring),
    otherwise torch's (a ZeRO-3 run before this one in the process gave it back at its end)."""
    import torch.nn.functional as F

    if not ds_linear:
        yield
        return
    own = F.linear
    F.linear = _saves_like_deepspeeds_linear(own)
    try:
        yield
    finally:
        F.linear = own


def _saves_like_deepspeeds_linear(linear):
    """A linear that saves for backward what DeepSpeed's (deepspeed/runtime/zero/linear.py) saves: its input as
    it came, weight and bias, and nothing its matmul makes (a contiguous copy, autocast's 16-bit weight). It
    computes with torch's own linear: DeepSpeed's, run on CPU under fp16 autocast, took 6x as long to measure.
    Only the measurement's forward runs it (SavedActivations(backward=False)), so it has no backward."""
    import torch

    class SavesItsInput(torch.autograd.Function):
        @staticmethod
        def forward(ctx, input, weight, bias=None):
            ctx.save_for_backward(input, weight, bias)
            out = linear(input, weight, bias)
            # A view (a 3-D input's matmul) may not leave a custom Function: its users modify it in place.
            return out.clone() if out._base is not None else out

    return SavesItsInput.apply


def _fit_quadratic(xs: list[int], ys: list[float]):
    """Exact quadratic through three points (Lagrange form): bytes as a function of sequence length."""
    (x0, x1, x2), (y0, y1, y2) = xs, ys

    def f(x):
        return (
            y0 * (x - x1) * (x - x2) / ((x0 - x1) * (x0 - x2))
            + y1 * (x - x0) * (x - x2) / ((x1 - x0) * (x1 - x2))
            + y2 * (x - x0) * (x - x1) / ((x2 - x0) * (x2 - x1))
        )

    return f


def _fit_line(xs: list[int], ys: list[float]):
    """The line through two points: bytes as a function of sequence length (sliding-window attention)."""
    (x0, x1), (y0, y1) = xs, ys
    return lambda x: y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _window(cfg) -> int | None:
    return _measured(cfg).pad_multiple()


def sample_lengths(cfg, seq_len: int) -> list[int]:
    """Two lengths fit a line, three a quadratic: anything else cannot be fitted, and names the method."""
    from shardtrain.config.settings import ConfigError

    model = _measured(cfg)
    lengths = list(model.sample_lengths(seq_len))
    if len(lengths) not in (2, 3) or len(set(lengths)) != len(lengths) or not all(int(n) > 0 for n in lengths):
        raise ConfigError(
            f"{type(model).__name__}.sample_lengths({seq_len}) gave {lengths}: the activations are measured at "
            f"2 distinct positive lengths (a line) or 3 (a quadratic), e.g. [seq_len // 4, seq_len // 2]"
        )
    return lengths


@functools.lru_cache(maxsize=32)
def _activation_model(
    cfg_json: str,
    recompute: bool,
    precision: str,
    lengths: tuple[int, ...],
    gathered_16bit: bool = False,
    ds_linear: bool = False,
    cuda: bool = False,
):
    """(per-sample bytes outside the layers, per-sample bytes per layer) as functions of the length, and the
    per-forward bytes (weight copies, BatchNorm statistics) outside the layers and per layer."""
    from shardtrain.config.settings import from_dict

    cfg = from_dict(json.loads(cfg_json))
    per_sample, per_forward = {}, {}
    for n in (1, 2):
        how = {"gathered_16bit": gathered_16bit, "ds_linear": ds_linear, "layers": n, "cuda": cuda}
        at2 = [_saved_bytes(cfg, length, recompute, precision, **how) for length in lengths]
        per_forward[n] = max(0, 2 * at2[0] - _saved_bytes(cfg, lengths[0], recompute, precision, batch=4, **how))
        per_sample[n] = [(b - per_forward[n]) / 2 for b in at2]
    per_layer = [b - a for a, b in zip(per_sample[1], per_sample[2])]
    fixed = [a - p for a, p in zip(per_sample[1], per_layer)]
    fit = _fit_quadratic if len(lengths) == 3 else _fit_line
    layer_forward = per_forward[2] - per_forward[1]
    return fit(list(lengths), fixed), fit(list(lengths), per_layer), per_forward[1] - layer_forward, layer_forward


def activation_bytes(
    cfg,
    batch: int,
    seq_len: int,
    recompute: float,
    precision: str,
    layers: int,
    planned_length: int | None = None,
    gathered_16bit: bool = False,
    ds_linear: bool = False,
    cuda: bool = False,
) -> dict:
    """Predicted bytes saved for backward per micro-batch, and one layer's worth (the recompute working set).
    `recompute`: the share of the blocks checkpointed (True: all). Between none and all the saved bytes are
    interpolated: each checkpointed block keeps its input instead of everything inside it, which for blocks of
    one kind (Longformer's layers) is the per-layer measurement exactly.
    `planned_length`: the length the measurement is planned for (default seq_len); the end of a run evaluates
    the banner's fit (planned for max_length) at the length a batch really had.
    `ds_linear`: measured with DeepSpeed's linear, which ZeRO-3 trains with (see the module docstring).
    `cuda`: for a run on CUDA, whose dropout and attention kernels save less (_kernels_of)."""
    w = _window(cfg)
    if w:
        seq_len = -(-seq_len // w) * w
    d = cfg.to_dict()
    cfg_json = json.dumps({k: v for k, v in d.items() if k in ("workload", "model", "data")}, sort_keys=True)
    lengths = tuple(sample_lengths(cfg, planned_length or seq_len))

    def saved(checkpointed: bool) -> float:
        fixed, per_layer, fixed_forward, layer_forward = _activation_model(
            cfg_json, checkpointed, precision, lengths, gathered_16bit, ds_linear, cuda
        )
        return batch * (fixed(seq_len) + layers * per_layer(seq_len)) + fixed_forward + layers * layer_forward

    _, per_layer_full, _, layer_forward_full = _activation_model(
        cfg_json, False, precision, lengths, gathered_16bit, ds_linear, cuda
    )
    share = float(recompute)
    total = saved(False) if share == 0 else saved(False) + share * (saved(True) - saved(False))
    return {"saved": max(0.0, total), "one_layer": max(0.0, batch * per_layer_full(seq_len) + layer_forward_full)}


def gpu_bytes(
    cfg,
    variant: str,
    m: ModelCount,
    n: int,
    micro: int,
    precision: str,
    recompute: float,
    cuda: bool,
    seq_len: int | None = None,
):
    """(bytes per rank on the GPU by part, host bytes per rank) for one variant at this micro-batch and share of
    checkpointed blocks: model states, activations at max_length (or at `seq_len`, from the same measurement),
    and backward's working set. `cuda`: a run on CUDA, with its context and its kernels' saved tensors."""
    gathered = gathers_16bit(variant, precision)
    states = model_states(variant, m, n, precision)
    act = activation_bytes(
        cfg,
        micro,
        seq_len or cfg.data.max_length,
        recompute,
        precision,
        m.layers,
        planned_length=cfg.data.max_length,
        gathered_16bit=gathered,
        ds_linear=trains_with_ds_linear(variant),
        cuda=cuda,
    )
    g = dict(states["gpu"])
    g["activations"] = act["saved"]
    g["overhead"] += (CUDA_CONTEXT if cuda else 0.0) + act["one_layer"] * (1 if recompute else 0.5)
    return g, states["host"]


def trains_with_ds_linear(variant: str) -> bool:
    """ZeRO-3 builds the model under zero.Init, which swaps in DeepSpeed's linear (see the module docstring)."""
    return variant.startswith("zero3")


def recompute_cost(share: float) -> float:
    """Relative step time of checkpointing this share of the blocks: each one runs its forward again."""
    return 1 + (RECOMPUTE_COST - 1) * share


def recompute_time_share(share: float) -> float:
    """The predicted share of a step's time spent recomputing."""
    return (recompute_cost(share) - 1) / recompute_cost(share)


# ---- model states per variant --------------------------------------------------------------------------------
def _ds_settings(path: str) -> dict:
    data = json.loads((REPO / path).read_text())
    z = data.get("zero_optimization", {})
    return {
        "bucket": int(z.get("reduce_bucket_size", 5e8)),
        "prefetch": int(z.get("stage3_prefetch_bucket_size", 5e7)),
        "persist": int(z.get("stage3_param_persistence_threshold", 1e5)),
    }


def gathers_16bit(variant: str, precision: str, policy_path: str | None = None) -> bool:
    """Whether FSDP all-gathers 16-bit parameters here: the policy's mixed_precision (the shipped policies': on)
    under bf16/fp16."""
    if not variant.startswith("fsdp") or precision == "fp32":
        return False
    if policy_path is None:
        return True
    from shardtrain.strategies.fsdp_policy import load_policy

    return load_policy(policy_path).mixed_precision


def model_states(variant: str, m: ModelCount, n: int, precision: str, gathered_16bit: bool | None = None) -> dict:
    """Bytes per rank on the GPU (params/grads/optimizer/comm/overhead) and in host RAM, steady state after
    backward (what shardtrain.memory.accounting measures) plus the transient peak in `overhead`."""
    psi = m.params
    psi_t = m.params - m.frozen  # what gets gradients and optimizer state (strategies: frozen parameters get none)
    opt = m.optim_bytes  # --optim's state (AdamW: 8 bytes per trained parameter)
    lp = 2 if precision != "fp32" else 4  # bytes per 16-bit-or-fp32 weight where the backend keeps them so
    native_fp16 = precision == "fp16"  # only DeepSpeed fp16 keeps 16-bit weights (others: autocast)
    gpu = {"params": 0.0, "grads": 0.0, "optimizer": 0.0, "comm": 0.0, "overhead": 0.0}
    host = 0.0
    gathered = gathers_16bit(variant, precision) if gathered_16bit is None else gathered_16bit
    if variant == "ddp":
        gpu.update(params=4 * psi, grads=4 * psi_t, optimizer=opt)
    elif variant in ("fsdp", "fsdp_sgo"):
        gpu.update(params=4 * psi / n, grads=4 * psi_t / n, optimizer=opt / n)
        # Gathered units: the current and the prefetched one; SHARD_GRAD_OP keeps all of them from forward to backward.
        g = 2 if gathered else 4
        gpu["overhead"] = g * psi * (1 - 1 / n) if variant == "fsdp_sgo" else 2 * g * m.largest_unit
    elif variant == "fsdp_offload":
        host = 4 * psi / n + 4 * psi_t / n + opt / n
        g = 2 if gathered else 4
        gpu["overhead"] = 2 * g * m.largest_unit + 4 * m.largest_unit  # gathered units + a unit's gradient
    else:
        ds = _ds_settings(VARIANTS[variant][1])
        w = lp if native_fp16 else 4
        if variant.startswith("zero2"):
            gpu["params"] = w * psi
            part = {"grads": 4 * psi_t / n, "optimizer": (4 * psi_t + opt) / n}  # fp32 master + the optimizer's
            if variant == "zero2":
                gpu.update(part)
            else:
                host = sum(part.values())
            # During backward: two reduce buckets (overlap_comm); at the step the flat fp32 gradient.
            gpu["overhead"] = 2 * w * min(ds["bucket"], psi_t) + 4 * psi_t / n
        else:
            persistent = m.small_params
            shard = {
                "params": w * (psi / n) + w * persistent,
                "grads": 4 * psi_t / n,
                "optimizer": (4 * psi_t + opt) / n,  # fp32 master + the optimizer's state
            }
            gpu["comm"] = 4 * ds["bucket"]  # allocated for the whole run (measured)
            gathered = w * min(ds["prefetch"], psi) + 2 * w * m.largest_unit
            if variant == "zero3":
                gpu.update(shard)
            else:
                # Offloaded, the gradient partition buffer moves to host RAM and the CPU optimizer gets an
                # fp32 gradient buffer of its own beside it (measured: 8Ψ/N of gradients per rank).
                gpu["params"] = w * persistent
                host = shard["params"] - w * persistent + 2 * shard["grads"] + shard["optimizer"]
            gpu["overhead"] = gathered
    gpu["overhead"] += m.buffer_bytes
    return {"gpu": gpu, "host": host}


def save_host_bytes(variant: str, m: ModelCount, n: int, async_save: bool) -> float:
    """Host memory one checkpoint save adds per rank. The portable form is the fp32 weights and Adam's two moments
    (4Ψ + 8Ψ_t bytes, the "model state" below); sharded strategies (FSDP, ZeRO-2/3) each write only their 1/N of
    it, from their own partitions, while every DDP rank holds all of it (DCP spreads the writing, not the
    holding). A synchronous save copies one chunk at a time to the host (off the GPU, or out of a view of a
    larger buffer): at most the largest block's fp32 share. --async-save snapshots the whole share first."""
    state = 4 * m.params + m.optim_bytes
    shards = 1 if variant == "ddp" else n
    return state / shards if async_save else 4 * m.largest_unit / shards


def paper_formula(variant: str, psi: int, n: int) -> dict:
    """ZeRO paper model-state bytes (fp16 weights and grads, K=12) and DeepSpeed's estimator where it exists."""
    k = 12
    base = variant.split("_")[0]
    paper = {
        "ddp": (2 + 2 + k) * psi,
        "zero2": 2 * psi + (2 + k) * psi / n,
        "fsdp_sgo": 2 * psi + (2 + k) * psi / n,
        "zero3": (4 + k) * psi / n,
        "fsdp": (4 + k) * psi / n,
    }.get(base if base != "fsdp" else variant.split("_offload")[0])
    out = {"zero_paper": paper}
    if variant == "zero2":
        out["deepspeed_estimator"] = 2 * psi + 18 * psi / n
    return out


# ---- the plan ------------------------------------------------------------------------------------------------
def resolve_gpu(name: str, memory_budget_gb: float | None = None) -> GPU:
    """A card of the table; another one by its name when --memory-budget-gb says how much memory to plan for
    (assumed to have bf16: every card since the A100's generation does)."""
    from shardtrain.config.settings import ConfigError

    key = GPU_ALIASES.get(name.lower(), name.lower())
    if key in GPUS:
        return GPUS[key]
    if memory_budget_gb is not None:
        return GPU(name, memory_budget_gb, True)
    raise ConfigError(
        f"--gpu {name}: unknown GPU; known: {', '.join(GPUS)} (another card: --gpu NAME --memory-budget-gb "
        "its memory in GB)"
    )


def plan(
    cfg, gpus: int, capacity_bytes: float, bf16_ok: bool = True, cuda: bool = True, at_token_budget: bool = False
) -> dict:
    """Every variant with activation checkpointing off and on, at the config's micro-batch; the recommendation.
    `at_token_budget` (`shardtrain plan`): under a --max-tokens-per-batch, at the largest micro-batch the run can
    meet instead, the budget's worth of max_length texts, as the run's banner predicts."""
    t = cfg.train
    precision = t.precision if (t.precision != "bf16" or bf16_ok) else "fp16"
    vocab, vocab_source = run_vocab(cfg)
    m = count_model(cfg, vocab_size=vocab)
    planned = BatchGeometry.configured(cfg, gpus)
    if at_token_budget:
        planned = planned.at_token_budget(cfg)
    global_batch = planned.global_batch

    def row(variant: str, micro: int, checkpointed: int) -> dict:
        _, _, cost, comm = VARIANTS[variant]
        share = checkpointed / m.blocks if m.blocks else float(checkpointed > 0)
        g, host = gpu_bytes(cfg, variant, m, gpus, micro, precision, share, cuda)
        total = sum(g.values())
        partial = 0 < checkpointed < m.blocks
        return {
            "variant": variant,
            # True / False, or "auto" for the fewest blocks that fit (what --activation-checkpointing auto picks)
            "activation_checkpointing": "auto" if partial else checkpointed > 0,
            "checkpointed_blocks": checkpointed,
            "blocks": m.blocks,
            "micro_batch_size": micro,
            "grad_accum": global_batch // (micro * gpus),
            "gpu_bytes": g,
            "total_bytes": total,
            "host_bytes_per_gpu": host,
            "host_bytes_total": host * gpus,
            "save_host_bytes_per_gpu": save_host_bytes(variant, m, gpus, cfg.checkpoint.async_save),
            "headroom_bytes": capacity_bytes - total,
            "fits": total <= capacity_bytes * (1 - HEADROOM),
            "relative_cost": round(cost * recompute_cost(share), 3),
            "communication": comm,
            "recompute": f"{checkpointed} of {m.blocks} blocks run their forward again" if share else "none",
            **{k: v for k, v in paper_formula(variant, m.params, gpus).items() if v is not None},
        }

    def rows_at(micro: int) -> list[dict]:
        rows = []
        for variant in VARIANTS:
            off, full = row(variant, micro, 0), row(variant, micro, m.blocks)
            rows += [off, full]
            if full["fits"] and not off["fits"]:  # some blocks are enough: the fewest
                k = fewest_blocks(cfg, variant, m, gpus, micro, precision, capacity_bytes, cuda)
                if k is not None and 0 < k < m.blocks:
                    rows.insert(-1, row(variant, micro, k))
        return rows

    micro = planned.micro
    rows = rows_at(micro)
    fitting = [r for r in rows if r["fits"]]
    recommendation, note = None, ""
    while not fitting and micro > 1:
        # Keep the global batch: halve the micro-batch while it still divides it, doubling accumulation.
        micro //= 2
        if global_batch % (micro * gpus):
            continue
        fitting = [r for r in rows_at(micro) if r["fits"]]
        note = f"nothing fits at micro-batch {planned.micro}; keeps global batch {global_batch}"
    budget = None
    if fitting:
        recommendation = min(fitting, key=lambda r: (r["relative_cost"], r["total_bytes"]))
        # --max-tokens-per-batch for the recommendation: as many tokens per micro-batch as fit at any text length
        budget = token_budget(cfg, recommendation, m, gpus, precision, capacity_bytes, cuda)
    return {
        "model_params": m.params,
        "vocab_size": vocab,
        "vocab_source": vocab_source,
        "gpus": gpus,
        "capacity_bytes": capacity_bytes,
        "precision": precision,
        "seq_len": cfg.data.max_length,
        "micro_batch_size": planned.micro,
        "global_batch_size": global_batch,
        "asked_max_tokens_per_batch": cfg.data.max_tokens_per_batch if at_token_budget else None,
        "rows": rows,
        "recommendation": recommendation,
        "max_tokens_per_batch": budget,
        "note": note,
    }


MAX_TOKEN_BUDGET = 1 << 24  # the search's ceiling: 16M tokens per micro-batch, beyond any device's activations


def budget_lengths(cfg) -> list[int]:
    """The text lengths a token-budget micro-batch is checked at: every window multiple up to max_length
    (Longformer pads to one), else halvings of max_length down to a one-token text. The short end matters where
    a sample costs memory its text does not (an image): N tokens of 8-token texts are N // 8 samples, and a
    budget checked from 16 tokens up ran the multimodal configs out of memory on short posts."""
    top, w = cfg.data.max_length, _window(cfg)
    if w:
        return list(range(w, -(-top // w) * w + 1, w))
    return sorted({max(1, top >> k) for k in range(top.bit_length())})


def token_budget(cfg, row: dict, m: ModelCount, n: int, precision: str, capacity: float, cuda: bool) -> int | None:
    """The largest --max-tokens-per-batch for `row`'s variant and checkpointed blocks whose every micro-batch
    fits: at each text length L up to max_length, N // L texts of length L (the measured per-sample activation
    model, evaluated at L), within the same headroom as the table's `fits`. In multiples of the window (or of
    64 tokens); None: not even one max_length text."""
    share = row["checkpointed_blocks"] / m.blocks if m.blocks else float(row["checkpointed_blocks"] > 0)
    lengths, unit = budget_lengths(cfg), _window(cfg) or 64

    def fits(tokens: int) -> bool:
        for length in lengths:
            micro = tokens // length
            if micro >= 1:
                g, _ = gpu_bytes(cfg, row["variant"], m, n, micro, precision, share, cuda, seq_len=length)
                if sum(g.values()) > capacity * (1 - HEADROOM):
                    return False
        return True

    low = -(-lengths[-1] // unit) * unit  # one text of the longest length
    if not math.isfinite(capacity) or not fits(low):
        return None  # no limit to plan for (a benchmark's capacity=inf), or not even one text
    high = 2 * low
    while high <= MAX_TOKEN_BUDGET and fits(high):
        low, high = high, 2 * high
    while high - low > unit:
        mid = (low + high) // 2 // unit * unit
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def fewest_blocks(cfg, variant, m: ModelCount, n: int, micro: int, precision: str, capacity: float, cuda: bool):
    """The fewest blocks to checkpoint for the predicted peak to fit `capacity` (None: not even all of them).
    Blocks of one kind (each a text layer) can be counted one by one; a model whose blocks differ (a text
    encoder's layers and a CNN's) has a prediction for none and all only, which are then the choices."""
    choices = range(m.blocks + 1) if m.blocks == m.layers else (0, m.blocks)
    for k in choices:
        share = k / m.blocks if m.blocks else 0.0
        g, _ = gpu_bytes(cfg, variant, m, n, micro, precision, share, cuda)
        if sum(g.values()) <= capacity * (1 - HEADROOM):
            return k
    return None


def variant_of(cfg) -> str:
    """The planner's name for the strategy a config runs."""
    from shardtrain.strategies.ds_config import describe_ds, read_json
    from shardtrain.strategies.fsdp import load_policy

    kind = cfg.parallel.strategy
    if kind == "fsdp":
        pol = load_policy(cfg.parallel.fsdp_policy)
        return "fsdp_offload" if pol.cpu_offload else ("fsdp" if pol.reshard_after_forward else "fsdp_sgo")
    if kind == "deepspeed":
        info = describe_ds(read_json(cfg.parallel.ds))
        return f"zero{info['stage']}" + ("_offload" if info["offload_optimizer"] != "none" else "")
    return "ddp"


def predict_run(
    cfg,
    world_size: int,
    vocab_size: int | None = None,
    batch_shape: list | None = None,
    recompute=None,
    cuda: bool = False,
) -> dict:
    """Per-rank prediction (GiB) for the run this config describes. The startup banner shows it at the
    config's micro-batch and max_length (the largest batch the run can meet: padding is to the longest text
    of each batch), with the run's own `vocab_size` (None: planned, as `plan` does). The end of the run
    repeats it at `batch_shape`, the [micro-batch, tokens] a rank's memory was measured at, with the same fit.
    `recompute`: the run's RecomputePlan (None: what the config says, which must not be auto). `cuda`: the run
    trains on CUDA (activations as its kernels save them; no context: the allocator's peak does not see it)."""
    from shardtrain.config.recompute import RecomputePlan

    m = count_model(cfg, vocab_size=vocab_size)
    recompute = recompute or RecomputePlan.configured(cfg.train.activation_checkpointing)
    variant = variant_of(cfg)
    gathered = gathers_16bit(
        variant, cfg.train.precision, cfg.parallel.fsdp_policy if cfg.parallel.strategy == "fsdp" else None
    )
    s = model_states(variant, m, world_size, cfg.train.precision, gathered)
    batch, seq_len = batch_shape or (cfg.train.per_device_batch_size, cfg.data.max_length)
    act = activation_bytes(
        cfg,
        batch,
        seq_len,
        recompute.share(m.blocks),
        cfg.train.precision,
        m.layers,
        gathered_16bit=gathered,
        planned_length=cfg.data.max_length,
        ds_linear=trains_with_ds_linear(variant),
        cuda=cuda,
    )
    g = s["gpu"]
    return {
        "variant": variant,
        "parameters": m.params,
        "batch": f"{batch} x {seq_len} tokens",
        "params_gib": g["params"] / GIB,
        "grads_gib": g["grads"] / GIB,
        "optimizer_gib": g["optimizer"] / GIB,
        "activations_gib": act["saved"] / GIB,
        "model_state_gib": (g["params"] + g["grads"] + g["optimizer"]) / GIB,
        "host_gib": s["host"] / GIB,
        "save_host_gib": save_host_bytes(variant, m, world_size, cfg.checkpoint.async_save) / GIB,
    }


def memory_prediction(
    cfg,
    world_size: int,
    vocab_size: int | None = None,
    batch_shape: list | None = None,
    recompute=None,
    cuda: bool = False,
) -> dict:
    """predict_run for the startup banner and summary.json: a run is never stopped by its advice, so a failure
    (or --predict-memory false) becomes a one-entry {"note": why} the banner prints instead."""
    if not cfg.log.predict_memory:
        return {"note": "not predicted (--predict-memory false)"}
    try:
        return predict_run(cfg, world_size, vocab_size, batch_shape, recompute, cuda)
    except Exception as e:  # noqa: BLE001 - a prediction is advice; it must not stop a run
        return {"note": f"no prediction: planner failed ({type(e).__name__}: {str(e)[:120]})"}


def format_table(header: list[str], rows: list[list[str]], align: str, gap: int = 2) -> list[str]:
    """Lines of a table whose every column is as wide as its widest cell (header included) plus `gap`, so a
    long variant name or a terabyte figure widens its column instead of running into the next one.
    `align` has one character per column: '<' for text, '>' for figures (their decimals line up)."""
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]
    lines = []
    for cells in [header, *rows]:
        padded = [f"{cell:{a}{w}}" for cell, a, w in zip(cells, align, widths)]
        lines.append((" " * gap).join(padded).rstrip())
    return lines


def _gib(b: float) -> str:
    return f"{b / GIB:.2f}"


def _capacity_gib(p: dict) -> str:
    """The memory planned for, as given: 16, or a --memory-budget-gb of 2.5 (it read "2", under a fitting 2.29)."""
    return f"{p['capacity_bytes'] / GIB:.2f}".rstrip("0").rstrip(".")


def _plan_table(p: dict, with_activations: bool) -> list[str]:
    """The per-variant table of `plan` (built-in models: activations too) and of `plan --workload` (model
    states only, which fit or not before activations)."""
    act = with_activations
    gpu = lambda key: lambda r: _gib(r["gpu_bytes"][key])  # noqa: E731
    total, fits = ("total_bytes", "fits") if act else ("model_state_bytes", "fits_before_activations")
    columns = [("variant", "<", lambda r: r["variant"])]
    columns += [("AC", "<", lambda r: _ac_cell(r))] if act else []
    columns += [("params", ">", gpu("params")), ("grads", ">", gpu("grads")), ("optim", ">", gpu("optimizer"))]
    columns += [("activ", ">", gpu("activations"))] if act else []
    columns += [
        ("comm", ">", gpu("comm")),
        ("overh", ">", gpu("overhead")),
        ("total" if act else "states", ">", lambda r: _gib(r[total])),
        ("host/GPU", ">", lambda r: _gib(r["host_bytes_per_gpu"])),
        ("save/GPU", ">", lambda r: _gib(r["save_host_bytes_per_gpu"])),
        ("fits", "<", lambda r: "yes" if r[fits] else "NO"),
        ("headroom", ">", lambda r: _gib(r["headroom_bytes"])),
        ("cost", ">", lambda r: f"{r['relative_cost']:.2f}"),
        ("paper", ">", lambda r: _gib(r["zero_paper"]) if "zero_paper" in r else "-"),
    ]
    return format_table(
        [name for name, _, _ in columns],
        [[cell(r) for _, _, cell in columns] for r in p["rows"]],
        "".join(align for _, align, _ in columns),
    )


def _ac_cell(row: dict, short: bool = True) -> str:
    """off, on, or k of B blocks (k/B in the table)."""
    if "checkpointed_blocks" not in row:  # a row without block counts: all or none
        return "on" if row["activation_checkpointing"] else "off"
    text = checkpointed_text(row["checkpointed_blocks"], row["blocks"])
    return text.replace(" of ", "/").replace(" blocks", "") if short else text


def _budget_note(p: dict) -> str:
    asked = p.get("asked_max_tokens_per_batch")
    return f" (--max-tokens-per-batch {asked} at seq {p['seq_len']}: the largest it holds)" if asked else ""


def _token_budget_line(p: dict, rec: dict) -> list[str]:
    """The budget, where it holds at least the recommended micro-batch of full-length texts. A smaller one (that
    fits the shortest texts) would make every step smaller than the recommendation's, so it is not offered."""
    budget, full = p.get("max_tokens_per_batch"), p["seq_len"]
    if not budget:
        return []
    if budget // full < rec["micro_batch_size"]:
        return [
            f"token budget: none suits: one that fits 1-token texts too holds {budget // full} texts of {full}, under "
            f"the micro-batch of {rec['micro_batch_size']} (a sample's memory is mostly not its text's; keep "
            "--per-device-batch-size)"
        ]
    return [
        f"token budget: --max-tokens-per-batch {budget} fits with it at every text length up to {full} "
        "(micro-batches sized by tokens for variable-length data; see docs/data.md)"
    ]


def format_plan(p: dict, gpu_name: str) -> str:
    vocab = f"vocabulary {p['vocab_size']:,}: {p['vocab_source']}" if p.get("vocab_size") else ""
    lines = [
        f"plan: {p['model_params']:,} parameters{f' ({vocab})' if vocab else ''} on {p['gpus']} x {gpu_name} "
        f"({_capacity_gib(p)} GiB), "
        f"{p['precision']}, micro-batch {p['micro_batch_size']}{_budget_note(p)}, seq {p['seq_len']}, global batch "
        f"{p['global_batch_size']}  (GiB per GPU)",
        *_plan_table(p, with_activations=True),
    ]
    rec = p["recommendation"]
    if rec:
        lines.append(
            f"recommendation: {rec['variant']} with activation checkpointing "
            f"{_ac_cell(rec, short=False)}, micro-batch {rec['micro_batch_size']} x "
            f"accum {rec['grad_accum']} ({_gib(rec['total_bytes'])} GiB of {_capacity_gib(p)})"
            + (f" -- {p['note']}" if p["note"] else "")
        )
        lines += _token_budget_line(p, rec)
    else:
        lines.append("recommendation: nothing fits, even at micro-batch 1: more or bigger GPUs")
    lines.append(
        "AC k/B: the fewest of B blocks to checkpoint that fit (--activation-checkpointing auto); "
        "activ: saved activations of one micro-batch; comm: collective buffers; overh: the transient peak "
        "(gathered shards, a recomputed block) and the CUDA context; "
        f"fits: total within {1 - HEADROOM:.0%} of the memory (headroom: what is left); "
        "cost: relative step time (heuristic ranking: communication, offload, recompute); "
        "paper: ZeRO paper model states (fp16 weights, K=12); save/GPU: host RAM a checkpoint save adds per GPU"
    )
    return "\n".join(lines)


def count_workload_model(cfg, persistence_threshold: int = 100_000) -> tuple[ModelCount, str]:
    """A user's model, built by its Workload on the meta device (nothing allocated, no weights loaded), counted
    like the built-ins: (the count, the workload class name)."""
    import torch

    from shardtrain.config.settings import ConfigError
    from shardtrain.runtime.training_rng import aside
    from shardtrain.workloads.base import load_workload, model_of, resolve_block_classes

    workload = load_workload(cfg)
    name = type(workload).__name__
    workload.loads_weights = False
    try:
        with aside(seed=cfg.train.seed), torch.device("meta"):
            model = model_of(workload)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's code; one line names the method
        raise ConfigError(
            f"plan: {name}.build_model() failed on the meta device, where plan builds it to count "
            f"it without allocating: {type(e).__name__}: {' '.join(str(e).split())[:300]}"
        ) from None
    blocks = resolve_block_classes(model, workload.block_classes(), f"{name}.block_classes()")
    return count_built(cfg, model, blocks, workload.freezable_parameter_names, persistence_threshold, layers=0), name


def plan_workload(cfg, gpus: int, capacity_bytes: float, bf16_ok: bool = True, cuda: bool = True) -> dict:
    """A user's workload: every variant's model states (exact: counted from its build_model), no activations
    and so no recommendation. The activation measurement needs an architecture and input shapes the planner
    knows (the built-ins'); a user's forward and batches are their own."""
    precision = cfg.train.precision if (cfg.train.precision != "bf16" or bf16_ok) else "fp16"
    m, name = count_workload_model(cfg)
    rows = []
    for variant, (_, _, cost, comm) in VARIANTS.items():
        states = model_states(variant, m, gpus, precision)
        g = {**states["gpu"], "activations": None}
        g["overhead"] += CUDA_CONTEXT if cuda else 0.0
        total = sum(v for v in g.values() if v is not None)
        rows.append(
            {
                "variant": variant,
                "gpu_bytes": g,
                "model_state_bytes": total,
                "host_bytes_per_gpu": states["host"],
                "headroom_bytes": capacity_bytes - total,
                "save_host_bytes_per_gpu": save_host_bytes(variant, m, gpus, cfg.checkpoint.async_save),
                "fits_before_activations": total <= capacity_bytes * (1 - HEADROOM),
                "relative_cost": cost,
                "communication": comm,
                **{k: v for k, v in paper_formula(variant, m.params, gpus).items() if v is not None},
            }
        )
    return {
        "workload": name,
        "model_params": m.params,
        "frozen_params": m.frozen,
        "largest_unit_params": m.largest_unit,
        "gpus": gpus,
        "capacity_bytes": capacity_bytes,
        "precision": precision,
        "rows": rows,
        "recommendation": None,
        "activations": f"not predicted for {name}: it has no memory_model() (docs/your-own-model.md), which "
        f"would measure them; the headroom column is what {name}'s activations may use",
    }


def format_workload_plan(p: dict, gpu_name: str) -> str:
    frozen = f", {p['frozen_params']:,} of them frozen" if p.get("frozen_params") else ""
    lines = [
        f"plan: {p['workload']}, {p['model_params']:,} parameters{frozen} (largest block "
        f"{p['largest_unit_params']:,}) on "
        f"{p['gpus']} x {gpu_name} ({_capacity_gib(p)} GiB), {p['precision']}  (GiB per GPU)",
        *_plan_table(p, with_activations=False),
    ]
    lines.append(f"activations: {p['activations']}; no recommendation without them (fits: model states only)")
    return "\n".join(lines)
