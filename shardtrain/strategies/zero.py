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

from shardtrain.checkpointing.dcp_state import EXTRA_FILE, save_portable, save_portable_async
from shardtrain.checkpointing.unpickle_guard import check_torch_file
from shardtrain.config.settings import ConfigError, where
from shardtrain.runtime.startup_gc import freeze_start_up
from shardtrain.strategies.base import StepResult, Strategy, checkpoint_group, extra_state, load_extra_state
from shardtrain.strategies.capabilities import Freezing, MemoryIntrospection, Resizing, ShardGuard
from shardtrain.strategies.deepspeed_import import import_deepspeed
from shardtrain.strategies.ds_config import describe_ds, resolve_ds_config
from shardtrain.strategies.root import workload_root

TAG = "engine"


# The optimizer state kept per element of a parameter, which _partition_state writes as this rank's ranges.
MOMENTS = {"adamw": ("exp_avg", "exp_avg_sq"), "sgd": ()}


class ZeroStrategy(Freezing, Resizing, MemoryIntrospection, ShardGuard, Strategy):
    name = "zero"  # zero2 or zero3 once the config is read
    refused_optimizers = {
        "adafactor": "DeepSpeed hands the optimizer flat 1-D partitions of the parameters, so Adafactor could not "
        "factor a weight's second moment by rows and columns (it would run unfactored, with Adam-sized state); "
        "use it under --strategy ddp",
        "adamw_8bit": "its 8-bit moments would be quantized in blocks of DeepSpeed's flat partitions, across "
        "parameter boundaries, so no checkpoint could hold them per parameter for a resume under another "
        "strategy or world size; use it under --strategy ddp or fsdp",
    }

    def __init__(self, cfg, dist_info, workload=None, geometry=None, recompute=None):
        super().__init__(cfg, dist_info, workload, geometry, recompute)
        from shardtrain.runtime.device_defaults import deepspeed_accelerator

        line = deepspeed_accelerator(self.device.type)  # before deepspeed is first imported: it reads it once
        if line:
            self._warn(line)
        # Resolved before any model is built: a contradiction in the JSON costs nothing.
        self.ds_config = resolve_ds_config(cfg, dist_info.world_size, geometry=self.geometry)
        self.info = describe_ds(self.ds_config)
        self.stage = self.info["stage"]
        self.name = f"zero{self.stage}"
        self.offload = self.info["offload_optimizer"] != "none" or self.info["offload_param"] != "none"
        self.shards_outside_forward = self.stage == 3
        self._moments = MOMENTS[cfg.train.optim]
        if cfg.checkpoint.async_save and (self.ds_config.get("fp16") or {}).get("enabled"):
            # save_async writes the portable form alone, which has no place for DeepSpeed's dynamic loss scale:
            # a resume would start again from the initial scale and skip steps finding it (not exact).
            raise ConfigError(
                f"{where('async_save')} with DeepSpeed fp16: the background save keeps no loss-scaler "
                f"state, so a resume would not be exact; use --precision bf16 or fp32, or save "
                f"synchronously"
            )

    def is_shard(self, p):
        # ZeRO-3 releases each gathered parameter after use (shape [0]); small ones persist whole.
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        return getattr(p, "ds_status", None) == ZeroParamStatus.NOT_AVAILABLE

    def autocast(self):
        # The engine applies torch.autocast itself from the "torch_autocast" section.
        import contextlib

        return contextlib.nullcontext()

    def setup(self, build_model, frozen_names):
        # Frozen parameters do not require grad when the engine is built, so DeepSpeed gives them no fp32 master,
        # gradient or optimizer partitions (it partitions only what requires grad, at initialize time); at
        # unfreeze_at_step set_frozen builds a new engine that has them (see _rebuild). What build_model froze
        # itself (user_frozen) is frozen in every engine.
        self._build_model, self._freezable = build_model, set(frozen_names)
        self._build(frozen_now=set(frozen_names), weights_from_memory=False)
        if self.cfg.checkpoint.async_save:
            self._save_group = checkpoint_group()
        return self.model, self.optimizer, self.scheduler

    def _build(self, frozen_now: set[str], weights_from_memory: bool) -> None:
        """The model and its engine, with the `frozen_now` parameters frozen. `weights_from_memory`: the
        caller copies every weight in afterwards (_rebuild), so nothing is loaded or copied from rank 0."""
        _use_own_ninja()
        deepspeed = import_deepspeed()

        build_model = self._build_model
        rank0 = self.dist.is_rank0
        # Attach deepspeed.comm to our process group; zero.Init reads its world size from there.
        deepspeed.init_distributed(dist_backend=self.dist.backend)
        _unlink_shared_allreduce_buffer(self.dist.rank, self.dist.world_size)
        if self.stage == 3:
            # zero.Init patches torch.Tensor.__new__; torch._dynamo, imported lazily inside it, rejects
            # the patched signature. Import it first.
            import torch._dynamo  # noqa: F401

            # DeepSpeed's and torch._dynamo's imports too: ZeRO-3's set-up calls gc.collect() (runtime/startup_gc.py).
            freeze_start_up()
            # Rank 0 alone materialises the weights, pretrained ones included, in host memory; every rank
            # then builds a partitioned copy under zero.Init (no rank ever holds the full model on the
            # device) and rank 0 fills it in, one module gathered at a time.
            source = build_model(on_meta=False) if rank0 and not weights_from_memory else None
            # The copy is built empty: its weights come from rank 0. Loading inside zero.Init would write
            # the pretrained tensors into size-0 partitions (from_pretrained's "ignore_mismatched_sizes",
            # load_state_dict's size mismatch for --image-weights), and HF's initialisation would index them.
            from transformers.initialization import no_init_weights

            with (
                no_init_weights(),
                deepspeed.zero.Init(config_dict_or_path=self.ds_config, remote_device=self._param_device()),
            ):
                try:
                    model = build_model(on_meta=False, load_weights=False)
                except RuntimeError as e:
                    if "ignore_mismatched_sizes" not in str(e):
                        raise
                    raise ConfigError(
                        f"{type(self.workload).__name__}.build_model() loaded pretrained weights inside ZeRO-3's "
                        f"zero.Init, where its parameters are empty shards: while self.loads_weights is False, "
                        f"build from the config (from_config); rank 0's weights are copied in afterwards"
                    ) from None
            if hasattr(model, "tie_weights"):
                # no_init_weights() also skips Hugging Face's weight tying (transformers 5): GPT-2's lm_head would
                # be a separate copy of the token embeddings, each half-trained (measured: grad norm 8% low).
                model.tie_weights()
            if not weights_from_memory:
                _copy_from_rank0(model, source, rank0, deepspeed)
            del source
        else:
            # the engine broadcasts rank 0's weights
            model = build_model(on_meta=False, load_weights=not weights_from_memory)
        if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
            # fp16 with BatchNorm: one line
            resolve_ds_config(self.cfg, self.dist.world_size, has_batchnorm=True, geometry=self.geometry)
        frozen_now = self._freeze(model, frozen_now)  # with what build_model froze itself, every engine
        self.recompute_count = self._apply_recompute(model, self.block_classes(model))
        # Frozen parameters are left out of the optimizer (a ZeRO group with nothing to train breaks the
        # flattening); once they unfreeze, their groups are the same as under DDP and FSDP (optim.param_groups).
        trainable = [(n, p) for n, p in model.named_parameters() if n not in frozen_now]
        optimizer, scheduler = self._optimizer_and_scheduler(
            trainable, self._freezable, model_names=[n for n, _ in model.named_parameters()]
        )
        self._client_groups = [list(g["params"]) for g in optimizer.param_groups]  # DeepSpeed flattens them
        engine, optimizer, _, scheduler = deepspeed.initialize(  # the engine's forward runs the workload's
            model=workload_root(model, self.workload),
            optimizer=optimizer,
            lr_scheduler=scheduler,
            config=self.ds_config,
        )
        self.engine, self.model, self.optimizer, self.scheduler = engine, engine, optimizer, scheduler
        self._inner = model
        self._frozen_now = set(frozen_now)

    def close(self) -> None:
        # zero.Init swaps DeepSpeed's memory-efficient linear in for torch.nn.functional.linear, and it "will persist
        # unless manually reset" (DeepSpeed's own log line). Left in place, every later run in the process trained
        # with it: an FSDP run after a ZeRO-3 one differed from the same run in a fresh process in the 8th digit of
        # its loss by step 5 (its backward computes in another order).
        if self.stage != 3:
            return
        from deepspeed.runtime.zero.linear import zero3_linear_wrap
        from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses as patcher

        if torch.nn.functional.linear is zero3_linear_wrap and hasattr(patcher, "linear_bk"):
            torch.nn.functional.linear = patcher.linear_bk

    def _param_device(self):
        return "cpu" if self.info["offload_param"] == "cpu" else None

    @property
    def unwrapped(self) -> nn.Module:
        return self._inner

    def full_numel(self, p):
        # ZeRO-3: between uses a parameter's data is empty (shape [0]; this rank's partition is its ds_tensor), and
        # ds_numel counts the whole. ZeRO-2 parameters are whole.
        return getattr(p, "ds_numel", None) or p.numel()

    def full_ndim(self, p):
        # ZeRO-3's parameters are flat partitions under zero.Init (1-D): their own shape is ds_shape. Read as 1-D,
        # every weight matrix fell in the no-decay group, and ZeRO-3 trained without weight decay.
        shape = getattr(p, "ds_shape", None)
        return len(shape) if shape is not None else p.ndim

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
        now = (set(names) if frozen else set()) | self.user_frozen
        if now != self._frozen_now:
            # Before the first step (a resume unfreezes before it loads) there is no state to carry.
            self._rebuild(now, carry_state=self.engine.global_steps > 0)
        self.hold_frozen_norms(now)

    def _rebuild(self, frozen_now: set[str], carry_state: bool = True) -> None:
        """A new engine and optimizer with `frozen_now` frozen, continuing exactly where the old one was: the
        full fp32 weights, the Adam moments and step of every parameter that has them, the buffers, the schedule
        position, the engine's step counters and (fp16) the loss scaler. Parameters that were frozen start with
        fresh Adam state, as torch's AdamW gives them under DDP and FSDP. The old engine is destroyed first, so
        the memory its partitions held is given back before the new ones are allocated.
        `carry_state=False`: a new engine as setup builds it, before any step (a resume then loads into it)."""
        import gc

        training = self.model.training
        if carry_state:
            model_sd, optim_state = self._portable_state()
            extra = extra_state(self.scheduler, self.optimizer)
            counters = {
                k: getattr(self.engine, k) for k in ("global_steps", "global_samples", "micro_steps", "skipped_steps")
            }
            scaler = getattr(self.engine.optimizer, "loss_scaler", None) if self.precision == "fp16" else None
        rng = torch.get_rng_state(), (torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
        self._frozen_norms = []  # modules of the old model
        if self.stage == 3:
            # ZeRO-3's forward hooks push modules on a module-level stack and leave the root there (0.19.8): it
            # would keep the old model, its engine and every partition alive (found with gc.get_referrers).
            from deepspeed.runtime.zero import parameter_offload

            old = {id(m) for m in (*self._inner.modules(), self.engine.module)}  # the engine's module: the root
            parameter_offload.FWD_MODULE_STACK[:] = [m for m in parameter_offload.FWD_MODULE_STACK if id(m) not in old]
        self.engine.destroy()
        _release_storage(self.engine, self._inner)
        self.engine = self.model = self.optimizer = self.scheduler = self._inner = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self._build(frozen_now, weights_from_memory=carry_state)
        # The model is built aside (runtime/training_rng.py), the engine is not: dropout must go on as it would have.
        torch.set_rng_state(rng[0])
        if rng[1] is not None:
            torch.cuda.set_rng_state_all(rng[1])
        if carry_state:
            self._load_state(model_sd, optim_state, extra, load_optimizer=True)
            for k, v in counters.items():
                setattr(self.engine, k, v)
            if scaler is not None:
                self.engine.optimizer.loss_scaler = scaler
            del model_sd, optim_state
        if training:
            self.train()

    def save(self, ckpt_dir: Path):
        self.sync_buffers()
        if self.cfg.checkpoint.engine_files:  # for DeepSpeed's own tools (zero_to_fp32.py); resume does not read it
            # `latest` in the step folder names the tag, as zero_to_fp32.py (copied beside it) reads by default.
            self.engine.save_checkpoint(str(ckpt_dir), tag=TAG, save_latest=True)
        # The portable form, each rank writing only the partition it owns (no gather): what every strategy at any
        # world size, `export` and a resume read.
        model_sd, optim_state = self._partition_state()
        save_portable(ckpt_dir, model_sd, optim_state, self._extra(), self.dist.is_rank0)

    def save_async(self, ckpt_dir: Path):
        """--async-save: the snapshot is a host copy of this rank's partition alone (fp32 weights and Adam
        moments: ~12 bytes per parameter / N), written by DCP's async_save. DeepSpeed's engine files, when
        asked for (checkpoint.engine_files), are written before, synchronously: DeepSpeed 0.19.8's one
        asynchronous writer (the decoupled checkpoint engine) hands its live tensors to a writer process and waits
        for that write inside the next engine.step(), so training would stall there for the whole write."""
        self.sync_buffers()
        if self.cfg.checkpoint.engine_files:
            self.engine.save_checkpoint(str(ckpt_dir), tag=TAG, save_latest=True)
        model_sd, optim_state = self._partition_state(snapshot=True)
        return save_portable_async(ckpt_dir, model_sd, optim_state, self._extra(), self.dist.is_rank0, self._save_group)

    def _extra(self) -> dict:
        """strategy_state.json: the schedule and learning rates, the engine's step counters and (fp16) its loss
        scaler, which the engine files kept before the portable form was all a resume reads."""
        extra = {
            **extra_state(self.scheduler, self.optimizer),
            "ds_config": self.ds_config,
            "frozen": len(self._frozen_now),
            "engine_files": bool(self.cfg.checkpoint.engine_files),
            "engine_counters": {
                k: int(getattr(self.engine, k)) for k in ("global_steps", "global_samples", "skipped_steps")
            },
        }
        scaler = getattr(self.engine.optimizer, "loss_scaler", None) if self.precision == "fp16" else None
        if scaler is not None:
            extra["loss_scaler"] = {k: v for k, v in vars(scaler).items() if isinstance(v, (bool, int, float))}
        return extra

    def _partition_state(self, snapshot: bool = False) -> tuple[dict, dict]:
        """This rank's partitions of the fp32 weights and Adam moments, as FlatRange views (no copy; `snapshot`:
        host copies of them, for a background write), by parameter name and in each parameter's own shape: DCP
        writes each rank's ranges as chunks at their global offsets. Replicated tensors (buffers, ZeRO-2's frozen
        parameters, Adam's step) are plain: DCP writes each once."""
        from shardtrain.checkpointing.flat_chunks import FlatRange

        self._relink_optimizer_state()
        steps, with_state = self._group_steps(), self._groups_with_state()
        group_of = self._group_of

        def own(t: torch.Tensor) -> torch.Tensor:
            t = t.detach()
            return t.to("cpu", copy=True) if snapshot else t

        model_sd, optim_state = {}, {}
        for name, p in self._inner.named_parameters():
            if name in self.base_not_saved:  # a LoRA model's frozen base: build_model rebuilds it
                continue
            shape, start, local = self._local_range(p)
            if p.requires_grad:
                model_sd[name] = FlatRange(shape, own(local(None)), start)
            elif hasattr(p, "ds_id"):  # frozen under ZeRO-3: no fp32 master; this rank's slice of the module's copy
                model_sd[name] = FlatRange(shape, own(local(None).float()), start)
            else:  # frozen under ZeRO-2: every rank holds it whole
                model_sd[name] = own(p.data.float())
                continue
            if group_of.get(name) in with_state:
                optim_state[name] = {
                    "step": torch.tensor(float(steps[group_of[name]])),
                    **{k: FlatRange(shape, own(local(k)), start) for k in self._moments},
                }
        for name, buf in self._persistent_buffers().items():
            model_sd[name] = buf.detach().cpu().clone()
        return model_sd, optim_state

    def _local_range(self, p):
        """(full shape, first element this rank owns in the flattened parameter, key -> 1-D view of this rank's
        elements: None the fp32 master, or an Adam state key; ZeRO-3 frozen: the module's own partition)."""
        if hasattr(p, "ds_id"):
            # ZeRO-3: partitions of ceil(numel / N) elements, the last padded; rank r owns [r * size, ...).
            size = p.ds_tensor.numel()
            numel = self.full_numel(p)
            start = min(p.ds_zero_partition_rank * size, numel)
            valid = max(0, min(size, numel - start))
            opt = p._z3_optimizer if p.requires_grad else None

            def local(key):
                if opt is None:
                    return p.ds_tensor.data.narrow(0, 0, valid)
                part, _ = opt._get_fp32_opt_state_partition(p, release_swap_buffers=False, optim_state_key=key)
                return part.narrow(0, 0, valid)

            return tuple(p.ds_shape), start, local
        mapping = getattr(p, "_hp_mapping", None)
        if mapping is None:  # ZeRO-2: none of this parameter lies in this rank's flat partition
            empty = torch.empty(0, dtype=torch.float32)
            return tuple(p.shape), 0, lambda key: empty
        # ZeRO-2: this rank's flat partition holds elements [start, start + numel) of the parameter.
        address = mapping.lp_fragment_address
        return tuple(p.shape), address.start, lambda key: mapping.get_hp_fragment(key).view(-1)

    def _relink_optimizer_state(self) -> None:
        if hasattr(self.optimizer, "_lazy_init_hp_params_optimizer_state"):
            # ZeRO-1/2 link each parameter to its slice of the Adam state once, at the first step; measured
            # on 0.19.8 the links come out empty (safe_get_full_optimizer_state: "exp_avg not found").
            # Re-linking against the current state is what that call does when the flag is clear.
            self.optimizer._hp_optimizer_states_linked = False
            self.optimizer._lazy_init_hp_params_optimizer_state()

    def _groups_with_state(self) -> set[int]:
        """Optimizer groups whose Adam moments exist (every rank alike: they all step their partitions)."""
        return {i for i, state in self._flat_states() if self._moments and self._moments[0] in state}

    def _portable_state(self) -> tuple[dict, dict]:
        """Full fp32 weights and Adam moments per parameter name (none for a frozen parameter: it has no
        optimizer state), for _rebuild alone: the new engine partitions differently (other optimizer groups).
        Every rank gathers every tensor (the gathers are collective). Host memory: ~3x the fp32 model per rank.
        Checkpoints never take this path (_partition_state)."""
        import deepspeed
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        self._relink_optimizer_state()
        steps = self._group_steps()
        model_sd, optim_state = {}, {}
        for name, p in self._inner.named_parameters():
            if not p.requires_grad:
                # No fp32 master: the module's own copy is the weight (ZeRO-3: gathered from its partitions).
                with deepspeed.zero.GatheredParameters([p], enabled=hasattr(p, "ds_id")):
                    model_sd[name] = p.data.detach().float().cpu().clone()
                continue
            model_sd[name] = safe_get_full_fp32_param(p).detach().float().cpu().clone()
            moments = {k: safe_get_full_optimizer_state(p, k) for k in self._moments}
            if moments and all(v is not None for v in moments.values()):
                optim_state[name] = {
                    "step": torch.tensor(float(steps[self._group_of[name]])),
                    **{k: v.detach().float().cpu().clone() for k, v in moments.items()},
                }
        for mod_name, mod in self._inner.named_modules():
            for b_name, buf in mod.named_buffers(recurse=False):
                if buf is not None and b_name not in mod._non_persistent_buffers_set:
                    model_sd[f"{mod_name}.{b_name}" if mod_name else b_name] = buf.detach().cpu().clone()
        return model_sd, optim_state

    @property
    def _group_of(self) -> dict[str, int]:
        """Parameter name -> index of its optimizer group (the client optimizer's groups are the ZeRO groups)."""
        ids = {id(p): n for n, p in self._inner.named_parameters()}
        return {ids[id(p)]: i for i, g in enumerate(self._client_groups) for p in g if id(p) in ids}

    def _flat_partitions(self) -> list[list[torch.Tensor]]:
        """Per optimizer group, the flat fp32 partitions of this rank that the inner optimizer steps."""
        opt = self.optimizer
        if hasattr(opt, "fp32_partitioned_groups_flat"):
            groups: list[list[torch.Tensor]] = [[] for _ in opt.optimizer.param_groups]
            for i, t in enumerate(opt.fp32_partitioned_groups_flat):
                groups[opt.sub_group_to_group_id[i]].append(t)
            return groups
        return [list(g["params"]) for g in opt.optimizer.param_groups]

    def _flat_states(self) -> list[tuple[int, dict]]:
        """(group index, Adam state) of each flat fp32 partition the inner optimizer steps (ZeRO-3 may split a
        group into sub-groups)."""
        opt = self.optimizer
        inner = opt.optimizer.state
        if hasattr(opt, "fp32_partitioned_groups_flat"):
            return [
                (opt.sub_group_to_group_id[i], inner[t])
                for i, t in enumerate(opt.fp32_partitioned_groups_flat)
                if t in inner
            ]
        return [(i, inner[t]) for i, t in enumerate(opt.single_partition_of_fp32_groups) if t in inner]

    def _group_steps(self) -> dict[int, float]:
        """Adam's step count per optimizer group (0 before its first step)."""
        steps = {i: 0.0 for i in range(len(self._client_groups))}
        for i, state in self._flat_states():
            if "step" in state:
                steps[i] = float(state["step"])
        return steps

    def load(self, ckpt_dir: Path, saved: dict | None = None, load_optimizer: bool = True):
        saved = saved or {}
        writer = (saved.get("strategy") or {}).get("strategy")
        extra_file = ckpt_dir / EXTRA_FILE
        try:  # how many parameters its engine had frozen (none before this was recorded)
            extra = json.loads(extra_file.read_text()) if extra_file.exists() else {}
        except (OSError, ValueError) as e:
            raise ConfigError(f"--resume {ckpt_dir}: cannot read {EXTRA_FILE} (corrupt?): {e}") from None
        if self._needs_engine_files(ckpt_dir, extra, writer, saved.get("world_size")):
            return self._load_engine_files(ckpt_dir, load_optimizer)
        return self._load_portable(ckpt_dir, load_optimizer)  # the loop says a change of strategy or world size

    def _needs_engine_files(self, ckpt_dir: Path, extra: dict, writer, world_size) -> bool:
        """The portable form is what a resume reads, from any writer; the one exception is an fp16 checkpoint
        written before strategy_state.json kept DeepSpeed's loss scaler: its engine files, when they fit this
        engine (same stage, world size and freezing), are the only place the dynamic loss scale is."""
        return (
            self.precision == "fp16"
            and "loss_scaler" not in extra
            and (ckpt_dir / TAG).is_dir()
            and writer == self.name
            and world_size == self.dist.world_size
            and extra.get("frozen", 0) == len(self._frozen_now)
        )

    def _load_engine_files(self, ckpt_dir: Path, load_optimizer: bool) -> None:
        for f in sorted((ckpt_dir / TAG).glob("*.pt")):
            check_torch_file(f)  # DeepSpeed itself reads them with torch.load(weights_only=False)
        try:
            self.engine.load_checkpoint(
                str(ckpt_dir), tag=TAG, load_optimizer_states=load_optimizer, load_lr_scheduler_states=load_optimizer
            )
        except (RuntimeError, OSError, KeyError, ValueError) as e:
            msg = " ".join(str(e).split())[:300]
            raise ConfigError(
                f"--resume {ckpt_dir}: DeepSpeed cannot load {TAG}/ (corrupt, or another model?): {msg}"
            ) from None

    def _load_portable(self, ckpt_dir: Path, load_optimizer: bool) -> None:
        """Each rank reads only its own partitions (fp32 weights, Adam moments) straight into the engine's
        buffers, resharded by DCP from whatever the checkpoint holds: another ZeRO stage or world size, FSDP's
        row shards, DDP's whole tensors, or the gathered form DeepSpeed checkpoints had before. Collective."""
        from shardtrain.checkpointing.dcp_state import check_model_fits, load_shards, read_metadata, tensor_shapes
        from shardtrain.checkpointing.flat_chunks import FlatRange, LoadPlanner

        shapes = tensor_shapes(read_metadata(ckpt_dir))
        params = dict(self._inner.named_parameters())
        full_shape = {n: tuple(getattr(p, "ds_shape", None) or p.shape) for n, p in params.items()}
        buffers = self._persistent_buffers()
        check_model_fits(
            ckpt_dir, {**full_shape, **{n: tuple(b.shape) for n, b in buffers.items()}}, shapes, self.base_not_saved
        )
        params = {n: p for n, p in params.items() if n not in self.base_not_saved}  # kept as build_model built it
        keys = (*self._moments, "step")
        # A frozen parameter has no optimizer state, in the checkpoint (saved while frozen, by any strategy)
        # or here (its saved moments, if any, wait in the checkpoint until a resume past the unfreeze).
        with_moments = [
            n
            for n, p in params.items()
            if self._moments and p.requires_grad and all(f"optim.state.{n}.{k}" in shapes for k in keys)
        ]
        trainable = [n for n, p in params.items() if p.requires_grad]
        if load_optimizer:
            if self._moments and len(with_moments) < len(trainable):
                self._warn(
                    f"optimizer state for {len(trainable) - len(with_moments)} of {len(trainable)} trainable "
                    f"parameters is not in {ckpt_dir}: they start with fresh Adam moments"
                )
            self._init_optimizer_state()  # the moments' buffers exist only after a first step
        model, moments = {}, {}
        for name, p in params.items():
            shape, start, local = self._local_range(p)
            if p.requires_grad or hasattr(p, "ds_id"):
                model[name] = FlatRange(shape, local(None), start)  # ZeRO-3 frozen: the module's own partition
            else:
                model[name] = p.data  # ZeRO-2 frozen: whole on every rank
            if load_optimizer and name in with_moments:
                moments[name] = {
                    "step": torch.empty(()),
                    **{k: FlatRange(shape, local(k), start) for k in self._moments},
                }
        model.update({n: torch.empty_like(b, device="cpu") for n, b in buffers.items()})
        state = {"model": model, **({"optim": {"state": moments}} if load_optimizer else {})}
        load_shards(state, ckpt_dir, planner=LoadPlanner())
        self._weights_from_masters(params)
        for name, buf in buffers.items():
            buf.copy_(model[name])
        if load_optimizer:
            extra_file = ckpt_dir / EXTRA_FILE
            extra = json.loads(extra_file.read_text()) if extra_file.exists() else {}
            self._set_group_steps({n: float(st["step"]) for n, st in moments.items()})
            load_extra_state(extra, self.scheduler, self.optimizer)
            for k, v in (extra.get("engine_counters") or {}).items():
                setattr(self.engine, k, v)
            scaler = getattr(self.engine.optimizer, "loss_scaler", None)
            for k, v in (extra.get("loss_scaler") or {}).items() if scaler is not None else ():
                setattr(scaler, k, v)

    def _weights_from_masters(self, params: dict) -> None:
        """The engine computes with the module's (low-precision) copy and steps the fp32 master: after the masters
        are loaded, the copy is refreshed from them as DeepSpeed does after a step. Collective."""
        if self.stage == 3:
            with torch.no_grad():
                for p in params.values():
                    if p.requires_grad:
                        _, _, local = self._local_range(p)
                        master = local(None)
                        p.ds_tensor.data.narrow(0, 0, master.numel()).copy_(master)
            # Parameters under stage3_param_persistence_threshold stay whole on every rank: gather them again
            # from the partitions just written, as DeepSpeed's own load does (partition, then all_gather).
            persistent = [p for p in params.values() if getattr(p, "ds_persist", False)]
            if persistent:
                persistent[0].partition(persistent)
                persistent[0].all_gather(persistent)
        else:
            self.optimizer.update_lp_params()  # fp32 partitions -> 16-bit partitions, all-gathered to every rank

    def _set_group_steps(self, step_of: dict[str, float]) -> None:
        """Adam's step per group: a group whose parameters come without moments starts afresh, as torch's AdamW
        starts a parameter it has not stepped before (the _init_optimizer_state step left zeros)."""
        group_of = self._group_of
        steps = {group_of[n]: s for n, s in step_of.items() if n in group_of}
        for i, state in self._flat_states():
            if "step" in state:
                step = steps.get(i, 0.0)
                state["step"] = (
                    torch.tensor(step, dtype=state["step"].dtype, device=state["step"].device)
                    if torch.is_tensor(state["step"])
                    else int(step)
                )

    def _persistent_buffers(self) -> dict[str, torch.Tensor]:
        buffers = {}
        for mod_name, mod in self._inner.named_modules():
            for b_name, buf in mod.named_buffers(recurse=False):
                if buf is not None and b_name not in mod._non_persistent_buffers_set:
                    buffers[f"{mod_name}.{b_name}" if mod_name else b_name] = buf
        return buffers

    def _load_state(self, model_sd: dict, optim_state: dict, extra: dict, load_optimizer: bool) -> None:
        """Full tensors by name (the portable form, from a checkpoint or from _portable_state) into this engine.
        Collective. Parameters without moments in `optim_state` get fresh ones (step 0 in their group)."""
        import deepspeed
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        if load_optimizer:
            self._init_optimizer_state()
        for name, p in self._inner.named_parameters():
            value = model_sd[name]
            # The engine computes with the low-precision (here: model) copy and steps the fp32 master copy:
            # both must hold the checkpoint's weights. A frozen parameter has only the first.
            with deepspeed.zero.GatheredParameters([p], modifier_rank=0, enabled=hasattr(p, "ds_id")):
                with torch.no_grad():
                    p.data.copy_(value.view(p.shape).to(p.dtype))
            if not p.requires_grad:
                continue
            if hasattr(p, "ds_id"):
                _z3_set_full(p, value, None)
            else:
                safe_set_full_fp32_param(p, value)
            if load_optimizer and name in optim_state:
                for k in self._moments:
                    if hasattr(p, "ds_id"):
                        _z3_set_full(p, optim_state[name][k], k)
                    else:
                        safe_set_full_optimizer_state(p, optim_state[name][k], k)
        for name, buf in self._persistent_buffers().items():
            buf.copy_(model_sd[name])
        if load_optimizer:
            self._set_group_steps({n: float(st["step"]) for n, st in optim_state.items()})
            load_extra_state(extra, self.scheduler, self.optimizer)

    def _init_optimizer_state(self) -> None:
        """Adam's state exists only after a first step; make it with zero gradients and a zero learning
        rate (no weight change), then let ZeRO-1/2 link parameters to it."""
        inner = self.optimizer.optimizer
        if not inner.state:
            # ZeRO-3 hands the inner optimizer its flat partitions only while it steps them (the groups are empty
            # in between); ZeRO-1/2 leave them in place.
            flat = self._flat_partitions()
            lrs = [g["lr"] for g in inner.param_groups]
            held = [(g["params"], [p.grad for p in t]) for g, t in zip(inner.param_groups, flat)]
            for g, t in zip(inner.param_groups, flat):
                g["lr"], g["params"] = 0.0, t
                for p in t:
                    p.grad = torch.zeros_like(p)
            inner.step()
            for g, lr, (params, grads) in zip(inner.param_groups, lrs, held):
                for p, grad in zip(g["params"], grads):
                    p.grad = grad
                g["lr"], g["params"] = lr, params
        self._relink_optimizer_state()

    def describe(self):
        return {
            "strategy": self.name,
            "offload": self.offload,
            **self.info,
            "recompute_blocks": self.recompute_count,
            "blocks": self.block_count,
            "ds_config": self.ds_config,
        }

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

    def set_batch_geometry(self, geometry):
        super().set_batch_geometry(geometry)
        engine = self.engine
        engine.set_train_micro_batch_size(geometry.micro)
        engine.set_train_batch_size(geometry.global_batch)
        # The engine finds the accumulation boundary from micro_steps % gas: restart the count at a boundary.
        engine.micro_steps = engine.global_steps * geometry.accum

    def collectives_in(self, phase, is_last):
        # ZeRO-1/2 hold every parameter whole: the forward runs none; the backward reduces gradients into their
        # partitions in every micro-step. ZeRO-3 gathers parameters in both passes.
        return phase == "backward" or self.stage == 3

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
            for k in list(grads) if isinstance(grads, dict) else range(len(grads or [])):
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


def _release_storage(engine, model: nn.Module) -> None:
    """Give back the memory of a destroyed engine's partitions, moments, gradients and weights. Under ZeRO-3 the
    engine object outlives destroy() (0.19.8: a reference from outside Python's reach, not found with
    gc.get_referrers), so its tensors are emptied in place rather than left to the garbage collector."""
    opt = engine.optimizer
    inner = getattr(opt, "optimizer", None)
    if inner is not None:
        inner.state.clear()
    for name in (
        "single_partition_of_fp32_groups",
        "fp32_partitioned_groups_flat",
        "bit16_groups_flat",
        "fp16_partitioned_groups_flat",
        "averaged_gradients",
        "grads_in_partition",
        "grad_partitions_flat_buffer",
    ):
        for t in _tensors(getattr(opt, name, None)):
            t.grad = None
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)
    for p in model.parameters():
        p.grad = None
        for t in (p, getattr(p, "ds_tensor", None)):
            if t is not None:
                t.data = torch.empty(0, dtype=t.dtype, device=t.device)


