"""DeepSpeed ZeRO stage 2/3 (optionally with optimizer and parameter offload to CPU).

(Named zero.py: a module called deepspeed.py would shadow the library when this folder is on sys.path.)
The engine owns accumulation: it scales the loss by 1/accum, counts micro-steps in `engine.step()` and
reduces gradients only at the boundary, so there is no no_sync here.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from shardtrain.config import ConfigError
from shardtrain.ds_config import describe_ds, resolve_ds_config
from shardtrain.strategies.base import Strategy, StepResult, extra_state, load_extra_state
from shardtrain.strategies.dcp_state import save_portable
from shardtrain.unpickle_guard import check_torch_file

TAG = "engine"


class ZeroStrategy(Strategy):
    def __init__(self, cfg, dist_info, workload=None, has_batchnorm: bool = False):
        super().__init__(cfg, dist_info, workload)
        # Resolved before any model is built: a contradiction in the JSON costs nothing.
        self.ds_config = resolve_ds_config(cfg, dist_info.world_size, has_batchnorm)
        self.info = describe_ds(self.ds_config)
        self.stage = self.info["stage"]
        self.name = f"zero{self.stage}"
        self.offload = self.info["offload_optimizer"] != "none" or self.info["offload_param"] != "none"
        self.shards_outside_forward = self.stage == 3

    def is_shard(self, p):
        # ZeRO-3 releases each gathered parameter after use (shape [0]); small ones persist whole.
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
        return getattr(p, "ds_status", None) == ZeroParamStatus.NOT_AVAILABLE

    def autocast(self):
        # The engine applies torch.autocast itself from the "torch_autocast" section.
        import contextlib
        return contextlib.nullcontext()

    def setup(self, build_model, frozen_names):
        _use_own_ninja()
        import deepspeed

        rank0 = self.dist.is_rank0
        # Attach deepspeed.comm to our process group; zero.Init reads its world size from there.
        deepspeed.init_distributed(dist_backend=self.dist.backend)
        if self.stage == 3:
            # zero.Init patches torch.Tensor.__new__; torch._dynamo, imported lazily inside it, rejects
            # the patched signature. Import it first.
            import torch._dynamo  # noqa: F401
            # Rank 0 alone materialises the weights, pretrained ones included, in host memory; every rank
            # then builds a partitioned copy under zero.Init (no rank ever holds the full model on the
            # device) and rank 0 fills it in, one module gathered at a time.
            source = build_model(on_meta=False) if rank0 else None
            # The copy is built empty: its weights come from rank 0. Loading inside zero.Init would write
            # the pretrained tensors into size-0 partitions (from_pretrained's "ignore_mismatched_sizes",
            # load_state_dict's size mismatch for --image-weights), and HF's initialisation would index them.
            from transformers.initialization import no_init_weights
            with no_init_weights(), deepspeed.zero.Init(config_dict_or_path=self.ds_config,
                                                        remote_device=self._param_device()):
                model = build_model(on_meta=False, load_weights=False)
            if hasattr(model, "tie_weights"):
                # no_init_weights() also skips Hugging Face's weight tying (transformers 5): GPT-2's lm_head would
                # be a separate copy of the token embeddings, each half-trained (measured: grad norm 8% low).
                model.tie_weights()
            _copy_from_rank0(model, source, rank0, deepspeed)
            del source
        else:
            model = build_model(on_meta=False)  # the engine broadcasts rank 0's weights
        # DeepSpeed partitions only parameters that require grad at initialize time, so frozen ones
        # keep requires_grad and are frozen by their zero learning rate (optim.build_scheduler).
        if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
            resolve_ds_config(self.cfg, self.dist.world_size, has_batchnorm=True)  # fp16 with BatchNorm: one line
        self.recompute_count = self._apply_recompute(model, self.block_classes(model))
        optimizer, scheduler = self._optimizer_and_scheduler(model.named_parameters(), frozen_names)
        engine, optimizer, _, scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=self.ds_config)
        self.engine, self.model, self.optimizer, self.scheduler = engine, engine, optimizer, scheduler
        self._inner = model
        return self.model, self.optimizer, self.scheduler

    def _param_device(self):
        return "cpu" if self.info["offload_param"] == "cpu" else None

    @property
    def unwrapped(self) -> nn.Module:
        return self._inner

    def backward(self, loss):
        self.engine.backward(loss)
        if not self._is_last:
            self.engine.step()  # only advances DeepSpeed's micro-step counter off the boundary

    def step(self, skip=False, grad_norm=None):
        # ZeRO computes the global gradient norm itself (grad_norm_share is None: the loop sends none), and
        # skips the update when it is inf/nan, in every precision; `skip` from the loop (a non-finite loss)
        # implies exactly such gradients.
        self.engine.step()
        applied = self.engine.was_step_applied()
        norm = self.engine.get_global_grad_norm()
        norm = float("nan") if norm is None else float(norm)
        overflow = not applied and self.precision == "fp16"
        return StepResult(grad_norm=norm, applied=applied and not skip, overflow=overflow)

    def set_frozen(self, names, frozen):
        # The learning rate of the frozen groups carries freezing here (see setup); frozen BatchNorm is held alike.
        self.hold_frozen_norms(names if frozen else set())

    def save(self, ckpt_dir: Path):
        self.sync_buffers()
        self.engine.save_checkpoint(str(ckpt_dir), tag=TAG, save_latest=False)
        # The portable form beside the engine's: what FSDP/DDP (any world size) and `export` read.
        model_sd, optim_state = self._portable_state()
        extra = {**extra_state(self.scheduler, self.optimizer), "ds_config": self.ds_config}
        save_portable(ckpt_dir, model_sd, optim_state, extra, self.dist.is_rank0)

    def _portable_state(self) -> tuple[dict, dict]:
        """Full fp32 weights and Adam moments per parameter name. Every rank gathers every tensor (the
        gathers are collective); DCP then writes each once. Host memory: ~3x the fp32 model per rank."""
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        if hasattr(self.optimizer, "_lazy_init_hp_params_optimizer_state"):
            # ZeRO-1/2 link each parameter to its slice of the Adam state once, at the first step; measured
            # on 0.19.8 the links come out empty (safe_get_full_optimizer_state: "exp_avg not found").
            # Re-linking against the current state is what that call does when the flag is clear.
            self.optimizer._hp_optimizer_states_linked = False
            self.optimizer._lazy_init_hp_params_optimizer_state()
        inner_state = getattr(getattr(self.optimizer, "optimizer", None), "state", {})
        steps = [v["step"] for v in inner_state.values() if "step" in v]
        step = torch.tensor(float(steps[0]) if steps else 0.0)
        model_sd, optim_state = {}, {}
        for name, p in self._inner.named_parameters():
            model_sd[name] = safe_get_full_fp32_param(p).detach().float().cpu().clone()
            moments = {k: safe_get_full_optimizer_state(p, k) for k in ("exp_avg", "exp_avg_sq")}
            if all(v is not None for v in moments.values()):
                optim_state[name] = {"step": step.clone(),
                                     **{k: v.detach().float().cpu().clone() for k, v in moments.items()}}
        for mod_name, mod in self._inner.named_modules():
            for b_name, buf in mod.named_buffers(recurse=False):
                if buf is not None and b_name not in mod._non_persistent_buffers_set:
                    model_sd[f"{mod_name}.{b_name}" if mod_name else b_name] = buf.detach().cpu().clone()
        return model_sd, optim_state

    def load(self, ckpt_dir: Path, saved: dict | None = None, load_optimizer: bool = True):
        saved = saved or {}
        writer = (saved.get("strategy") or {}).get("strategy")
        if writer != self.name or saved.get("world_size") != self.dist.world_size:
            # The engine's own files only fit the same stage and world size; anything else is portable.
            if self.stage == 3:
                raise ConfigError(f"--resume {ckpt_dir}: written by {writer} on {saved.get('world_size')} ranks; "
                                  f"ZeRO-3 resumes only its own checkpoints at the same world size so far. "
                                  f"Continue under zero2, fsdp or ddp (they read any checkpoint)")
            self._warn(f"resuming a {writer} checkpoint ({saved.get('world_size')} ranks) under {self.name} "
                       f"({self.dist.world_size} ranks) through its portable form")
            return self._load_portable(ckpt_dir, load_optimizer)
        engine_dir = ckpt_dir / TAG
        if not engine_dir.is_dir():
            raise ConfigError(f"--resume {ckpt_dir}: missing {TAG}/: the checkpoint is incomplete")
        for f in sorted(engine_dir.glob("*.pt")):
            check_torch_file(f)  # DeepSpeed itself reads them with torch.load(weights_only=False)
        try:
            self.engine.load_checkpoint(str(ckpt_dir), tag=TAG, load_optimizer_states=load_optimizer,
                                        load_lr_scheduler_states=load_optimizer)
        except (RuntimeError, OSError, KeyError, ValueError) as e:
            msg = " ".join(str(e).split())[:300]
            raise ConfigError(f"--resume {ckpt_dir}: DeepSpeed cannot load {TAG}/ (corrupt, or another "
                              f"model?): {msg}") from None

    def _load_portable(self, ckpt_dir: Path, load_optimizer: bool) -> None:
        import deepspeed
        import torch.distributed.checkpoint as dcp
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        from shardtrain.strategies.dcp_state import EXTRA_FILE, MODEL_DIR, check_model_fits, read_metadata, tensor_shapes

        shapes = tensor_shapes(read_metadata(ckpt_dir))
        params = dict(self._inner.named_parameters())
        full_shape = {n: tuple(getattr(p, "ds_shape", None) or p.shape) for n, p in params.items()}
        buffers = {}
        for mod_name, mod in self._inner.named_modules():
            for b_name, buf in mod.named_buffers(recurse=False):
                if buf is not None and b_name not in mod._non_persistent_buffers_set:
                    buffers[f"{mod_name}.{b_name}" if mod_name else b_name] = buf
        check_model_fits(ckpt_dir, {**full_shape, **{n: tuple(b.shape) for n, b in buffers.items()}}, shapes)
        state = {"model": {n: torch.empty(s) for n, s in full_shape.items()}}
        state["model"].update({n: torch.empty_like(b, device="cpu") for n, b in buffers.items()})
        keys = ("exp_avg", "exp_avg_sq", "step")
        with_moments = [n for n in params if all(f"optim.state.{n}.{k}" in shapes for k in keys)]
        if load_optimizer:
            if len(with_moments) < len(params):
                self._warn(f"optimizer state for {len(params) - len(with_moments)} of {len(params)} parameters "
                           f"is not in {ckpt_dir}: they start with fresh Adam moments")
            state["optim"] = {"state": {n: {"exp_avg": torch.empty(full_shape[n]), "exp_avg_sq":
                                            torch.empty(full_shape[n]), "step": torch.empty(())}
                                        for n in with_moments}}
        try:
            dcp.load(state, checkpoint_id=str(ckpt_dir / MODEL_DIR))
        except Exception as e:  # noqa: BLE001
            raise ConfigError(f"--resume {ckpt_dir}: cannot read {MODEL_DIR}/ (corrupt or truncated?): "
                              f"{' '.join(str(e).split())[:300]}") from None
        if load_optimizer:
            self._init_optimizer_state()
        for name, p in params.items():
            value = state["model"][name]
            # The engine computes with the low-precision (here: model) copy and steps the fp32 master copy:
            # both must hold the checkpoint's weights.
            with deepspeed.zero.GatheredParameters([p], modifier_rank=0, enabled=hasattr(p, "ds_id")):
                with torch.no_grad():
                    p.data.copy_(value.view(p.shape).to(p.dtype))
            safe_set_full_fp32_param(p, value)
            if load_optimizer and name in state["optim"]["state"]:
                for k in ("exp_avg", "exp_avg_sq"):
                    safe_set_full_optimizer_state(p, state["optim"]["state"][name][k], k)
        for name, buf in buffers.items():
            buf.copy_(state["model"][name])
        if load_optimizer and with_moments:
            step = float(state["optim"]["state"][with_moments[0]]["step"])
            for v in self.optimizer.optimizer.state.values():
                if "step" in v:
                    v["step"] = torch.tensor(step, dtype=torch.float32) if torch.is_tensor(v["step"]) else int(step)
        extra_file = ckpt_dir / EXTRA_FILE
        if load_optimizer and extra_file.exists():
            load_extra_state(json.loads(extra_file.read_text()), self.scheduler, self.optimizer)

    def _init_optimizer_state(self) -> None:
        """Adam's state exists only after a first step; make it with zero gradients and a zero learning
        rate (no weight change), then let ZeRO-1/2 link parameters to it."""
        inner = self.optimizer.optimizer
        if not inner.state:
            lrs = [g["lr"] for g in inner.param_groups]
            for g in inner.param_groups:
                g["lr"] = 0.0
                for p in g["params"]:
                    p.grad = torch.zeros_like(p)
            inner.step()
            for g, lr in zip(inner.param_groups, lrs):
                g["lr"] = lr
                for p in g["params"]:
                    p.grad = None
        if hasattr(self.optimizer, "_lazy_init_hp_params_optimizer_state"):
            self.optimizer._hp_optimizer_states_linked = False
            self.optimizer._lazy_init_hp_params_optimizer_state()

    def describe(self):
        return {"strategy": self.name, "offload": self.offload, **self.info,
                "recompute_blocks": self.recompute_count, "ds_config": self.ds_config}

    def memory_tensors(self):
        opt = self.engine.optimizer
        for p in self._inner.parameters():
            yield "params", getattr(p, "ds_tensor", None)  # ZeRO-3: this rank's partition
            # ZeRO-2: a view of the flat fp32/16-bit buffer; ZeRO-3: empty unless gathered or persistent
            # (stage3_param_persistence_threshold keeps small parameters whole on every rank).
            yield "params", p.data
        for b in self._inner.buffers():
            yield "buffers", b
        # fp32 master partitions and the gradient partitions the optimizer steps on. ZeRO-3 means to reuse an
        # fp32 parameter partition as its master, but compares a torch.device with a string, so it always
        # copies (measured); were it reused, the storage would already be counted under params above.
        for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
            for t in getattr(opt, name, None) or []:
                yield "optimizer", t
                yield "grads", t.grad
        for name in ("grads_in_partition", "grad_partitions_flat_buffer"):
            yield "grads", getattr(opt, name, None)
        yield from (("grads", t) for t in _tensors(getattr(opt, "averaged_gradients", None)))
        for bucket in (getattr(opt, "ipg_buckets", None) or {}).values():
            yield from (("comm", t) for t in _tensors(getattr(bucket, "buffer", None)))
        for state in opt.optimizer.state.values():
            for v in state.values():
                yield "optimizer", v

    def set_batch_geometry(self, micro_batch_size, grad_accum):
        super().set_batch_geometry(micro_batch_size, grad_accum)
        engine = self.engine
        engine.set_train_micro_batch_size(micro_batch_size)
        engine.set_train_batch_size(micro_batch_size * grad_accum * self.dist.world_size)
        # The engine finds the accumulation boundary from micro_steps % gas: restart the count at a boundary.
        engine.micro_steps = engine.global_steps * grad_accum

    def discard_gradients(self):
        # What the ZeRO optimizers do themselves when they skip an overflowed step, minus the loss-scale
        # update; plus the micro-step id, so that the redone step's first backward copies (not adds) into
        # the gradient partitions.
        from deepspeed.runtime.zero.stage_1_and_2 import INITIAL_MICRO_STEP_ID

        opt = self.engine.optimizer
        opt.zero_grad(set_to_none=True)
        if getattr(opt, "cpu_offload", False) or getattr(opt, "offload_optimizer", False):
            opt.reset_cpu_buffers()
        for name in ("averaged_gradients", "all_grad_tensors"):
            grads = getattr(opt, name, None)
            for k in (list(grads) if isinstance(grads, dict) else range(len(grads or []))):
                grads[k] = None
        release = getattr(opt, "_release_preflattened_grad_buffers", None)
        if release is not None:
            release()
        if getattr(opt, "grad_partitions_flat_buffer", None) is not None:
            opt.grad_partitions_flat_buffer.zero_()
        opt.micro_step_id = INITIAL_MICRO_STEP_ID if self.stage < 3 else 0

def _tensors(obj):
    """Tensors inside DeepSpeed's nested lists/dicts of gradient partitions."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def _use_own_ninja() -> None:
    """DeepSpeed JIT-builds its ops with whichever `ninja` PATH finds first. ninja 1.11 (Debian) and 1.12+ (the
    venv's) hash commands differently, so runs with different PATHs sharing one TORCH_EXTENSIONS_DIR rebuilt
    shm_comm for each other every time (minutes under load). Always use the one installed beside this Python."""
    import os
    import sys

    own = os.path.dirname(sys.executable)
    if os.path.exists(os.path.join(own, "ninja")) and not os.environ.get("PATH", "").startswith(own + os.pathsep):
        os.environ["PATH"] = own + os.pathsep + os.environ.get("PATH", "")


def _copy_from_rank0(model: nn.Module, source: nn.Module | None, rank0: bool, deepspeed) -> None:
    import torch.distributed as dist

    # Every name, tied ones included: a tied lm_head.weight is listed under its own module below, while
    # named_parameters() gives each shared tensor once, under the first name (the token embeddings).
    src_params = dict(source.named_parameters(remove_duplicate=False)) if rank0 else {}
    for name, module in model.named_modules():
        params = list(module.named_parameters(prefix=name, recurse=False))
        if not params:
            continue
        with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=0):
            if rank0:
                with torch.no_grad():
                    for pname, p in params:
                        p.copy_(src_params[pname])
    src_buffers = dict(source.named_buffers()) if rank0 else {}
    for name, buf in model.named_buffers():
        if rank0:
            buf.copy_(src_buffers[name])
        if dist.get_world_size() > 1:
            dist.broadcast(buf, src=0)
