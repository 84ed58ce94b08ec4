"""A minimal hand-written DeepSpeed ZeRO loop (deepspeed.initialize): shardtrain's ZeRO baseline.

    torchrun --nproc_per_node=2 benchmarks/handwritten_zero.py --config configs/multimodal_tiny.yaml \
        --ds ds_configs/zero2.json --data-dir DATA --output-dir OUT

The ZeRO section comes from the same --ds file (ds_configs/zero2.json or zero3.json); the rest of the
DeepSpeed config is written out (bench_common.ds_config), as a user would, with the same client AdamW
shardtrain hands the engine.
"""

import sys

import deepspeed
import torch
import torch.distributed as dist
from bench_common import (
    StepLog,
    adamw,
    batches,
    data_and_model,
    ds_config,
    finish,
    forward_loss,
    load_config,
    warmup_linear,
)


def main(argv):
    cfg = load_config(argv)
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    loader, model = data_and_model(cfg, rank, world, dist.barrier)
    t = cfg.train
    opt = adamw(model, cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_linear(cfg))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=ds_config(cfg))
    log = StepLog(cfg, rank)
    engine.train()
    data = batches(loader)
    for step in range(1, t.max_steps + 1):
        batch = next(data)
        loss = forward_loss(engine, batch)
        engine.backward(loss)
        engine.step()  # clips, steps the optimizer and the schedule, zeroes the grads
        log.step(step, loss)
    log.close()
    finish()


if __name__ == "__main__":
    main(sys.argv[1:])
