"""A minimal hand-written FSDP2 (`fully_shard`) loop: shardtrain's FSDP baseline (benchmarks/overhead.py).

    torchrun --nproc_per_node=2 benchmarks/handwritten_fsdp.py --config configs/multimodal_tiny.yaml \
        --data-dir DATA --output-dir OUT

Sharded like shardtrain's default policy (each transformer layer / ResNet block its own unit, then the root),
but every rank builds the full model from the same seed (the simple way; shardtrain builds it on rank 0 only).
"""

import sys

import torch
import torch.distributed as dist
from bench_common import StepLog, adamw, batches, data_and_model, finish, forward_loss, load_config, warmup_linear
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def main(argv):
    cfg = load_config(argv)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    loader, model = data_and_model(cfg, rank, world, dist.barrier)
    mesh = init_device_mesh("cpu", (world,))
    for block in [m for m in model.modules() if isinstance(m, model.block_classes())]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = adamw(model, cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_linear(cfg))
    log = StepLog(cfg, rank)
    model.train()
    data = batches(loader)
    for step in range(1, cfg.train.max_steps + 1):
        batch = next(data)
        loss = forward_loss(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.max_grad_norm, foreach=True)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        log.step(step, loss)
    log.close()
    finish()


if __name__ == "__main__":
    main(sys.argv[1:])