def _z3_set_full(param, value: torch.Tensor, key: str | None) -> None:
    """This rank's slice of a full tensor into a ZeRO-3 parameter's fp32 master (key None) or Adam state.
    DeepSpeed's own setter (safe_set_full_fp32_param) narrows past the end of the value on the last rank when
    the parameter's size does not divide by the world size (0.19.8: "start (2) + length (2) exceeds dimension
    size (3)"): its partitions are padded, the value is not."""
    opt = param._z3_optimizer
    part, group_idx = opt._get_fp32_opt_state_partition(param, release_swap_buffers=False, optim_state_key=key)
    flat = value.flatten().to(part.device, part.dtype)
    start = part.numel() * opt._get_param_partition_rank(param)
    mine = flat[start : start + part.numel()]
    part.data.zero_()
    part.data[: mine.numel()].copy_(mine)
    if opt._swappable_optimizer_subgroup(group_idx):
        opt._optimizer_states_and_gradient_swap_out(group_idx)


def _unlink_shared_allreduce_buffer(rank: int, world_size: int) -> None:
    """DeepSpeed's CPU all-reduce (its shm_comm op, where LOCAL_SIZE says every rank is on this machine: the
    `deepspeed` launcher sets it) puts a 66 MiB buffer per rank in /dev/shm and never removes it (shm.cpp's
    shared_close is never called): every such job left them in memory until a reboot, 5.2 GB of this dev machine's
    24 by the time it was noticed. Once every rank has mapped every rank's buffer (init_distributed returns after
    that, hence the barrier), the names can go: the mappings stay until each process ends, however it ends.
    Only where DeepSpeed made them (shm_interface.cpp's test: LOCAL_SIZE equals the world size), so a torchrun
    or multi-node job, which has none, pays no barrier."""
    import contextlib
    import os

    from deepspeed.accelerator import get_accelerator

    from shardtrain.runtime.distributed import barrier

    if get_accelerator().device_name() != "cpu" or not os.path.isdir("/dev/shm"):
        return
    if os.environ.get("LOCAL_SIZE", "").strip() != str(world_size):
        return
    barrier()
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{rank}")


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
    from shardtrain.runtime.distributed import broadcast_

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
        broadcast_(buf, src=0)
