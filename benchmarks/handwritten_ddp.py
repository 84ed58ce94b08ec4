"""A minimal hand-written PyTorch DDP loop: the baseline shardtrain must match (benchmarks/overhead.py).

    torchrun --nproc_per_node=2 benchmarks/handwritten_ddp.py --config configs/multimodal_tiny.yaml \
        --data-dir DATA --output-dir OUT

Same model, data, seed, AdamW (decay / no-decay groups), warmup + linear decay and gradient clipping as
shardtrain; grad_accum 1 only.
"""

import sys

import torch
import torch.distributed as dist
from bench_common import StepLog, adamw, batches, data_and_model, finish, forward_loss, load_config, warmup_linear
from torch.nn.parallel import DistributedDataParallel as DDP


def main(argv):
    cfg = load_config(argv)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    loader, model = data_and_model(cfg, rank, world, dist.barrier)
    model = DDP(model, gradient_as_bucket_view=True)
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
