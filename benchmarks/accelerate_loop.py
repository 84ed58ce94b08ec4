"""The same training with Hugging Face Accelerate (a benchmark-only extra): what users would otherwise pick.

    torchrun --nproc_per_node=2 benchmarks/accelerate_loop.py --config configs/multimodal_tiny.yaml \
        --data-dir DATA --output-dir OUT [--strategy fsdp | --ds ds_configs/zero2.json]

Each strategy the way Accelerate documents it: DDP (its MULTI_CPU / MULTI_GPU path), FSDP2 through
`FullyShardedDataParallelPlugin(fsdp_version=2)` wrapping the same blocks as shardtrain's default policy, and
DeepSpeed through `DeepSpeedPlugin(hf_ds_config=...)` with the ZeRO section of the same --ds file. The scheduler
steps once per optimizer step, as shardtrain's (Accelerate's default would step it once per process).
"""

import sys

import torch
from accelerate import Accelerator, DeepSpeedPlugin, FullyShardedDataParallelPlugin, PartialState
from accelerate.utils import DistributedType
from bench_common import (
    StepLog,
    adamw,
    batches,
    block_classes,
    check_world,
    data_and_model,
    ds_config,
    finish,
    forward_loss,
    load_config,
    peer_strategy,
    warmup_linear,
)


def fsdp_accelerator(model) -> Accelerator:
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        reshard_after_forward=True,
        transformer_cls_names_to_wrap=[c.__name__ for c in block_classes(model)],
    )
    accelerator = Accelerator(fsdp_plugin=plugin, step_scheduler_with_optimizer=False)
    if accelerator.distributed_type != DistributedType.FSDP:  # it would train unsharded, silently
        raise RuntimeError(unsharded(accelerator.distributed_type, accelerator.num_processes))
    return accelerator


def unsharded(kind, processes: int) -> str:
    return (
        f"Accelerate would not shard: distributed_type {kind} ({processes} process(es)); it enables FSDP only "
        f"for its multi-accelerator types (MULTI_GPU, MULTI_XPU, ...), and without an accelerator it is NO, or "
        f"MULTI_CPU with cpu=True, where the FSDP plugin is ignored"
    )


def main(argv):
    cfg = load_config(argv)
    kind = peer_strategy(cfg)
    if kind == "fsdp":  # the process group before the model, the model before the plugin (it names blocks)
        state, accelerator = PartialState(), None
    elif kind == "deepspeed":
        # As HF Trainer does it on CPU (use_cpu=True): the CPU process group first, then the plugin. Accelerator(
        # cpu=True, deepspeed_plugin=...) drops DeepSpeed, and without cpu=True a CPU-only rank sees 1 process.
        PartialState(cpu=cfg.parallel.device == "cpu")
        accelerator = Accelerator(
            deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds_config(cfg)), step_scheduler_with_optimizer=False
        )
        if accelerator.distributed_type != DistributedType.DEEPSPEED:
            raise RuntimeError(f"Accelerate runs {accelerator.distributed_type}, not DeepSpeed")
        state = accelerator.state
    else:
        accelerator = Accelerator(cpu=cfg.parallel.device == "cpu", step_scheduler_with_optimizer=False)
        state = accelerator.state
    if kind == "fsdp" and state.distributed_type == DistributedType.NO:
        raise RuntimeError(unsharded(state.distributed_type, state.num_processes))
    rank, world = state.process_index, state.num_processes
    check_world(world)
    loader, model = data_and_model(cfg, rank, world, state.wait_for_everyone, shard=False)
    if kind == "fsdp":  # FSDP: the optimizer is built on the sharded parameters
        accelerator = fsdp_accelerator(model)
        model = accelerator.prepare(model)
    opt = adamw(model, cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_linear(cfg))
    # As users write it: Accelerate shards the loader across processes itself.
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    log = StepLog(cfg, rank)
    model.train()
    data = batches(loader)
    for step in range(1, cfg.train.max_steps + 1):
        batch = next(data)
        loss = forward_loss(model, batch)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), cfg.train.max_grad_norm)  # DeepSpeed: the engine clips
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        log.step(step, loss)
    log.close()
    finish()


if __name__ == "__main__":
    main(sys.argv[1:])
