"""The same training with Lightning Fabric (a benchmark-only extra), each strategy the way Fabric documents it.

    torchrun --nproc_per_node=2 benchmarks/fabric_loop.py --config configs/multimodal_tiny.yaml \
        --data-dir DATA --output-dir OUT [--strategy fsdp | --ds ds_configs/zero2.json]

DDP: `strategy="ddp"`. FSDP: Fabric's FSDP2 path, `ModelParallelStrategy(parallelize_fn)` with a data-parallel
mesh of all processes and `fully_shard` on the blocks shardtrain's default policy shards, then the root; the model
is set up before the optimizer is built (Fabric's FSDP recipe). Fabric's FSDP1 `FSDPStrategy` refuses CPU
("FSDP is only available on GPU"). DeepSpeed:
`DeepSpeedStrategy(config=...)` with the ZeRO section of the same --ds file. fp32 ("32-true") everywhere.
Under torchrun Fabric joins the launcher's processes (its torchelastic environment).
"""

import sys

import torch
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
from lightning.fabric import Fabric
from lightning.fabric.strategies import DeepSpeedStrategy, ModelParallelStrategy
from torch.distributed.fsdp import fully_shard


def strategy_for(cfg, model):
    kind = peer_strategy(cfg)
    if kind == "fsdp":
        classes = block_classes(model)

        def parallelize(module, mesh):
            dp = mesh["data_parallel"]
            for block in [m for m in module.modules() if isinstance(m, classes)]:
                fully_shard(block, mesh=dp)
            return fully_shard(module, mesh=dp)

        return ModelParallelStrategy(
            parallelize, data_parallel_size=torch.distributed.get_world_size(), tensor_parallel_size=1
        )
    if kind == "deepspeed":
        return DeepSpeedStrategy(config=ds_config(cfg))
    return "ddp"


def main(argv):
    cfg = load_config(argv)
    # The block classes come from the model, the model needs the tokenizer, which rank 0 trains behind a
    # barrier: a plain process group first, which Fabric then joins.
    torch.distributed.init_process_group("gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    loader, model = data_and_model(cfg, rank, world, torch.distributed.barrier)
    fabric = Fabric(
        accelerator=cfg.parallel.device if cfg.parallel.device != "auto" else "auto",
        devices=world,
        strategy=strategy_for(cfg, model),
        precision="32-true",
    )
    fabric.launch()
    check_world(fabric.world_size)
    if peer_strategy(cfg) == "fsdp":  # FSDP: the optimizer is built on the sharded parameters
        model = fabric.setup_module(model)
        opt = adamw(model, cfg)
        opt = fabric.setup_optimizers(opt)
    else:
        opt = adamw(model, cfg)
        model, opt = fabric.setup(model, opt)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_linear(cfg))
    # The loader comes sharded as shardtrain shards (bench_common.data_and_model): Fabric's own sampler wrapper
    # would not pass the epoch on to the order inside it, so every epoch would repeat the first.
    loader = fabric.setup_dataloaders(loader, use_distributed_sampler=False)
    log = StepLog(cfg, rank)
    model.train()
    data = batches(loader)
    for step in range(1, cfg.train.max_steps + 1):
        batch = next(data)
        loss = forward_loss(model, batch)
        fabric.backward(loss)
        if peer_strategy(cfg) != "deepspeed":  # DeepSpeed clips in the engine (gradient_clipping)
            fabric.clip_gradients(model, opt, max_norm=cfg.train.max_grad_norm)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        log.step(step, loss)
    log.close()
    finish()


if __name__ == "__main__":
    main(sys.argv[1:])
