"""What the planner measures of the built-ins (`Workload.memory_model()`, shardtrain/memory/planner.py): their
architecture counted on the meta device, and the bytes one forward + loss saves for backward at small shapes.

The text encoder's layers repeat, so the planner measures 1 and 2 of them and scales to the configured count.
Longformer pads every text to whole attention windows and is linear in the length (times the window) from two
windows on: it is measured at 2 and 3 windows, where a quadratic through one window bent the extrapolation to 16
windows 21% low. Full attention may grow as L², so the multimodal model is measured at three lengths.
The vocabulary is the one the run's tokenizer has, or will have (shardtrain/data/tokenizer.py
planned_vocab_size: a BPE trained on a small corpus stops short of tokenizer_vocab_size, 566 of 1000 on the tiny
multimodal data).
The weights are zeros (_built_without_random_init), so the forward's products are known without computing them
(_ShapesOnly).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from shardtrain.config.settings import Config, pad_multiple, replace_fields
from shardtrain.memory.planner import ModelCount, count_built


class BuiltinMemoryModel:
    """`tokenizer`: the run's own, once the workload has one (the banner); None: planned from the config."""

    def __init__(self, cfg: Config, tokenizer=None):
        self.cfg = cfg
        self.tokenizer = tokenizer

    def vocab(self) -> tuple[int | None, str]:
        """(vocab size, where it comes from) of the model the run builds: a pretrained checkpoint's own (None)."""
        cfg = self.cfg
        if cfg.model.pretrained:
            return None, f"{cfg.model.text_model}'s own"
        if self.tokenizer is not None:
            return len(self.tokenizer), "the run's tokenizer"
        from shardtrain.data.tokenizer import planned_vocab_size

        return planned_vocab_size(cfg)

    def check_offline(self) -> str | None:
        """Only a text model missing from the offline table is read from the hub (its config, no weights)."""
        from shardtrain.runtime.hub import check_hub_names

        return check_hub_names(arch_only(self.cfg), fields=("text_model",))

    def pad_multiple(self) -> int | None:
        """Every text is padded to a multiple of this many tokens (Longformer's window); None: no padding rule."""
        return pad_multiple(self.cfg)

    def sample_lengths(self, seq_len: int) -> list[int]:
        """The lengths saved_bytes is measured at: two fit a line, three a quadratic."""
        w = self.pad_multiple()
        if w:
            return [2 * w, 3 * w]
        top = min(seq_len, 512)
        pts = sorted({max(4, top // 4), max(6, top // 2), max(8, top)})
        return pts if len(pts) == 3 else [4, 6, 8]

    def count(self, persistence_threshold: int, vocab_size: int | None) -> ModelCount:
        from shardtrain.builtin_workloads import networks

        cfg = arch_only(self.cfg)
        with torch.device("meta"):
            model = networks.build_model(cfg.model, cfg.data, vocab_size, load_weights=False)
        layers = networks.text_config_for(cfg.model, cfg.data, vocab_size).num_hidden_layers
        return count_built(
            cfg, model, model.block_classes(), model.freezable_parameter_names, persistence_threshold, layers
        )

    def saved_bytes(
        self, layers: int | None, seq_len: int, recompute: bool, precision: str, batch: int, gathered_16bit: bool
    ) -> int:
        """Bytes one forward + loss saves for backward with `layers` text layers (None: as configured), on CPU.
        `gathered_16bit`: FSDP's 16-bit all-gathers: the weights arrive in 16 bits, so autocast saves no cast copy
        of them, and each BatchNorm, in the norms' fp32 unit, casts its input up to fp32 (saving that) and hands
        back 16 bits."""
        from shardtrain.memory.accounting import SavedActivations
        from shardtrain.strategies.recompute import apply_activation_checkpointing

        cfg = arch_only(self.cfg)
        if layers is not None:
            cfg = replace_fields(cfg, text_config={**cfg.model.text_config, "num_hidden_layers": layers})
        # The vocabulary changes the embedding table (a parameter, not a saved tensor), so the configured size
        # does as well as the trained tokenizer's and costs no training.
        vocab = None if cfg.model.pretrained or cfg.data.tokenizer else cfg.data.tokenizer_vocab_size
        model = _built_without_random_init(cfg, vocab)
        model.train()
        if recompute:
            apply_activation_checkpointing(model, model.block_classes())
        if gathered_16bit and precision != "fp32":
            low = torch.bfloat16
            for m in model.modules():
                if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                    m.register_forward_pre_hook(lambda mod, args: tuple(a.float() for a in args))
                    m.register_forward_hook(lambda mod, args, out: out.to(low))
                else:
                    for _name, p in m.named_parameters(recurse=False):
                        p.data = p.data.to(low)
        inputs = {
            "input_ids": torch.randint(3, model.text_cfg.vocab_size, (batch, seq_len)),
            "attention_mask": torch.ones(batch, seq_len, dtype=torch.long),
        }
        if "pixel_values" in model.batch_keys:
            size = cfg.data.image_size
            inputs["pixel_values"] = torch.randn(batch, 3, size, size)
        amp = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision != "fp32")
        # Forward + loss only: what is saved for backward is known once the forward is done, and no backward runs
        # (the hooks hold the saved tensors, not the graph, so dropping the outputs releases them).
        with SavedActivations(backward=False) as saved, amp, _ShapesOnly():
            logits = model(**inputs)
            loss = F.cross_entropy(logits.float(), torch.zeros(batch, dtype=torch.long))
        # Reference counting frees the model and its saved tensors here; no gc.collect(): a full collection walks
        # every object torch and transformers hold (0.2-0.6 s each, six times per banner prediction).
        del loss, logits, model
        return saved.bytes


def _built_without_random_init(cfg: Config, vocab: int | None):
    """The model, its weights zeros: what a forward saves depends on shapes, not values (only the inputs decide
    Longformer's global attention), and drawing random weights was half of `plan`'s time (22 of 44 s for the
    shipped ResNet-50 + RoBERTa, 14 of 68 for the 4096-token Longformer) and of the banner's at every start.
    transformers' no_init_weights skips its own and torch's init functions (torchvision's too), leaving
    torch.empty's memory, which may hold NaNs or slow denormals: zeros are as fast as any values and repeatable."""
    from transformers.initialization import no_init_weights

    from shardtrain.builtin_workloads import networks

    with no_init_weights():
        model = networks.build_model(cfg.model, cfg.data, vocab, load_weights=False)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model


aten = torch.ops.aten
# Products that are zero where an operand is: (first operand, second operand, the term added to them or None).
_PRODUCTS = {
    aten.mm.default: (0, 1, None),
    aten.bmm.default: (0, 1, None),
    aten.addmm.default: (1, 2, 0),
    aten.baddbmm.default: (1, 2, 0),
    aten.convolution.default: (0, 1, 2),
}


class _ShapesOnly(TorchDispatchMode):
    """The measurement's forward without the work whose result is known: what it saves for backward depends on
    shapes, not values (_built_without_random_init), and on zero weights most of its time went to computing zeros.
    - A matrix product or convolution with an all-zero operand (a weight, or an activation made of them) and a zero
      or absent added term is zero: the result is allocated with the shape, strides and dtype the kernel's own meta
      function gives, and filled with zeros, the values the kernel would have computed. Autograd, above this mode,
      saves the operands as it does for the computed product.
    - Dropout drops nothing: its mask is drawn as all ones (CPU's at::dropout draws it with bernoulli_, the fused
      kernel that _kernels_of emulates with native_dropout returns it as bools), so the mask and the output have
      their own bytes and dtype, and no random number is drawn.
    `shardtrain plan` for configs/longformer_4096.yaml went from 43.1 to 21.5 s of CPU, for
    configs/multimodal_sentiment.yaml from 19.4 to 13.5 s, each plan the same to the byte
    (benchmarks/plan_zero_products.py; benchmarks/plan_seed_setups.py gives the same plans for every seed setup)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        operands = _PRODUCTS.get(func)
        if operands is not None and _is_zero_product(args, *operands):
            shape = func(*tree_map(_meta, args), **tree_map(_meta, kwargs))
            device = args[operands[0]].device
            return torch.empty_strided(shape.shape, shape.stride(), dtype=shape.dtype, device=device).zero_()
        if func is aten.native_dropout.default and args[2]:
            keep = 1 / (1 - args[1]) if args[1] < 1 else 0.0
            return args[0] * keep, torch.ones_like(args[0], dtype=torch.bool)
        if func is aten.bernoulli_.float:
            return args[0].fill_(1)
        return func(*args, **kwargs)


def _is_zero_product(args, first: int, second: int, added: int | None) -> bool:
    a, b = args[first], args[second]
    small, large = (a, b) if a.numel() <= b.numel() else (b, a)
    if small.any() and large.any():
        return False
    return added is None or args[added] is None or not args[added].any()


def _meta(x):
    return x.to("meta") if isinstance(x, torch.Tensor) else x


def arch_only(cfg: Config) -> Config:
    """The same architecture with nothing to load: the offline table stands in for hub configs it knows
    (identical shapes), so plan works with no network and never downloads weights."""
    from shardtrain.builtin_workloads.networks import KNOWN_TEXT_ARCHS

    m = cfg.model
    changes: dict = {"image_weights": None}
    if m.text_model in KNOWN_TEXT_ARCHS and not (Path(m.text_model) / "config.json").is_file():
        changes["pretrained"] = False
    if m.num_labels is None:
        # Taken from the data when the run reads it (sources.py); the head is a few hundred parameters either way.
        changes["num_labels"] = 2
    return replace_fields(cfg, **changes)
